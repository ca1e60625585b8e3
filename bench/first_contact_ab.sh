#!/bin/bash
# Interleaved first-contact A/B (issue 32, bench/results/serving_first_contact_trace_{before,after}_N.json):
# BASE: an export of the base commit with this branch's bench files copied in; AFTER: this checkout.
#   git archive 5ff23a2 | tar -x -C "$BASE" && cp bench/{serve_trace,first_contact_trace,serving,serving_first_contact}.py "$BASE/bench/"
# usage: bench/first_contact_ab.sh BASE AFTER OUT_DIR [RUNS] [ARMS]
# ARMS (default "base after"): "after_grid" is AFTER with JAXSERVE_TRACE_FAST_DECODE_GRID=1 (bench/serve_trace.py:
# `--warmup fast` also compiles every decode shape before ready); "base_grid" is BASE with it.
base=$1 after=$2 out=$3 runs=${4:-3} arms=${5:-base after}
mkdir -p "$out/traces"
for i in $(seq "$runs"); do
  for b in $arms; do
    if [ ${b%_grid} = base ]; then d=$base; else d=$after; fi
    grid=0; [ ${b%_grid} != $b ] && grid=1
    echo "$b $i $(uptime)"
    (cd "$d" && JAXSERVE_TRACE_FAST_DECODE_GRID=$grid PYTHONPATH=$d nice -n 10 /work/main/.venv/bin/python \
      bench/serving.py --first-contact --warmup fast --max-model-len 256 --trace "$out/traces" \
      --json "$out/ab_${b}_$i.json" > "$out/ab_${b}_$i.log" 2>&1)
  done
done
echo "done $(uptime)"
