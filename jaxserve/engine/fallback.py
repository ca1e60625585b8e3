"""The padded fallback of `--warmup fast`: which bucketed shapes are compiled, the smallest compiled shape that
covers one that is not, and the background thread that compiles the rest of the grid.

Before ready, "fast" compiles the largest shape of each program kind the scheduler can select (decode and verify:
the most rows x the widest block table; prefill: each maximal (rows, chunk) pair of `EngineConfig.prefill_shapes`
x the widest block table), in every sampling form, with the decode-batch unpacking of that shape, every hand-off
size and the tag syncs; and the shapes a lone short request runs (`lone_shapes`: one row in the smallest block
tables), so a single stream never pays a large bucket's step while the rest compiles beside it. After ready one
thread compiles the rest of `warmup.full_plan` (the scoring prefill's grid included) in demand order: next, the
shape the most padded steps have wanted so far (each form, and for decode its unpacking); with no such shape left,
small (likely-first) shapes first. The traffic's own shapes so stop padding first (in the first-contact sweeps
only ~20 of the ~170 jobs finish meanwhile: in size order most of those were shapes no step wanted). Meanwhile a step whose own shape is not compiled yet is padded to the smallest compiled shape that
covers it (`fit`: more rows, pages and chunk tokens are padding the bucketed programs already handle), so the
engine thread never compiles; once its own shape (every form, and for decode its unpacking) is compiled, it is used
(after the engine's `runner`, when set, has run its program once between steps: `engine.priming`).
The background thread runs at the lowest CPU priority (`lower_priority`: nice 19, Linux), so on a host with few
cores the engine and HTTP threads win them; XLA:CPU's own compile pool (threads the client started earlier) keeps
its priority: a cold compile's codegen runs there, a compile-cache load and the tracing/lowering on the thread. The
tracing and lowering hold the GIL (about 2/3 of a warm-cache job): while the thread runs, the interpreter hands the
GIL on every 0.5 ms instead of 5 (`short_switch_interval`), so the engine thread gets it back sooner. After each
job it freezes the heap (`engine.heap`): each job leaves ~10k long-lived objects, and a full garbage collection
walking them all stopped every thread for 0.3-0.7 s during the first sweeps (bench/first_contact_trace.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from jaxserve.engine import heap
from jaxserve.engine.batch import rank_rows
from jaxserve.engine.sampling_forms import SERVING_MODES
from jaxserve.engine.scoring import SCORING_MODE
from jaxserve.engine.warmup import Job, Key, WarmupReport, chains, job_of, plan_keys, run_jobs

if TYPE_CHECKING:
    from jaxserve.engine.programs import Programs

Shape = tuple[str, int, int, int]  # (kind, rows, pages, chunk tokens)
MODEL_KINDS = ("prefill", "decode", "verify", "prefill_scored")
FORMS = {"prefill_scored": (SCORING_MODE,)}  # a kind's sampling forms, where not SERVING_MODES
BACKGROUND_NICE = 19  # the lowest priority: the background compiles take only the CPU nothing else wants
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


def largest_keys(programs: Programs, keys: list[Key]) -> list[Key]:
    """The keys "fast" compiles before ready: the model programs of each kind's maximal shapes (no other shape of
    that kind has rows, pages and chunk all >=) and of `lone_shapes`, the unpacking of those decode and verify shapes, every
    other job (hand-off, tag syncs); not the scoring prefill (few requests use it: it compiles in the background)."""
    shapes = {k[:4] for k in keys if k[0] in MODEL_KINDS}
    maximal = {s for s in shapes if not any(o != s and o[0] == s[0] and all(o[i] >= s[i] for i in (1, 2, 3))
                                            for o in shapes)}
    first = (maximal | lone_shapes(programs)) - {s for s in shapes if s[0] == "prefill_scored"}
    unpacks = {(f"unpack{'' if kind == 'decode' else ' verify'}", b, m, 0, "") for kind, b, m, _ in first
               if kind in ("decode", "verify")} | {("chain", b, m, 0, "") for kind, b, m, _ in first if kind == "verify"}
    paired = (*MODEL_KINDS, "unpack", "unpack verify", "chain")  # jobs that go with a model shape
    return [k for k in keys if k[:4] in first or k in unpacks or k[0] not in paired]


class CompiledShapes:
    """The plan keys compiled so far (`done`), the shapes usable from them (every sampling form compiled, and for
    decode its unpacking), and the cover of a shape not usable yet. Thread-safe: the background thread adds."""

    def __init__(self, programs: Programs) -> None:
        self.programs = programs
        self.done: set[Key] = set()
        self.chains = chains(programs)  # a verify shape is usable once its chain step is compiled too
        self.usable: set[Shape] = set()
        self.thread: threading.Thread | None = None
        self.report: WarmupReport | None = None  # the background compiles', once finished
        self.stopped = threading.Event()  # set by `stop`: the jobs left are skipped
        self.runner: Callable[[Key], None] | None = None  # runs a key's program once before it is usable (priming)
        self.wanted: dict[Shape, int] = {}  # padded steps per shape not usable yet (what to compile next)
        self.order: list[Key] = []  # keys in the order they were compiled
        self._queue: list[Key] = []  # the background's keys not started yet, likely-first
        self._lock = threading.Lock()

    def add(self, key: Key) -> None:
        """Record a compiled plan key; its shape (and for an unpacking, its decode shape) may become usable."""
        with self._lock:
            self.done.add(key)
            self.order.append(key)
            kind, b, m, t, _ = key
            shape = ("decode", b, m, t) if kind == "unpack" else ("verify", b, m, t) if kind == "chain" else \
                (kind, b, m, t)
            forms = FORMS.get(shape[0], SERVING_MODES)
            if shape[0] in MODEL_KINDS and all((*shape, form) in self.done for form in forms) and \
                    (shape[0] != "decode" or ("unpack", b, m, 0, "") in self.done) and \
                    (shape[0] != "verify" or not self.chains or ("chain", b, m, 0, "") in self.done):
                self.usable.add(shape)

    def cover(self, kind: str, b: int, m: int, t: int = 0) -> tuple[int, int, int]:
        """(rows, pages, chunk) to run a (kind, b, m, t) step in: its own shape when usable, else the smallest
        usable one with rows, pages and chunk all >= (its own when none is: it compiles on first use)."""
        with self._lock:
            if (kind, b, m, t) in self.usable:
                return b, m, t
            self.wanted[(kind, b, m, t)] = self.wanted.get((kind, b, m, t), 0) + 1
            over = [s for s in self.usable if s[0] == kind and s[1] >= b and s[2] >= m and s[3] >= t]
        best = min(over, key=lambda s: (_size(s), s), default=(kind, b, m, t))
        return best[1], best[2], best[3]

    def warm(self, level: str, progress: bool, max_maps: int | None) -> list[Key]:
        """Compile the largest shapes (`largest_keys`) now, in parallel; -> the keys left, likely-first."""
        keys = plan_keys(self.programs)
        first = largest_keys(self.programs, keys)
        self.report = run_jobs(level, self._jobs(first, freeze=False), progress, max_maps=max_maps,
                               resident=self.programs.resident)
        done = set(first)
        return sorted((k for k in keys if k not in done), key=_size)  # stable: full_plan's order within a size

    def start(self, keys: list[Key], hold: threading.Event | None = None, max_maps: int | None = None,
              done: Callable[[WarmupReport | None], None] | None = None) -> threading.Thread:
        """Compile `keys` in one background thread (started and returned; it waits for `hold` first, a test hook),
        one job at a time, never on the engine thread, at the lowest priority (`lower_priority`) and handing the GIL
        on sooner (`short_switch_interval`); then `done(its report)` (None if it stopped on an error)."""
        def run() -> None:
            lower_priority()
            while hold is not None and not hold.wait(0.05):
                if self.stopped.is_set():
                    break
            report = None
            with short_switch_interval():
                try:
                    report = self.report = run_jobs("fast, background", self._demand_jobs(keys), False,
                                                    threads=1, max_maps=max_maps, resident=self.programs.resident)
                except Exception:  # noqa: BLE001 - the shapes not compiled stay padded; serving goes on
                    log.exception("background compiles stopped: shapes not compiled yet run padded")
                finally:
                    if done is not None:
                        done(report)

        self.thread = threading.Thread(target=run, name="jaxserve-compile-background", daemon=True)
        self.thread.start()
        return self.thread

    def stop(self, timeout: float) -> None:
        """Skip the background jobs not started yet and wait up to `timeout` s for the one in flight."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def next_key(self) -> Key | None:
        """Take the background's next key (None when none is left): of the shape the most padded steps wanted
        (ties: the smaller shape), else the first left (likely-first order)."""
        with self._lock:
            if not self._queue:
                return None
            best = max(range(len(self._queue)), key=lambda i: (self.demand(self._queue[i]), -_size(self._queue[i]), -i))
            return self._queue.pop(best)

    def demand(self, key: Key) -> int:
        """Padded steps that wanted this key's shape (an unpacking: its decode shape's)."""
        kind = {"unpack": "decode", "chain": "verify"}.get(key[0], key[0])
        return self.wanted.get((kind, *key[1:4]), 0)

    def _demand_jobs(self, keys: list[Key]) -> list[Job]:
        """One job per key, each compiling `next_key()` when it runs (not the key it was made for): the report's
        count per kind is `keys`' and the order follows the padded steps' demand (see the module docstring)."""
        with self._lock:
            self._queue = list(keys)

        def run_next() -> None:
            key = self.next_key()
            if key is not None:
                self._jobs([key], freeze=True)[0][1]()

        return [(k[0], run_next) for k in keys]

    def _jobs(self, keys: list[Key], freeze: bool) -> list[Job]:
        """Each key's compile job, recording the key once it is compiled; freeze: then freeze the heap (`heap.freeze`:
        the job's long-lived objects leave the collector's full walks; its collection walks only the job's)."""
        def marked(key: Key, job: Callable[[], None]) -> None:
            if self.stopped.is_set():  # the engine is closing: no compile may outlive it
                return
            job()
            if self.runner is not None:  # its first run here, not in a request's step
                self.runner(key)
            self.add(key)
            if freeze:
                heap.freeze()

        return [(k[0], lambda k=k, job=job_of(self.programs, k)[1]: marked(k, job)) for k in keys]


def fit(shapes: CompiledShapes | None, kind: str, ranks: list[int], n_ranks: int, B: int, place: list[int], M: int,
        T: int = 0) -> tuple[int, list[int], int, int]:
    """A step's bucket (B rows with rows `place` for items on DP ranks `ranks`, M pages, T chunk tokens) moved to
    `shapes.cover`'s (unchanged with no fallback: `--warmup` full or none). -> (B, place, M, T)."""
    if shapes is None:
        return B, place, M, T
    b, m, t = shapes.cover(kind, B, M, T)
    if b != B:
        B, place = rank_rows(ranks, n_ranks, [b])  # the same layout over b rows (padding rows on every rank)
    return B, place, m, t
