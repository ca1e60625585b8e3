"""Attribution of first-contact latencies (bench/serving.py --first-contact --trace): each request of a first sweep
(and each in-stream gap over GAP_S in any sweep) set beside what the traced server's threads did during it
(bench/serve_trace.py records): engine steps and the buckets they ran in, XLA work (tracing, lowering, compile or
cache load) on the engine thread and on the background compile threads, background compile jobs, first runs of
their programs under the step lock (priming), gc pauses, compile-cache writes, evictions (`jax.clear_caches`), and
CPU ticks per thread group and of the whole host (other processes included) from the 100 ms samples.

A request "misses" when its TTFT is over GOAL_RATIO x the warm sweep's TTFT p99 at its concurrency (one such
request in a sweep of <= 32 sets the p99 over the goal)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

GAP_S = 0.5
GOAL_RATIO = 1.5
SAMPLE_S = 0.1
ENGINE = "jaxserve-engine"


def load(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _ov(e: dict, w0: float, w1: float) -> float:
    return max(0.0, min(e["t"], w1) - max(e.get("t0", e["t"]), w0))


def group(name: str) -> str:
    """A thread's group: engine, background (the compile thread and its pool), http, native (XLA's and other
    threads Python did not start), other."""
    if name == ENGINE:
        return "engine"
    if name.startswith(("jaxserve-compile-background", "jaxserve-warmup")):
        return "background"
    if name.startswith(("waitress", "Thread-", "jaxserve-disconnects")):
        return "http"
    return "native" if name.startswith("~") else "other"


def window(ev: list[dict], w0: float, w1: float) -> dict:
    """What happened in [w0, w1] (monotonic seconds): see the module docstring. Seconds are overlap with the
    window; CPU ticks are 1/100 s (USER_HZ), host ticks over all cores."""
    def over(kind: str, pred=lambda e: True) -> list[dict]:
        return [e for e in ev if e["ev"] == kind and pred(e) and (_ov(e, w0, w1) > 0 or w0 <= e["t"] <= w1)]

    steps = over("step")
    eng_xla, bg_xla = Counter(), Counter()
    for e in over("jax"):
        (eng_xla if e["th"] == ENGINE else bg_xla)[e["name"]] += _ov(e, w0, w1)
    jobs, primes, gcs = over("bg_job"), over("prime"), over("gc")
    cpu: Counter = Counter()
    busy = total = running = 0
    for e in ev:
        if e["ev"] == "cpu" and w0 < e["t"] <= w1 + SAMPLE_S:
            for name, ticks in e["cpu"].items():
                cpu[group(name)] += ticks
            busy, total, running = busy + e["host_busy"], total + e["host_total"], max(running, e["running"])
    fits = over("fit")
    padded = [e for e in steps if any(f["asked"] != f["run"] and e["t0"] <= f["t"] <= e["t"] for f in fits)]
    return {
        "steps": len(steps), "step_s_max": max((e["t"] - e["t0"] for e in steps), default=0.0),
        "padded_fits": [[f["kind"], f["asked"], f["run"]] for f in fits if f["asked"] != f["run"]][:6],
        "padded_step_s": round(sum(_ov(e, w0, w1) for e in padded), 4),
        "engine_xla_s": {k: round(v, 4) for k, v in eng_xla.items()},
        "engine_xla_funs": sorted({e["fun"] for e in over("jax", lambda e: e["th"] == ENGINE)})[:4],
        "background_xla_s": {k: round(v, 4) for k, v in bg_xla.items()},
        "bg_jobs": [e["key"] for e in jobs], "bg_job_s": round(sum(_ov(e, w0, w1) for e in jobs), 4),
        "primes": [e["key"] for e in primes], "prime_s": round(sum(_ov(e, w0, w1) for e in primes), 4),
        "prime_s_max": round(max((e["t"] - e["t0"] - e["lock_wait"] for e in primes), default=0.0), 4),
        "gc_s": round(sum(_ov(e, w0, w1) for e in gcs), 4), "gc_gen2": sum(e["gen"] == 2 for e in gcs),
        "gc_s_max": round(max((e["t"] - e["t0"] for e in gcs), default=0.0), 4),
        "cache_writes": len(over("cache_write")), "evictions": len(over("clear_caches")),
        "cpu_ticks": dict(cpu), "host_busy_ticks": busy, "host_total_ticks": total,
        "other_processes_ticks": busy - sum(cpu.values()), "max_runnable": running,
    }


def cause(w: dict, excess_s: float) -> str:
    """The main suspect for `excess_s` seconds over the warm latency, from `window`'s record (a label, ranked by
    seconds; CPU ticks converted at 100 per second and shared over the host's 2 cores)."""
    if w["evictions"]:
        return "eviction (jax.clear_caches: programs reload on the engine thread)"
    engine_xla = sum(w["engine_xla_s"].values())
    cands = {"engine-thread XLA (trace/lower/compile/load)": engine_xla,
             "steps run padded in a larger compiled shape": w["padded_step_s"],
             "priming under the step lock": w["prime_s"],
             "gc pause": w["gc_s"],
             "background compile CPU": w["cpu_ticks"].get("background", 0) / 100.0 / 2,
             "XLA native threads CPU (compile pool / intra-op)": w["cpu_ticks"].get("native", 0) / 100.0 / 2,
             "other processes CPU": max(w["other_processes_ticks"], 0) / 100.0 / 2}
    name, secs = max(cands.items(), key=lambda kv: kv[1])
    if secs < 0.25 * excess_s:
        return f"unattributed (largest: {name} {secs:.3f} s)"
    return f"{name} {secs:.3f} s"


def timeline(ev: list[dict], t_ready: float | None) -> dict:
    """The run's background work: jobs, priming, evictions, cache writes, gc, relative to ready."""
    rel = (lambda t: round(t - t_ready, 2)) if t_ready is not None else (lambda t: round(t, 2))
    jobs = [e for e in ev if e["ev"] == "bg_job" and (t_ready is None or e["t0"] >= t_ready - 60)]
    after = [e for e in jobs if t_ready is not None and e["t0"] >= t_ready]
    prime = [e for e in ev if e["ev"] == "prime"]
    gcs = [e for e in ev if e["ev"] == "gc"]
    return {
        "bg_jobs_after_ready": len(after),
        "bg_jobs_span_s": [rel(min(e["t0"] for e in after)), rel(max(e["t"] for e in after))] if after else None,
        "bg_job_s_total": round(sum(e["t"] - e["t0"] for e in after), 2),
        "primes_after_ready": sum(1 for e in prime if t_ready is None or e["t0"] >= t_ready),
        "prime_s_total": round(sum(e["t"] - e["t0"] - e["lock_wait"] for e in prime), 3),
        "evictions_at_s": [rel(e["t"]) for e in ev if e["ev"] == "clear_caches"],
        "cache_writes": sum(1 for e in ev if e["ev"] == "cache_write"),
        "engine_xla_after_ready": Counter(e["name"] for e in ev if e["ev"] == "jax" and e["th"] == ENGINE
                                          and (t_ready is None or e["t0"] >= t_ready)),
        "gc_over_50ms": [[rel(e["t0"]), round(e["t"] - e["t0"], 3), e["gen"], e["th"]] for e in gcs
                         if e["t"] - e["t0"] > 0.05],
        "gc_gen2": sum(e["gen"] == 2 for e in gcs), "gc_s_max": round(max((e["t"] - e["t0"] for e in gcs),
                                                                          default=0.0), 4),
    }


def attribute(trace: Path, sweeps: list[dict], t_ready: float) -> dict:
    """sweeps: [{"workload", "pass", "c", "t_base", "streams": [Stream]}] -> the run's timeline, and per first-sweep
    request (and per gap > GAP_S in any sweep) its window's record and `cause` when it misses."""
    ev = load(trace)
    warm_p99 = {}
    for s in sweeps:
        if s["pass"] == "warm":
            ttfts = sorted(x.chunk_times[0] - x.sent for x in s["streams"] if x.ok)
            warm_p99[(s["workload"], s["c"])] = ttfts[-1] if ttfts else None
    requests, gaps, sweep_spans = [], [], []
    for s in sweeps:
        ok = sorted((x for x in s["streams"] if x.ok), key=lambda x: x.sent)
        base = s["t_base"]
        if ok:
            sweep_spans.append({"workload": s["workload"], "pass": s["pass"], "c": s["c"],
                                "from_ready_s": [round(base + ok[0].sent - t_ready, 2),
                                                 round(base + max(x.chunk_times[-1] for x in ok) - t_ready, 2)]})
        for i, x in enumerate(ok):
            w0, w1 = base + x.sent, base + x.chunk_times[0]
            if s["pass"] == "first":
                ref = warm_p99.get((s["workload"], s["c"]))
                miss = ref is not None and w1 - w0 > GOAL_RATIO * ref
                rec = window(ev, w0, w1)
                requests.append({"workload": s["workload"], "c": s["c"], "i": i, "from_ready_s": round(w0 - t_ready, 3),
                                 "ttft_ms": round((w1 - w0) * 1000, 1), "miss": miss,
                                 "cause": cause(rec, w1 - w0 - ref) if miss else None, **rec})
            for a, b in zip(x.chunk_times, x.chunk_times[1:]):
                if b - a > GAP_S:
                    rec = window(ev, base + a, base + b)
                    gaps.append({"workload": s["workload"], "pass": s["pass"], "c": s["c"], "i": i,
                                 "from_ready_s": round(base + a - t_ready, 3), "gap_ms": round((b - a) * 1000, 1),
                                 "cause": cause(rec, b - a), **rec})
    return {"timeline": timeline(ev, t_ready), "sweeps": sweep_spans, "requests": requests, "gaps": gaps,
            "misses": [{k: r[k] for k in ("workload", "c", "i", "ttft_ms", "cause")} for r in requests if r["miss"]]}
