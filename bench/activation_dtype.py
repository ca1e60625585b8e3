"""Activation dtype on CPU: the serving engine with bf16 activations (`EngineConfig()`'s default) against the same
engine with f32 activations (`EngineConfig(dtype="float32")`; the weight and KV formats unchanged: FP8 prefill,
INT4 decode, FP8 KV), plain decode, and optionally each with n-gram speculation, side by side in one run.

Usage: python bench/activation_dtype.py [--concurrency 1,16] [--reps 5] [--sides bf16,f32,bf16+ngram3,f32+ngram3]
                                        [--new-tokens 128] [--json bench/results/activation_dtype.json]

Workload and timing as bench/speculative.py (its `timed` and `prompts_for`): c requests of 64 held-out tokens, 128
new, greedy, ignore_eos, no prefix cache; each side runs the workload once untimed (compiles), then the timed passes
alternate between the sides, so a drift in the shared host's load hits every side alike. Per (c, side): tokens/s
median and min..max, the ratio of medians to the first side, whether its greedy tokens equal the first side's
(requests alike / c), and the load average at the start and end.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.speculative import CKPT, prompts_for, timed  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.engine.config import Speculative  # noqa: E402

DTYPES = {"bf16": "bfloat16", "f32": "float32"}


def config(side: str) -> EngineConfig:
    """A side "DTYPE" or "DTYPE+ngramK" -> the serving config with that activation dtype (and speculation)."""
    dtype, _, spec = side.partition("+")
    cfg = replace(EngineConfig(prefix_cache=False), dtype=DTYPES[dtype])
    return cfg if not spec else replace(cfg, speculative=Speculative("ngram", int(spec.removeprefix("ngram"))))


def run(concurrency: list[int], sides: list[str], reps: int, new_tokens: int) -> dict:
    engines = {s: Engine.from_checkpoint(CKPT, config(s), start=False) for s in sides}
    rows = []
    for c in concurrency:
        prompts = prompts_for(engines[sides[0]], c, seed=c)
        for e in engines.values():
            timed(e, prompts, new_tokens)  # untimed: compiles this workload's shapes
        load0 = os.getloadavg()
        tps: dict[str, list[float]] = {s: [] for s in sides}
        outs: dict[str, list] = {}
        for _ in range(reps):
            for s, e in engines.items():
                wall, toks, _ = timed(e, prompts, new_tokens)
                tps[s].append(sum(map(len, toks)) / wall)
                outs[s] = toks
        load1 = os.getloadavg()
        first = common.spread(tps[sides[0]])["median"]
        for s in sides:
            t = common.spread(tps[s])
            rows.append({"c": c, "side": s, "tokens_per_s": t, "vs_first": t["median"] / first,
                         "identical_requests": sum(a == b for a, b in zip(outs[s], outs[sides[0]])), "requests": c,
                         "loadavg_start": load0, "loadavg_end": load1})
    for e in engines.values():
        e.close()
    return {"bench": "activation_dtype", "machine": common.machine(), "reps": reps, "new_tokens": new_tokens,
            "configs": {s: repr(config(s)) for s in sides}, "rows": rows}


def table(result: dict) -> str:
    lines = [f"{'c':>3} {'side':<12} {'tok/s (min..max)':>26} {'x first':>8} {'same':>6} {'load start->end':>16}"]
    for r in result["rows"]:
        t = r["tokens_per_s"]
        lines.append(f"{r['c']:>3} {r['side']:<12} {t['median']:>8.1f} ({t['min']:.1f}..{t['max']:.1f})".ljust(48)
                     + f"{r['vs_first']:>6.2f} {r['identical_requests']:>3}/{r['requests']:<2} "
                     f"{r['loadavg_start'][0]:>6.2f}->{r['loadavg_end'][0]:.2f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--sides", default="bf16,f32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "activation_dtype.json")
    args = ap.parse_args()
    result = run([int(x) for x in args.concurrency.split(",")], args.sides.split(","), args.reps, args.new_tokens)
    return common.write_result(result, table(result), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
