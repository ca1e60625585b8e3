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
"""
from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax

Signature = tuple[str, Any, tuple]  # (entry point, pytree structure, leaf shapes/dtypes or scalar values)


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

    def get(self, sig: Signature, make: Callable[[], Any]) -> Any:
        """The jit object of `sig` (made by `make` on first use), now the most recently used."""
        with self._lock:
            jit = self._jits.get(sig)
            if jit is None:
                jit = self._jits[sig] = make()
            self._jits.move_to_end(sig)
            self._used[sig] = self.tick
            return jit

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
                sig = next(iter(self._jits), None)
                if sig is None or self._used[sig] >= keep_since:
                    break
                jit = self._jits.pop(sig)
                del self._used[sig]
            jit.clear_cache()  # its executables are freed (and unmapped) with their last reference, no collection
            del jit
            n += 1
        self.dropped += n
        return n


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
