"""DSA lightning-indexer scores for one decode query per row, for TPU (Mosaic): each key's score is
sum_h w[h] * relu((q[h] . k) * scale * hd ** -0.5) over the indexer's heads, the keys' pages DMA'd by the kernel
itself from the whole paged index-key pool left in HBM (`memory_space=pl.ANY`; `layer` picks the indexer layer:
no per-layer slice, which XLA:TPU would copy).

Grid (row, block-table chunk), both "parallel": the chunk's page ids reach SMEM as a 1-D block of the flattened
table (padded with page 0 to whole chunks; the padded slots' scores are dropped), and the chunk is walked in
compute blocks of `pages_per_block` pages, double-buffered: while block i is scored, block i + 1's page DMAs (one
[ps, hd] page and, FP8, one [ps] f32 scale row each) are in flight. Whole pages only: a page is tile-aligned in
any tiling, so the stored bits (uint8 FP8 / uint16 BF16 / uint32 F32) are DMA'd as they are and viewed as values
in VMEM. Per block one [nh, hd] x [hd, bk] dot, the FP8 per-key scale on the products, ReLU, the head-weighted sum
as an [nh, 1] column broadcast and a sublane sum; scores written lane-dense into the chunk's output block.
Unmasked, as the GPU kernel: the caller masks causality and the context (a slot past it may hold anything).

What was checked: interpret mode vs reference_sparse.index_scores_reference (tests/kernels/
test_dsa_index_scores_tpu.py) and real compiles by XLA:TPU + Mosaic for v5e / v5p / v6e at GLM-5.2's decode
shapes (tests/compile/test_compile_sparse.py). NOT run on a TPU: no speed figures; block sizes are untuned priors.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention_tpu import BITS_TO_VALUES, _scale_row, dot_precision

TOKENS_PER_BLOCK = 512  # keys per compute block: 8 pages of 64 (a [512, 128] u8 slot: 64 KiB; [32, 512] f32 scores)
MAX_CHUNK_PAGES = 1024  # block-table entries per grid step at most (the SMEM block: 2 x 4 KiB)
CHUNK_ALIGN = 128  # a 1-D SMEM block's size: a multiple of 128


def choose_index_blocks(num_pages: int, page_size: int, *, pages_per_block: int | None = None,
                        chunk_pages: int | None = None) -> tuple[int, int]:
    """(pages per compute block, pages per grid step). Block: TOKENS_PER_BLOCK tokens (at least one page; its
    tokens a multiple of 128, the output's lane tiling); chunk: the whole table up to MAX_CHUNK_PAGES, a multiple
    of the block and of CHUNK_ALIGN."""
    ppb = pages_per_block or max(1, TOKENS_PER_BLOCK // page_size)
    if ppb * page_size % 128:
        raise ValueError(f"pages_per_block {ppb} x page size {page_size} must be a multiple of 128 tokens")
    unit = math.lcm(ppb, CHUNK_ALIGN)
    chunk = chunk_pages or min(-(-num_pages // unit) * unit, max(unit, MAX_CHUNK_PAGES // unit * unit))
    if chunk % unit:
        raise ValueError(f"chunk_pages {chunk} must be a multiple of {unit}")
    return ppb, chunk


def _values(x: jax.Array) -> jax.Array:
    """A VMEM block of stored bits (uint8 / uint16 / uint32) as float8_e4m3fn / bfloat16 / float32 values."""
    to = {**BITS_TO_VALUES, jnp.dtype(jnp.uint32): jnp.float32}.get(jnp.dtype(x.dtype))
    return x if to is None else lax.bitcast_convert_type(x, to)


def _kernel(layer_ref, bt_ref, q_ref, w_ref, *refs, fp8: bool, page_size: int, pages_per_block: int,
            scale: float):
    """One (row, chunk) program.

    layer_ref [1] int32 (scalar prefetch); bt_ref [chunk] int32 (SMEM: page ids); q_ref [nh, hd] f32; w_ref
    [nh, 1] f32; HBM: k_hbm [L, P, ps, hd] bits, (s_hbm [L, P, ps] f32). o_ref [1, chunk * ps] f32. Scratch: buf
    [2, ppb, ps, hd] bits, (s_buf [2, ppb, ps] f32), sems DMA [2].
    """
    k_hbm, rest = refs[0], refs[1:]
    s_hbm, rest = (rest[0], rest[1:]) if fp8 else (None, rest)
    o_ref, buf, rest = rest[0], rest[1], rest[2:]
    s_buf, sems = rest if fp8 else (None, *rest)
    ppb, layer = pages_per_block, layer_ref[0]
    bk = ppb * page_size
    n_blocks = bt_ref.shape[0] // ppb

    def each_page(blk, slot, op: str):
        def one(j, carry):
            page = bt_ref[blk * ppb + j]
            cps = [pltpu.make_async_copy(k_hbm.at[layer, page], buf.at[slot, j], sems.at[slot])]
            if fp8:
                cps.append(pltpu.make_async_copy(s_hbm.at[layer, page], s_buf.at[slot, j], sems.at[slot]))
            for cp in cps:
                cp.start() if op == "start" else cp.wait()
            return carry

        lax.fori_loop(0, ppb, one, 0)

    q = q_ref[...].astype(jnp.float32)
    w = w_ref[...].astype(jnp.float32)
    each_page(0, 0, "start")

    def body(blk, carry):
        slot = lax.rem(blk, 2)

        @pl.when(blk + 1 < n_blocks)
        def _prefetch():  # the next block's pages fly while this one is scored
            each_page(blk + 1, 1 - slot, "start")

        each_page(blk, slot, "wait")
        k = _values(buf[slot]).astype(jnp.float32).reshape(bk, buf.shape[-1])
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                            precision=dot_precision(jnp.float32))  # [nh, bk]
        if fp8:
            s = s * _scale_row(s_buf[slot], page_size)
        o_ref[:, pl.ds(pl.multiple_of(blk * bk, 128), bk)] = (w * jnp.maximum(s * scale, 0.0)).sum(
            axis=0, keepdims=True)
        return carry

    lax.fori_loop(0, n_blocks, body, 0)


@functools.partial(jax.jit, static_argnames=("pages_per_block", "chunk_pages", "interpret"))
def dsa_index_scores_tpu(q: jax.Array, w: jax.Array, pool: jax.Array, block_tables: jax.Array,
                         scales: jax.Array | None = None, *, layer: int | jax.Array, pages_per_block: int | None = None,
                         chunk_pages: int | None = None,
                         interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """Index scores of every token slot of each row's block table (TPU: page DMAs from the whole HBM pool).

    q: [B, nh, hd] f32|bf16 (the indexer's roped queries, one per row); w: [B, nh] f32 (head weights); pool:
    [L, P, ps, hd] stored bits uint8 (float8_e4m3fn) | uint16 (bfloat16) | uint32 (float32), or values; scales:
    [L, P, ps] f32 for an FP8 pool, else None; layer: int or int32 scalar (the indexer layer); block_tables:
    [B, M] int32. Tiling: see choose_index_blocks. Returns [B, 1, M * ps] f32 (the decode query axis T = 1, as
    dsa.select_topk scores): slot t of row b scores the key at (block_tables[b, t // ps], t % ps), unmasked.
    """
    b, nh, hd = q.shape
    _, _, page_size, hd_p = pool.shape
    if hd != hd_p or w.shape != (b, nh):
        raise ValueError(f"q {q.shape}, w {w.shape}, pool {pool.shape}: head dims or rows differ")
    fp8 = scales is not None
    m = block_tables.shape[1]
    ppb, chunk = choose_index_blocks(m, page_size, pages_per_block=pages_per_block, chunk_pages=chunk_pages)
    chunks = -(-m // chunk)
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, chunks * chunk - m))).reshape(-1)
    hbm = [pool] + ([scales.astype(jnp.float32)] if fp8 else [])
    if not interpret:  # pinned to HBM: XLA:TPU prefetched a pl.ANY operand that fits VMEM (few layers' scales) whole
        hbm = [pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in hbm]
    scratch = [pltpu.VMEM((2, ppb, page_size, hd), pool.dtype)]
    scratch += [pltpu.VMEM((2, ppb, page_size), jnp.float32)] if fp8 else []
    kernel = functools.partial(_kernel, fp8=fp8, page_size=page_size, pages_per_block=ppb, scale=hd ** -0.5)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, chunks),
        in_specs=[pl.BlockSpec((chunk,), lambda i, c, _: (i * chunks + c,), memory_space=pltpu.SMEM),
                  pl.BlockSpec((None, nh, hd), lambda i, c, _: (i, 0, 0)),
                  pl.BlockSpec((None, nh, 1), lambda i, c, _: (i, 0, 0)),
                  *[pl.BlockSpec(memory_space=pl.ANY)] * len(hbm)],
        out_specs=pl.BlockSpec((None, 1, chunk * page_size), lambda i, c, _: (i, 0, c)),
        scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA((2,))],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, 1, chunks * chunk * page_size), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="dsa_index_scores_tpu",
    )(jnp.asarray(layer, jnp.int32).reshape(1), bt, q, w.astype(jnp.float32).reshape(b, nh, 1), *hbm)
    return out if chunks * chunk == m else out[:, :, :m * page_size]
