# Shared by bench/gpu.sh and bench/tpu.sh (sourced with the platform name): the Python to use, the output folder
# ($OUT/bench if OUT is set, else bench/results/PLATFORM), and `run`, which gives each bench its own hard time limit
# so one slow bench cannot eat the others' time; a failure is recorded and the rest still run.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${OUT:+$OUT/bench}
DEST=${DEST:-bench/results/$1}
mkdir -p "$DEST"
status=0
run() {  # run NAME SECONDS ARGS...: one bench under a hard time limit, its log beside its JSON
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) $(date +%T)"
  if ! timeout "$limit" "$PY" "bench/$name.py" "$@" --json "$DEST/$name.json" > "$DEST/$name.log" 2>&1; then
    echo "   FAILED (see $DEST/$name.log)"; status=1
  fi
  tail -n 12 "$DEST/$name.log"
}
finish() {  # the report over this run's JSON files, and the exit status (1 if any bench failed)
  "$PY" bench/report.py --results "$DEST" --out "$DEST/REPORT.md"
  exit $status
}
