"""Sparse (DSA) absorbed-MLA decode attention for TPU (Mosaic): each decode row attends to its own selected tokens
(GLM-5.x's indexer top-k), whose latent rows the kernel DMAs itself, one DMA per selected token, from the whole
paged pool left in HBM (`memory_space=pl.ANY`; `layer` picks the layer: no per-layer slice, which XLA:TPU would
copy).

DMA granularity: Mosaic refuses a one-row DMA of an 8- or 16-bit array ("Offsets along tiled dimensions must be
aligned to tiles": XLA:TPU tiles a u8 pool (32, 128)(4, 1), 4 consecutive tokens' bytes of a column share a 32-bit
word), and accepts one at any row of a 32-bit array. So the kernel views the HBM bits as uint32 word rows
(`ref.bitcast`, no copy: [L, P, ps / pack, r + dr], pack = 4 FP8 / 2 BF16 / 1 F32 tokens per word row, token k of
a group in bits [k * bits, (k + 1) * bits)), DMAs the word row holding each selected token (2,304 B: 4x an FP8
row's bytes, 2x a BF16 row's), and extracts the token in VMEM by shift and mask (FP8 -> f32 in 32-bit integer
ops, `_e4m3_to_f32`; BF16 -> f32 by a 16-bit shift). Reading 1x would need the pool stored 32-bit-packed along the
latent dim (one token per word row), a change to every MLA kernel and writer of the pool.

Before the call (XLA, [B, K] int32 / f32, ~0.5 MB a layer at 64 rows x 2048): each selected token index is
resolved through its row's block table to a pool row id (page * ps + slot; -1 for padding: negative or past the
table), and an FP8 pool's per-token scale is gathered. The whole block table is not scalar-prefetched: at GLM-5.2's
1,048,576-token context it is 4 MiB at 64 rows, over SMEM.

Grid (row, head block), both "parallel". Per program: the row's pool row ids in SMEM (one [Kp] block); the
selection is walked in blocks of `block_k` tokens, double-buffered: while block i is computed, block i + 1's
block_k word-row DMAs (all on the buffer slot's one DMA semaphore) are in flight. A padding token's DMA is not
issued; its logits are masked and its (stale) V row zeroed. Compute: absorbed logits (q . latent) * softmax_scale
(FP8: the per-token scale on the logits, then on the probabilities, as the GPU kernel), online softmax in f32
VMEM scratch, f32 accumulation of latent[:r]. A row with no valid index gives 0. Interpret mode has no ref
bitcast: there the same word view (`pltpu.bitcast`, Mosaic's packing) is built in XLA, a copy.

What was checked: interpret mode vs reference_sparse.py (tests/kernels/test_sparse_mla_decode_tpu.py) and real
compiles by XLA:TPU + Mosaic (libtpu 0.0.42.1) for v5e / v5p / v6e at GLM-5.2's per-device shapes, TP 8 heads x 64
rows and DP 64 x 8, FP8 and BF16, pages of 16 and 64 (tests/compile/test_compile_sparse.py): scoped VMEM 0.9-1.4
MB, no pool copy; 2048-token blocks are refused (scoped VMEM OOM). NOT run on a TPU: that Mosaic's packed-ref
bitcast of the HBM pool matches `pltpu.bitcast`'s packing is taken from Pallas' definition, not observed; no
DMA-rate or speed figures (per selected token one 2,304 B DMA and ~10 VPU ops per latent element); block_k is an
untuned prior.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax
from pallas_kernels.online_softmax import MASK_VALUE, dot_precision

BLOCK_K = 128  # selected tokens per double-buffer slot: 128 row DMAs in flight (a [128, 576] u32 slot: 288 KiB)
LANES = 128  # the selection is padded to whole blocks of a multiple of 128 (the SMEM block, the lane axis)
# the stored bits of each value dtype (jaxserve.cache.pool's storage dtypes)
VALUE_OF_BITS = {jnp.dtype(jnp.uint8): jnp.float8_e4m3fn, jnp.dtype(jnp.uint16): jnp.bfloat16,
                 jnp.dtype(jnp.uint32): jnp.float32}


def choose_block_k(topk: int, block_k: int | None = None) -> int:
    """Selected tokens per compute block: BLOCK_K (at most the selection rounded up to 128); an override must be a
    multiple of 128 (the per-token rows are lane-tiled)."""
    bk = block_k or min(BLOCK_K, -(-topk // LANES) * LANES)
    if bk % LANES:
        raise ValueError(f"block_k {bk} must be a multiple of {LANES}")
    return bk


def _column(row: jax.Array) -> jax.Array:
    """A [1, n] f32 row as an [n, 1] column (a diagonal select and a lane sum: no sublane-to-lane relayout)."""
    n = row.shape[1]
    diag = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.where(diag, jnp.broadcast_to(row, (n, n)), 0.0).sum(axis=1, keepdims=True)


def _e4m3_to_f32(b: jax.Array) -> jax.Array:
    """float8_e4m3fn bit patterns (int32 in [0, 256)) -> f32 values, exactly, in 32-bit integer ops only (no packed
    8-bit vectors): normal (1 + m/8) 2^(e-7) re-biased into f32's fields, subnormal m 2^-9, S.1111.111 NaN."""
    sign, e, m = lax.shift_right_logical(b, 7), lax.shift_right_logical(b, 3) & 15, b & 7
    normal = lax.bitcast_convert_type((sign << 31) | ((e + 120) << 23) | (m << 20), jnp.float32)
    sub = m.astype(jnp.float32) * 2.0 ** -9
    sub = jnp.where(sign == 1, -sub, sub)
    x = jnp.where(e == 0, sub, normal)
    return jnp.where((e == 15) & (m == 7), jnp.nan, x)


def _unpack(words: jax.Array, sub: jax.Array, value_dtype) -> jax.Array:
    """Token rows from word rows: words [bk, Dl] uint32, each packing 32 // bits consecutive tokens of a page
    (token k of the group in bits [k * bits, (k + 1) * bits), Mosaic's packed-ref bitcast); sub [bk, 1] int32 the
    wanted token's place in its group. -> [bk, Dl] f32 values."""
    bits = 8 * jnp.dtype(value_dtype).itemsize
    w = lax.bitcast_convert_type(words, jnp.int32)
    if bits == 32:
        return lax.bitcast_convert_type(w, jnp.float32)
    x = lax.shift_right_logical(w, sub * bits) & ((1 << bits) - 1)
    if bits == 16:  # bfloat16: the high half of an f32
        return lax.bitcast_convert_type(x << 16, jnp.float32)
    return _e4m3_to_f32(x)


def _kernel(layer_ref, ids_ref, q_ref, sub_ref, *refs, value_dim: int, page_size: int, block_k: int,
            softmax_scale: float, compute_dtype, value_dtype, fp8: bool, view_words: bool):
    """One (row, head block) program.

    layer_ref [1] int32 (scalar prefetch); ids_ref [Kp] int32 (SMEM: pool row ids page * ps + slot, -1 padding);
    q_ref [bh, Dl]; sub_ref [n_blocks, bk] f32 (the token's place in its word row, -1 padding); (w_ref [n_blocks,
    bk] f32: FP8 scales); pool_hbm: the whole pool's bits [L, P, ps, Dl] (view_words: viewed as uint32 word rows
    [L, P, ps / pack, Dl] here) or that view given [L, P, ps / pack, Dl] uint32. o_ref [bh, r] f32. Scratch: buf
    [2, bk, Dl] uint32, sems DMA [2], m, l [bh, 1], acc [bh, r] f32.
    """
    w_ref, rest = (refs[0], refs[1:]) if fp8 else (None, refs)
    pool_hbm, o_ref, buf, sems, m_sc, l_sc, acc_sc = rest
    words_hbm = pool_hbm.bitcast(jnp.uint32) if view_words else pool_hbm
    pack = page_size // words_hbm.shape[2]
    n_blocks = sub_ref.shape[0]
    layer = layer_ref[0]

    def each_row(blk, slot, op: str):
        def one(j, carry):
            row = ids_ref[blk * block_k + j]

            @pl.when(row >= 0)
            def _():
                page, word = lax.div(row, page_size), lax.div(lax.rem(row, page_size), pack)
                cp = pltpu.make_async_copy(words_hbm.at[layer, page, pl.ds(word, 1)], buf.at[slot, pl.ds(j, 1)],
                                           sems.at[slot])
                cp.start() if op == "start" else cp.wait()
            return carry

        lax.fori_loop(0, block_k, one, 0)

    online_softmax.reset(m_sc, l_sc, acc_sc)
    each_row(0, 0, "start")

    def body(blk, carry):
        slot = lax.rem(blk, 2)

        @pl.when(blk + 1 < n_blocks)
        def _prefetch():  # the next block's rows fly while this one is computed
            each_row(blk + 1, 1 - slot, "start")

        each_row(blk, slot, "wait")
        sub = sub_ref[pl.ds(blk, 1), :]  # [1, bk]
        valid = sub >= 0
        sub_col = _column(sub)  # [bk, 1]
        # padding rows were not copied: stale buffer contents (NaN included) must not reach 0 * NaN
        k = jnp.where(sub_col >= 0, _unpack(buf[slot], jnp.maximum(sub_col, 0).astype(jnp.int32), value_dtype),
                      0.0).astype(compute_dtype)  # [bk, Dl]
        q = q_ref[...].astype(compute_dtype)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                 precision=dot_precision(compute_dtype))
        w = w_ref[pl.ds(blk, 1), :] if fp8 else None
        if fp8:
            logits = logits * w  # K-side dequant: (q . k8) s == q . (k8 s)
        logits = jnp.where(valid, logits * softmax_scale, MASK_VALUE)
        p, correction = online_softmax.fold_logits(m_sc, l_sc, logits)  # masked entries underflow to exactly 0
        if fp8:  # V-side dequant, after the sum so l stays the plain softmax denominator
            p = p * w
        online_softmax.fold_values(acc_sc, p, correction, k[:, :value_dim])
        return carry

    lax.fori_loop(0, n_blocks, body, 0)
    online_softmax.write_out(o_ref, l_sc, acc_sc)


def resolve_rows(block_tables: jax.Array, indices: jax.Array, page_size: int, padded: int) -> jax.Array:
    """Selected token indices [B, K] -> pool row ids (page * ps + slot) [B, padded] int32, -1 for padding (negative,
    past the table, or past K)."""
    valid = (indices >= 0) & (indices < block_tables.shape[1] * page_size)
    tok = jnp.where(valid, indices, 0).astype(jnp.int32)
    page = jnp.take_along_axis(block_tables.astype(jnp.int32), tok // page_size, axis=1)
    rows = jnp.where(valid, page * page_size + tok % page_size, -1)
    return jnp.pad(rows, ((0, 0), (0, padded - indices.shape[1])), constant_values=-1)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "block_h", "block_k",
                                             "compute_dtype", "interpret", "out_dtype"))
def sparse_mla_decode_tpu(q: jax.Array, pool: jax.Array, block_tables: jax.Array, indices: jax.Array,
                          scales: jax.Array | None = None, *, layer: int | jax.Array, kv_lora_rank: int,
                          softmax_scale: float, block_h: int | None = None, block_k: int | None = None,
                          compute_dtype: jnp.dtype | None = None, interpret: bool | pltpu.InterpretParams = False,
                          out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Absorbed MLA decode attention of each row over its selected tokens' latent rows (TPU: word-row DMAs from
    the whole HBM pool, double-buffered).

    q: [B, H, r + dr] bf16|f32 (absorbed nope part, then rope part); pool: the whole pool's stored bits
    [L, P, ps, r + dr] uint8 (float8_e4m3fn) | uint16 (bfloat16) | uint32 (float32); scales: [L, P, ps] f32 for an
    FP8 pool, else None; layer: int or int32 scalar; block_tables: [B, M] int32; indices: [B, K] int32 token
    indices within the row (< 0 or >= M * ps: padding). block_h: heads per program (default all, so each selected
    row is DMA'd once per batch row; must divide H and be a multiple of 8 unless it equals H). block_k: see
    choose_block_k. compute_dtype: MXU operand dtype (default q.dtype). interpret: False (Mosaic), True or
    `pltpu.InterpretParams()` (CPU; the word view of the pool is then built in XLA: the interpreter has no ref
    bitcast). Returns [B, H, r] in out_dtype (0 for a row with no valid index).
    """
    b, h, dl = q.shape
    n_layers, num_pages, page_size, dl_p = pool.shape
    value_dtype = VALUE_OF_BITS.get(jnp.dtype(pool.dtype))
    if value_dtype is None:
        raise ValueError(f"pool dtype {pool.dtype}: pass the stored bits (uint8 / uint16 / uint32)")
    if dl != dl_p or not 0 < kv_lora_rank < dl:
        raise ValueError(f"q latent dim {dl}, pool latent dim {dl_p}, kv_lora_rank {kv_lora_rank}")
    pack = 4 // pool.dtype.itemsize
    if page_size % pack:
        raise ValueError(f"page size {page_size} must be a multiple of {pack} ({pool.dtype} tokens per word)")
    bh = block_h or h
    if h % bh or (bh != h and bh % 8):
        raise ValueError(f"block_h {bh} must divide {h} heads and be a multiple of 8 (or equal it)")
    fp8 = scales is not None
    bk = choose_block_k(indices.shape[1], block_k)
    n_blocks = -(-indices.shape[1] // bk)
    rows = resolve_rows(block_tables, indices, page_size, n_blocks * bk)  # [B, Kp]
    extra = []
    if fp8:  # the selected tokens' scales: one gather of [B, Kp] f32 from the whole scale pool
        safe = jnp.maximum(rows, 0)
        extra.append(scales.astype(jnp.float32)[layer, safe // page_size, safe % page_size].reshape(b, n_blocks, bk))
    sub = jnp.where(rows >= 0, rows % pack, -1).astype(jnp.float32).reshape(b, n_blocks, bk)
    view_words = not interpret and pack > 1  # Mosaic views the HBM bits as word rows in the kernel (no copy)
    if interpret:  # the same view built in XLA (pltpu.bitcast: Mosaic's packing), a copy: interpret mode only
        words = pltpu.bitcast(pool, jnp.uint32) if pack > 1 else pool
    else:
        words = pool
    kernel = functools.partial(_kernel, value_dim=kv_lora_rank, page_size=page_size, block_k=bk,
                               softmax_scale=softmax_scale, compute_dtype=jnp.dtype(compute_dtype or q.dtype),
                               value_dtype=value_dtype, fp8=fp8, view_words=view_words)
    per_token = pl.BlockSpec((None, n_blocks, bk), lambda i, j, _: (i, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, h // bh),
        in_specs=[pl.BlockSpec((n_blocks * bk,), lambda i, j, _: (i,), memory_space=pltpu.SMEM),
                  pl.BlockSpec((None, bh, dl), lambda i, j, _: (i, j, 0)), per_token, *[per_token] * len(extra),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, bh, kv_lora_rank), lambda i, j, _: (i, j, 0)),
        scratch_shapes=[pltpu.VMEM((2, bk, dl), jnp.uint32), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((bh, 1), jnp.float32), pltpu.VMEM((bh, 1), jnp.float32),
                        pltpu.VMEM((bh, kv_lora_rank), jnp.float32)],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, h, kv_lora_rank), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="sparse_mla_decode_tpu",
    )(jnp.asarray(layer, jnp.int32).reshape(1), rows.reshape(-1), q, sub, *extra, words)
    return out.astype(out_dtype)
