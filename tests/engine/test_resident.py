"""The resident programs (engine/resident.py): one jit object per call signature, and an eviction that drops the
least recently used ones (their memory mappings with them) while the programs still in use stay loaded."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from engine_util import prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.resident import Resident, ShapeJit
from jaxserve.engine.warmup import map_count

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class Compiles:
    """XLA compiles while the block runs."""

    def __enter__(self) -> "Compiles":
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def _on(self, event: str, seconds: float, **_: object) -> None:
        if event == BACKEND_COMPILE:
            self.n += 1

    def __exit__(self, *_: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on)


def _body(weights: jax.Array, x: jax.Array) -> jax.Array:
    for i in range(8):  # several kernels: each maps its own code and data
        x = jnp.sort(x * weights[i], axis=-1) + jnp.cumsum(x, axis=0)
    return x


def test_eviction_drops_the_least_recently_used_signatures_and_keeps_the_rest_loaded():
    resident = Resident()
    f = ShapeJit(resident, "body", _body, functools.partial(jax.jit, donate_argnums=()))
    w = jnp.arange(8, dtype=jnp.float32)
    for rows in (2, 4, 8):  # three signatures, each used at its own tick
        f(w, jnp.ones((rows, 16))).block_until_ready()
        resident.tick += 1
    f.lower(w, jnp.ones((16, 16))).compile()  # lowered and compiled as a warm-up does, never called: one more
    assert len(resident) == 4 and f._cache_size() >= 3
    f(w, jnp.ones((2, 16))).block_until_ready()  # the oldest used again: now the newest
    before = map_count()
    assert resident.evict(lambda: True, keep_since=resident.tick) == 2  # rows 4 (tick 1) and 8 (tick 2) go
    assert [sig[2][0][0] for sig, _ in resident.items()] == [(16, 16), (2, 16)]  # the rest, oldest first
    assert before is None or map_count() < before  # their code and data were unmapped
    with Compiles() as kept:
        f(w, jnp.ones((2, 16))).block_until_ready()
        f(w, jnp.ones((16, 16))).block_until_ready()  # lowered and compiled, never called: loaded all the same
    assert kept.n == 0
    with Compiles() as dropped:
        f(w, jnp.ones((8, 16))).block_until_ready()
    assert dropped.n == 1 and len(resident) == 3


@pytest.mark.slow  # compiles the tiny model's programs for a short workload (about a minute on 2 shared cores)
def test_engine_eviction_keeps_the_programs_the_last_steps_used():
    """After a 4-row workload and then a lone request, dropping every program older than the lone request's steps
    leaves the lone request's loaded (it runs again with no compile) and frees the others' mappings."""
    e = Engine(tiny_model(), small_config(kv_dtype="fp8", max_batch=4, max_model_len=32), start=False)
    try:
        lone = prompts(1, seed=2, lengths=(5,))
        e.generate(prompts(4, seed=1, lengths=(3, 20, 9, 27)), SamplingParams(max_tokens=6, ignore_eos=True))
        resident = e.programs.resident
        tick = resident.tick  # advanced once per step (MapGuard.check)
        assert tick > 0
        want = e.generate(lone, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
        kinds = {sig[0] for sig, _ in resident.items()}
        n, before = len(resident), map_count()
        dropped = resident.evict(lambda: True, keep_since=tick)
        assert 0 < dropped < n and kinds == {"prefill", "decode"}
        assert before is None or map_count() < before
        with Compiles() as again:
            got = e.generate(lone, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
        assert again.n == 0 and got == want  # the lone request's programs stayed loaded
    finally:
        e.close()
