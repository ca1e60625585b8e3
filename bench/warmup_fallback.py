"""What `--warmup fast`'s padded fallback (engine/fallback.py) costs: the time to ready of "fast" before it (what a
first short request runs, `Programs.compile_first`: `Engine(warmup="first")`) and with it (the largest shape of
each kind and a lone short request's, both sampling forms, every hand-off size, the tag syncs; the background thread
held), and the lone short request's shapes alone (`fallback.lone_shapes`: what they add), each cold (its own
empty compile cache) in its own process; and one decode step of one row (c = 1) in the largest decode bucket, as it
runs until its own shape is compiled, against its own bucket.

Usage: python bench/warmup_fallback.py [--serve-flags "--max-model-len 256"] [--reps 15] [--calls 10] --json OUT.json

The embedded model under `jaxserve serve`'s engine config from the flags, not started. The decode step is
`Programs.run_decode` on a captured batch of one 64-token prompt decoding (`bench.common.steady_decode`), and the
same row captured padded (the scheduler's `fit` with only the largest decode shape usable): `--reps` rounds of
`--calls` calls of each in turn (interleaved), median of the rounds' means (min..max), load average before/after.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

_READY = """
import json, sys, threading, time
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.server.main import engine_config
args = build_parser().parse_args(["serve", "--compile-cache", sys.argv[1], *sys.argv[3:]])
enable_from_args(args)
engine = Engine.from_checkpoint(default_checkpoint(), engine_config(args), start=False)
t0 = time.monotonic()
if sys.argv[2] == "before":
    engine._warm_first()
    jobs = 0
elif sys.argv[2] == "lone":
    from jaxserve.engine.fallback import lone_shapes
    from jaxserve.engine.warmup import job_of, plan_keys, run_jobs
    lone = lone_shapes(engine.programs)
    keys = [k for k in plan_keys(engine.programs)
            if k[:4] in lone or (k[0] == "unpack" and ("decode", *k[1:4]) in lone)]
    jobs = sum(run_jobs("lone", [job_of(engine.programs, k) for k in keys], False).jobs.values())
else:
    jobs = sum(engine.warm_up("fast", hold=threading.Event()).jobs.values())
print(json.dumps({"seconds": time.monotonic() - t0, "jobs": jobs}))
"""


def ready_times(flags: list[str]) -> dict:
    out = {}
    for name in ("before", "lone", "after"):
        with tempfile.TemporaryDirectory() as td:
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, "-c", _READY, td, name, *flags], cwd=ROOT, check=True,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            out[name] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": load,
                         "load_after": os.getloadavg()[0]}
    return out


def padded_call(engine: object) -> common.DecodeCall:
    """The next decode call's arguments with only the largest decode shape usable (what "fast" runs meanwhile)."""
    from jaxserve.engine.fallback import CompiledShapes
    from jaxserve.engine.sampling_forms import SERVING_MODES

    c = engine.cfg
    shapes = CompiledShapes(engine.programs)
    b, m = c.row_buckets[-1], c.page_buckets[-1]
    for key in [("decode", b, m, 0, mode) for mode in SERVING_MODES] + [("unpack", b, m, 0, "")]:
        shapes.add(key)  # marked, not compiled: the first calls below compile it, outside the timing
    engine.scheduler.shapes = shapes
    captured: list[common.DecodeCall] = []
    real = engine.programs.dispatch_decode
    engine.programs.dispatch_decode = lambda batch, samp: (captured.append(common.DecodeCall(batch, samp)),
                                                           real(batch, samp))[1]
    try:
        engine.step()
    finally:
        del engine.programs.dispatch_decode
        engine.scheduler.shapes = None
    return captured[0]


def step_costs(flags: list[str], reps: int, calls: int) -> dict:
    from jaxserve.cli import build_parser, default_checkpoint
    from jaxserve.engine import Engine
    from jaxserve.server.main import engine_config

    engine = Engine.from_checkpoint(default_checkpoint(), engine_config(build_parser().parse_args(["serve", *flags])),
                                    start=False)
    own = common.steady_decode(engine, [[(31 * j) % 4000 + 10 for j in range(64)]], max_tokens=100)
    padded = padded_call(engine)
    calls_of = {"own": own, "largest": padded}
    shapes = {name: tuple(int(x) for x in (c.batch.tokens.shape[0], c.batch.block_tables.shape[1]))
              for name, c in calls_of.items()}

    def timed(call: common.DecodeCall, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            engine.programs.run_decode(call.batch, call.samp)
        return (time.perf_counter() - t0) / n

    for call in calls_of.values():
        timed(call, 2)  # compile and settle outside the timing
    wall: dict[str, list[float]] = {name: [] for name in calls_of}
    for _ in range(reps):
        for name, call in calls_of.items():
            wall[name].append(timed(call, calls))
    engine.close()
    out = {name: {"rows_pages": shapes[name], "wall": common.spread(wall[name])} for name in calls_of}
    out["ratio_median"] = out["largest"]["wall"]["median"] / out["own"]["wall"]["median"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-flags", default="--max-model-len 256")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    flags = shlex.split(args.serve_flags)
    out: dict = {"bench": "warmup_fallback", "command": shlex.join(["python", "bench/warmup_fallback.py",
                                                                    *(sys.argv[1:] if argv is None else argv)]),
                 "machine": common.machine(), "serve_flags": flags,
                 "load_before": os.getloadavg()[0]}
    out["ready"] = r = ready_times(flags)
    out["decode_c1"] = d = step_costs(flags, args.reps, args.calls)
    out["load_after"] = os.getloadavg()[0]
    text = (f"fast to ready (cold, {' '.join(flags)}): before {r['before']['seconds']:.1f} s, after "
            f"{r['after']['seconds']:.1f} s ({r['after']['jobs']} jobs; the lone request's {r['lone']['jobs']} alone "
            f"{r['lone']['seconds']:.1f} s); c=1 decode step: own bucket "
            f"{d['own']['rows_pages']} {d['own']['wall']['median'] * 1e3:.2f} ms, largest {d['largest']['rows_pages']} "
            f"{d['largest']['wall']['median'] * 1e3:.2f} ms ({d['ratio_median']:.2f}x, median of {args.reps}); "
            f"load {out['load_before']:.1f}..{out['load_after']:.1f}")
    return common.write_result(out, text, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
