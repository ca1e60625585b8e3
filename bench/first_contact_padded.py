"""Padded engine steps of first-contact runs (issue 32): from each run's trace (bench/serving.py --first-contact
--trace, bench/serve_trace.py), the engine steps after the first sweep began, their seconds, and the share of
them run padded into a larger compiled shape (a `fit` event whose run shape differs from the asked one inside the
step); `jax.clear_caches` calls and programs dropped least-recently-used (`evict_lru`, traces since engine.resident);
with each run's TTFT p99 ratios, largest in-stream gap, /ready time, evictions and load; after the first
least-recently-used eviction: the background jobs that loaded a key again (compiled before it), the padded decode
steps that asked one of those shapes, and XLA work (trace / lower / compile or load) on the engine thread.

Usage: python bench/first_contact_padded.py --runs NAME=RUN.json:TRACE.jsonl ... --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.first_contact_trace import load  # noqa: E402


def padded_share(events: list[dict]) -> dict:
    """Engine steps (any thread's `step` events) from the first `fit` on: count, seconds, padded seconds."""
    fits = [e for e in events if e["ev"] == "fit"]
    t_first = min((f["t"] for f in fits), default=float("inf"))
    steps = [e for e in events if e["ev"] == "step" and e["t"] >= t_first]
    padded_fits = sorted(f["t"] for f in fits if f["asked"] != f["run"])
    i, padded = 0, 0.0
    for e in sorted(steps, key=lambda e: e["t"]):
        while i < len(padded_fits) and padded_fits[i] < e["t0"]:
            i += 1
        if i < len(padded_fits) and padded_fits[i] <= e["t"]:
            padded += e["t"] - e["t0"]
    total = sum(e["t"] - e["t0"] for e in steps)
    return {"steps": len(steps), "step_s": round(total, 2), "padded_step_s": round(padded, 2),
            "padded_share": round(padded / total, 3) if total else None,
            "evictions": sum(e["ev"] == "clear_caches" for e in events),
            "lru_dropped": sum(e.get("dropped", 0) for e in events if e["ev"] == "evict_lru"), **reloads(events)}


def reloads(events: list[dict]) -> dict:
    """From the first `evict_lru` on: background jobs of keys compiled before it (loaded again), the padded decode
    steps asking their shapes, and the engine thread's XLA events."""
    t_evict = min((e["t"] for e in events if e["ev"] == "evict_lru"), default=None)
    if t_evict is None:
        return {}
    jobs = [e for e in events if e["ev"] == "bg_job"]
    before = {tuple(e["key"]) for e in jobs if e["t"] < t_evict}
    again = [e for e in jobs if e["t0"] >= t_evict and tuple(e["key"]) in before]
    shapes = {tuple(e["key"][1:4]) for e in again if e["key"][0] == "decode"}
    padded = [e for e in events if e["ev"] == "fit" and e["t"] > t_evict and e["kind"] == "decode"
              and e["asked"] != e["run"]]
    return {"reloaded_keys": [e["key"] for e in again], "reload_s": [round(e["t"] - e["t0"], 2) for e in again],
            "padded_decode_steps_after_evict": len(padded),
            "of_them_asking_a_reloaded_shape": sum(tuple(e["asked"]) in shapes for e in padded),
            "engine_xla_after_evict": sum(e["ev"] == "jax" and e.get("th") == "jaxserve-engine" and e["t"] > t_evict
                                          for e in events)}


def summary(run: Path, trace: Path) -> dict:
    lv = json.loads(run.read_text())["levels"]["fast"]
    gaps = [row["max_gap_ms"] for sweep in lv["sweeps"] for row in sweep["rows"]]
    return {"ready_s": round(lv["spawn_to_ready_s"], 1), "load_before": lv["load_before"][0],
            "load_after": lv["load_after"][0], "ratios": {w: {c: round(r, 2) for c, r in rs.items()}
                                                          for w, rs in lv["ratios"].items()},
            "goals": lv["goals"], "max_gap_ms": round(max(gaps)),
            **padded_share(load(trace))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, metavar="NAME=RUN.json:TRACE.jsonl")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    out = {}
    for spec in args.runs:
        name, paths = spec.split("=", 1)
        run, trace = paths.split(":", 1)
        out[name] = s = summary(Path(run), Path(trace))
        print(f"{name}: ready {s['ready_s']} s, load {s['load_before']:.1f}->{s['load_after']:.1f}, padded "
              f"{s['padded_share']} of {s['step_s']} s steps, evictions {s['evictions']}, max gap {s['max_gap_ms']} ms, "
              f"ratios {s['ratios']}")
    args.json_out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
