"""How big `serve --warmup full` is on this host: the programs the default serving config compiles, the time of a
cold warm-up (empty compile cache) and a warm one (a second process reading the cache), and the cache it writes;
also a cold `--warmup fast` (its own empty cache) for comparison.

Usage: python bench/warmup_grid.py [--serve-flags "--max-model-len 512"] [--count-only] [--cache DIR]
                                   [--passes cold,warm,plan,warm,fast] --json OUT.json

Each pass is its own process (`jaxserve serve`'s engine config from the given flags, the embedded model, not
started): it enables the compile cache in a fresh temporary folder (shared by the full passes) or --cache, runs
`Engine.warm_up(level)` and prints its WarmupReport as JSON (with the process's memory mappings and peak RSS after,
its seconds to load the engine and to warm up, and `spent`: JAX's compile-event durations summed over the threads,
[seconds, count] each: jaxpr trace, lowering to MLIR, backend compile (on a cache hit: the key, the read and the
load), the cache retrieval (read and load), and the warm-up's evictions).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

_PASS = """
import time
t_start = time.monotonic()
import collections, json, resource, sys, threading
import jax
from jaxserve.engine import warmup
from dataclasses import asdict
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.engine.warmup import full_plan, map_count
from jaxserve.server.main import engine_config, start_jax
args = build_parser().parse_args(["serve", "--compile-cache", sys.argv[1], *sys.argv[3:]])
enable_from_args(args)
layout = start_jax(args)  # as `serve` starts JAX: its CPU layout's devices and XLA flags are in every cache key
engine = Engine.from_checkpoint(default_checkpoint(), engine_config(args, layout), start=False)
if sys.argv[2] == "count":
    jobs = {}
    for kind, _ in full_plan(engine.programs):
        jobs[kind] = jobs.get(kind, 0) + 1
    print(json.dumps({"jobs": jobs, "program_count": engine.cfg.program_count()}))
    sys.exit(0)
spent = collections.defaultdict(float)  # where the time goes: JAX's compile events and the warm-up's own steps
counts = collections.Counter()
lock = threading.Lock()

def on_duration(event, seconds, **_):
    with lock:
        spent[event] += seconds
        counts[event] += 1

def timed(name, fn):
    def run(*a, **k):
        t0 = time.monotonic()
        try:
            return fn(*a, **k)
        finally:
            on_duration(name, time.monotonic() - t0)
    return run

jax.monitoring.register_event_duration_secs_listener(on_duration)
warmup._evict = timed("evict", warmup._evict)
t0 = time.monotonic()
report = engine.warm_up("fast" if sys.argv[2] == "fast" else "full", progress=True)
print(json.dumps({**asdict(report), "ready_seconds": time.monotonic() - t0, "load_seconds": t0 - t_start,
                  "program_count": engine.cfg.program_count(), "maps_after": map_count(),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "spent": {k: [round(v, 3), counts[k]] for k, v in sorted(spent.items())}}), flush=True)
engine.close()  # a warm start leaves background loads running: exiting under them aborts the process
"""


def cache_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-flags", default="", help="extra `jaxserve serve` flags (default: none, its defaults)")
    ap.add_argument("--count-only", action="store_true", help="list the warm-up jobs, compile nothing")
    ap.add_argument("--cache", type=Path, default=None,
                    help="compile cache folder for the full passes (default: a fresh temporary one)")
    ap.add_argument("--passes", default="cold,warm,fast",
                    help="comma-separated passes in order: cold, warm, plan (full; plan: warm without the warm-start "
                         "manifest, `engine.warm_manifest`), fast (its own empty cache); a name may repeat")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    flags = shlex.split(args.serve_flags)
    out: dict = {"bench": "warmup_grid", "machine": common.machine(), "serve_flags": flags}
    with tempfile.TemporaryDirectory() as td:
        cache = args.cache or Path(td) / "xla"
        for i, name in enumerate(("count",) if args.count_only else args.passes.split(",")):
            load = os.getloadavg()[0]
            folder = Path(td) / "xla-fast" if name == "fast" else cache
            if name == "plan":  # a warm full warm-up without its warm-start manifest: every plan job loads
                shutil.rmtree(cache / "jaxserve-warm", ignore_errors=True)
            proc = subprocess.run([sys.executable, "-c", _PASS, str(folder), name, *flags], cwd=ROOT, check=True,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            key = name if name == "count" else f"{i}:{name}"  # passes in order; a name may repeat
            out[key] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": load,
                        "load_after": os.getloadavg()[0], "cache_bytes_after": cache_bytes(folder)}
            args.json_out.write_text(json.dumps(out, indent=1))  # each pass kept as it ends (a cold one takes long)
    if args.count_only:
        return common.write_result(out, f"warm-up full jobs: {out['count']['jobs']}", args.json_out)
    done = [n for n in out if isinstance(out[n], dict) and "seconds" in out[n]]
    text = f"warm-up ({' '.join(flags) or 'serve defaults'}): " + "; ".join(
        f"{n} {out[n]['seconds']:.1f} s ({out[n]['backend_compiles']} XLA programs, {out[n]['cache_hits']} cache "
        f"hits, {out[n]['evictions']} evictions, {out[n].get('skipped', 0)} jobs skipped, load "
        f"{out[n]['load_before']:.1f}..{out[n]['load_after']:.1f})"
        for n in done)
    return common.write_result(out, text, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
