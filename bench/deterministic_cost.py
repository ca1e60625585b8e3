"""The cost of `serve --deterministic` (batch-invariant outputs): throughput at each concurrency and time to ready.

Usage: python bench/deterministic_cost.py [--reps 5] [--concurrency 1,16] [--num-requests 32] [--no-ready]
                                          --json OUT.json

Per mode (`--no-deterministic`, `--deterministic`; default flags otherwise, embedded model, `--max-model-len 512`):
unless --no-ready, `jaxserve serve` is started twice on its own empty compile cache, one mode at a time (nothing
else of the bench running): spawn -> `/ready` cold (empty cache), then stopped and started again: warm (the cache
the first start wrote). Then both servers are started on their (warm) caches side by side, each gets one untimed
warm-up pass per concurrency, then `--reps` measured passes of the same workload per concurrency (bench/serving.py's
load generator: streamed completions, corpus prompts of 32-96 tokens, 16-32 output tokens) alternating between
the two, so host load drifts hit both alike. Reports output tokens/s per mode and concurrency (median, min..max),
the cost (1 - deterministic / default, on medians) and the load average around each pass.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common, serving  # noqa: E402

MODES = {"default": ("--no-deterministic",), "deterministic": ("--deterministic",)}
READY_TIMEOUT_S = 1800.0


def start_ready(ckpt: Path, cache: Path, log: Path, extra: tuple[str, ...]) -> tuple[object, int, float]:
    """A server on `cache`; -> (process, port, seconds from spawn to /ready 200)."""
    t0 = time.monotonic()
    proc, port = serving.start_server(ckpt, 64, log, (*extra, "--compile-cache", str(cache)))
    serving.wait_ready(proc, port, log, READY_TIMEOUT_S)
    return proc, port, time.monotonic() - t0


def cache_bytes(cache: Path) -> int:
    return sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())


def ready_times(ckpt: Path, tmp: Path) -> dict:
    """Per mode: spawn -> /ready on an empty compile cache, then again on the cache that start wrote."""
    out = {}
    for m, extra in MODES.items():
        cache = tmp / f"cache-{m}"
        runs = {}
        for which in ("cold", "warm"):
            load = os.getloadavg()[0]
            proc, _, s = start_ready(ckpt, cache, tmp / f"{m}-{which}.log", extra)
            serving.stop_server(proc)
            runs[which] = {"ready_s": s, "load_before": load, "load_after": os.getloadavg()[0],
                           "cache_bytes": cache_bytes(cache)}
            print(f"{m} {which}: /ready after {s:.1f} s", flush=True)
        out[m] = runs
    return out


def throughput(ckpt: Path, tmp: Path, reps: int, specs: list[serving.LoadSpec]) -> dict[str, dict[int, list]]:
    """Per mode and concurrency: `reps` interleaved passes' output tokens/s, errors and load average."""
    from tools.train_tiny import ModelSize

    vocab = ModelSize().vocab_size
    stream = serving.corpus_tokens()
    passes: dict[str, dict[int, list]] = {m: {s.concurrency: [] for s in specs} for m in MODES}
    procs = {m: start_ready(ckpt, tmp / f"cache-{m}", tmp / f"{m}.log", extra)[:2] for m, extra in MODES.items()}
    try:
        for spec in specs:
            for m, (_, port) in procs.items():
                warm = serving.workload(spec, spec.warmup_requests, vocab, spec.seed + 1, stream)
                serving.run_pass("127.0.0.1", port, "tiny-kimi", warm, replace(spec, max_seconds=600.0),
                                 spec.seed + 1, f"warm-up {m} c={spec.concurrency}")
        for rep in range(reps):
            for spec in specs:
                reqs = serving.workload(spec, spec.num_requests, vocab, spec.seed, stream)
                for m in (MODES if rep % 2 == 0 else reversed(list(MODES))):
                    load = os.getloadavg()[0]
                    results, seconds = serving.run_pass("127.0.0.1", procs[m][1], "tiny-kimi", reqs, spec,
                                                        spec.seed, f"{m} c={spec.concurrency} {rep}")
                    s = serving.summarize(results, seconds, len(reqs))
                    passes[m][spec.concurrency].append({
                        "output_tokens_per_s": s["output_tokens_per_s"], "errors": s["errors"],
                        "load_before": load, "load_after": os.getloadavg()[0]})
    finally:
        for proc, _ in procs.values():
            serving.stop_server(proc)
    return passes


def measure(reps: int, specs: list[serving.LoadSpec], ready: bool) -> dict:
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        ckpt, _ = serving.bench_checkpoint(None, tmp)
        ready_s = ready_times(ckpt, tmp) if ready else None
        passes = throughput(ckpt, tmp, reps, specs)
    per_c = {}
    for spec in specs:
        c = spec.concurrency
        tps = {m: [p["output_tokens_per_s"] for p in passes[m][c]] for m in MODES}
        med = {m: statistics.median(v) for m, v in tps.items()}
        per_c[c] = {"median_tokens_per_s": med, "min_max": {m: (min(v), max(v)) for m, v in tps.items()},
                    "cost": 1 - med["deterministic"] / med["default"]}
    return {"bench": "deterministic_cost", "machine": common.machine(), "specs": [asdict(s) for s in specs],
            "reps": reps, "modes": MODES, "ready": ready_s, "passes": passes, "by_concurrency": per_c,
            "loadavg_at_end": os.getloadavg()}


def table(r: dict) -> str:
    lines = []
    for m, runs in (r["ready"] or {}).items():
        lines.append(f"{m}: /ready cold {runs['cold']['ready_s']:.1f} s, warm {runs['warm']['ready_s']:.1f} s, "
                     f"cache {runs['warm']['cache_bytes'] / 2**20:.1f} MiB")
    for c, v in r["by_concurrency"].items():
        for m, (lo, hi) in v["min_max"].items():
            lines.append(f"c = {c} {m}: {v['median_tokens_per_s'][m]:.1f} output tok/s median ({lo:.1f}..{hi:.1f})")
        lines.append(f"c = {c} cost: {100 * v['cost']:.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    ap.add_argument("--num-requests", type=int, default=32, help="per measured pass (c = 1: half as many)")
    ap.add_argument("--no-ready", action="store_true", help="skip the cold / warm time-to-ready starts")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    specs = [serving.LoadSpec(concurrency=c, num_requests=args.num_requests if c > 1 else args.num_requests // 2,
                              warmup_requests=max(c, 8), max_seconds=600.0)
             for c in (int(x) for x in args.concurrency.split(","))]
    r = measure(args.reps, specs, not args.no_ready)
    return common.write_result(r, table(r), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
