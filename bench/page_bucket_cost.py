"""What a wider block table costs a short-context decode step: the engine with its page buckets (a 40-token context
decodes in the smallest block table) against one pinned to the widest table (`EngineConfig.min_pages_bucket` = the
pages of max_model_len: one decode page bucket, as a fixed-width table with the attention loop's dynamic bound would
give). Issue 32: fewer page buckets would mean fewer programs to compile and load.

Usage: python bench/page_bucket_cost.py [--rows 1,8] [--tokens 64] [--reps 3] --json OUT.json

The serve defaults' engine config (the embedded model, `--warmup none`: each config compiles what it runs on first
use; the compile cache is left off), greedy, eos ignored. Per decode step: (time of max_tokens=N - time of
max_tokens=1) / (N - 1), the same prompts; the two configs alternate per rep; the load average is kept.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402


def step_ms(engine: object, rows: int, tokens: int) -> float:
    """Milliseconds per decode step of `rows` concurrent 40-token prompts (see the module docstring)."""
    from jaxserve.engine import SamplingParams

    prompts = [[(7 * r + 3 * i) % 200 + 10 for i in range(40)] for r in range(rows)]
    timed = {}
    for n in (1, tokens):
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        timed[n] = time.perf_counter() - t0
    return 1e3 * (timed[tokens] - timed[1]) / (tokens - 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    from jaxserve.cli import build_parser, default_checkpoint
    from jaxserve.engine import Engine
    from jaxserve.server.main import engine_config

    base = engine_config(build_parser().parse_args(["serve"]))
    widest = base.page_buckets[-1]
    configs = {"buckets": base, "widest": dataclasses.replace(base, min_pages_bucket=widest)}
    engines = {k: Engine.from_checkpoint(default_checkpoint(), c, start=False) for k, c in configs.items()}
    rows = [int(r) for r in args.rows.split(",")]
    runs: dict[str, dict[int, list]] = {k: {r: [] for r in rows} for k in configs}
    for r in rows:
        for name, e in engines.items():
            step_ms(e, r, 4)  # compiles this shape's programs
        for _ in range(args.reps):
            for name, e in engines.items():
                runs[name][r].append({"step_ms": step_ms(e, r, args.tokens), "load": os.getloadavg()[0]})
    summary = {k: {r: common.spread([x["step_ms"] for x in v[r]]) for r in rows} for k, v in runs.items()}
    out = {"bench": "page_bucket_cost", "machine": common.machine(), "page_buckets": base.page_buckets,
           "widest": widest, "tokens": args.tokens, "runs": runs, "summary": summary}
    text = "; ".join(f"{k} rows {r}: {s['median']:.1f} ms ({s['min']:.1f}..{s['max']:.1f})"
                     for k, v in summary.items() for r, s in v.items())
    for e in engines.values():
        e.close()
    return common.write_result(out, f"decode step, 40-token context: {text}", args.json_out)


if __name__ == "__main__":
    sys.exit(main())
