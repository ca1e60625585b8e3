"""A traced `jaxserve serve` (bench only; nothing of it runs in a plain `serve`): what every thread of the server
process did, for bench/first_contact_trace.py to set beside each request's TTFT.

    python -m bench.serve_trace OUT.jsonl -m jaxserve.cli serve ...   (bench/serving.py --first-contact --trace)

Installs, before the server starts (times: time.monotonic(), system-wide on Linux, so the client's clock):
  * jax.monitoring time spans (tracing, lowering, backend compile = XLA compile or persistent-cache load) and
    events (cache hits), with the thread they ran on;
  * persistent compile-cache writes (`compilation_cache.put_executable_and_time`, timed) and `jax.clear_caches`
    (evictions: every compiled program dropped);
  * gc collections (`gc.callbacks`: start/stop, generation, thread);
  * the engine: each step (`Engine.step`, its seconds), each bucket choice (`scheduler.fit`: asked -> run shape),
    each background compile job (`fallback.job_of`'s job: key, start, end) and each program's first run between
    steps (`Engine._run_once`: its key, the wait for the step lock and the run);
  * every 100 ms, CPU ticks per thread of this process (/proc/self/task, Python thread names where known, XLA's
    own threads by their comm) and the host's busy jiffies and runnable count (/proc/stat: other processes too).
Records are JSON lines {"t": end, "ev": kind, "th": thread, ...} ("t0": start for intervals), flushed every 0.5 s.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path

SAMPLE_S = 0.1


class Trace:
    """Thread-safe buffer of records, flushed to a JSON-lines file by the sampler thread and at exit."""

    def __init__(self, path: Path) -> None:
        self.f = path.open("w")
        self.buf: list[dict] = []
        self.lock = threading.Lock()

    def add(self, ev: str, t0: float | None = None, t: float | None = None, **fields: object) -> None:
        rec = {"t": time.monotonic() if t is None else t, "ev": ev, "th": threading.current_thread().name, **fields}
        if t0 is not None:
            rec["t0"] = t0
        with self.lock:
            self.buf.append(rec)

    def flush(self) -> None:
        with self.lock:
            buf, self.buf = self.buf, []
        for rec in buf:
            self.f.write(json.dumps(rec, default=str) + "\n")
        self.f.flush()


def timed(trace: Trace, ev: str, fn, describe=lambda *a: {}):
    """fn wrapped to record one interval `ev` per call (fields from describe(*args))."""
    def wrapper(*args, **kw):
        t0 = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            trace.add(ev, t0, **describe(*args))
    return wrapper


def hook_jax(trace: Trace) -> None:
    import jax
    from jax._src import compilation_cache

    def span(event: str, start: float, end: float, fun_name: str = "", **_: object) -> None:
        shift = time.monotonic() - time.time()  # the span is in wall time: move it to the monotonic clock
        trace.add("jax", start + shift, end + shift, name=event.rsplit("/", 1)[-1], fun=fun_name)

    def event(name: str, **_: object) -> None:
        if "cache_hits" in name or "cache_misses" in name:
            trace.add("jax_event", name=name.rsplit("/", 1)[-1])

    jax.monitoring.register_event_time_span_listener(span)
    jax.monitoring.register_event_listener(event)
    compilation_cache.put_executable_and_time = timed(trace, "cache_write", compilation_cache.put_executable_and_time,
                                                      lambda key, module, *_: {"module": module})
    jax.clear_caches = timed(trace, "clear_caches", jax.clear_caches)


def hook_gc(trace: Trace) -> None:
    starts: dict[int, float] = {}

    def cb(phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            starts[tid] = time.monotonic()
        else:
            trace.add("gc", starts.pop(tid, time.monotonic()), gen=info.get("generation"),
                      collected=info.get("collected"))

    gc.callbacks.append(cb)


def hook_engine(trace: Trace) -> None:
    from jaxserve.engine import engine as engine_mod
    from jaxserve.engine import fallback, scheduler

    E = engine_mod.Engine
    E.step = timed(trace, "step", E.step)

    def run_once(self, key) -> None:
        t0 = time.monotonic()
        with self._step_lock:
            t1 = time.monotonic()
            engine_mod.run_once(self.programs, key, self.scheduler.ranks)
        trace.add("prime", t0, key=list(key), lock_wait=t1 - t0)

    E._run_once = run_once
    job_of = fallback.job_of

    def traced_job_of(programs, key):
        kind, job = job_of(programs, key)
        return kind, timed(trace, "bg_job", job, lambda *_: {"key": list(key)})

    fallback.job_of = traced_job_of
    fit = scheduler.fit

    def traced_fit(shapes, kind, ranks, n_ranks, B, place, M, T=0):
        out = fit(shapes, kind, ranks, n_ranks, B, place, M, T)
        trace.add("fit", kind=kind, asked=[B, M, T], run=[out[0], out[2], out[3]])
        return out

    scheduler.fit = traced_fit
    try:  # the least-recently-used eviction (engine.resident), where the traced commit has it
        from jaxserve.engine.resident import Resident
    except ImportError:
        return
    evict = Resident.evict

    def traced_evict(self, over, keep_since) -> int:
        t0, n = time.monotonic(), evict(self, over, keep_since)
        trace.add("evict_lru", t0, dropped=n, left=len(self))
        return n

    Resident.evict = traced_evict


def hook_fast_decode_grid() -> None:
    """An experiment (JAXSERVE_TRACE_FAST_DECODE_GRID=1): `--warmup fast` compiles every decode shape (both forms,
    its unpacking) before ready too, so no decode step runs padded."""
    from jaxserve.engine import fallback

    largest = fallback.largest_keys

    def with_decode(programs, keys):
        first = largest(programs, keys)
        extra = [k for k in keys if k[0] in ("decode", "unpack") and k not in first]
        return first + extra

    fallback.largest_keys = with_decode


def _thread_names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def _ticks(tid: str) -> tuple[str, int] | None:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    comm = s[s.index("(") + 1:s.rindex(")")]
    fields = s[s.rindex(")") + 2:].split()
    return comm, int(fields[11]) + int(fields[12])  # utime + stime


def _host() -> tuple[int, int, int]:
    """(busy jiffies, total jiffies, runnable tasks) of the whole host."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    cpu = [int(x) for x in lines[0].split()[1:]]
    running = next(int(ln.split()[1]) for ln in lines if ln.startswith("procs_running"))
    return sum(cpu) - cpu[3] - cpu[4], sum(cpu), running


def sampler(trace: Trace) -> None:
    """CPU ticks per thread (named) and of the host, every SAMPLE_S; flushes the trace every 0.5 s."""
    last: dict[str, int] = {}
    host_last = _host()
    n = 0
    while True:
        time.sleep(SAMPLE_S)
        names = _thread_names()
        cpu: dict[str, int] = {}
        for tid in os.listdir("/proc/self/task"):
            got = _ticks(tid)
            if got is None:
                continue
            comm, ticks = got
            d = ticks - last.get(tid, ticks)
            last[tid] = ticks
            if d:
                name = names.get(int(tid), f"~{comm}")
                cpu[name] = cpu.get(name, 0) + d
        host = _host()
        trace.add("cpu", cpu=cpu, host_busy=host[0] - host_last[0], host_total=host[1] - host_last[1],
                  running=host[2])
        host_last = host
        n += 1
        if n % 5 == 0:
            trace.flush()


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: python -m bench.serve_trace OUT.jsonl -m MODULE ARGS...")
    trace = Trace(Path(argv[0]))
    atexit.register(trace.flush)
    hook_jax(trace)
    hook_gc(trace)
    hook_engine(trace)
    if os.environ.get("JAXSERVE_TRACE_FAST_DECODE_GRID") == "1":
        hook_fast_decode_grid()
        trace.add("experiment", name="fast_decode_grid")
    trace.add("start")
    threading.Thread(target=sampler, args=(trace,), name="trace-sampler", daemon=True).start()
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
