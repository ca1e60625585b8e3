"""Flash (chunked, ragged) PREFILL attention over the page pool: MLA absorbed (MQA over the latent) and GQA.

Contract (both functions; `reference_prefill.py` implements the same one in plain jnp):
- A chunk of T query tokens per batch row (right-padded), attending over the row's context read back from the
  page pool through its block table: prior context + this chunk, whose KV must already be written.
- q [B, T, heads, Dk]; block_tables [B, M] int32 (padding entries 0, a valid page); positions [B, T] int32
  (absolute); ctx_lens [B] int32 (prior + chunk tokens, clipped to M * page_size).
- Key position s is visible to the query at position p iff s <= p and s < ctx_len. A query that sees no key
  (ctx_len 0, position < 0) gets exactly 0; padding query slots get whatever their positions give (finite).
- Output f32. MLA: absorbed (latent) form, MQA of q [B, T, N, kv_lora_rank + rope] against latent rows, value =
  latent[:kv_lora_rank] -> [B, T, N, kv_lora_rank]. GQA: [B, T, Hq, D], query head h reads kv head h // G.
- FP8 pages carry f32 scales (x ~= q8 * scale): MLA [num_pages, page_size], GQA [num_pages, page_size, Hkv].
- q may be any float dtype; for bf16 / fp8 pages it is cast to bf16 for the dots (f32 accumulation).

Layout: the wrapper flattens (token, query head of a kv group) into query rows, [B, Hkv, T * G, Dk], so one
program's block of rows shares every key it loads (MLA: all N heads read the same latent row; GQA: the G heads
of one kv head) with no head padding (GLM-4.5's 12-head group is 12 rows a token, not 16). Online softmax over
key blocks of `block_k // page_size` pages; a program's key loop stops at its causal limit,
cdiv(min(max(row positions) + 1, ctx_len), block_k), so key blocks past it are never read and the cost of a
chunk follows its real context, not the table width. Slots past ctx_len (tail of the last page, the null page)
may hold anything, NaN included: their logits are masked, their V rows and V scales zeroed.
- backend "gpu" (Triton; `plgpu.CompilerParams(num_warps, num_stages)`): grid (B, Hkv, row blocks); the whole
  pool is one block and a key block's pages are gathered by a vector of page ids (as JAX's GPU paged attention
  does), at a layer of the whole [L, P, ps, ...] pool handed in as a [1] int32 input (as the GPU decode kernels:
  XLA:GPU copies a layer slice handed to a Triton call), pages as values or the pool's bits; K dequant multiplies
  the logits by the K scales, V dequant the probabilities by the V scales; the latent is loaded as a
  kv_lora_rank-wide and a rope-wide part (Triton loads need power-of-two widths).
- backend "tpu" (Mosaic): grid (B, Hkv, row blocks), all parallel; pages stay in HBM (`memory_space=pl.ANY`);
  each key block's pages are DMA'd one page per copy into a two-slot VMEM buffer, the next block's copies in
  flight while this one computes, page ids read from that batch row's block table held in SMEM (one row, a
  [1, M] block: 64 KiB at 262,144 tokens of 16-token pages, double-buffered, independent of the batch); the
  per-row-block key-block counts are scalar-prefetched. MLA FP8 rows are dequantized in VMEM (x8 -> f32 times
  the scale column -> q's dtype) before the dots. GQA pages are DMA'd whole, as [Hkv * ps, D] head-major rows (a
  per-head slice of the [P, ps, Hkv, D] pool is not tile-aligned: Mosaic refuses it, and strided VMEM loads exist
  for 32-bit data only), from the whole pool [L, P, ps, Hkv, D] (values or bits) at a scalar-prefetched layer: the
  TPU pool is stored head-major (`jaxserve.sharding.pool_format`), so the [L, P, Hkv * ps, D] view is free and no
  layer slice is copied into the call (XLA:TPU copied each layer's K and V, GLM-4.5 on v5p). GQA FP8 scales come
  from the whole scale pools too, [L, Hkv, P, ps] as the TPU stores them (`scale_rows`; a per-layer slice was
  materialized each call: the speculative verify over the FP8 decode pool), one [ps] row per page and kv head
  per DMA, spread into the block's row as the decode kernel does, multiplying the logits (K) and the
  probabilities after the softmax sum (V) in f32, as the GPU kernel does. The logits of other kv heads' columns
  are masked: Hkv x the key reads and dot work of a per-head kernel when a device holds several kv heads
  (GLM-4.5 DP attention: 8), none with one (TP: 1).

What was checked (CPU only, JAX 0.10.2; tests/test_paged_prefill.py): against the dense f32 reference with a
derived per-element bound, GPU layout in legacy `interpret=True`, TPU layout in TPU interpret mode
(`pltpu.InterpretParams()`, which raises on out-of-bounds DMAs): toy dims (page sizes 8 and 16, ragged
ctx_lens, chunks at the start, middle and end of a sequence, one-token chunks, padding rows, several row and key
blocks) and the real per-device dims with few pages (Kimi / GLM-5 MLA 8 heads x (512 + 64); GLM-4.5 GQA 12 q
heads / 1 kv head x 128), bf16 and fp8 pages, NaN in every slot outside a context; that the TPU kernel never
copies a page past the causal limit (out-of-range ids there run clean, inside the limit they raise);
cross-lowering with `jax.export` for cuda and tpu at chunk 256 and 512 over block tables of 262,144 tokens,
bf16 and fp8 (this runs the Pallas -> Triton and Pallas -> Mosaic lowerings, including Pallas' power-of-two
and TPU block-shape rules); per-stage shared-memory / VMEM / SMEM estimates of the default blocks against H200
and TPU budgets (a model of the buffers, not a compiler's number).
Real compiles (tests/compile, on the CPU host): XLA:GPU + Triton for H200 (sm_90a) and XLA:TPU + Mosaic for
v5e, v5p and v6e, Kimi K2.6 / GLM-5.2 MLA (TP 8, DP 64 heads) and GLM-4.5 GQA (TP 12/1, DP 96/8 heads), chunk 256,
bf16 and fp8, page 16 and 64: all compile (they did not before: every TPU variant failed, the GQA DMAs on tile
alignment and the MLA ones on an fp32-precision bf16 dot under jax_default_matmul_precision="highest").
What was NOT checked: running on any device, register pressure and speed. Block sizes are untuned. The TPU
variant does not prefetch the next row block's first key block across grid steps (a DMA bubble per row block).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import online_softmax
from pallas_kernels.online_softmax import MASK_VALUE, dot_precision
from pallas_kernels.paged_attention import with_layer_axis
from pallas_kernels.paged_attention_tpu import (BITS_TO_VALUES, _scale_row, _values, head_major, head_of_row,
                                                scale_rows, token_of_row)
_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class PrefillBlocks:
    """Static tiling of one kernel.

    block_r: query rows per program, a row being one (token, query head of the kv group) pair.
    block_k: keys per inner step, a multiple of page_size (block_k // page_size pages per step).
    num_warps, num_stages: Triton launch parameters (GPU only).
    """

    block_r: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_blocks(backend: str, *, mla: bool, rows: int, page_size: int, block_r: int | None = None,
                  block_k: int | None = None) -> PrefillBlocks:
    """Default tiling (untuned: no accelerator has run these kernels); any argument given overrides it.

    rows: T * (query heads per kv head), the query rows one (batch row, kv head) holds.
    GPU: block_r a power of two in [16, 64] (Triton's dot minimum 16; a 64 x 512 f32 MLA accumulator is 128
    registers a thread at 8 warps); block_k 32 keys for MLA (a 32 x 576 bf16 latent tile, double-buffered, plus
    the 64 x 576 query tile stays under H200's 227 KiB of shared memory), 64 for GQA (head_dim 128).
    TPU: block_r up to 256 (MXU-sized, a multiple of 16 for bf16 sublane packing), block_k 128 keys (lane-dense
    logits); VMEM use is a few MiB (checked against the scoped limit in the tests).
    """
    if backend == "gpu":
        br = block_r or min(64, max(16, _next_pow2(rows)))
        bk = block_k or max(page_size, 32 if mla else 64)
        blocks = PrefillBlocks(br, bk, num_warps=8 if mla else 4, num_stages=2)
    elif backend == "tpu":
        br = block_r or min(256, max(16, _next_pow2(rows)))
        bk = block_k or max(page_size, 128)
        blocks = PrefillBlocks(br, bk)
    else:
        raise ValueError(f"backend {backend!r}: 'gpu' or 'tpu'")
    if blocks.block_k % page_size or blocks.block_r % 8:
        raise ValueError(f"{blocks}: block_k must be a multiple of page_size {page_size}, block_r of 8")
    return blocks


def _rows(q: jax.Array, positions: jax.Array, hkv: int, block_r: int) -> tuple[jax.Array, jax.Array]:
    """q [B, T, Hq, D] -> q rows [B, Hkv, R, D] (row t * G + g is token t, query head kv * G + g), R = T * G
    padded to a multiple of block_r; positions [B, T] -> row positions [B, R] int32 (-1 on padding rows)."""
    b, t, hq, d = q.shape
    g = hq // hkv
    r = t * g
    rp = -(-r // block_r) * block_r
    qr = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, r, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rp - r), (0, 0)))
    pos = jnp.repeat(positions.astype(jnp.int32), g, axis=1)
    return qr, jnp.pad(pos, ((0, 0), (0, rp - r)), constant_values=-1)


def _unrows(o: jax.Array, t: int, hq: int) -> jax.Array:
    """o [B, Hkv, R, Dv] -> [B, T, Hq, Dv] (drops padding rows)."""
    b, hkv, _, dv = o.shape
    g = hq // hkv
    return o[:, :, : t * g].reshape(b, hkv, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dv)


def _tables(block_tables: jax.Array, ctx_lens: jax.Array, page_size: int,
            pages_per_block: int) -> tuple[jax.Array, jax.Array]:
    """Pad block tables [B, M] with page 0 to a multiple of pages_per_block; clip ctx_lens to M * page_size."""
    m = block_tables.shape[1]
    mp = -(-m // pages_per_block) * pages_per_block
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, mp - m)))  # page 0 = null page, masked
    return bt, jnp.clip(ctx_lens.astype(jnp.int32), 0, m * page_size)


# ----------------------------------------------------------------------------------------------------------------
# GPU (Triton): the whole pool is one block; pages are gathered by a vector of page ids inside the kernel.


def _gpu_kernel(bt_ref, len_ref, pos_ref, layer_ref, *refs, mla: bool, fp8: bool, value_dim: int, page_size: int,
                block_k: int, softmax_scale: float, value_dtype):
    """One (batch row b, kv head, row block) program.

    bt_ref [Mp] int32 (this row's pages), len_ref [1] int32 (ctx_len), pos_ref [br] int32 (row positions),
    layer_ref [1] int32 (the pool layer read). MLA refs: q [br, Dv], q_rope [br, Dr], latent pool [L, P, ps, Dv +
    Dr], (scales [L, P, ps]), o [br, Dv] f32. GQA refs: q [br, D], k pool [L, P, ps, D], v pool [L, P, ps, D] (this
    kv head), (k, v scales [L, P, ps]), o [br, D]. Pages may be bits (uint8 / uint16), viewed as value_dtype.
    """
    if mla:
        q_ref, qr_ref, kv_ref, *rest = refs
        s_ref, o_ref = rest if fp8 else (None, *rest)
    else:
        q_ref, k_ref, v_ref, *rest = refs
        ks_ref, vs_ref, o_ref = rest if fp8 else (None, None, *rest)
    ppb = block_k // page_size
    ctx_len = len_ref[0]
    layer = layer_ref[0]
    pos = pos_ref[...]  # [br]
    q = q_ref[...]
    qr = qr_ref[...] if mla else None
    br = q.shape[0]
    # causal limit of this query block: no key past max(position) + 1 or ctx_len; later blocks are skipped
    limit = jnp.minimum(jnp.max(pos) + 1, ctx_len)
    n_blocks = pl.cdiv(jnp.maximum(limit, 0), block_k)

    def rows(ref, ids, *trailing):
        """Pages `ids` of layer `layer` of a [L, P, ps, ...] ref -> [block_k, ...] (values; scales f32)."""
        x = ref[(layer, ids, slice(None), *trailing)]
        x = x.reshape(block_k, *x.shape[2:])
        return x if x.dtype in (jnp.float32, value_dtype) else lax.bitcast_convert_type(x, value_dtype)

    def load(ids):
        """-> (logits [br, bk] f32 unscaled, v [bk, Dv] in q dtype, v_scale [1, bk] f32 | None)."""
        if mla:
            c = rows(kv_ref, ids, pl.ds(0, value_dim)).astype(q.dtype)
            cr = rows(kv_ref, ids, pl.ds(value_dim, qr.shape[-1])).astype(q.dtype)
            logits = (jnp.dot(q, c.T, preferred_element_type=jnp.float32)
                      + jnp.dot(qr, cr.T, preferred_element_type=jnp.float32))
            scale = rows(s_ref, ids).reshape(1, block_k) if fp8 else None
            return (logits if scale is None else logits * scale), c, scale  # K-side dequant on the logits
        k = rows(k_ref, ids).astype(q.dtype)
        v = rows(v_ref, ids).astype(q.dtype)
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        if fp8:
            logits = logits * rows(ks_ref, ids).reshape(1, block_k)
        return logits, v, (rows(vs_ref, ids).reshape(1, block_k) if fp8 else None)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        logits, v, v_scale = load(bt_ref[pl.ds(i * ppb, ppb)])
        kpos = i * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        in_ctx = kpos < ctx_len  # [1, bk]
        mask = (kpos <= pos[:, None]) & in_ctx  # [br, bk]
        logits = jnp.where(mask, logits * (softmax_scale * _LOG2E), MASK_VALUE)  # base-2 domain
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp2(m_prev - m_next)
        # a row that has seen no key yet has m_next == MASK_VALUE: exp2(0) = 1 must not count, hence the where
        p = jnp.where(mask, jnp.exp2(logits - m_next[:, None]), 0.0)
        l_next = correction * l_prev + p.sum(axis=-1)
        if v_scale is not None:
            p = p * jnp.where(in_ctx, v_scale, 0.0)  # V-side dequant; scales past ctx_len may be garbage
        # zero V rows past ctx_len: a tail page may hold anything (NaN included) and 0 * NaN would leak
        v = jnp.where(in_ctx.reshape(block_k, 1), v, jnp.zeros((), v.dtype))
        acc = correction[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_next, l_next

    init = (jnp.zeros((br, value_dim), jnp.float32), jnp.full((br,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((br,), jnp.float32))
    acc, _, l = lax.fori_loop(0, n_blocks, body, init)
    # rows that saw no key (padding, ctx_len 0): l == 0 -> output 0, not 0 / 0
    o_ref[...] = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0).astype(o_ref.dtype)


def _gpu_call(kernel, grid, in_specs, args, out_shape, blocks: PrefillBlocks, interpret: bool, name: str):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, blocks.block_r, out_shape[-1]), lambda b, j, r: (b, j, r, 0)),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(*args)


def _paged_prefill_mla_gpu(q, pages, bt, lens, pos, scales, layer, *, value_dtype, kv_lora_rank, softmax_scale,
                           blocks, interpret):
    """q rows [B, 1, R, Dl]; pages [L, P, ps, Dl] (values, or bits of value_dtype), scales [L, P, ps] f32 | None,
    layer [1] int32; bt [B, Mp]; lens [B]; pos [B, R]. -> [B, 1, R, kv_lora_rank] f32."""
    b, _, rp, dl = q.shape
    pool = pages.shape[:3]
    br, mp = blocks.block_r, bt.shape[1]
    fp8 = scales is not None
    kernel = functools.partial(_gpu_kernel, mla=True, fp8=fp8, value_dim=kv_lora_rank, page_size=pool[2],
                               block_k=blocks.block_k, softmax_scale=softmax_scale, value_dtype=value_dtype)
    in_specs = [
        pl.BlockSpec((None, mp), lambda i, j, r: (i, 0)),  # this row's whole block table
        pl.BlockSpec((None, 1), lambda i, j, r: (i, 0)),  # ctx_len
        pl.BlockSpec((None, br), lambda i, j, r: (i, r)),  # row positions
        pl.BlockSpec((1,), lambda i, j, r: (0,)),  # layer
        pl.BlockSpec((None, None, br, kv_lora_rank), lambda i, j, r: (i, 0, r, 0)),  # q value part
        pl.BlockSpec((None, None, br, dl - kv_lora_rank), lambda i, j, r: (i, 0, r, 0)),  # q rope part
        pl.BlockSpec((*pool, dl), lambda i, j, r: (0, 0, 0, 0)),  # whole pool: gathered by layer and page id
    ]
    # the latent is read as a kv_lora_rank-wide and a rope-wide part: Triton loads need power-of-two widths
    args = [bt, lens.reshape(b, 1), pos, layer, q[..., :kv_lora_rank], q[..., kv_lora_rank:], pages]
    if fp8:
        in_specs.append(pl.BlockSpec(pool, lambda i, j, r: (0, 0, 0)))
        args.append(scales)
    return _gpu_call(kernel, (b, 1, rp // br), in_specs, args, (b, 1, rp, kv_lora_rank), blocks, interpret,
                     "paged_prefill_mla")


def _paged_prefill_gqa_gpu(q, k_pages, v_pages, bt, lens, pos, k_scales, v_scales, layer, *, value_dtype,
                           softmax_scale, blocks, interpret):
    """q rows [B, Hkv, R, D]; k, v pages [L, P, ps, Hkv, D] (values, or bits of value_dtype), scales [L, P, ps, Hkv]
    f32 | None, layer [1] int32; bt [B, Mp]; lens [B]; pos [B, R]. -> [B, Hkv, R, D] f32."""
    b, hkv, rp, d = q.shape
    pool = k_pages.shape[:3]
    br, mp = blocks.block_r, bt.shape[1]
    fp8 = k_scales is not None
    kernel = functools.partial(_gpu_kernel, mla=False, fp8=fp8, value_dim=d, page_size=pool[2],
                               block_k=blocks.block_k, softmax_scale=softmax_scale, value_dtype=value_dtype)
    kv_spec = pl.BlockSpec((*pool, None, d), lambda i, j, r: (0, 0, 0, j, 0))  # kv head j, all layers and pages
    in_specs = [
        pl.BlockSpec((None, mp), lambda i, j, r: (i, 0)),
        pl.BlockSpec((None, 1), lambda i, j, r: (i, 0)),
        pl.BlockSpec((None, br), lambda i, j, r: (i, r)),
        pl.BlockSpec((1,), lambda i, j, r: (0,)),  # layer
        pl.BlockSpec((None, None, br, d), lambda i, j, r: (i, j, r, 0)),
        kv_spec, kv_spec,
    ]
    args = [bt, lens.reshape(b, 1), pos, layer, q, k_pages, v_pages]
    if fp8:
        sc_spec = pl.BlockSpec((*pool, None), lambda i, j, r: (0, 0, 0, j))
        in_specs += [sc_spec, sc_spec]
        args += [k_scales, v_scales]
    return _gpu_call(kernel, (b, hkv, rp // br), in_specs, args, (b, hkv, rp, d), blocks, interpret,
                     "paged_prefill_gqa")


# ----------------------------------------------------------------------------------------------------------------
# TPU (Mosaic): pages stay in HBM (`memory_space=pl.ANY`); each key block's pages are DMA'd into a two-slot VMEM
# buffer by page id read from the block table in SMEM, the next block's copies in flight while this one computes.


def _tpu_kernel(nblk_ref, lens_ref, layer_ref, bt_ref, q_ref, pos_ref, *refs, mla: bool, fp8: bool,
                value_dim: int, page_size: int, block_k: int, num_row_blocks: int, softmax_scale: float,
                kv_heads: int = 1):
    """One (batch row b, kv head j, row block r) program; the key loop runs inside it.

    Scalar prefetch (SMEM): nblk_ref [B * nR] int32 (key blocks this row block needs: its causal limit),
    lens_ref [B] int32 (ctx_len), layer_ref [1] int32 (the pool layer read). bt_ref [1, Mp] int32 (SMEM, this
    row's block table). q_ref [br, Dk] (VMEM), pos_ref [br, 1] int32 (row positions, -1 on padding rows).
    Value pools carry a leading layer axis (the whole pool, or one layer as [1, ...]; values or their bits); MLA
    scales are one layer [1, ...], GQA scales the whole [L, Hkv, P, ps] pools. MLA refs: latent pool [L, P, ps, Dl]
    (HBM), (scales [1, P, ps, 1] f32 HBM), o [br, Dv] f32, then scratch:
    kbuf [2, bk, Dl], (sbuf [2, bk, 1] f32), sem DMA[2], acc [br, Dv] f32, m, l [br, 1] f32.
    GQA refs: k pool, v pool [L, P, Hkv * ps, D] (HBM; row = head * ps + slot), (k, v scales [L, Hkv, P, ps]
    f32 HBM), o [br, D] f32, scratch kbuf, vbuf [2, bk * Hkv, D], (ksbuf, vsbuf [2, bk // ps * Hkv, ps] f32:
    row = page * Hkv + head), sem
    DMA[2], acc, m, l. Whole pages are DMA'd (a per-head slice is not tile-aligned); columns of other kv heads
    than j are masked.
    """
    n_values = 1 if mla else 2
    n_src = (2 if fp8 else 1) * n_values  # HBM sources: pools, then their scales
    srcs, (o_ref, *scratch) = refs[:n_src], refs[n_src:]
    bufs, (sem, acc_sc, m_sc, l_sc) = scratch[:n_src], scratch[n_src:]
    b, j, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ppb = block_k // page_size
    page_rows = page_size * kv_heads
    n_blocks = nblk_ref[b * num_row_blocks + r]
    ctx_len = lens_ref[b]

    def copies(i, slot):
        """DMA descriptors bringing key block i into buffer slot `slot` (one per page and source; GQA scales one
        [ps] row per page and kv head)."""
        out = []
        layer = layer_ref[0]
        for p in range(ppb):
            page = bt_ref[0, i * ppb + p]
            for n, (src, buf) in enumerate(zip(srcs, bufs)):
                if n < n_values or mla:  # MLA scales: one layer's [1, P, ps, 1] columns
                    at, dst = src.at[layer if n < n_values else 0, page], buf.at[slot, pl.ds(p * page_rows, page_rows)]
                    out.append(pltpu.make_async_copy(at, dst, sem.at[slot]))
                    continue
                for h in range(kv_heads):  # GQA scales: the whole [L, Hkv, P, ps] pool, row = page * Hkv + head
                    out.append(pltpu.make_async_copy(src.at[layer, h, page], buf.at[slot, p * kv_heads + h],
                                                     sem.at[slot]))
        return out

    @pl.when(n_blocks > 0)
    def _prefetch_first():
        for c in copies(0, 0):
            c.start()

    online_softmax.reset(m_sc, l_sc, acc_sc)
    q = q_ref[...]
    pos = pos_ref[...]  # [br, 1]

    def dequant(buf, sbuf, slot):
        """-> [bk, D] in q's dtype; fp8 rows times their scale (fp8 -> f32 exact, one rounding to q's dtype)."""
        x = _values(buf[slot])
        if sbuf is None:
            return x.astype(q.dtype)
        return (x.astype(jnp.float32) * sbuf[slot]).astype(q.dtype)

    def scale_row(sbuf, i, slot):
        """GQA: the block's [ppb * Hkv, ps] scale rows -> [1, bk * Hkv] in the K rows' order; slots past ctx_len
        zeroed first (they may hold NaN, which the spreading matmul would carry over the page's whole row)."""
        s = sbuf[slot]
        page = lax.broadcasted_iota(jnp.int32, s.shape, 0)
        page = page if kv_heads == 1 else lax.div(page, kv_heads)
        tok = i * block_k + page * page_size + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        return _scale_row(jnp.where(tok < ctx_len, s, 0.0), page_size)

    def body(i, carry):
        slot = i % 2

        @pl.when(i + 1 < n_blocks)
        def _prefetch_next():
            for c in copies(i + 1, 1 - slot):
                c.start()

        for c in copies(i, slot):
            c.wait()
        if mla:
            k = dequant(bufs[0], bufs[1] if fp8 else None, slot)  # [bk, Dl]
            v = k[:, :value_dim]
        else:  # FP8 -> q's bf16 is exact; the scales multiply the logits (K) and probabilities (V) in f32
            k, v = dequant(bufs[0], None, slot), dequant(bufs[1], None, slot)
        # q [br, Dk] . k [bk, Dk]^T over the whole key width (MLA: nope + rope parts)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                 precision=dot_precision(q.dtype))
        if fp8 and not mla:
            logits = logits * scale_row(bufs[2], i, slot)  # K-side dequant: (q . k8) s == q . (k8 s)
        col = lax.broadcasted_iota(jnp.int32, (1, block_k * kv_heads), 1)
        kpos = i * block_k + token_of_row(col, kv_heads, page_size)
        mask = (kpos <= pos) & (kpos < ctx_len)  # [br, bk * Hkv]
        if kv_heads > 1:
            mask = mask & (head_of_row(col, kv_heads, page_size) == j)
        logits = jnp.where(mask, logits * softmax_scale, MASK_VALUE)
        # a row may have seen no key yet (causal mask, padding): its p must not count exp(0) = 1, hence keep
        p, correction = online_softmax.fold_logits(m_sc, l_sc, logits, keep=mask)
        if fp8 and not mla:  # V-side dequant, after the sum so l stays the plain softmax denominator
            p = p * scale_row(bufs[3], i, slot)
        # zero V rows past ctx_len: a tail page may hold anything (NaN included) and 0 * NaN would leak
        kcol = i * block_k + token_of_row(lax.broadcasted_iota(jnp.int32, (block_k * kv_heads, 1), 0), kv_heads,
                                          page_size)
        v = jnp.where(kcol < ctx_len, v, jnp.zeros((), v.dtype))
        online_softmax.fold_values(acc_sc, p, correction, v)
        return carry

    lax.fori_loop(0, n_blocks, body, 0)
    online_softmax.write_out(o_ref, l_sc, acc_sc)


def _key_blocks(pos: jax.Array, lens: jax.Array, block_r: int, block_k: int, max_blocks: int) -> jax.Array:
    """pos [B, R] (row positions), lens [B] -> [B * R // block_r] int32: key blocks each row block needs."""
    b, rp = pos.shape
    limit = jnp.minimum(pos.reshape(b, rp // block_r, block_r).max(axis=-1) + 1, lens[:, None])
    return jnp.clip(-(-limit // block_k), 0, max_blocks).reshape(-1).astype(jnp.int32)


def _tpu_call(kernel, q, pos, bt, lens, layer, srcs, scratch_bufs, value_dim, blocks, interpret, name):
    """q rows [B, Hkv, R, Dk]; pos [B, R]; bt [B, Mp]; lens [B]; layer [1] int32; srcs: HBM arrays;
    -> [B, Hkv, R, Dv] f32."""
    b, hkv, rp, dk = q.shape
    br, bk = blocks.block_r, blocks.block_k
    nr = rp // br
    nblk = _key_blocks(pos, lens, br, bk, bt.shape[1] // (bk // kernel.keywords["page_size"]))
    row = lambda b_, j_, r_, *_: (b_, j_, r_, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, hkv, nr),
        in_specs=[
            # one row's block table in SMEM (bounded: Mp int32, 64 KiB at 262,144 tokens / 16-token pages)
            # ([B, 1, Mp] so the block's last two dims equal the array's: the TPU block-shape rule)
            pl.BlockSpec((None, 1, bt.shape[1]), lambda b_, j_, r_, *_: (b_, 0, 0), memory_space=pltpu.SMEM),
            pl.BlockSpec((None, None, br, dk), row),
            pl.BlockSpec((None, br, 1), lambda b_, j_, r_, *_: (b_, r_, 0)),
            *[pl.BlockSpec(memory_space=pl.ANY) for _ in srcs],
        ],
        out_specs=pl.BlockSpec((None, None, br, value_dim), row),
        scratch_shapes=[*scratch_bufs, pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((br, value_dim), jnp.float32),
                        pltpu.VMEM((br, 1), jnp.float32), pltpu.VMEM((br, 1), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(kernel, num_row_blocks=nr),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, hkv, rp, value_dim), jnp.float32),
        # every program runs its own key loop, so all grid axes are independent
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name=name,
    )(nblk, lens, layer, bt[:, None], q, pos[..., None], *srcs)


def _paged_prefill_mla_tpu(q, pages, bt, lens, pos, scales, *, kv_lora_rank, softmax_scale, blocks, interpret):
    """q rows [B, 1, R, Dl]; bt [B, Mp]; lens [B]; pos [B, R]. -> [B, 1, R, kv_lora_rank] f32."""
    num_pages, page_size, dl = pages.shape
    bk, fp8 = blocks.block_k, scales is not None
    kernel = functools.partial(_tpu_kernel, mla=True, fp8=fp8, value_dim=kv_lora_rank, page_size=page_size,
                               block_k=bk, softmax_scale=softmax_scale)
    srcs = [pages[None]]
    bufs = [pltpu.VMEM((2, bk, dl), pages.dtype)]
    if fp8:
        # [1, P, ps, 1]: a page's scales land as a [ps, 1] column, broadcast over the latent's lanes
        srcs.append(scales.astype(jnp.float32).reshape(1, num_pages, page_size, 1))
        bufs.append(pltpu.VMEM((2, bk, 1), jnp.float32))
    return _tpu_call(kernel, q, pos, bt, lens, jnp.zeros((1,), jnp.int32), srcs, bufs, kv_lora_rank, blocks,
                     interpret, "paged_prefill_mla_tpu")


def _paged_prefill_gqa_tpu(q, k_pages, v_pages, bt, lens, pos, k_scales, v_scales, layer, *, softmax_scale, blocks,
                           interpret):
    """q rows [B, Hkv, R, D]; k_pages, v_pages [L, P, ps, Hkv, D] (values or bits); k_scales, v_scales
    [L, P, ps, Hkv] f32 | None; layer [1] int32; bt [B, Mp]; lens [B]; pos [B, R]. -> [B, Hkv, R, D] f32."""
    _, _, page_size, hkv, d = k_pages.shape
    bk, fp8 = blocks.block_k, k_scales is not None
    kernel = functools.partial(_tpu_kernel, mla=False, fp8=fp8, value_dim=d, page_size=page_size, block_k=bk,
                               softmax_scale=softmax_scale, kv_heads=hkv)
    # whole pages as [Hkv * ps, D] head-major rows (the TPU pool's layout): a per-head DMA is not tile-aligned
    srcs = [head_major(k_pages), head_major(v_pages)]
    bufs = [pltpu.VMEM((2, bk * hkv, d), k_pages.dtype), pltpu.VMEM((2, bk * hkv, d), v_pages.dtype)]
    if fp8:
        # the whole scale pools as [L, Hkv, P, ps] rows (the TPU pool's layout, `scale_rows`: no per-layer slice),
        # one [ps] row per page and kv head
        srcs += [scale_rows(s.astype(jnp.float32)) for s in (k_scales, v_scales)]
        bufs += [pltpu.VMEM((2, bk // page_size * hkv, page_size), jnp.float32)] * 2
    return _tpu_call(kernel, q, pos, bt, lens, layer, srcs, bufs, d, blocks, interpret, "paged_prefill_gqa_tpu")


# ----------------------------------------------------------------------------------------------------------------
# Public wrappers.


def _compute_dtype(pages_dtype) -> jnp.dtype:
    """bf16 for bf16 / fp8 pages (tensor-core / MXU inputs, and what the default blocks' shared-memory / VMEM
    budgets assume); f32 only for f32 pages (tests; f32 tiles need smaller GPU blocks than the defaults)."""
    return jnp.dtype(jnp.float32) if jnp.dtype(pages_dtype) == jnp.float32 else jnp.dtype(jnp.bfloat16)


def _one_layer(backend: str, layer: int | jax.Array | None) -> None:
    if layer is not None:
        raise ValueError(f"backend {backend!r} reads one layer's pages: `layer` is for backend 'gpu'")


def _layer_pages(pages: jax.Array, scales: jax.Array | None, block_tables: jax.Array, layer: int | jax.Array | None
                 ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """TPU MLA: one layer [P, ps, D] as given (layer None), or the whole pool [L, P, ps, D] (values or bits) with
    `layer` as one [L * P, ps, D] pool (a row-major pool's leading dims merge for free) and the block table
    shifted to the layer's pages: no layer slice (v6e copied each layer's whole slice) and no whole-pool bitcast
    for XLA:TPU to materialize."""
    if (layer is None) != (pages.ndim == 3):
        raise ValueError(f"pages {pages.shape}: pass one layer (3 dims), or the pool with a leading layer axis and "
                         f"`layer`")
    if layer is None:
        return pages, scales, block_tables
    n, p = pages.shape[:2]
    pages = pages.reshape(n * p, *pages.shape[2:])  # bits stay bits: the kernel views a VMEM block as values
    scales = None if scales is None else scales.reshape(n * p, *scales.shape[2:])
    return pages, scales, block_tables + jnp.asarray(layer, jnp.int32) * p


def _check_mla(q: jax.Array, pages: jax.Array, scales: jax.Array | None, kv_lora_rank: int) -> None:
    if q.ndim != 4 or q.shape[-1] != pages.shape[-1] or not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"q {q.shape}, pages {pages.shape}, kv_lora_rank {kv_lora_rank}")
    if scales is not None and scales.shape != pages.shape[:-1]:
        raise ValueError(f"scales {scales.shape} != {pages.shape[:-1]}")


def _check_gqa(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, k_scales: jax.Array | None,
               v_scales: jax.Array | None) -> None:
    if q.ndim != 4 or k_pages.shape != v_pages.shape or q.shape[-1] != k_pages.shape[-1] \
            or q.shape[2] % k_pages.shape[-2]:
        raise ValueError(f"q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("pass both k_scales and v_scales or neither")
    if k_scales is not None and not k_scales.shape == v_scales.shape == k_pages.shape[:-1]:
        raise ValueError(f"k_scales {k_scales.shape}, v_scales {v_scales.shape} != {k_pages.shape[:-1]}")


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "backend", "interpret", "block_r",
                                             "block_k"))
def paged_prefill_mla(q: jax.Array, pages: jax.Array, block_tables: jax.Array, positions: jax.Array,
                      ctx_lens: jax.Array, scales: jax.Array | None = None, *, layer: int | jax.Array | None = None,
                      kv_lora_rank: int,
                      softmax_scale: float, backend: str = "gpu", interpret: bool | pltpu.InterpretParams = False,
                      block_r: int | None = None, block_k: int | None = None) -> jax.Array:
    """Absorbed MLA prefill attention over paged latents (MQA: every head reads the same latent rows).

    q: [B, T, N, kv_lora_rank + rope_dim] (the absorbed query: q_nope through kv_b's key half, then q_rope),
    any float dtype; it is cast to the compute dtype (`_compute_dtype`: bf16 for bf16 / fp8 pages) and the dots
    accumulate in f32.
    pages: [num_pages, page_size, kv_lora_rank + rope_dim] bf16 | f32 | float8_e4m3fn, one layer, the chunk's own
    latents already written. scales: [num_pages, page_size] f32 for fp8 pages (x ~= q8 * scale), else None.
    Backends "gpu" and "tpu" also take the whole pool [layers, num_pages, ...] (scales likewise) with `layer` (int
    or int32 scalar), pages as values or their bits (uint8 / uint16), as paged_attention.paged_mla_decode: no layer
    slice for XLA to copy.
    block_tables: [B, M] int32 (prior context + this chunk; padding entries 0, a valid page).
    positions: [B, T] int32 absolute positions. ctx_lens: [B] int32 (prior + chunk tokens; clipped to M * ps).
    Key s is visible to the query at position p iff s <= p and s < ctx_len; a query that sees no key gets 0.
    logits = (q . latent) * softmax_scale; value = latent[:kv_lora_rank].
    backend: "gpu" (Triton) or "tpu" (Mosaic); interpret: True (legacy, either backend) or
    `pltpu.InterpretParams()` (TPU interpret mode, backend "tpu") to run on CPU.
    Returns [B, T, N, kv_lora_rank] f32.
    """
    _check_mla(q, pages, scales, kv_lora_rank)
    b, t, n, _ = q.shape
    page_size = pages.shape[-2]
    blocks = choose_blocks(backend, mla=True, rows=t * n, page_size=page_size, block_r=block_r, block_k=block_k)
    if backend != "gpu":
        pages, scales, block_tables = _layer_pages(pages, scales, block_tables, layer)
    bt, lens = _tables(block_tables, ctx_lens, page_size, blocks.block_k // page_size)
    kw = dict(kv_lora_rank=kv_lora_rank, softmax_scale=softmax_scale, blocks=blocks, interpret=interpret)
    if backend != "gpu":
        qr, pos = _rows(q.astype(_compute_dtype(pages.dtype)), positions, 1, blocks.block_r)
        return _unrows(_paged_prefill_mla_tpu(qr, pages, bt, lens, pos, scales, **kw), t, n)
    pages, (scales,), layer, value_dtype = with_layer_axis(pages, 3, layer, (scales,))
    qr, pos = _rows(q.astype(_compute_dtype(value_dtype)), positions, 1, blocks.block_r)
    return _unrows(_paged_prefill_mla_gpu(qr, pages, bt, lens, pos, scales, layer, value_dtype=value_dtype, **kw),
                   t, n)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "backend", "interpret", "block_r", "block_k"))
def paged_prefill_gqa(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                      positions: jax.Array, ctx_lens: jax.Array, k_scales: jax.Array | None = None,
                      v_scales: jax.Array | None = None, *, layer: int | jax.Array | None = None,
                      softmax_scale: float, backend: str = "gpu",
                      interpret: bool | pltpu.InterpretParams = False, block_r: int | None = None,
                      block_k: int | None = None) -> jax.Array:
    """GQA prefill attention over paged K/V.

    q: [B, T, Hq, D] any float dtype, cast to the compute dtype as in `paged_prefill_mla` (query head h uses kv
    head h // (Hq // Hkv)); k_pages, v_pages: [num_pages,
    page_size, Hkv, D] bf16 | f32 | float8_e4m3fn, one layer, the chunk's own K/V already written; k_scales,
    v_scales: [num_pages, page_size, Hkv] f32 for fp8, else None. block_tables, positions, ctx_lens, the causal
    rule, backend, interpret and the whole pool with `layer` as in `paged_prefill_mla` (backend "gpu"; here also
    "tpu": a layer of the whole pool's bits, stored head-major on a TPU, one layer's scales sliced).
    logits = (q . k) * softmax_scale.
    Returns [B, T, Hq, D] f32.
    """
    _check_gqa(q, k_pages, v_pages, k_scales, v_scales)
    b, t, hq, _ = q.shape
    page_size, hkv = k_pages.shape[-3], k_pages.shape[-2]
    blocks = choose_blocks(backend, mla=False, rows=t * (hq // hkv), page_size=page_size, block_r=block_r,
                           block_k=block_k)
    bt, lens = _tables(block_tables, ctx_lens, page_size, blocks.block_k // page_size)
    kw = dict(softmax_scale=softmax_scale, blocks=blocks, interpret=interpret)
    if backend != "gpu":  # the whole pool and its scales read at `layer` (values or bits)
        one = layer is None
        k_pool, v_pool = (k_pages[None], v_pages[None]) if one else (k_pages, v_pages)
        k_scales, v_scales = (s[None] if one and s is not None else s for s in (k_scales, v_scales))
        at = jnp.asarray(0 if one else layer, jnp.int32).reshape(1)
        qr, pos = _rows(q.astype(_compute_dtype(BITS_TO_VALUES.get(jnp.dtype(k_pages.dtype), k_pages.dtype))),
                        positions, hkv, blocks.block_r)
        return _unrows(_paged_prefill_gqa_tpu(qr, k_pool, v_pool, bt, lens, pos, k_scales, v_scales, at, **kw), t,
                       hq)
    v_pages = with_layer_axis(v_pages, 4, layer, ())[0]
    k_pages, (k_scales, v_scales), layer, value_dtype = with_layer_axis(k_pages, 4, layer, (k_scales, v_scales))
    qr, pos = _rows(q.astype(_compute_dtype(value_dtype)), positions, hkv, blocks.block_r)
    o = _paged_prefill_gqa_gpu(qr, k_pages, v_pages, bt, lens, pos, k_scales, v_scales, layer,
                               value_dtype=value_dtype, **kw)
    return _unrows(o, t, hq)
