#!/usr/bin/env bash
# Run every kernel's micro-benchmark (bench/kernels.py: GB/s vs the chip's peak HBM bandwidth, Triton tilings)
# and the --quick version of every engine bench on one GPU, in under 10 minutes, then build the report.
# Output: $OUT/bench/*.json and $OUT/bench/REPORT.md if OUT is set, else bench/results/gpu/.
# Each bench gets its own time limit so one slow bench cannot eat the others' time; a failure is recorded and
# the rest still run. Usage: bash bench/gpu.sh   (from anywhere; uses .venv/bin/python if present)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${OUT:+$OUT/bench}
DEST=${DEST:-bench/results/gpu}
mkdir -p "$DEST"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$DEST/gpu.txt" 2>&1 || true
"$PY" -c "import jax; print(jax.devices())" >> "$DEST/gpu.txt" 2>&1
status=0
run() {  # run NAME SECONDS ARGS...: one bench under a hard time limit, its log beside its JSON
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) $(date +%T)"
  if ! timeout "$limit" "$PY" "bench/$name.py" "$@" --json "$DEST/$name.json" > "$DEST/$name.log" 2>&1; then
    echo "   FAILED (see $DEST/$name.log)"; status=1
  fi
  tail -n 12 "$DEST/$name.log"
}
run kernels 100 --backend gpu
run kv_capacity 20 --quick
run roofline 50 --quick
run kv_dtype_concurrency 90 --quick
run weight_formats 90 --quick
run integrity_overhead 50 --quick
run peer_transformers 60 --quick
run serving 80 --quick
"$PY" bench/report.py --results "$DEST" --out "$DEST/REPORT.md"
exit $status
