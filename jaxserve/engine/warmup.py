"""Warm-up plans: what an engine compiles ahead of traffic at each `--warmup` level, and the count of what came
from the persistent compilation cache.

  * "full": every program the serving configuration can select, so nothing compiles once it is done: decode
    (rows x pages), speculative verify (rows x pages, when on) and prefill ((rows, chunk) x pages) in both sampling
    forms (`sampling_forms.SERVING_MODES`: "greedy", and the general "any" that serves every other batch, penalties,
    logit_bias, min_tokens, grammars, forced tokens and top logprobs included, as data), the hand-off sizes, the
    decode-batch unpacking (rows x pages, and after an overlapped step rows x previous rows x pages), each pool's
    tag syncs (every power-of-two length up to its page count), and the prefill that returns prompt logprobs
    (`SamplingParams.prompt_logprobs`: lm-eval's echo + logprobs; `scoring`), one program per prefill shape (its
    single form, `scoring.SCORING_MODE`). `full_plan` lists them; `EngineConfig.program_count` counts the model
    shapes among them.
    Memory: each XLA:CPU program holds ~3 memory mappings per compiled kernel (its JIT code, constants and data:
    ~500 for one decode program of the embedded model), so the default grid's 817 programs would need over ~370k
    mappings (measured for its 717 before the scoring prefill), 6x the kernel's per-process limit
    (`vm.max_map_count`, 65,530 by default): the mmap that passes it
    fails, and LLVM reports "Cannot allocate memory". `run_jobs` therefore keeps the process under `max_maps`
    (default half that limit): past it, it waits for the jobs in flight and drops the least recently used model
    programs (`engine.resident`: one jit object per shape; `drop_oldest`, to LOW_WATER x max_maps, never those of
    the last KEEP_STEPS + 1 engine steps), or, where that is not enough, every compiled program from memory
    (`jax.clear_caches`); the persistent compile cache (`compile_cache.py`) has already stored them. Each job is
    labelled with its plan key (`labelled_job`), so after ready the engine knows which keys were dropped
    (`fallback.CompiledShapes.adopt`): a step of such a shape runs padded in a loaded one while the background
    thread loads it again from the cache once steps want it (an XLA cache hit, never an XLA compile, never on the
    engine thread: loading there stalls every stream). Without the persistent cache a grid over the limit
    is refused (ConfigError) instead.
    `jax.clear_caches` is process-wide: a program another thread is loading at that moment may miss the persistent
    cache and compile (seen in a test), so the warm-up clears only with its own jobs settled; a request served
    before ready can still race it. After ready the engine keeps the same bound (`MapGuard`): between steps,
    on the thread that steps, past `max_maps` it drops the least recently used programs again (with the persistent
    cache on): the programs traffic uses stay loaded. An evicted program's shape stops being a padding target and
    the background thread loads it again (`fallback.CompiledShapes.dropped`): steps load nothing.
  * "fast": the largest shape of each program kind in both forms, the largest unpacking, every hand-off size and
    the tag syncs, what a lone short request runs (`fallback.lone_shapes`) and a ladder of decode covers
    (`fallback.ladder_shapes`); then, after ready, the rest of
    "full" (the scoring prefill included) in one background thread while a step whose shape is not compiled yet
    runs padded in the smallest compiled shape covering it (`engine.fallback`): nothing compiles on the engine
    thread (but a scoring prefill before any scoring shape covering it is compiled: it compiles its own).
    A warm start of "full" (`warm_manifest`: a manifest, named by a digest of the sources, versions, configs and
    plan, says an earlier full warm-up stored every program of this plan in the persistent cache) loads only the
    fast set below; the rest load from the cache after ready as under "fast": in the background thread, steps
    padded meanwhile (`WarmupReport.skipped`), no XLA compile.
    Both "full" and "fast" then run the fast set's programs once on padding (`engine.priming`, under the engine's
    step lock; `WarmupReport.primed`): a program's first run costs several times a later one (XLA:CPU executable
    set-up, jit's C++ fast path: bench/first_execution.py), paid before ready instead of by a first request.
    Then both freeze the heap (`engine.heap`: a full garbage collection no longer walks the warm-up's objects).
    (`Engine(warmup="first")` is the older, smaller set: what a first short request runs,
    `Programs.compile_first`, its sampled programs deferred to the first idle second, the rest on first use.)
  * "none": nothing; each program compiles on first use, inside the engine loop.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import jax
from tqdm import tqdm

from jaxserve.cache.pool import compile_tag_sync
from jaxserve.engine import heap, spec_chain
from jaxserve.engine.batch import compile_unpack
from jaxserve.engine.sampling import SamplingMode
from jaxserve.engine.sampling_forms import SERVING_MODES
from jaxserve.engine.scoring import SCORING_MODE
from jaxserve.engine.verify import padding_verify
from jaxserve.errors import ConfigError

if TYPE_CHECKING:
    from jaxserve.engine.programs import Programs
    from jaxserve.engine.resident import Resident

WarmupLevel = Literal["full", "fast", "none"]
WARMUP_LEVELS: tuple[WarmupLevel, ...] = ("full", "fast", "none")
_HIT = "/jax/compilation_cache/cache_hits"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
LOW_WATER = 0.9  # a least-recently-used eviction drops programs until the process is under this share of max_maps
KEEP_STEPS = 2  # ... but never those the last KEEP_STEPS + 1 engine steps used (a prefill and a decode step apart)
log = logging.getLogger("jaxserve.warmup")

Job = tuple[str, Callable[[], None]]  # (kind, compile it)


@dataclass
class WarmupReport:
    """What one warm-up did: jobs run by kind, XLA compiles asked for, and how many of those the persistent
    compilation cache answered (the rest were compiled); seconds of wall time; the programs then run once on
    padding by kind (`engine.priming`: a live request never pays a program's first run) and the seconds that took."""

    level: str
    jobs: dict[str, int] = field(default_factory=dict)
    backend_compiles: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    evictions: int = 0
    max_maps: int | None = None
    primed: dict[str, int] = field(default_factory=dict)  # programs run once on padding after compiling (priming)
    prime_seconds: float = 0.0
    freeze_seconds: float | None = None  # the garbage collection before freezing the heap (`engine.heap`)
    job_seconds: dict[str, float] = field(default_factory=dict)  # wall time of the jobs by kind (threads overlap)
    skipped: int = 0  # warm "full": plan jobs left to the background, loaded from the cache (`warm_manifest`)

    def line(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in self.jobs.items()) or "nothing"
        return (f"warm-up {self.level}: {kinds} in {self.seconds:.1f} s; {self.backend_compiles} XLA programs, "
                f"{self.cache_hits} loaded from the compile cache, {self.backend_compiles - self.cache_hits} compiled"
                + (f"; {self.skipped} more jobs' programs are in the compile cache (its warm-start manifest) and "
                   "load from it in the background after ready, steps padded meanwhile" if self.skipped else "")
                + (f"; dropped from memory {self.evictions} times to stay under {self.max_maps} memory mappings (they "
                   "load from the compile cache again in the background when a step wants them, steps padded "
                   "meanwhile)" if self.evictions else "")
                + (f"; ran {sum(self.primed.values())} of them once ({self.prime_seconds:.1f} s)"
                   if self.primed else "")
                + (f"; heap frozen ({self.freeze_seconds:.2f} s)" if self.freeze_seconds is not None else ""))


@contextmanager
def counting(report: WarmupReport) -> Iterator[WarmupReport]:
    """Count the XLA compiles (backend compiles and persistent-cache hits, any thread) while the block runs."""
    lock = threading.Lock()

    def on_event(event: str, **_: object) -> None:
        if event == _HIT:
            with lock:
                report.cache_hits += 1

    def on_duration(event: str, seconds: float, **_: object) -> None:
        if event == _BACKEND_COMPILE:
            with lock:
                report.backend_compiles += 1

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    t0 = time.monotonic()
    try:
        yield report
    finally:
        report.seconds = time.monotonic() - t0
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)


def _pow2_upto(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= n (the padded lengths of `PageAllocator.sync_device_tags`)."""
    out = [1]
    while out[-1] < n:
        out.append(out[-1] * 2)
    return tuple(out)


Key = tuple[str, int, int, int, str]  # (kind, rows, pages, chunk tokens, sampling form or ""): one job of a plan


def plan_keys(programs: Programs, modes: tuple[SamplingMode, ...] = SERVING_MODES) -> list[Key]:
    """The keys of `full_plan`'s jobs, in its order (a tag sync's "rows" is its phase's index)."""
    c = programs.cfg
    shapes = programs.program_shapes()
    model = ("prefill", "decode", "verify")
    keys: list[Key] = [(kind, b, m, t, mode) for kind, b, m, t in shapes if kind in model for mode in modes]
    keys += [("prefill_scored", b, m, t, SCORING_MODE) for kind, b, m, t in shapes if kind == "prefill"]
    keys += [(kind, b, m, t, "") for kind, b, m, t in shapes if kind not in model]
    if programs.decode_phase is not None:
        keys += [("unpack", b, m, 0, "") for b in c.row_buckets for m in c.page_buckets]
        keys += [("unpack verify", b, m, 0, "") for kind, b, m, t in shapes if kind == "verify"]
        if chains(programs):
            keys += [("chain", b, m, 0, "") for kind, b, m, t in shapes if kind == "verify"]
    return keys + [("tag sync", i, 0, 0, "") for i, _ in enumerate(programs.phases())]


def chains(programs: Programs) -> bool:
    """Whether the plan has `spec_chain.chain_inputs` at each verify shape (`spec_chain.chains`)."""
    return programs.decode_phase is not None and spec_chain.chains(programs.cfg, programs.decode_rows)


def job_of(programs: Programs, key: Key) -> Job:
    """The compile job of one plan key."""
    kind, b, m, t, mode = key
    if kind == "unpack":
        return kind, functools.partial(compile_unpack, programs.decode_rows, b, m, tuple(programs.cfg.row_buckets))
    if kind == "unpack verify":  # verify.unpack_verify, run once on a padding batch
        return kind, functools.partial(padding_verify, b, programs.cfg.speculative.k, m, programs.decode_rows)
    if kind == "chain":  # spec_chain.chain_inputs, both links of a chain, on padding
        c = programs.cfg
        return kind, functools.partial(spec_chain.warm_chain, b, c.speculative.k, m, programs.decode_rows, c.page_size,
                                       c.max_model_len)
    if kind == "tag sync":
        tags = programs.phases()[b].pages.tags
        return kind, functools.partial(compile_tag_sync, tags, _pow2_upto(tags.shape[0]))
    return kind, functools.partial(programs._compile, kind, b, m, t, **({"mode": mode} if mode else {}))


def labelled_job(programs: Programs, key: Key) -> Job:
    """`job_of(key)`, its programs labelled with the key in `programs.resident`: an eviction reports the key."""
    kind, job = job_of(programs, key)

    def run() -> None:
        with programs.resident.labelled(key):
            job()
    return kind, run


def full_plan(programs: Programs, modes: tuple[SamplingMode, ...] = SERVING_MODES) -> list[Job]:
    """Every program the configuration can select for a request (see the module docstring), smallest shapes
    first."""
    return [job_of(programs, key) for key in plan_keys(programs, modes)]


def map_count() -> int | None:
    """Memory mappings this process holds (lines of /proc/self/maps); None where there is no procfs."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def default_max_maps() -> int | None:
    """Half the kernel's per-process mapping limit (vm.max_map_count): the other half is for the programs traffic
    loads after ready and the rest of the process. None where the limit is unknown (nothing is evicted)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text()) // 2
    except (OSError, ValueError):
        return None


def _cache_holds_everything() -> bool:
    """The persistent compile cache is on and stores every program (a minimum compile time would skip some)."""
    return bool(jax.config.jax_compilation_cache_dir) and jax.config.jax_persistent_cache_min_compile_time_secs <= 0


def drop_oldest(resident: Resident | None, max_maps: int) -> bool:
    """Drop the least recently used model programs (`engine.resident`: not those the current step used) until
    the process is under LOW_WATER x max_maps mappings. -> whether it is then under max_maps (False: it dropped
    nothing or not enough; the caller drops every program)."""
    if resident is None:
        return False
    resident.evict(lambda: (map_count() or 0) > LOW_WATER * max_maps, resident.tick - KEEP_STEPS)
    return (map_count() or 0) <= max_maps


def drop_all(resident: Resident | None) -> None:
    """Drop every compiled program of the process (`jax.clear_caches`); `resident` reports them all dropped."""
    jax.clear_caches()
    heap.refreeze()  # the dropped caches' cycles become collectable
    if resident is not None:
        resident.clear()


def _over_bound(report: WarmupReport) -> int | None:
    """The process's memory mappings when over `report.max_maps` (None: under it, or no bound or count)."""
    maps = map_count() if report.max_maps is not None else None
    return maps if maps is not None and maps > report.max_maps else None


def keep_bound(report: WarmupReport, resident: Resident | None) -> None:
    """Past `report.max_maps` memory mappings, drop programs as `run_jobs` does between jobs (`_evict`); call it with
    no compile of the caller's in flight."""
    if (maps := _over_bound(report)) is not None:
        _evict(report, maps, resident)


def _evict(report: WarmupReport, maps: int, resident: Resident | None = None) -> None:
    """Drop the least recently used programs, or every compiled program when that is not enough (they are in the
    persistent cache); refuse when there is no such cache."""
    if not _cache_holds_everything():
        raise ConfigError(f"warm-up {report.level}: the process holds {maps} memory mappings, over max_maps "
                          f"{report.max_maps} (default half of vm.max_map_count), and there is no persistent compile "
                          "cache to drop compiled programs to: enable the compile cache (serve: without "
                          "--no-compile-cache; library: `compile_cache.enable_compile_cache`), shrink the grid (a "
                          "smaller max_model_len or max_batch), warm up less (--warmup fast), or raise "
                          "vm.max_map_count",
                          value=maps, param="max_maps")
    report.evictions += 1
    if drop_oldest(resident, report.max_maps):
        log.info("warm-up %s: %d memory mappings, over %d: the least recently used programs dropped", report.level,
                 maps, report.max_maps)
        return
    drop_all(resident)
    log.info("warm-up %s: %d memory mappings, over %d: compiled programs dropped (in the compile cache)",
             report.level, maps, report.max_maps)


def run_jobs(level: str, jobs: list[Job], progress: bool, threads: int | None = None,
             max_maps: int | None = None, resident: Resident | None = None) -> WarmupReport:
    """Run the compile jobs in a thread pool (XLA compiles with the GIL released), with a progress bar, keeping
    the process under max_maps memory mappings (default `default_max_maps()`; see the module docstring): past it,
    dropping the least recently used of `resident`'s programs where that is enough (`drop_oldest`)."""
    report = WarmupReport(level, max_maps=max_maps if max_maps is not None else default_max_maps())
    for kind, _ in jobs:
        report.jobs[kind] = report.jobs.get(kind, 0) + 1
    threads = threads or min(8, os.cpu_count() or 1)
    lock = threading.Lock()
    with counting(report), tqdm(total=len(jobs), desc=f"warm-up {level}", disable=not progress) as bar, \
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxserve-warmup") as pool:
        pending: set[concurrent.futures.Future[None]] = set()

        def settle(when: str) -> None:
            nonlocal pending
            done, pending = concurrent.futures.wait(pending, return_when=when)
            for f in done:
                f.result()
                bar.update()

        for kind, job in jobs:
            if len(pending) >= threads:
                settle(concurrent.futures.FIRST_COMPLETED)
            if (maps := _over_bound(report)) is not None:
                settle(concurrent.futures.ALL_COMPLETED)
                _evict(report, maps, resident)
            pending.add(pool.submit(_timed, report, kind, job, lock))
        settle(concurrent.futures.ALL_COMPLETED)
    return report


def _timed(report: WarmupReport, kind: str, job: Callable[[], None], lock: threading.Lock) -> None:
    """Run one job, adding its wall time to `report.job_seconds[kind]`."""
    t0 = time.monotonic()
    try:
        job()
    finally:
        with lock:
            report.job_seconds[kind] = report.job_seconds.get(kind, 0.0) + time.monotonic() - t0


class MapGuard:
    """The mapping bound after ready: `check()`, called between engine steps by the thread that steps, when a
    program was loaded since the last check and the process holds more than `max_maps` memory mappings, drops the
    least recently used model programs (`resident`, `drop_oldest`: never those of the step just run) or, where that
    is not enough, every compiled program (`jax.clear_caches`); they load again from the persistent compile cache on next use (an XLA cache
    hit, not a compile). Without that cache it only logs, once. Paused while a warm-up runs (it evicts on its own);
    the caller skips it while another of its threads compiles (`jax.clear_caches` is process-wide: replicas in one
    process, `serve --workers`, are not coordinated, and a program another replica loads meanwhile may compile)."""

    def __init__(self, max_maps: int | None, resident: Resident | None = None) -> None:
        self.max_maps = max_maps
        self.resident = resident
        self.evictions = 0
        self.warming = 0  # warm-ups in progress (their own `run_jobs` keeps the bound)
        self._loaded = threading.Event()  # a program was compiled or loaded since the last check
        self._warned = False
        self._closed = False
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, event: str, **_: object) -> None:
        if event == _HIT:
            self._loaded.set()

    def _on_duration(self, event: str, seconds: float, **_: object) -> None:
        if event == _BACKEND_COMPILE:
            self._loaded.set()

    def check(self) -> bool:
        """Evict if over the bound (see the class docstring); True when it did."""
        try:
            return self._check()
        finally:
            if self.resident is not None:
                self.resident.tick += 1  # one step more (the programs a step uses record its tick)

    def _check(self) -> bool:
        if self.max_maps is None or self.warming or not self._loaded.is_set():
            return False
        self._loaded.clear()
        maps = map_count()
        if maps is None or maps <= self.max_maps:
            return False
        if not _cache_holds_everything():
            if not self._warned:
                self._warned = True
                log.warning("%d memory mappings, over %d, and no persistent compile cache: compiled programs stay "
                            "(past vm.max_map_count an mmap fails); enable the compile cache", maps, self.max_maps)
            return False
        for a in jax.live_arrays():  # nothing dispatched still runs when its program is dropped
            a.block_until_ready()
        self.evictions += 1
        if drop_oldest(self.resident, self.max_maps):
            log.info("%d memory mappings, over %d: the least recently used programs dropped", maps, self.max_maps)
            return True
        drop_all(self.resident)
        log.info("%d memory mappings, over %d: compiled programs dropped (they load from the compile cache)", maps,
                 self.max_maps)
        return True

    def close(self) -> None:
        """Stop listening for compiles (a second call does nothing)."""
        if not self._closed:
            self._closed = True
            jax.monitoring.unregister_event_listener(self._on_event)
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
