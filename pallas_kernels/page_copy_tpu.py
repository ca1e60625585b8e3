"""TPU page import: n pages of every layer DMA'd from a compact chunk into a page pool, the pool updated in place.

The prefill -> decode hand-off writes a chunk [L, n, ...] into the decode pool [L, P, ...] at page ids [n]. As an
XLA scatter (or a loop of per-page dynamic_update_slices) XLA:TPU takes an 8-bit pool only in (8, 128) tiles while
a multi-device program keeps it in (32, 128), so it relaid out the whole pool in and out around the write (Kimi
K2.6 on v5p: 2 x the pool per hand-off). Here both arrays stay in HBM (`memory_space=pl.ANY`, the pool aliased to
the output) and each live page is one DMA of its [L, 1, ...] slab: whole tiles in any tiling, since the page axis
is major. At most `IN_FLIGHT` DMAs are outstanding (one DMA semaphore; every copy has the same size, so a wait
for any of them retires one). Page ids outside [0, P) (padding, a failed tag check) write nothing.

What was checked: interpret mode against `reference_paged.copy_pages_reference` (tests/kernels/test_page_copy_tpu.py:
MLA / GQA / scale shapes, uint8 / uint16 / f32, padding and out-of-range ids, more pages than IN_FLIGHT); the real
compile of the hand-off import for v5p (tests/compile/test_plan_targets.py: no copy of the pool).
What was NOT checked: running on a TPU, DMA throughput.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

IN_FLIGHT = 8  # outstanding page DMAs: enough to cover DMA latency, far under the DMA queue depth


def _copy_kernel(ids_ref, chunk_ref, pool_in_ref, pool_ref, sem, *, pages: int, n: int) -> None:
    """ids_ref [n] int32 (SMEM); chunk_ref [L, n, ...], pool_ref [L, P, ...] in HBM (pool_in_ref is pool_ref)."""
    del pool_in_ref  # aliased to the output: the same buffer

    def copy(i):
        page = jnp.clip(ids_ref[i], 0, pages - 1)
        return pltpu.make_async_copy(chunk_ref.at[:, pl.ds(i, 1)], pool_ref.at[:, pl.ds(page, 1)], sem)

    def live(i):
        return (ids_ref[i] >= 0) & (ids_ref[i] < pages)

    def step(i, carry):
        @pl.when(live(i))
        def _start():
            copy(i).start()

        @pl.when((i >= IN_FLIGHT) & live(jnp.maximum(i - IN_FLIGHT, 0)))
        def _retire():
            copy(i - IN_FLIGHT).wait()

        return carry

    lax.fori_loop(0, n, step, 0)

    def drain(i, carry):
        @pl.when(live(i))
        def _wait():
            copy(i).wait()

        return carry

    lax.fori_loop(max(n - IN_FLIGHT, 0), n, drain, 0)


def copy_pages_tpu(pool: jax.Array, chunk: jax.Array, page_ids: jax.Array, *, interpret=False) -> jax.Array:
    """pool [L, P, ...] (aliased: donate it for an in-place update) with pool[:, page_ids[i]] = chunk[:, i] for each
    live i; chunk [L, n, ...] of pool's dtype and trailing dims; page_ids [n] int32 (outside [0, P): skipped).
    interpret: False, True or `pltpu.InterpretParams()` (tests). Returns the updated pool."""
    if chunk.shape[0] != pool.shape[0] or chunk.shape[2:] != pool.shape[2:] or chunk.dtype != pool.dtype:
        raise ValueError(f"copy_pages_tpu: chunk {chunk.shape} {chunk.dtype} does not fit pool {pool.shape} "
                         f"{pool.dtype}")
    n = chunk.shape[1]
    if n == 0:
        return pool
    kernel = functools.partial(_copy_kernel, pages=pool.shape[1], n=n)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())]),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={2: 0},  # operands: (page_ids, chunk, pool)
        interpret=interpret,
        name="copy_pages_tpu",
    )(page_ids.astype(jnp.int32), chunk, pool)
