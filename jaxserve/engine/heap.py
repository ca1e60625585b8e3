"""The serving process's heap as the cyclic garbage collector sees it: the long-lived objects (the model's Python
objects, the compiled programs and JAX's tracing and lowering caches: ~575k objects once `--warmup fast` is done on
the embedded model) moved out of its reach (`gc.freeze`), so a full collection, which holds the GIL and so stops
every Python thread, walks only what was made since instead of all of them (0.3-0.7 s per full collection here,
several during the background compiles: the streams' largest stalls, bench/first_contact_trace.py).

`freeze` runs at the end of a warm-up, before ready, and after each background compile job (each adds ~10k long-
lived objects; its collection then walks only those); `refreeze` after `jax.clear_caches` (an eviction) hands the
frozen objects back to the collector first, so the cycles the dropped caches leave are collected, not kept;
`thaw` when an engine closes (its cycles are collectable again: a process that makes many engines, tests, keeps
none of them).
"""
from __future__ import annotations

import gc
import time


def freeze() -> float:
    """Collect what is garbage now, then freeze every object left (the next collections skip them). -> seconds."""
    t0 = time.monotonic()
    gc.collect()
    gc.freeze()
    return time.monotonic() - t0


def refreeze() -> float:
    """Unfreeze (objects freed meanwhile in reference cycles become collectable), then `freeze`. -> seconds."""
    gc.unfreeze()
    return freeze()


def thaw() -> None:
    """Hand every frozen object back to the collector (the next full collection walks them all once)."""
    gc.unfreeze()
