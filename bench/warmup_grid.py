"""How big `serve --warmup full` is on this host: the programs the default serving config compiles, the time of a
cold warm-up (empty compile cache) and a warm one (a second process reading the cache), and the cache it writes;
also a cold `--warmup fast` (its own empty cache) for comparison.

Usage: python bench/warmup_grid.py [--serve-flags "--max-model-len 512"] [--count-only] --json OUT.json

Each pass is its own process (`jaxserve serve`'s engine config from the given flags, the embedded model, not
started): it enables the compile cache in a fresh temporary folder (shared by the two full passes), runs
`Engine.warm_up(level)` and prints its WarmupReport as JSON (with the process's memory mappings and peak RSS after).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

_PASS = """
import json, resource, sys
from dataclasses import asdict
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.engine.warmup import full_plan, map_count
from jaxserve.server.main import engine_config
args = build_parser().parse_args(["serve", "--compile-cache", sys.argv[1], *sys.argv[3:]])
enable_from_args(args)
engine = Engine.from_checkpoint(default_checkpoint(), engine_config(args), start=False)
if sys.argv[2] == "count":
    jobs = {}
    for kind, _ in full_plan(engine.programs):
        jobs[kind] = jobs.get(kind, 0) + 1
    print(json.dumps({"jobs": jobs, "program_count": engine.cfg.program_count()}))
    sys.exit(0)
report = engine.warm_up("fast" if sys.argv[2] == "fast" else "full", progress=True)
print(json.dumps({**asdict(report), "program_count": engine.cfg.program_count(), "maps_after": map_count(),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def cache_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-flags", default="", help="extra `jaxserve serve` flags (default: none, its defaults)")
    ap.add_argument("--count-only", action="store_true", help="list the warm-up jobs, compile nothing")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    flags = shlex.split(args.serve_flags)
    out: dict = {"bench": "warmup_grid", "machine": common.machine(), "serve_flags": flags}
    with tempfile.TemporaryDirectory() as td:
        cache = Path(td) / "xla"
        for name in (("count",) if args.count_only else ("cold", "warm", "fast")):
            load = os.getloadavg()[0]
            folder = Path(td) / "xla-fast" if name == "fast" else cache
            proc = subprocess.run([sys.executable, "-c", _PASS, str(folder), name, *flags], cwd=ROOT, check=True,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            out[name] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": load,
                         "load_after": os.getloadavg()[0], "cache_bytes_after": cache_bytes(folder)}
    if args.count_only:
        return common.write_result(out, f"warm-up full jobs: {out['count']['jobs']}", args.json_out)
    c, w, f = out["cold"], out["warm"], out["fast"]
    text = (f"warm-up full ({' '.join(flags) or 'serve defaults'}): jobs {c['jobs']} = {c['backend_compiles']} XLA "
            f"programs; cold {c['seconds']:.1f} s ({c['evictions']} evictions), warm {w['seconds']:.1f} s "
            f"({w['cache_hits']} cache hits); cache {c['cache_bytes_after'] / 2**20:.1f} MiB; fast cold "
            f"{f['seconds']:.1f} s; load {c['load_before']:.1f}..{f['load_after']:.1f}")
    return common.write_result(out, text, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
