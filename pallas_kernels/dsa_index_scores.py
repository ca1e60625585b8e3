"""DSA lightning-indexer scores for one decode query per row, for the Pallas Triton lowering (GPU): each key's
score is sum_h w[h] * relu((q[h] . k) * scale * hd ** -0.5) over the indexer's heads, the keys read in place from
the whole paged index-key pool.

Per (row, token block) program: `block_tokens` consecutive token slots of the row (whole pages), their keys
gathered row by row from the pool of every indexer layer ([L, P, ps, hd], `layer` a [1] int32 input picks one:
no per-layer slice, which XLA:GPU would copy for a custom call; Triton uses 64-bit offsets over 2**32 bytes),
viewed as values when the pool holds bits (uint8 FP8 / uint16 BF16 / uint32 F32), one dot of the heads [bh, hd]
by the keys [hd, block_tokens], the FP8 per-key scale on the products, ReLU, the head-weighted sum. Writes f32
scores [B, M * ps]: neither the gathered keys nor the per-head scores exist outside the kernel (the XLA path
writes both: at GLM-5.2 TP decode, 64 rows x 8192 tokens, 64 MB of u8 keys and 71 MB of dot traffic per
indexer layer). Heads past nh repeat head nh - 1 with weight 0 (Triton's dot needs >= 16 rows; no padded copy).

Unmasked: the caller masks causality and the context length (a slot past it may hold anything, NaN included).
Checked: interpret mode against reference_sparse.index_scores_reference (tests/kernels/test_dsa_index_scores.py)
and compiled for an H200 (sm_90a) at GLM-5.2's per-device decode shapes (tests/compile/test_compile_sparse.py):
Triton allocates 16,384 B of shared memory (the f32 query block of 32 heads; the keys reach the dot from registers,
the same at 128 to 512 tokens per program); 512 heads (256 KB) are refused. NOT run on a GPU: block sizes and
launch parameters are untuned starting points.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.paged_attention import _next_pow2

MAX_BLOCK_TOKENS = 128  # keys per program: [bh, 128] f32 products per program, 64 programs a row at 8k tokens


@dataclass(frozen=True)
class IndexBlocks:
    """Static tiling: pages per program (block_tokens = pages x page size), Triton's launch parameters."""

    pages: int
    num_warps: int = 4
    num_stages: int = 2


def choose_blocks(num_pages: int, page_size: int, *, pages: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> IndexBlocks:
    """Default tiling; any argument given overrides it. pages: the largest power of two dividing the block table
    width `num_pages` with at most MAX_BLOCK_TOKENS tokens (at least one page)."""
    pb = 1
    while pages is None and num_pages % (2 * pb) == 0 and 2 * pb * page_size <= MAX_BLOCK_TOKENS:
        pb *= 2
    return IndexBlocks(pages or pb, num_warps or 4, num_stages or 2)


def _kernel(layer_ref, bt_ref, q_ref, w_ref, k_ref, *rest, fp8: bool, value_dtype, page_size: int, pages: int,
            block_h: int, scale: float):
    """One (row, token block) program.

    layer_ref [1] int32; bt_ref [M] int32 (the row's block table); q_ref [B, nh, hd], w_ref [B, nh] f32 (whole:
    the program gathers its row's heads, those past nh repeating nh - 1); k_ref [L, P, ps, hd] (whole pool);
    s_ref [L, P, ps] f32 (fp8). Output o_ref [pages * ps] f32.
    """
    s_ref, o_ref = rest if fp8 else (None, *rest)
    layer, row, nh = layer_ref[0], pl.program_id(0), q_ref.shape[1]
    iota_h = lax.broadcasted_iota(jnp.int32, (block_h,), 0)
    heads = jnp.minimum(iota_h, nh - 1)
    q = q_ref[row, heads, :]  # [bh, hd]
    w = jnp.where(iota_h < nh, w_ref[row, heads], 0.0)  # [bh]
    tok = lax.broadcasted_iota(jnp.int32, (pages * page_size,), 0)
    # lax.div / lax.rem: tok >= 0, and jnp's floor-mod sign fix-up does not lower to Triton
    page = bt_ref[pl.program_id(1) * pages + lax.div(tok, page_size)]
    slot = lax.rem(tok, page_size)
    k = k_ref[layer, page, slot, :]  # [bk, hd], gathered row by row
    if value_dtype is not None:
        k = lax.bitcast_convert_type(k, value_dtype)
    s = jnp.dot(q, k.astype(q.dtype).T, preferred_element_type=jnp.float32)  # [bh, bk]
    if fp8:
        s = s * s_ref[layer, page, slot].reshape(1, -1)
    o_ref[...] = jnp.sum(w[:, None] * jnp.maximum(s * scale, 0.0), axis=0)


@functools.partial(jax.jit, static_argnames=("value_dtype", "pages", "num_warps", "num_stages", "interpret"))
def dsa_index_scores(q: jax.Array, w: jax.Array, pool: jax.Array, block_tables: jax.Array,
                     scales: jax.Array | None = None, *, layer: int | jax.Array, value_dtype: jnp.dtype | None = None,
                     pages: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     interpret: bool = False) -> jax.Array:
    """Index scores of every token slot of each row's block table.

    q: [B, nh, hd] f32|bf16 (the indexer's roped queries, one per row); w: [B, nh] f32 (head weights); pool:
    [L, P, ps, hd] float8_e4m3fn|bf16|f32, or its bits uint8|uint16|uint32 with `value_dtype`; scales: [L, P, ps]
    f32 for an fp8 pool, else None; layer: int or int32 scalar (the indexer layer); block_tables: [B, M] int32.
    Returns [B, M * ps] f32: slot t of row b scores the key at (block_tables[b, t // ps], t % ps), unmasked.
    """
    b, nh, hd = q.shape
    _, _, page_size, hd_p = pool.shape
    if hd != hd_p or w.shape != (b, nh):
        raise ValueError(f"q {q.shape}, w {w.shape}, pool {pool.shape}: head dims or rows differ")
    if jnp.issubdtype(pool.dtype, jnp.integer) != (value_dtype is not None):
        raise ValueError(f"pool dtype {pool.dtype}: pass value_dtype exactly when the pool holds bits")
    fp8 = scales is not None
    m = block_tables.shape[1]
    blocks = choose_blocks(m, page_size, pages=pages, num_warps=num_warps, num_stages=num_stages)
    if m % blocks.pages:
        raise ValueError(f"pages per program {blocks.pages} must divide the block table width {m}")
    bk = blocks.pages * page_size
    kernel = functools.partial(_kernel, fp8=fp8, value_dtype=value_dtype, page_size=page_size, pages=blocks.pages,
                               block_h=max(16, _next_pow2(nh)), scale=hd ** -0.5)
    in_specs = [
        pl.BlockSpec((1,), lambda i, j: (0,)),  # layer
        pl.BlockSpec((None, m), lambda i, j: (i, 0)),  # the row's block table
        pl.BlockSpec(q.shape, lambda i, j: (0, 0, 0)),  # whole q: each program gathers its row's heads
        pl.BlockSpec(w.shape, lambda i, j: (0, 0)),
        pl.BlockSpec(pool.shape, lambda i, j: (0, 0, 0, 0)),  # whole pool: gathered by (layer, page, slot)
    ]
    args = [jnp.asarray(layer, jnp.int32).reshape(1), block_tables.astype(jnp.int32), q, w.astype(jnp.float32),
            pool]
    if fp8:
        in_specs.append(pl.BlockSpec(scales.shape, lambda i, j: (0, 0, 0)))
        args.append(scales.astype(jnp.float32))
    return pl.pallas_call(
        kernel, grid=(b, m // blocks.pages), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bk), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((b, m * page_size), jnp.float32),
        interpret=interpret,
        # Triton, not Mosaic GPU: the whole pool is one BlockSpec, gathered by (layer, page, slot) in the kernel
        compiler_params=pl_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        name="dsa_index_scores",
    )(*args)
