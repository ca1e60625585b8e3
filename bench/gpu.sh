#!/usr/bin/env bash
# Run every kernel's micro-benchmark (bench/kernels.py: GB/s vs the chip's peak HBM bandwidth, Triton tilings)
# and the --quick version of every engine bench on one GPU, in under 10 minutes, then build the report. First the
# decode roofline: its last lines print the measured vs the predicted step time (jaxserve/roofline.py's model).
# Output: $OUT/bench/*.json and $OUT/bench/REPORT.md if OUT is set, else bench/results/gpu/.
# Each bench runs under its own time limit (bench/device_common.sh).
# Usage: bash bench/gpu.sh   (from anywhere; uses .venv/bin/python if present)
. "$(dirname "$0")/device_common.sh" gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$DEST/gpu.txt" 2>&1 || true
"$PY" -c "import jax; print(jax.devices())" >> "$DEST/gpu.txt" 2>&1
# first: measured vs predicted decode step (the roofline model of jaxserve/roofline.py, checked on hardware)
run roofline 60 --quick
run kernels 100 --backend gpu
run kv_capacity 15 --quick
run kv_dtype_concurrency 90 --quick
run weight_formats 90 --quick
run integrity_overhead 50 --quick
run peer_transformers 60 --quick
run serving 80 --quick
run speculative 50 --quick
finish
