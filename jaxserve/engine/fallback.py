"""The padded fallback of `--warmup fast`: which bucketed shapes are compiled, the smallest compiled shape that
covers one that is not, and the background thread that compiles the rest of the grid.

Before ready, "fast" compiles the largest shape of each program kind the scheduler can select (decode and verify:
the most rows x the widest block table; prefill: each maximal (rows, chunk) pair of `EngineConfig.prefill_shapes` x
the widest block table), in every sampling form, with the decode-batch unpacking of that shape, every hand-off size
and the tag syncs; and the shapes a lone short request runs (`lone_shapes`: one row in the smallest block tables),
so a single stream never pays a large bucket's step while the rest compiles beside it; and covers between the two at
the widest table (`ladder_shapes`): decode at every LADDER-th row bucket below the most rows, so a few concurrent
streams pad into a few more rows, not into the largest bucket; prefill at the maximal (rows, chunk) pairs of at most
LADDER rows within half the prefill slots, so a small prefill computes at most half the slots, not all. After ready
one thread compiles the rest of `warmup.full_plan` (the scoring prefill's grid included) in demand order: next, the
shape the most padded steps have wanted so far (each form, and for decode its unpacking); with no such shape left,
small (likely-first) shapes first. The traffic's own shapes so stop padding first (in the first-contact sweeps only
~20 of the ~170 jobs finish meanwhile: in size order most of those were shapes no step wanted). Meanwhile a step
whose own shape is not compiled yet is padded to the smallest compiled shape that covers it (`fit`: more rows, pages
and chunk tokens are padding the bucketed programs already handle), so the engine thread never compiles; once its
own shape (every form, and for decode its unpacking) is compiled, it is used (after the engine's `runner`, when set,
has run its program once between steps: `engine.priming`).
The background thread runs at the lowest CPU priority (`lower_priority`: nice 19, Linux), so on a host with few
cores the engine and HTTP threads win them; XLA:CPU's own compile pool (threads the client started earlier) keeps
its priority: a cold compile's codegen runs there, a compile-cache load and the tracing/lowering on the thread. The
tracing and lowering hold the GIL (about 2/3 of a warm-cache job): while the thread runs, the interpreter hands the
GIL on every 0.5 ms instead of 5 (`short_switch_interval`), so the engine thread gets it back sooner. After each
job it freezes the heap (`engine.heap`): each job leaves ~10k long-lived objects, and a full garbage collection
walking them all stopped every thread for 0.3-0.7 s during the first sweeps (bench/first_contact_trace.py).

Evictions: past max_maps memory mappings the least recently used model programs leave memory (`warmup.run_jobs`
in the background, `warmup.MapGuard` between steps once it is done; `engine.resident`). Each program is labelled
with its plan key when loaded here (`Resident.labelled`), so an eviction reports its keys (`dropped`): they leave
`done`, their shapes leave `usable` (steps pad into a shape still loaded: never a load on the engine thread), and
they return to the background's queue, which loads them again from the persistent compile cache (primed, as the
plan's) once a padded step wants the shape after the eviction. Against thrash: the maximal shapes stay loaded
(`Resident.keep`: a step always has a loaded cover), an eviction takes neither what the last KEEP_STEPS + 1 steps
used nor a load in flight, `cover` marks what it returns used (no eviction between the choice and the step), and
an evicted key is loaded again only on new demand: what the bound just dropped because no step used it stays out.
Only `jax.clear_caches` (when dropping the least recently used is not enough) leaves no loaded cover; the steps then
load their own shapes until the background has loaded the wanted ones again.
A cold `--warmup full` compiles the whole plan itself and then hands it over here (`adopt`): the keys the bound
dropped during it are treated as evicted ones, so after ready no level but "none" loads a program on the engine
thread.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING

from jaxserve.engine import heap
from jaxserve.engine.batch import rank_rows
from jaxserve.engine.sampling_forms import SERVING_MODES
from jaxserve.engine.scoring import SCORING_MODE
from jaxserve.engine.warmup import (Job, Key, WarmupReport, chains, counting, default_max_maps, job_of, keep_bound,
                                    plan_keys, run_jobs)

if TYPE_CHECKING:
    from jaxserve.engine.programs import Programs

Shape = tuple[str, int, int, int]  # (kind, rows, pages, chunk tokens)
MODEL_KINDS = ("prefill", "decode", "verify", "prefill_scored")
FORMS = {"prefill_scored": (SCORING_MODE,)}  # a kind's sampling forms, where not SERVING_MODES
BACKGROUND_NICE = 19  # the lowest priority: the background compiles take only the CPU nothing else wants
RELOAD_POLL_S = 0.05  # how often the background looks for evicted keys wanted again, once the plan is compiled
LADDER = 4  # fast's decode covers step rows by this factor (`ladder_shapes`): few rows pad into <= 4x their bucket
BACKGROUND_SWITCH_S = 0.0005  # the interpreter's thread switch interval while they run (CPython's default: 5 ms)
log = logging.getLogger("jaxserve.warmup")


def _size(x: Key | Shape) -> int:
    """Padded rows x pages x chunk of a key or shape (its step's work, roughly)."""
    return max(x[1], 1) * max(x[2], 1) * max(x[3], 1)


def lower_priority() -> bool:
    """Set the calling thread's nice value to BACKGROUND_NICE; threads it starts later inherit it. Linux only (nice
    is per thread there; elsewhere `setpriority` would lower the whole process). -> whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as err:  # e.g. a seccomp profile forbids it: compile at normal priority
        log.warning("background compiles keep normal priority: %s", err)
        return False
    return True


@contextlib.contextmanager
def short_switch_interval() -> Iterator[None]:
    """Run the block with the interpreter's thread switch interval at BACKGROUND_SWITCH_S: tracing and lowering
    hold the GIL for long stretches, and each time the engine thread (it releases the GIL while XLA runs) wants it
    back it waits up to that interval, several times a step. Restored after unless changed meanwhile (two engines'
    background threads overlapping: the first to finish restores it)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, BACKGROUND_SWITCH_S))
    ours = sys.getswitchinterval()
    try:
        yield
    finally:
        if sys.getswitchinterval() == ours:
            sys.setswitchinterval(before)


def lone_shapes(programs: Programs) -> set[Shape]:
    """What a lone short request (one that fits the smallest prefill block table) runs: prefill of one row in that
    table with the widest chunk such a prompt can need (it covers every shorter chunk), decode and verify of the
    smallest row bucket at each decode table up to it."""
    c = programs.cfg
    pages = c.prefill_page_buckets[0]
    chunk = c.pick(c.chunk_buckets, min(c.prefill_chunk, pages * c.page_size))
    out = {("prefill", c.row_buckets[0], pages, chunk)}
    return out | {(kind, c.row_buckets[0], m, 0) for kind in ("decode", "verify") for m in c.page_buckets if m <= pages}


def ladder_shapes(programs: Programs) -> set[Shape]:
    """Covers between a lone request and the largest batch, at the widest block table. Decode and verify: every
    LADDER-th row bucket below the most rows, down to LADDER rows (under that a padded step computes few rows
    anyway): a first batch of a few rows pads into a few more rows, not into the largest bucket (the first-contact
    c = 4 sweep ran its 4 rows padded to 32: TTFT p50 1.5-2.2x the warm sweep's, bench/serving.py --first-contact).
    Prefill: the maximal (rows, chunk) pairs of at most LADDER rows within half the prefill slots, so a prefill of
    a few rows and half the slots or less computes at most half the slots, not all of them (first contact's 2 rows
    of 87 tokens, 256 slots of chunk 128, ran in 512; a tool prompt's one row of chunk 128 in 2 x 256); more rows
    come with more traffic, whose own shapes the background loads first (all five pairs at serve's defaults added 32 s
    to a cold fast warm-up, bench/warmup_grid.py --passes fast)."""
    c = programs.cfg
    out, r = set(), c.row_buckets[-1] // LADDER
    while r >= LADDER:
        out |= {(kind, c.pick(c.row_buckets, r), c.page_buckets[-1], 0) for kind in ("decode", "verify")}
        r //= LADDER
    widest = c.prefill_page_buckets[-1]
    half = {("prefill", b, widest, t) for b, t in c.prefill_shapes if b <= LADDER and b * t <= c.prefill_slots // 2}
    return out | maximal(half)


def maximal(shapes: set[Shape]) -> set[Shape]:
    """The model shapes no other shape of their kind covers (rows, pages and chunk all >=)."""
    shapes = {s for s in shapes if s[0] in MODEL_KINDS}
    return {s for s in shapes if not any(o != s and o[0] == s[0] and all(o[i] >= s[i] for i in (1, 2, 3))
                                         for o in shapes)}


def largest_keys(programs: Programs, keys: list[Key]) -> list[Key]:
    """The keys "fast" compiles before ready: the model programs of each kind's maximal shapes (no other shape of
    that kind has rows, pages and chunk all >=), of `lone_shapes` and of `ladder_shapes`, the unpacking of those
    decode and verify shapes, every other job (hand-off, tag syncs); not the scoring prefill (few requests use it:
    it compiles in the background)."""
    shapes = {k[:4] for k in keys if k[0] in MODEL_KINDS}
    first = (maximal(shapes) | lone_shapes(programs) | ladder_shapes(programs)) - \
        {s for s in shapes if s[0] == "prefill_scored"}
    unpacks = {(f"unpack{'' if kind == 'decode' else ' verify'}", b, m, 0, "") for kind, b, m, _ in first
               if kind in ("decode", "verify")} | {("chain", b, m, 0, "") for kind, b, m, _ in first if kind == "verify"}
    paired = (*MODEL_KINDS, "unpack", "unpack verify", "chain")  # jobs that go with a model shape
    return [k for k in keys if k[:4] in first or k in unpacks or k[0] not in paired]


def _shape_of(key: Key) -> Shape:
    """The model shape a plan key goes with (an unpacking: its decode shape; a chain step: its verify shape)."""
    kind, b, m, t, _ = key
    return ({"unpack": "decode", "chain": "verify"}.get(kind, kind), b, m, t)


class CompiledShapes:
    """The plan keys compiled and loaded (`done`), the shapes usable from them (every sampling form compiled, and
    for decode its unpacking), and the cover of a shape not usable yet. Thread-safe: the background thread adds;
    an eviction (`programs.resident`'s `on_drop`, on whichever thread evicts) takes keys out (`dropped`)."""

    def __init__(self, programs: Programs) -> None:
        self.programs = programs
        self.done: set[Key] = set()
        self.chains = chains(programs)  # a verify shape is usable once its chain step is compiled too
        self.usable: set[Shape] = set()
        self.thread: threading.Thread | None = None
        self.finished = threading.Event()  # the background compiled the plan (it goes on reloading evicted keys)
        self.report: WarmupReport | None = None  # the background compiles', once finished
        self.stopped = threading.Event()  # set by `stop`: the jobs left are skipped
        self._evicted = threading.Event()  # set by an eviction (and `stop`): wakes the reload loop, which else sleeps
        self.runner: Callable[[Key], None] | None = None  # runs a key's program once before it is usable (priming)
        self.wanted: dict[Shape, int] = {}  # padded steps per shape not usable yet (what to compile next)
        self.order: list[Key] = []  # keys in the order they were compiled (reloads again)
        self.evicted: list[Key] = []  # keys dropped from memory after they were done, in that order
        self.reloads = 0  # evicted keys the background loaded again
        self.padded = 0  # steps run in a larger loaded shape than their own (`cover`)
        self._queue: list[Key] = []  # the background's keys not started yet, likely-first
        self._reload: set[Key] = set()  # those of `_queue` that were evicted: loaded again only on demand
        self._plan: set[Key] = set()  # the background's keys (`start`)
        self._added: set[Key] = set()  # every key ever added (`reloads`: those added again)
        self._lock = threading.Lock()
        programs.resident.on_drop = self.dropped

    def add(self, key: Key) -> None:
        """Record a compiled plan key; its shape (and for an unpacking, its decode shape) may become usable."""
        with self._lock:
            self.reloads += key in self._added
            self._added.add(key)
            self.done.add(key)
            self.order.append(key)
            shape = _shape_of(key)
            b, m = shape[1], shape[2]
            forms = FORMS.get(shape[0], SERVING_MODES)
            if shape[0] in MODEL_KINDS and all((*shape, form) in self.done for form in forms) and \
                    (shape[0] != "decode" or ("unpack", b, m, 0, "") in self.done) and \
                    (shape[0] != "verify" or not self.chains or ("chain", b, m, 0, "") in self.done):
                self.usable.add(shape)

    def dropped(self, labels: list[Hashable], everything: bool) -> None:
        """`Resident.on_drop`: the programs of these keys (all keys when `everything`: `jax.clear_caches`) left
        memory. Their shapes stop being usable (steps pad to a shape still loaded) and they go back to the
        background's queue: a model key and its unpacking to be loaded again once a padded step wants its shape
        after this (`next_key`: no reload of what nobody asked for since, so no loop reloading what the bound
        just dropped), any other key (a tag sync, a hand-off: no shape to pad) at once."""
        with self._lock:
            self._drop({k for k in self.done} if everything else {k for k in labels if k in self.done})

    def _drop(self, keys: set[Key]) -> None:
        """`dropped`'s work, the lock held."""
        for key in sorted(keys):
            self.done.discard(key)
            self.evicted.append(key)
            shape = _shape_of(key)
            self.usable.discard(shape)
            self.wanted.pop(shape, None)  # demand counts anew from here
            self._queue.append(key)
            if shape[0] in MODEL_KINDS:
                self._reload.add(key)
        self._evicted.set()

    def cover(self, kind: str, b: int, m: int, t: int = 0) -> tuple[int, int, int]:
        """(rows, pages, chunk) to run a (kind, b, m, t) step in: its own shape when usable, else the smallest
        usable one with rows, pages and chunk all >= (its own when none is: it compiles on first use). The shape
        returned is marked used now in `programs.resident` (no eviction takes it before the step runs); one found
        evicted meanwhile (its `on_drop` not seen yet) is dropped here and the next is taken."""
        own = (kind, b, m, t)
        with self._lock:
            over = sorted((s for s in self.usable if s[0] == kind and s[1] >= b and s[2] >= m and s[3] >= t),
                          key=lambda s: (s != own, _size(s), s))
            best = own
            for s in over:
                gone = self.programs.resident.touch([(*s, form) for form in FORMS.get(kind, SERVING_MODES)])
                if not gone:
                    best = s
                    break
                self._drop({k for k in gone if k in self.done})
            if best != own or own not in self.usable:
                self.wanted[own] = self.wanted.get(own, 0) + 1
            self.padded += best != own
        return best[1], best[2], best[3]

    def warm(self, level: str, progress: bool, max_maps: int | None) -> list[Key]:
        """Compile the largest shapes (`largest_keys`) now, in parallel; -> the keys left, likely-first. The maximal
        shapes' programs stay loaded (`Resident.keep`): a step always has a loaded shape to pad into."""
        keys = plan_keys(self.programs)
        first = largest_keys(self.programs, keys)
        self.report = run_jobs(level, self._jobs(first, freeze=False), progress, max_maps=max_maps,
                               resident=self.programs.resident)
        self.programs.resident.keep([k for k in first if k[:4] in maximal({k[:4] for k in keys})])
        done = set(first)
        return sorted((k for k in keys if k not in done), key=_size)  # stable: full_plan's order within a size

    def adopt(self, keys: list[Key]) -> list[Key]:
        """After a cold full warm-up compiled `keys` (each labelled with its key: `warmup.labelled_job`): the keys
        still loaded are done; of those the mapping bound dropped meanwhile, the fast set's (`largest_keys`) load
        again now and the maximal shapes' stay loaded (a step always has a loaded cover, as after `warm`); the
        others wait as evicted keys do (`dropped`: loaded again by the background once a padded step wants them).
        -> the fast set, loaded."""
        first = largest_keys(self.programs, keys)
        gone = set(self.programs.resident.gone(list(keys)))
        for key in keys:
            if key not in gone:
                self.add(key)
        for key in first:
            if key in gone:
                self._load(key, freeze=False)
                gone.discard(key)
        self.programs.resident.keep([k for k in first if k[:4] in maximal({k[:4] for k in keys})])
        with self._lock:
            self._drop(gone)
        return first

    def start(self, keys: list[Key], hold: threading.Event | None = None, max_maps: int | None = None,
              done: Callable[[WarmupReport | None], None] | None = None) -> threading.Thread:
        """Compile `keys` in one background thread (started and returned; it waits for `hold` first, a test hook),
        one job at a time in demand order (`next_key`), never on the engine thread, at the lowest priority
        (`lower_priority`) and handing the GIL on sooner (`short_switch_interval`), keeping the process under
        max_maps (`warmup.keep_bound`); then `done(its report)` (None if it stopped on an error) and `finished`
        set. It then stays, until `stop`, to load evicted keys again as padded steps want them (`_reload_wanted`)."""
        plan = set(keys)
        with self._lock:  # after the keys any a warm-up eviction queued again
            self._queue = list(keys) + [k for k in self._queue if k not in plan]
            self._plan = plan

        def run() -> None:
            lower_priority()
            while hold is not None and not hold.wait(0.05):
                if self.stopped.is_set():
                    break
            report = None
            with short_switch_interval():
                try:
                    report = self.report = self._compile_plan(max_maps)
                except Exception:  # noqa: BLE001 - the shapes not compiled stay padded; serving goes on
                    log.exception("background compiles stopped: shapes not compiled yet run padded")
                finally:
                    if done is not None:
                        done(report)
                    self.finished.set()
            if report is not None:
                self._reload_wanted()

        self.thread = threading.Thread(target=run, name="jaxserve-compile-background", daemon=True)
        self.thread.start()
        return self.thread

    def _compile_plan(self, max_maps: int | None) -> WarmupReport:
        """The background's compiles of the plan keys left (and of evicted keys wanted meanwhile), one at a time."""
        report = WarmupReport("fast, background", max_maps=max_maps if max_maps is not None else default_max_maps())
        with counting(report):
            while not self.stopped.is_set():
                keep_bound(report, self.programs.resident)  # may evict: what it drops is queued before the pick
                key = self.next_key()
                if key is None:
                    break
                report.jobs[key[0]] = report.jobs.get(key[0], 0) + 1
                self._load(key, freeze=True)
        return report

    def _reload_wanted(self) -> None:
        """After the plan: load each evicted key again once it is wanted (`next_key`), until `stop`. The mapping
        bound is the engine's again (`warmup.MapGuard`, between steps): a load in flight is not evicted
        (`Resident.labelled`), nor what the last KEEP_STEPS + 1 steps used."""
        while not self.stopped.is_set():
            key = self.next_key()
            if key is None:
                if self._reload:  # evicted keys no step wants yet: look again soon
                    self.stopped.wait(RELOAD_POLL_S)
                else:  # nothing evicted: no polling (an engine never closed leaves a sleeping thread, no wake-ups)
                    self._evicted.wait()
                    self._evicted.clear()
                continue
            try:
                with short_switch_interval():
                    self._load(key, freeze=True)
            except Exception:  # noqa: BLE001 - its shape stays padded; serving goes on
                log.exception("loading %s again failed: the evicted shapes left run padded", key)
                return

    def stop(self, timeout: float) -> None:
        """Skip the background jobs not started yet and wait up to `timeout` s for the one in flight."""
        self.stopped.set()
        self._evicted.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def next_key(self) -> Key | None:
        """Take the background's next key (None when none is ready): of the shape the most padded steps wanted
        (ties: the smaller shape), else the first left (likely-first order). An evicted model key is ready only once
        a padded step has wanted its shape since the eviction (`dropped`)."""
        with self._lock:
            q = self._queue
            ready = [i for i, k in enumerate(q) if k not in self._reload or self.demand(k) > 0]
            if not ready:
                return None
            key = q.pop(max(ready, key=lambda i: (self.demand(q[i]), -_size(q[i]), -i)))
            self._reload.discard(key)
            return key

    def pending(self) -> int:
        """Plan keys not loaded now: the background's queue (evicted keys included) and the one it is loading."""
        with self._lock:
            return len((self._plan | set(self._queue)) - self.done)

    def demand(self, key: Key) -> int:
        """Padded steps that wanted this key's shape (an unpacking: its decode shape's)."""
        return self.wanted.get(_shape_of(key), 0)

    def _jobs(self, keys: list[Key], freeze: bool) -> list[Job]:
        """Each key's compile job (`_load`)."""
        return [(k[0], functools.partial(self._load, k, freeze)) for k in keys]

    def _load(self, key: Key, freeze: bool) -> None:
        """Compile (or load from the persistent cache) one key's program, run it once (`runner`) and record it,
        its programs labelled with the key in `programs.resident` (an eviction reports it: `dropped`); freeze: then
        freeze the heap (`heap.freeze`: the job's long-lived objects leave the collector's full walks)."""
        if self.stopped.is_set():  # the engine is closing: no compile may outlive it
            return
        with self.programs.resident.labelled(key):
            job_of(self.programs, key)[1]()
            if self.runner is not None:  # its first run here, not in a request's step
                self.runner(key)
            self.add(key)
        if freeze:
            heap.freeze()


def fit(shapes: CompiledShapes | None, kind: str, ranks: list[int], n_ranks: int, B: int, place: list[int], M: int,
        T: int = 0) -> tuple[int, list[int], int, int]:
    """A step's bucket (B rows with rows `place` for items on DP ranks `ranks`, M pages, T chunk tokens) moved to
    `shapes.cover`'s (unchanged with no fallback: `--warmup none`). -> (B, place, M, T)."""
    if shapes is None:
        return B, place, M, T
    b, m, t = shapes.cover(kind, B, M, T)
    if b != B:
        B, place = rank_rows(ranks, n_ranks, [b])  # the same layout over b rows (padding rows on every rank)
    return B, place, m, t
