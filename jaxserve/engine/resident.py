"""The model programs held in memory, one `jax.jit` object per call signature, so the memory-mapping bound
(`warmup.MapGuard`) can drop the least recently used ones instead of every program (`jax.clear_caches`).

Why per signature: XLA:CPU maps ~3 memory regions per compiled kernel (~735 for one decode program of the embedded
model, `bench/program_maps.py`, whatever `--xla_cpu_parallel_codegen_split_count`: each kernel is its own object),
so only ~40 programs fit under half of vm.max_map_count, while the default grid has 817. One jit object
holds every signature it compiled; `clear_cache()` on one drops its executables (its mappings are unmapped) and
leaves the other jit objects' programs loaded (a dropped one is traced again and loaded from the persistent
compile cache on its next use). `ShapeJit` stands in for one `jax.jit` of a Programs entry point (same call and
`lower`), making a jit object per signature (the arguments after the weights: shapes, dtypes, the pytree
structure with its static sampling form, and Python scalars), each over its own function object (JAX's tracing
cache is keyed on the function: one shared function would drop every signature's traces at once).

Labels: a caller that loads programs for something of its own (`fallback.CompiledShapes`: a warm-up plan key) does
so inside `labelled(label)`; the signatures its thread gets meanwhile carry that label, and every eviction reports
the labels it dropped to `on_drop`, so the caller learns what is no longer loaded without this module knowing
what a label means. A label being loaded (inside `labelled`) is never evicted; `touch` marks labels used now. `clear`
(after `jax.clear_caches`) reports every label loaded since the last clear, those whose programs are not held here
(an unpacking, a tag sync) too.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax

UNUSED = -(1 << 62)  # the recency of a program loaded (inside `labelled`) that no step has run yet: none to protect
Signature = tuple[str, Any, tuple]  # (entry point, pytree structure, leaf shapes/dtypes or scalar values)
# told the labels of dropped programs, and whether every compiled program of the process went (jax.clear_caches)
OnDrop = Callable[[list[Hashable], bool], None]


def signature(name: str, args: tuple) -> Signature:
    """The signature of a call's arguments after the weights (args[0], the same for every call)."""
    leaves, tree = jax.tree.flatten(args[1:])
    return name, tree, tuple((x.shape, str(x.dtype)) if hasattr(x, "shape") else x for x in leaves)


class Resident:
    """The jit objects of every `ShapeJit` of one Programs, least recently used first; `evict` drops from that
    end. Thread-safe: the engine thread calls and evicts, the warm-up threads lower and compile."""

    def __init__(self) -> None:
        self._jits: collections.OrderedDict[Signature, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.tick = 0  # evictions keep what was used at or after the tick `evict` is given
        self._used: dict[Signature, int] = {}
        self.dropped = 0
        self.on_drop: OnDrop | None = None
        self._labels: dict[Signature, Hashable] = {}
        self._by_label: dict[Hashable, set[Signature]] = {}
        self._gone: set[Hashable] = set()  # labels with a program dropped since it was last loaded
        self._loaded: set[Hashable] = set()  # labels loaded (`labelled`) since the last `clear`, held here or not
        self._loading: collections.Counter[Hashable] = collections.Counter()  # labels inside `labelled` now
        self._local = threading.local()  # .label: the calling thread's current label
        self._kept: set[Hashable] = set()  # labels no least-recently-used eviction takes (`keep`)

    def get(self, sig: Signature, make: Callable[[], Any]) -> Any:
        """The jit object of `sig` (made by `make` on first use), now the most recently used."""
        with self._lock:
            jit = self._jits.get(sig)
            if jit is None:
                jit = self._jits[sig] = make()
            self._jits.move_to_end(sig)
            label = getattr(self._local, "label", None)
            # a load is not a use: before any step all of a warm-up's loads would count as used by the current one,
            # and no least-recently-used eviction could drop anything (the bound then dropped every program)
            self._used[sig] = self._used.get(sig, UNUSED) if label is not None else self.tick
            if label is not None and sig not in self._labels:  # a signature keeps its first label
                self._labels[sig] = label
                self._by_label.setdefault(label, set()).add(sig)
                self._gone.discard(label)
            return jit

    @contextlib.contextmanager
    def labelled(self, label: Hashable) -> Iterator[None]:
        """Label the signatures this thread gets in the block (see the module docstring); none of the label's
        programs is evicted meanwhile, and they are the most recently loaded at the end (a load is not a use: only a
        step's call or `touch` protects a program from the least-recently-used eviction's recency bound)."""
        before = getattr(self._local, "label", None)
        self._local.label = label
        with self._lock:
            self._loading[label] += 1
        loaded = False
        try:
            yield
            loaded = True
        finally:
            self._local.label = before
            with self._lock:
                self._loading[label] -= 1
                if not self._loading[label]:
                    del self._loading[label]
                if loaded:  # a label whose programs are not held here (an unpacking, a tag sync) is loaded now too
                    self._loaded.add(label)
                    if not self._by_label.get(label):
                        self._gone.discard(label)
                for sig in self._by_label.get(label, ()):  # the most recently loaded; used once a step runs it
                    self._jits.move_to_end(sig)

    def keep(self, labels: list[Hashable]) -> None:
        """Never evict the programs of `labels` by recency (`clear` still drops them)."""
        with self._lock:
            self._kept.update(labels)

    def touch(self, labels: list[Hashable]) -> list[Hashable]:
        """Mark the programs of `labels` used now (the step about to run uses them: no eviction takes them after
        this). -> the labels with a program dropped (using it would load it again); labels never seen count as
        loaded."""
        gone = []
        with self._lock:
            for label in labels:
                if label in self._gone:
                    gone.append(label)
                for sig in self._by_label.get(label, ()):
                    self._jits.move_to_end(sig)
                    self._used[sig] = self.tick
        return gone

    def gone(self, labels: list[Hashable]) -> list[Hashable]:
        """The labels with a program dropped since it was loaded (as `touch` reports them), marking nothing used."""
        with self._lock:
            return [label for label in labels if label in self._gone]

    def __len__(self) -> int:
        return len(self._jits)

    def items(self) -> list[tuple[Signature, Any]]:
        """(signature, jit object), least recently used first."""
        with self._lock:
            return list(self._jits.items())

    def evict(self, over: Callable[[], bool], keep_since: int) -> int:
        """Drop jit objects, least recently used first, while `over()` and the next was last used before tick
        `keep_since` (what the current step uses stays). -> how many were dropped."""
        n = 0
        while over():
            with self._lock:
                sig = next((s for s in self._jits if self._used[s] >= keep_since or
                            self._labels.get(s) not in self._loading and self._labels.get(s) not in self._kept), None)
                if sig is None or self._used[sig] >= keep_since:
                    break
                jit = self._jits.pop(sig)
                del self._used[sig]
                label = self._forget(sig)
            if label is not None and self.on_drop is not None:
                self.on_drop([label], False)
            jit.clear_cache()  # its executables are freed (and unmapped) with their last reference, no collection
            del jit
            n += 1
        self.dropped += n
        return n

    def clear(self) -> None:
        """Forget every jit object (after `jax.clear_caches` dropped their programs) and report all labels."""
        with self._lock:
            n, sigs = len(self._jits), list(self._jits)
            # jax.clear_caches dropped the programs of every label loaded since, held here or not (not gone already)
            elsewhere = self._loaded - self._gone - set(self._labels.values())
            labels = [label for label in map(self._forget, sigs) if label is not None]
            labels += sorted(elsewhere, key=repr)
            self._gone.update(elsewhere)
            self._loaded.clear()
            self._jits.clear()
            self._used.clear()
        self.dropped += n
        if self.on_drop is not None:
            self.on_drop(list(dict.fromkeys(labels)), True)

    def _forget(self, sig: Signature) -> Hashable | None:
        """Drop `sig`'s label (which is then gone); the lock is held. -> the label, if any."""
        label = self._labels.pop(sig, None)
        if label is not None:
            self._by_label[label].discard(sig)
            self._gone.add(label)
        return label


class ShapeJit:
    """One `jax.jit(fn, ...)` entry point of Programs, as a jit object per call signature in `resident`
    (`jit` is `functools.partial(jax.jit, ...)` with the shardings and donations). Called and lowered as the jit."""

    def __init__(self, resident: Resident, name: str, fn: Callable, jit: Callable[[Callable], Any]) -> None:
        self.resident, self.name, self.fn, self.jit = resident, name, fn, jit

    def _of(self, args: tuple) -> Any:
        return self.resident.get(signature(self.name, args), lambda: self.jit(functools.partial(self.fn)))

    def __call__(self, *args: Any) -> Any:
        return self._of(args)(*args)

    def lower(self, *args: Any) -> Any:
        return self._of(args).lower(*args)

    def trace(self, *args: Any) -> Any:
        return self._of(args).trace(*args)

    def _cache_size(self) -> int:
        """Executables held over this entry point's resident signatures (as `jax.jit`'s, for tests)."""
        return sum(jit._cache_size() for sig, jit in self.resident.items() if sig[0] == self.name)
