"""Sparse (DSA) absorbed-MLA decode attention for the Pallas Triton lowering (GPU): each decode row attends to its
own selected tokens (GLM-5.x's indexer top-k), read in place from the whole paged latent pool.

Per (row, head block, split) program: for each step of `block_k` selected token indices, the row's block table
maps each index to (page, slot) (page = table[idx // page_size], slot = idx % page_size), the latent rows are
gathered from the pool of every layer ([L, P, ps, r + dr], `layer` picks one: no per-layer slice, which XLA:GPU
would copy for a custom call; Triton uses 64-bit offsets when the pool exceeds 2**32 bytes), dequantized with
the per-token f32 scale (FP8; K scale on the logits, V scale on the probabilities), absorbed logits
(q_nope . latent[:r] + q_rope . latent[r:]) * softmax_scale, online softmax, f32 accumulation of latent[:r].
Negative indices are padding (masked; their rows zeroed, as a garbage row may hold NaN). Split-K over the
selection (flash-decoding), merged by log-sum-exp in XLA.

The pool may be passed as values (bf16 / float8_e4m3fn) or as the engine's stored bit patterns (uint16 / uint8)
with `value_dtype`: the bits are viewed as values inside the kernel, so no XLA op touches the pool.

Replaces, for the decode step, the XLA path's gather of the top-k rows widened to f32 ([B, K, 576] f32 per layer:
379 MB at 64 rows x 2048) and its f32 attention dots. Checked: interpret mode against reference_sparse.py
(tests/kernels/test_sparse_mla_decode.py) and compiled for an H200 (sm_90a) at GLM-5.2's per-device shapes
(tests/compile/test_compile_sparse.py): shared memory Triton allocates (f32 q, the default blocks) TP 16-head
blocks x 32-token steps 75,904 B (BF16 pool) / 106,880 B (FP8), DP 64-head blocks x 16-token steps 198,720 /
189,568 B, all within the H200's 232,448; 256-token steps of 64 heads are refused. NOT run on a GPU: no speed or
register-pressure figures; block sizes and launch parameters are untuned starting points.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.paged_attention import _LOG2E, MASK_VALUE, TARGET_PROGRAMS, _merge_splits, _next_pow2

MAX_SPLIT_ROWS = 128  # block_h x splits at most: a row's split outputs <= f32 [128, 512] (256 KB; 2048 FP8 rows: 1.2 MB)


@dataclass(frozen=True)
class SparseBlocks:
    """Static tiling: query heads per program, selected tokens per inner step, selection splits, Triton's launch
    parameters."""

    block_h: int
    block_k: int
    k_splits: int
    num_warps: int = 4
    num_stages: int = 2


def choose_blocks(batch: int, heads: int, topk: int, *, block_h: int | None = None, block_k: int | None = None,
                  k_splits: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> SparseBlocks:
    """Default tiling; any argument given overrides it. block_h: power of two >= 16 (Triton's dot minimum), <= 64.
    block_k: 32 tokens per step for 16-head blocks, 16 for wider ones (a 576-wide f32 operand per token, as the
    paged MLA decode's compiled shared memory allows), at most the selection rounded up to 16. k_splits: doubled
    until batch x head blocks x splits >= TARGET_PROGRAMS, keeping >= 2 steps per split and block_h x splits <=
    MAX_SPLIT_ROWS (the split outputs are written, then read by the merge in XLA)."""
    bh = block_h or min(64, max(16, _next_pow2(heads)))
    bk = block_k or min(32 if bh <= 16 else 16, max(16, _next_pow2(topk)))
    steps = -(-topk // bk)
    ks = k_splits or 1
    while (k_splits is None and batch * (-(-heads // bh)) * ks < TARGET_PROGRAMS and steps // (2 * ks) >= 2
           and bh * 2 * ks <= MAX_SPLIT_ROWS):
        ks *= 2
    return SparseBlocks(bh, bk, ks, num_warps or 4, num_stages or 2)


def _kernel(layer_ref, bt_ref, idx_ref, q_ref, kv_ref, *rest, fp8: bool, value_dtype, value_dim: int,
            page_size: int, block_h: int, block_k: int, softmax_scale: float):
    """One (row, head block, split) program.

    layer_ref [1] int32; bt_ref [M] int32 (the row's block table); idx_ref [n] int32 (this split's selected token
    indices, < 0: padding); q_ref [B, H, r + dr] (whole: the program gathers its block_h head rows, those past
    H repeating row H - 1, so no padded copy of q exists); kv_ref [L, P, ps, r + dr] (whole pool); s_ref
    [L, P, ps] f32 (fp8). Outputs: o [bh, r] f32 (unnormalized), l [bh] f32 (sum of exp), m [bh] f32 (max).
    """
    s_ref, o_ref, l_ref, m_ref = rest if fp8 else (None, *rest)
    layer = layer_ref[0]
    heads = jnp.minimum(lax.broadcasted_iota(jnp.int32, (block_h,), 0) + pl.program_id(1) * block_h,
                        q_ref.shape[1] - 1)
    dr = q_ref.shape[2] - value_dim
    q = q_ref[pl.program_id(0), heads, pl.ds(0, value_dim)]
    qr = q_ref[pl.program_id(0), heads, pl.ds(value_dim, dr)]

    def rows(page, slot, start: int, width: int):
        x = kv_ref[layer, page, slot, pl.ds(start, width)]  # [bk, width], gathered row by row
        if value_dtype is not None:
            x = lax.bitcast_convert_type(x, value_dtype)
        return x.astype(q.dtype)

    def body(i, carry):
        o_prev, m_prev, l_prev = carry
        tok = idx_ref[pl.ds(i * block_k, block_k)]
        valid = tok >= 0
        tok = jnp.where(valid, tok, 0)
        # lax.div / lax.rem: tok >= 0, and jnp's floor-mod sign fix-up does not lower to Triton
        page, slot = bt_ref[lax.div(tok, page_size)], lax.rem(tok, page_size)
        c, cr = rows(page, slot, 0, value_dim), rows(page, slot, value_dim, dr)
        logits = jnp.dot(q, c.T, preferred_element_type=jnp.float32) + jnp.dot(qr, cr.T,
                                                                                preferred_element_type=jnp.float32)
        scale = s_ref[layer, page, slot].reshape(1, block_k) if fp8 else None
        if scale is not None:
            logits = logits * scale
        logits = jnp.where(valid.reshape(1, block_k), logits * softmax_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp2((m_prev - m_next) * _LOG2E)
        p = jnp.exp2((logits - m_next[:, None]) * _LOG2E)
        l_next = correction * l_prev + p.sum(axis=-1)
        if scale is not None:
            p = p * scale
        c = jnp.where(valid.reshape(block_k, 1), c, jnp.zeros((), c.dtype))  # 0 * NaN of a padding row would leak
        o_next = correction[:, None] * o_prev + jnp.dot(p.astype(c.dtype), c, preferred_element_type=jnp.float32)
        return o_next, m_next, l_next

    init = (jnp.zeros((q.shape[0], value_dim), jnp.float32), jnp.full((q.shape[0],), jnp.finfo(jnp.float32).min),
            jnp.zeros((q.shape[0],), jnp.float32))
    o, m, l = lax.fori_loop(0, idx_ref.shape[0] // block_k, body, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "value_dtype", "block_h", "block_k",
                                             "k_splits", "num_warps", "num_stages", "compute_dtype", "interpret",
                                             "out_dtype"))
def sparse_mla_decode(q: jax.Array, pool: jax.Array, block_tables: jax.Array, indices: jax.Array,
                      scales: jax.Array | None = None, *, layer: int | jax.Array, kv_lora_rank: int,
                      softmax_scale: float, value_dtype: jnp.dtype | None = None, block_h: int | None = None,
                      block_k: int | None = None, k_splits: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, compute_dtype: jnp.dtype | None = None, interpret: bool = False,
                      out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Absorbed MLA decode attention of each row over its selected tokens' latent rows.

    q: [B, H, r + dr] bf16|f32 (absorbed nope part, then rope part); pool: [L, P, ps, r + dr] bf16|float8_e4m3fn,
    or its bits uint16|uint8 with `value_dtype`; scales: [L, P, ps] f32 for an fp8 pool, else None; layer: int
    or int32 scalar; block_tables: [B, M] int32; indices: [B, K] int32 token indices within the row (< 0 or
    >= M * ps: padding, masked out). logits = (q . latent) * softmax_scale; value = latent[:r].
    compute_dtype: dot operand dtype (default q.dtype). Tiling overrides: see choose_blocks. Returns [B, H, r]
    in out_dtype (default q.dtype); a row with no valid index gives 0.
    """
    out_dtype = out_dtype or q.dtype
    q = q.astype(compute_dtype or q.dtype)
    b, h, dl = q.shape
    n_layers, num_pages, page_size, dl_p = pool.shape
    if dl != dl_p or not 0 < kv_lora_rank < dl:
        raise ValueError(f"q latent dim {dl}, pool latent dim {dl_p}, kv_lora_rank {kv_lora_rank}")
    if jnp.issubdtype(pool.dtype, jnp.integer) != (value_dtype is not None):
        raise ValueError(f"pool dtype {pool.dtype}: pass value_dtype exactly when the pool holds bits")
    fp8 = scales is not None
    topk = indices.shape[1]
    blocks = choose_blocks(b, h, topk, block_h=block_h, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                           num_stages=num_stages)
    bh, bk, s = blocks.block_h, blocks.block_k, blocks.k_splits
    per_split = -(-topk // (bk * s)) * bk
    capacity = block_tables.shape[1] * page_size
    idx = indices.astype(jnp.int32)
    idx = jnp.pad(jnp.where(idx < capacity, idx, -1), ((0, 0), (0, s * per_split - topk)), constant_values=-1)
    hp = -(-h // bh) * bh
    kernel = functools.partial(_kernel, fp8=fp8, value_dtype=value_dtype, value_dim=kv_lora_rank,
                               page_size=page_size, block_h=bh, block_k=bk, softmax_scale=softmax_scale)
    in_specs = [
        pl.BlockSpec((1,), lambda i, j, k: (0,)),  # layer
        pl.BlockSpec((None, block_tables.shape[1]), lambda i, j, k: (i, 0)),  # the row's block table
        pl.BlockSpec((None, per_split), lambda i, j, k: (i, k)),  # this split's selected indices
        pl.BlockSpec(q.shape, lambda i, j, k: (0, 0, 0)),  # whole q: each program gathers its head rows
        pl.BlockSpec(pool.shape, lambda i, j, k: (0, 0, 0, 0)),  # whole pool: gathered by (layer, page, slot)
    ]
    args = [jnp.asarray(layer, jnp.int32).reshape(1), block_tables.astype(jnp.int32), idx, q, pool]
    if fp8:
        in_specs.append(pl.BlockSpec(scales.shape, lambda i, j, k: (0, 0, 0)))
        args.append(scales.astype(jnp.float32))
    stat = pl.BlockSpec((None, None, bh), lambda i, j, k: (k, i, j))  # l and m: [splits, B, hp]
    o, l, m = pl.pallas_call(
        kernel, grid=(b, hp // bh, s), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, bh, kv_lora_rank), lambda i, j, k: (k, i, j, 0)), stat, stat],
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((s, b, hp, kv_lora_rank), (s, b, hp),
                                                                         (s, b, hp))],
        interpret=interpret,
        # Triton, not Mosaic GPU: the whole pool is one BlockSpec, gathered by (layer, page, slot) in the kernel
        compiler_params=pl_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        name="sparse_mla_decode",
    )(*args)
    # the padded head rows are dropped before the merge reads the split partials
    return _merge_splits(o[:, :, :h], l[:, :, :h], m[:, :, :h]).astype(out_dtype)
