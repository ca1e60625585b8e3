"""The throughput cost of `serve --deterministic` (batch-invariant outputs) at concurrency 16.

Usage: python bench/deterministic_cost.py [--reps 3] [--num-requests 32] --json OUT.json

Starts two `jaxserve serve` processes on the embedded model (default flags; one with --deterministic), runs one
untimed warm-up pass against each, then `--reps` measured passes of the same workload (bench/serving.py's load
generator: streamed completions, corpus prompts of 32-96 tokens, 16-32 output tokens, 16 clients) alternating
between the two, so host load drifts hit both alike. Reports output tokens/s per server (median, min..max), the
cost (1 - deterministic / default, on medians) and the load average around each pass.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common, serving  # noqa: E402

MODES = {"default": (), "deterministic": ("--deterministic",)}


def measure(reps: int, spec: serving.LoadSpec) -> dict:
    from tools.train_tiny import ModelSize

    vocab = ModelSize().vocab_size
    stream = serving.corpus_tokens()
    passes: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as td:
        ckpt, _ = serving.bench_checkpoint(None, Path(td))
        procs = {m: serving.start_server(ckpt, 64, Path(td) / f"{m}.log", extra) for m, extra in MODES.items()}
        try:
            for m, (_, port) in procs.items():
                warm = serving.workload(spec, spec.warmup_requests, vocab, spec.seed + 1, stream)
                serving.run_pass("127.0.0.1", port, "tiny-kimi", warm, replace(spec, max_seconds=600.0),
                                 spec.seed + 1, f"warm-up {m}")
            reqs = serving.workload(spec, spec.num_requests, vocab, spec.seed, stream)
            for rep in range(reps):
                for m in (MODES if rep % 2 == 0 else reversed(list(MODES))):
                    load = os.getloadavg()[0]
                    results, seconds = serving.run_pass("127.0.0.1", procs[m][1], "tiny-kimi", reqs, spec,
                                                        spec.seed, f"{m} {rep}")
                    s = serving.summarize(results, seconds, len(reqs))
                    passes[m].append({"output_tokens_per_s": s["output_tokens_per_s"], "errors": s["errors"],
                                      "load_before": load, "load_after": os.getloadavg()[0]})
        finally:
            for proc, _ in procs.values():
                serving.stop_server(proc)
    tps = {m: [p["output_tokens_per_s"] for p in ps] for m, ps in passes.items()}
    med = {m: statistics.median(v) for m, v in tps.items()}
    return {"bench": "deterministic_cost", "machine": common.machine(), "spec": asdict(spec), "reps": reps,
            "passes": passes, "median_tokens_per_s": med, "min_max": {m: (min(v), max(v)) for m, v in tps.items()},
            "cost": 1 - med["deterministic"] / med["default"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    spec = serving.LoadSpec(concurrency=16, num_requests=args.num_requests, warmup_requests=16, max_seconds=600.0)
    r = measure(args.reps, spec)
    lines = [f"{m}: {r['median_tokens_per_s'][m]:.1f} output tok/s median ({lo:.1f}..{hi:.1f})"
             for m, (lo, hi) in r["min_max"].items()]
    return common.write_result(r, "\n".join(lines + [f"cost: {100 * r['cost']:.1f}%"]), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
