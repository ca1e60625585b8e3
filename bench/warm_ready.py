"""`jaxserve serve --warmup full` (what `make serve` runs, with that flag) to /ready from a warm compile cache: with
its warm-start manifest (`engine.warm_manifest`: only the fast set loads) and without (the manifest folder moved
away: every plan job traces, lowers and loads its programs), interleaved.

Usage: python bench/warm_ready.py --cache DIR [--serve-flags "--max-model-len 128"] [--reps 2]
                                  [--modes manifest,plan] [--seed-fast] --json OUT.json

DIR: a compile cache a full warm-up of the same flags filled (`bench/warmup_grid.py --cache DIR --passes cold`, or a
first `plan` run here). Each run is a fresh server process on a free port, timed from spawn to (a) listening and
(b) GET /ready answering 200; the server's warm-up line (jobs, cache hits, XLA compiles, skipped jobs) and the load
average are kept per run. A `plan` run rewrites the manifest when it ends, so the next `manifest` run uses it.

--seed-fast (a stand-in where the full grid's cold warm-up does not fit the time, e.g. the default config's ~817
programs): first, in one process started as `serve` starts (`start_jax`, `engine_config`), load or compile only the
fast set (`fallback.largest_keys`) and write the manifest of the whole plan over those entries. A `manifest` run then
does exactly the work it does over a complete cache (it reads only the fast set's entries); but a program of the
plan outside the fast set that the server's start-up requests use is not in the cache and compiles (counted in the
run's warm-up line). Only `manifest` runs are meaningful then.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.serving import is_ready, listening_port, stop_server  # noqa: E402

_SEED = """
import json, sys
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.engine.fallback import largest_keys
from jaxserve.engine import warm_manifest
from jaxserve.engine.warmup import job_of, plan_keys, run_jobs
from jaxserve.server.main import engine_config, start_jax
args = build_parser().parse_args(["serve", "--compile-cache", sys.argv[1], *sys.argv[2:]])
folder = enable_from_args(args)
layout = start_jax(args)
engine = Engine.from_checkpoint(default_checkpoint(), engine_config(args, layout), start=False)
keys = plan_keys(engine.programs)
fast = largest_keys(engine.programs, keys)
with warm_manifest.recording() as entries:
    report = run_jobs("seed", [job_of(engine.programs, k) for k in fast], True, resident=engine.programs.resident)
wrote = warm_manifest.write(folder, warm_manifest.digest(engine.programs, keys), entries, len(keys))
print(json.dumps({"plan_jobs": len(keys), "fast_jobs": len(fast), "entries": len(entries), "written": wrote,
                  "seconds": report.seconds, "compiled": report.backend_compiles - report.cache_hits}))
"""


def serve_to_ready(cache: Path, flags: list[str], log: Path, limit: float = 3000.0) -> dict:
    """One `serve --warmup full` process: seconds from spawn to listening and to /ready 200, its warm-up line."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--warmup", "full",
           "--compile-cache", str(cache), *flags]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with log.open("w") as errf:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errf, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    port, listening = None, None
    try:
        while time.perf_counter() - t0 < limit:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if port is None:
                if (port := listening_port(log)) is not None:
                    listening = time.perf_counter() - t0
            elif is_ready(port):
                ready = time.perf_counter() - t0
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"not ready within {limit} s")
    finally:
        stop_server(proc, timeout=60)
    lines = [ln for ln in log.read_text().splitlines() if "warm-up full:" in ln and "XLA programs" in ln]
    return {"listening_s": listening, "ready_s": ready, "load_before": load, "load_after": os.getloadavg()[0],
            "warmup_line": lines[-1].strip() if lines else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--serve-flags", default="", help="extra `jaxserve serve` flags (default: none, its defaults)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="manifest,plan", help="comma-separated, interleaved per rep")
    ap.add_argument("--seed-fast", action="store_true", help="write the manifest over the fast set first (see above)")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    flags = shlex.split(args.serve_flags)
    out: dict = {"bench": "warm_ready", "machine": common.machine(), "serve_flags": flags,
                 "command": "python -m jaxserve.cli serve --warmup full --compile-cache DIR " + args.serve_flags}
    if args.seed_fast:
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, "-c", _SEED, str(args.cache), *flags], cwd=ROOT, check=True,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out["seed_fast"] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": load}
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    manifests = args.cache / "jaxserve-warm"
    with tempfile.TemporaryDirectory() as td:
        for _ in range(args.reps):
            for mode in modes:
                if mode == "plan":
                    shutil.rmtree(manifests, ignore_errors=True)  # every plan job again; it writes a new manifest
                runs[mode].append(serve_to_ready(args.cache, flags, Path(td) / f"{mode}.log"))
                print(mode, runs[mode][-1], file=sys.stderr, flush=True)
    out["runs"] = runs
    out["summary"] = {m: {k: common.spread([r[k] for r in v]) for k in ("listening_s", "ready_s")}
                      for m, v in runs.items()}
    text = "; ".join(f"{m}: ready {s['ready_s']['median']:.1f} s ({s['ready_s']['min']:.1f}..{s['ready_s']['max']:.1f})"
                     f", listening {s['listening_s']['median']:.1f} s" for m, s in out["summary"].items())
    return common.write_result(out, f"serve --warmup full {args.serve_flags}: {text}", args.json_out)


if __name__ == "__main__":
    sys.exit(main())
