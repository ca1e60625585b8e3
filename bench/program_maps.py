"""Memory mappings per XLA:CPU program and its step cost, per XLA:CPU codegen setting (issue 32: a resident decode
grid must stay under half of vm.max_map_count).

Usage: python bench/program_maps.py [--splits 0,1,4] [--programs 6] [--runs 30] --json OUT.json

Each setting is two processes on one fresh compile cache (`--xla_cpu_parallel_codegen_split_count=S` in XLA_FLAGS;
0: XLA's default): "cold" compiles the first `--programs` decode programs of the serve-default grid (embedded model,
--max-model-len 256) one at a time, recording /proc/self/maps lines before and after each, then runs the largest
of them `--runs` times on padding (engine.priming) and reports the median seconds; "warm" loads the same programs
from the cache and records the same.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

_PASS = """
import json, statistics, sys, time
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.engine.priming import run_once
from jaxserve.engine.warmup import job_of, map_count, plan_keys
from jaxserve.server.main import engine_config
args = build_parser().parse_args(["serve", "--compile-cache", sys.argv[1], "--max-model-len", "256"])
enable_from_args(args)
engine = Engine.from_checkpoint(default_checkpoint(), engine_config(args), start=False)
keys = [k for k in plan_keys(engine.programs) if k[0] == "decode" and k[4] == "any"][:int(sys.argv[2])]
deltas, secs = [], []
for k in keys:
    before, t0 = map_count(), time.monotonic()
    job_of(engine.programs, k)[1]()
    secs.append(time.monotonic() - t0)
    run_once(engine.programs, k)
    deltas.append(map_count() - before)
runs = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter()
    run_once(engine.programs, keys[-1])
    runs.append(time.perf_counter() - t0)
print(json.dumps({"keys": keys, "maps_delta": deltas, "compile_s": secs, "maps_after": map_count(),
                  "step_median_s": statistics.median(runs), "step_min_s": min(runs)}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", default="0,1,4")
    ap.add_argument("--programs", type=int, default=6)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    out: dict = {"bench": "program_maps", "machine": common.machine(), "settings": {}}
    lines = []
    for split in map(int, args.splits.split(",")):
        flags = os.environ.get("XLA_FLAGS", "") + (f" --xla_cpu_parallel_codegen_split_count={split}" if split else "")
        res = {}
        with tempfile.TemporaryDirectory() as td:
            for name in ("cold", "warm"):
                load = os.getloadavg()[0]
                proc = subprocess.run([sys.executable, "-c", _PASS, td, str(args.programs), str(args.runs)], cwd=ROOT,
                                      check=True, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags})
                res[name] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": load,
                             "load_after": os.getloadavg()[0]}
        out["settings"][str(split)] = res
        c, w = res["cold"], res["warm"]
        lines.append(f"split {split or 'default'}: maps per decode program cold {c['maps_delta']} warm "
                     f"{w['maps_delta']}; step {c['step_median_s'] * 1e3:.1f} ms (min {c['step_min_s'] * 1e3:.1f}); "
                     f"compile {sum(c['compile_s']):.1f} s cold, {sum(w['compile_s']):.1f} s warm; "
                     f"load {c['load_before']:.1f}..{w['load_after']:.1f}")
    return common.write_result(out, "\n".join(lines), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
