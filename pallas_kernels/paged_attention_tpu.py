"""TPU-shaped paged decode attention (one query token per sequence): absorbed MLA (MQA over the latent) and GQA.

The page pool stays in HBM (`memory_space=pl.ANY`); the kernel copies the pages a sequence uses into VMEM itself,
several pages per compute block, double-buffered: while block k is computed, the pages of block k + 1 are in
flight (`pltpu.make_async_copy`, one DMA per page and per scale row, one DMA semaphore per buffer slot), the
pattern of JAX's own TPU paged attention and tpu-inference's ragged paged attention. Grid (batch, head block,
block-table chunk); GQA has one head block holding every kv head: each page is DMA'd once and whole, as
[Hkv * ps, D] head-major rows (row = head * ps + slot, the TPU pool's layout: `jaxserve.sharding.pool_format`;
a per-head `.at[page, :, head]` slice is not tile-aligned and Mosaic refuses it), and each query row's logits
are masked to its own kv head's columns (Hkv x the MXU work of a per-head kernel, none of its extra DMA; decode
is bound by the page reads). The block table, flattened, reaches the kernel one chunk of `pages_per_chunk`
entries (a multiple of 128, at most 1024) per grid step as a 1-D SMEM block, so SMEM holds 2 x pages_per_chunk
page ids (double-buffered by the pipeline) plus the [batch] lengths (scalar prefetch) whatever the context
length (the previous version scalar-prefetched the whole [B, M] table: 4 MiB at batch 64 and 262,144 tokens,
over SMEM and tpu-inference's 128k-entry guard); the chunk axis is "arbitrary" and carries the
online-softmax state (m, l [rows, 1], acc [rows, Dv] f32) in VMEM scratch, initialised at chunk 0 and normalised
into the output at the last chunk. Chunks wholly past a sequence's length do no work and their index map repeats
the last used chunk (no new SMEM copy). Pages past the length are not copied; tokens past the length inside
a block are masked (logits to a large negative, V rows to 0, so stale or NaN buffer contents cannot leak).

Dequantization: BF16 or FP8 e4m3 pages are cast to the compute dtype (the query's, bf16 or f32; e4m3 -> bf16 is
exact) and fed to the MXU with f32 accumulation. The per-token f32 scales (MLA [P, ps]; GQA [P, ps, Hkv] read
as [Hkv, P, ps], `scale_rows`) arrive one [ps] page row (per kv head) per DMA; an exact 0/1 matmul spreads them
into the block's [1, rows] row, which multiplies the logits (K side) and the probabilities after the softmax
sum (V side), as in the GPU kernel. A length of 0 gives an output of 0.

Not done (yet): prefetch across grid steps (the first block of every chunk and sequence is waited for, one
exposed DMA latency per chunk; JAX's kernel carries a buffer index across steps to hide it); megacore splitting
beyond the "parallel" batch and head axes; a tuned block table (TOKENS_PER_COMPUTE_BLOCK is a prior: ~256
tokens per block, 16 page DMAs in flight per slot).

What was checked: TPU interpret mode (`pltpu.InterpretParams()`) and legacy `interpret=True` against
`reference_paged.py` (tests/test_paged_attention_tpu.py: toy dims, page sizes 8 and 16, lengths 0, 1, ps-1, ps,
several pages, the full table, random non-contiguous block tables, bf16 and fp8, one and two head blocks, 1 and 2
kv heads, NaN past the length; three block-table chunks in legacy mode; real per-device dims MLA 8 heads x
(512 + 64) and GQA 12 / 1 heads x 128), and the interpreter's race detector finds no race in the double buffer.
Real compiles by XLA:TPU + Mosaic (libtpu 0.0.42.1) for v5e, v5p and v6e on the CPU host (tests/compile:
Kimi K2.6 / GLM-5.2 MLA TP 8 and DP 64 heads, GLM-4.5 GQA TP 12/1 and DP 96/8 heads, bf16 and fp8 pages, page
16 and 64, up to 1,048,576 tokens): all compile; scoped VMEM as the compiler reports it is ~0.8 MiB (MLA, page
64) to a few MiB, and Mosaic refuses a 1024-page compute block (VMEM OOM). With XLA:TPU's default layout a
[P, ps, 576] pool is page-minor and the compiled program copies the whole pool to the row-major layout this
kernel's call requires: the caller must hold the pool row-major (tests/compile/test_compile_controls.py). The
engine does (`sharding.pool_format`), passes the whole pool + layer (no per-layer slice) and writes new rows with
dynamic_update_slices (`cache.pool._store_rows`): its Kimi K2.6 decode on v5p copies no pool
(tests/compile/test_plan_targets.py). The GQA kernel likewise takes the whole pool + layer, stored head-major
([L, P, Hkv, ps, D] in memory: row-major padded a one-kv-head pool's (1, 128) minor tiles 4x, its scales 128x),
and its scales [L, Hkv, P, ps] (`scale_rows`; head-major they were (1, 128)-tiled and the scale scatter relaid
them out): GLM-4.5's decode and prefill on v5p and v6e copy no pool array (test_plan_targets.py, slow).
What was NOT checked: running on any TPU, DMA overlap and speed. No TPU was available.
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

from pallas_kernels import online_softmax
from pallas_kernels.online_softmax import MASK_VALUE, dot_precision
# Block-table entries per grid step at most: 2 x 1024 x 4 B = 8 KiB of SMEM, far under tpu-inference's
# 128k-entry guard, at any context length.
MAX_PAGES_PER_CHUNK = 1024
# The chunk is a 1-D SMEM block of the flattened table: Mosaic wants its size a multiple of 128.
CHUNK_ALIGN = 128
TOKENS_PER_COMPUTE_BLOCK = 256  # per compute block: 16 pages of 16, 4 of 64 (~300 KiB of a BF16 latent)

@dataclass(frozen=True)
class TpuDecodeBlocks:
    """Static tiling: query rows per program (MLA head block; GQA: the kv head's group), pages per compute block
    (one double-buffer slot), and block-table entries per grid step (a multiple of pages_per_compute_block)."""

    block_h: int
    pages_per_compute_block: int
    pages_per_chunk: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_block_h(num_heads: int, block_h: int | None = None) -> int:
    """MLA query heads per program.

    Default: all heads in one program, because every MLA head reads the same latent page, so one head block means
    each page is DMA'd once per sequence. An override must divide num_heads and be a multiple of 8 (TPU sublane
    tiling) unless it equals num_heads.
    """
    bh = block_h or num_heads
    if num_heads % bh or (bh != num_heads and bh % 8):
        raise ValueError(f"block_h {bh} must divide num_heads {num_heads} and be a multiple of 8 (or equal it)")
    return bh


def choose_tpu_blocks(page_size: int, max_pages: int, rows: int, *, block_h: int | None = None,
                      pages_per_compute_block: int | None = None,
                      pages_per_chunk: int | None = None) -> TpuDecodeBlocks:
    """Default tiling; any argument given overrides it.

    rows: MLA query heads (block_h from choose_block_h) or all GQA q heads (block_h = rows). Compute block
    ~TOKENS_PER_COMPUTE_BLOCK tokens (at least one page, at most the table); chunk: the whole table up to
    MAX_PAGES_PER_CHUNK entries, rounded up to a multiple of CHUNK_ALIGN and of the compute block.
    """
    bh = choose_block_h(rows, block_h)
    ppcb = pages_per_compute_block or max(1, min(_next_pow2(max_pages), TOKENS_PER_COMPUTE_BLOCK // page_size))
    unit = math.lcm(ppcb, CHUNK_ALIGN)
    chunk = pages_per_chunk or min(-(-max_pages // unit) * unit, max(unit, MAX_PAGES_PER_CHUNK // unit * unit))
    if chunk % unit:
        raise ValueError(f"pages_per_chunk {chunk} must be a multiple of {CHUNK_ALIGN} and of "
                         f"pages_per_compute_block {ppcb}")
    return TpuDecodeBlocks(bh, ppcb, chunk)


def token_of_row(row: jax.Array, kv_heads: int, page_size: int) -> jax.Array:
    """Token of a row of whole pages, each stored head-major (a page's row = head * ps + slot: the TPU pool's
    layout, `jaxserve.sharding.pool_format`); no vector division when there is one kv head."""
    return row if kv_heads == 1 else lax.div(row, page_size * kv_heads) * page_size + lax.rem(row, page_size)


def head_of_row(row: jax.Array, kv_heads: int, page_size: int) -> jax.Array:
    """KV head of a row of whole head-major pages (see token_of_row)."""
    return lax.rem(lax.div(row, page_size), kv_heads)


def head_major(pool: jax.Array, lead: int = 2) -> jax.Array:
    """GQA pages [*lead dims, ps, Hkv, ...] (the pool [L, P, ...]: lead 2; one layer: 1) as [*lead, Hkv * ps, ...]
    rows (row = head * ps + slot): free on a TPU pool stored head-major (`jaxserve.sharding.pool_format`), a
    transpose elsewhere (interpret mode)."""
    ps, hkv = pool.shape[lead], pool.shape[lead + 1]
    return jnp.swapaxes(pool, lead, lead + 1).reshape(*pool.shape[:lead], hkv * ps, *pool.shape[lead + 2:])


def scale_rows(scales: jax.Array) -> jax.Array:
    """GQA scales [L, P, ps, Hkv] f32 as [L, Hkv, P, ps]: one [ps] row per (layer, kv head, page), free on a TPU
    pool stored so (`jaxserve.sharding.pool_format`), a transpose elsewhere (interpret mode). Head-major pages
    ([L, P, Hkv, ps]) put a device's one kv head (TP) second-minor: XLA:TPU tiled that (1, 128), which its scatter
    of new scales relaid out to (8, 128) tiles over (P, ps) and back, copying the scale pools every step."""
    return jnp.transpose(scales, (0, 3, 1, 2))


def _last_chunk(b, lens_ref, page_size: int, pages_per_chunk: int) -> jax.Array:
    """Index of the last block-table chunk holding a page of sequence b (0 for an empty one), int32 scalar."""
    return jnp.maximum(pl.cdiv(lens_ref[b], page_size * pages_per_chunk) - 1, 0)


def _chunk_index_map(b, h, c, lens_ref, layer_ref, *, page_size: int, pages_per_chunk: int, chunks: int):
    """Block of the flattened table for grid step (b, h, c); past the last used chunk repeat it, so nothing is
    re-copied."""
    return (b * chunks + jnp.minimum(c, _last_chunk(b, lens_ref, page_size, pages_per_chunk)),)


def _scale_row(s: jax.Array, page_size: int) -> jax.Array:
    """Per-page scale rows s [ppcb, ps] f32 -> the block's row [1, ppcb * ps] (token t = page * ps + slot).

    An exact 0/1 matmul and a masked sublane sum instead of a sublane-to-lane reshape: s @ E, E[u, t] = (t % ps
    == u), repeats every page's row across the block; row j keeps its own page's lanes.
    """
    ppcb = s.shape[0]
    if ppcb == 1:
        return s
    bk = ppcb * page_size
    tok = lax.broadcasted_iota(jnp.int32, (page_size, bk), 1)
    spread = (lax.rem(tok, page_size) == lax.broadcasted_iota(jnp.int32, (page_size, bk), 0)).astype(jnp.float32)
    tiled = jnp.dot(s, spread, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    own = lax.div(lax.broadcasted_iota(jnp.int32, (ppcb, bk), 1), page_size) == lax.broadcasted_iota(
        jnp.int32, (ppcb, bk), 0)
    return jnp.where(own, tiled, 0.0).sum(axis=0, keepdims=True)


# A pool stored as bit patterns (jaxserve.cache.pool: uint8 FP8, uint16 BF16) is DMA'd as is and viewed as values in
# VMEM: a bitcast of the HBM pool outside the kernel is a whole-pool XLA:TPU op (the 8-bit tilings differ).
BITS_TO_VALUES = {jnp.dtype(jnp.uint8): jnp.float8_e4m3fn, jnp.dtype(jnp.uint16): jnp.bfloat16}


def _values(x: jax.Array) -> jax.Array:
    """A VMEM page block as values: bits (uint8 / uint16) bitcast to float8_e4m3fn / bfloat16, values as is."""
    to = BITS_TO_VALUES.get(jnp.dtype(x.dtype))
    return x if to is None else lax.bitcast_convert_type(x, to)


def _decode_kernel(lens_ref, layer_ref, bt_ref, q_ref, *refs, mla: bool, fp8: bool, value_dim: int, page_size: int,
                   kv_heads: int, pages_per_compute_block: int, softmax_scale: float, compute_dtype):
    """One (sequence b, head block h, block-table chunk c) step.

    lens_ref [B] int32, layer_ref [1] int32 (SMEM, scalar prefetch); bt_ref [chunk] int32 (SMEM); q_ref [rows, Dk].
    HBM refs carry a leading layer axis (the whole pool, or one layer as [1, ...]): page p of layer_ref[0] is read.
    MLA HBM refs: latent pages [L, P, ps, Dl], (scales [L, P, ps] f32). GQA (all kv heads in one program, rows = all q
    heads, query head r reads kv head r // (rows / Hkv)): k, v pages [L, P, Hkv * ps, D] (row = head * ps + slot),
    (k, v scales [L, Hkv, P, ps] f32). o_ref [rows, Dv] f32. Scratch: one [2, ppcb,
    Hkv * ps, width] page buffer per K/V part, (one [2, ppcb * Hkv, ps] f32 scale buffer per part: row = page *
    Hkv + head), DMA semaphores [2], m, l [rows, 1] f32, acc [rows, Dv] f32.
    """
    n_parts = 1 if mla else 2
    hbm, rest = refs[:n_parts], refs[n_parts:]
    s_hbm, rest = (rest[:n_parts], rest[n_parts:]) if fp8 else ((), rest)
    o_ref, rest = rest[0], rest[1:]
    bufs, rest = rest[:n_parts], rest[n_parts:]
    s_bufs, rest = (rest[:n_parts], rest[n_parts:]) if fp8 else ((), rest)
    sems, m_sc, l_sc, acc_sc = rest
    b, c = pl.program_id(0), pl.program_id(2)
    ppcb = pages_per_compute_block
    pages_per_chunk = bt_ref.shape[0]
    page_rows = page_size * kv_heads  # a GQA page is DMA'd whole: a per-head slice is not tile-aligned
    bk = ppcb * page_rows
    length = lens_ref[b]
    n_pages = jnp.clip(pl.cdiv(length, page_size) - c * pages_per_chunk, 0, pages_per_chunk)
    n_blocks = pl.cdiv(n_pages, ppcb)

    def copies(blk, slot) -> list[tuple[jax.Array, pltpu.AsyncCopyDescriptor]]:
        """(needed, copy) for every page (and scale row) of chunk-local compute block blk into buffer slot."""
        out = []
        for j in range(ppcb):
            p = blk * ppcb + j
            page, layer = bt_ref[p], layer_ref[0]
            for part in range(n_parts):
                out.append((p < n_pages, pltpu.make_async_copy(hbm[part].at[layer, page], bufs[part].at[slot, j],
                                                               sems.at[slot])))
                for h in range(kv_heads if fp8 else 0):  # one [ps] scale row per kv head
                    src = s_hbm[part].at[layer, page] if mla else s_hbm[part].at[layer, h, page]
                    out.append((p < n_pages, pltpu.make_async_copy(src, s_bufs[part].at[slot, j * kv_heads + h],
                                                                   sems.at[slot])))
        return out

    def start(blk, slot):
        for needed, cp in copies(blk, slot):
            pl.when(needed)(cp.start)

    def wait(blk, slot):
        for needed, cp in copies(blk, slot):
            pl.when(needed)(cp.wait)

    @pl.when(c == 0)
    def _init():
        online_softmax.reset(m_sc, l_sc, acc_sc)

    def compute(blk, slot):
        q = q_ref[...].astype(compute_dtype)
        k = _values(bufs[0][slot]).astype(compute_dtype).reshape(bk, bufs[0].shape[-1])
        v = k[:, :value_dim] if mla else _values(bufs[1][slot]).astype(compute_dtype).reshape(bk, value_dim)
        tok0 = (c * pages_per_chunk + blk * ppcb) * page_size
        col = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        valid = tok0 + token_of_row(col, kv_heads, page_size) < length  # [1, bk]
        # scale rows of uncopied pages are stale (NaN in interpret mode): zero them, 0 * NaN would leak
        # scale rows [ppcb * Hkv, ps] (row = page * Hkv + head): spread in the K rows' order, page-, then head-major
        scale = lambda part: jnp.where(valid, _scale_row(s_bufs[part][slot], page_size), 0.0)  # noqa: E731
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                 precision=dot_precision(compute_dtype))
        if fp8:
            k_row = scale(0)
            logits = logits * k_row  # K-side dequant: (q . k8) s == q . (k8 s)
        keep = valid
        if kv_heads > 1:  # each query row attends to its own kv head's columns only
            group = q.shape[0] // kv_heads
            keep = keep & (lax.div(lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0), group) ==
                           head_of_row(col, kv_heads, page_size))
        logits = jnp.where(keep, logits * softmax_scale, MASK_VALUE)
        p, correction = online_softmax.fold_logits(m_sc, l_sc, logits)  # masked entries underflow to exactly 0
        if fp8:  # V-side dequant, after the sum so l stays the plain softmax denominator
            p = p * (k_row if mla else scale(1))
        # zero V rows past the length: stale or uncopied buffer rows may hold anything (NaN included)
        v_tok = token_of_row(lax.broadcasted_iota(jnp.int32, (bk, 1), 0), kv_heads, page_size)
        v = jnp.where(tok0 + v_tok < length, v, jnp.zeros((), v.dtype))
        online_softmax.fold_values(acc_sc, p, correction, v)

    @pl.when(n_blocks > 0)
    def _run():
        start(0, 0)

        def body(blk, carry):
            slot = lax.rem(blk, 2)

            @pl.when(blk + 1 < n_blocks)
            def _prefetch():  # the next block's pages fly while this one is computed
                start(blk + 1, 1 - slot)

            wait(blk, slot)
            compute(blk, slot)
            return carry

        lax.fori_loop(0, n_blocks, body, 0)

    @pl.when(c == pl.num_programs(2) - 1)
    def _finalize():
        online_softmax.write_out(o_ref, l_sc, acc_sc)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "block_h", "pages_per_compute_block",
                                             "pages_per_chunk", "compute_dtype", "interpret", "out_dtype"))
def paged_mla_decode_tpu(q: jax.Array, pages: jax.Array, block_tables: jax.Array, lengths: jax.Array,
                         scales: jax.Array | None = None, *, layer: int | jax.Array | None = None,
                         kv_lora_rank: int, softmax_scale: float,
                         block_h: int | None = None, pages_per_compute_block: int | None = None,
                         pages_per_chunk: int | None = None, compute_dtype: jnp.dtype | None = None,
                         interpret: bool | pltpu.InterpretParams = False,
                         out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Absorbed MLA decode attention over paged latents (TPU: HBM pool, multi-page double-buffered DMAs).

    q: [batch, heads, latent_dim] bf16|f32 (absorbed nope part then rope part); pages: [num_pages, page_size,
    latent_dim] bf16|float8_e4m3fn (one layer), or the whole pool [layers, num_pages, page_size, latent_dim] with
    `layer` (int or int32 scalar: which layer to read; scales then [layers, num_pages, page_size]): the kernel DMAs
    from the pool itself, so no layer slice is materialized (XLA:TPU copied each slice to the Mosaic call's
    layout, 302 MB per layer at Kimi K2.6's 64 x 8k pool). Pages may also be the pool's bit patterns (uint8 for
    float8_e4m3fn, uint16 for bf16: viewed as values in VMEM). block_tables: [batch, max_pages] int32 (ids <
    num_pages for every page below the length); lengths: [batch] int32 (0 allowed; clipped to max_pages * page_size); scales:
    [num_pages, page_size] f32 for fp8 pages, else None. logits = (q . latent) * softmax_scale; value =
    latent[:kv_lora_rank]. compute_dtype: MXU operand dtype (default q.dtype). Tiling overrides: see
    choose_tpu_blocks. interpret: False (Mosaic), True or `pltpu.InterpretParams()` to run on CPU.
    Returns [batch, heads, kv_lora_rank] in out_dtype (default f32).
    """
    b, h, dl = q.shape
    if (layer is None) != (pages.ndim == 3):
        raise ValueError(f"pages {pages.shape}: pass one layer [P, ps, Dl], or the pool [L, P, ps, Dl] and `layer`")
    if layer is None:  # one layer: a leading unit layer axis is free (no data moves)
        pages, scales, layer = pages[None], None if scales is None else scales[None], 0
    _, num_pages, page_size, dl_p = pages.shape
    if dl != dl_p or not 0 < kv_lora_rank < dl:
        raise ValueError(f"q latent dim {dl}, pages latent dim {dl_p}, kv_lora_rank {kv_lora_rank}")
    fp8 = scales is not None
    if fp8 and scales.shape != pages.shape[:3]:
        raise ValueError(f"scales {scales.shape} != {pages.shape[:3]}")
    blocks = choose_tpu_blocks(page_size, block_tables.shape[1], h, block_h=block_h,
                               pages_per_compute_block=pages_per_compute_block, pages_per_chunk=pages_per_chunk)
    bt, lens = _prepare_tables(block_tables, lengths, page_size, blocks)
    bh, ppcb = blocks.block_h, blocks.pages_per_compute_block
    hbm = [pages]
    s_hbm = [scales.astype(jnp.float32)] if fp8 else []
    scratch = [pltpu.VMEM((2, ppcb, page_size, dl), pages.dtype)]
    scratch += [pltpu.VMEM((2, ppcb, page_size), jnp.float32)] if fp8 else []
    row_map = lambda b_, h_, c_, *_: (b_, h_, 0)  # noqa: E731
    kernel = functools.partial(_decode_kernel, mla=True, fp8=fp8, value_dim=kv_lora_rank, page_size=page_size,
                               kv_heads=1, pages_per_compute_block=ppcb, softmax_scale=softmax_scale,
                               compute_dtype=jnp.dtype(compute_dtype or q.dtype))
    return _pallas(kernel, blocks, page_size, lens, layer, bt, q, hbm + s_hbm, scratch, grid_h=h // bh,
                   q_block=(None, bh, dl), q_map=row_map, out_block=(None, bh, kv_lora_rank), out_map=row_map,
                   out_shape=(b, h, kv_lora_rank), out_dtype=out_dtype, name="paged_mla_decode_tpu",
                   interpret=interpret)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "pages_per_compute_block", "pages_per_chunk",
                                             "compute_dtype", "interpret", "out_dtype"))
def paged_gqa_decode_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                         lengths: jax.Array, k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                         *, layer: int | jax.Array | None = None, softmax_scale: float,
                         pages_per_compute_block: int | None = None, pages_per_chunk: int | None = None,
                         compute_dtype: jnp.dtype | None = None, interpret: bool | pltpu.InterpretParams = False,
                         out_dtype: jnp.dtype | None = None) -> jax.Array:
    """GQA decode attention over paged K/V (TPU: HBM pool, multi-page double-buffered DMAs of whole pages, all kv
    heads in one program, each query row masked to its kv head's columns). Same contract as
    paged_attention.paged_gqa_decode.

    q: [batch, q_heads, head_dim] bf16|f32; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]
    bf16|float8_e4m3fn (one layer), or the whole pools [layers, num_pages, page_size, kv_heads, head_dim] with
    `layer` (int or int32 scalar; scales then [layers, ...]): the kernel DMAs from the pool itself, so no layer
    slice is materialized (XLA:TPU copied each layer's K and V to the Mosaic call's layout, GLM-4.5 on v5p); pages
    may be the pool's bits (uint8 / uint16). k_scales, v_scales: [num_pages, page_size, kv_heads] f32 for fp8,
    else None; block_tables: [batch, max_pages] int32; lengths: [batch] int32. q_heads must be a multiple of
    kv_heads. compute_dtype: MXU operand dtype (default q.dtype). Tiling overrides: see choose_tpu_blocks.
    Returns [batch, q_heads, head_dim] in out_dtype (default q.dtype).
    """
    if (layer is None) != (k_pages.ndim == 4):
        raise ValueError(f"k_pages {k_pages.shape}: pass one layer [P, ps, Hkv, D], or the pool [L, P, ps, Hkv, D] "
                         "and `layer`")
    if layer is None:  # one layer: a leading unit layer axis is free (no data moves)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        k_scales, v_scales = (None if s is None else s[None] for s in (k_scales, v_scales))
    b, hq, d = q.shape
    layers, num_pages, page_size, hkv, d_k = k_pages.shape
    if d != d_k or hq % hkv or k_pages.shape != v_pages.shape:
        raise ValueError(f"q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("pass both k_scales and v_scales or neither")
    fp8 = k_scales is not None
    if fp8 and (k_scales.shape != k_pages.shape[:4] or v_scales.shape != k_scales.shape):
        raise ValueError(f"k_scales {k_scales.shape}, v_scales {v_scales.shape} != {k_pages.shape[:4]}")
    # one program per sequence holds every kv head: each page is DMA'd once, whole (tile-aligned), as
    # [Hkv * ps, D] head-major rows (the TPU pool's layout: `head_major` is free there)
    blocks = choose_tpu_blocks(page_size, block_tables.shape[1], hq,
                               pages_per_compute_block=pages_per_compute_block, pages_per_chunk=pages_per_chunk)
    bt, lens = _prepare_tables(block_tables, lengths, page_size, blocks)
    ppcb, rows = blocks.pages_per_compute_block, page_size * hkv
    hbm = [head_major(k_pages), head_major(v_pages)]
    s_hbm = [scale_rows(s.astype(jnp.float32)) for s in (k_scales, v_scales)] if fp8 else []
    scratch = [pltpu.VMEM((2, ppcb, rows, d), k_pages.dtype)] * 2
    scratch += [pltpu.VMEM((2, ppcb * hkv, page_size), jnp.float32)] * 2 if fp8 else []
    row_map = lambda b_, h_, c_, *_: (b_, 0, 0)  # noqa: E731
    kernel = functools.partial(_decode_kernel, mla=False, fp8=fp8, value_dim=d, page_size=page_size,
                               kv_heads=hkv, pages_per_compute_block=ppcb, softmax_scale=softmax_scale,
                               compute_dtype=jnp.dtype(compute_dtype or q.dtype))
    return _pallas(kernel, blocks, page_size, lens, layer, bt, q, hbm + s_hbm, scratch, grid_h=1,
                   q_block=(None, hq, d), q_map=row_map, out_block=(None, hq, d), out_map=row_map,
                   out_shape=(b, hq, d), out_dtype=out_dtype or q.dtype, name="paged_gqa_decode_tpu",
                   interpret=interpret)


def _prepare_tables(block_tables: jax.Array, lengths: jax.Array, page_size: int,
                    blocks: TpuDecodeBlocks) -> tuple[jax.Array, jax.Array]:
    """Pad block tables [B, M] with page 0 to whole chunks (never copied: past every length) and flatten them;
    clip lengths to the table's capacity. -> (bt [B * chunks * pages_per_chunk] int32, lens [B] int32)."""
    m = block_tables.shape[1]
    padded = -(-m // blocks.pages_per_chunk) * blocks.pages_per_chunk
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - m)))
    return bt.reshape(-1), jnp.clip(lengths.astype(jnp.int32), 0, m * page_size)


def _pallas(kernel, blocks: TpuDecodeBlocks, page_size: int, lens: jax.Array, layer: int | jax.Array, bt: jax.Array,
            q: jax.Array, hbm: list[jax.Array], scratch: list, *, grid_h: int, q_block: tuple, q_map,
            out_block: tuple, out_map, out_shape: tuple[int, ...], out_dtype, name: str, interpret) -> jax.Array:
    """pallas_call over grid (batch, grid_h, block-table chunks): lengths and the layer scalar-prefetched, the
    block-table chunk in SMEM, q / out pipelined VMEM blocks, `hbm` arrays left in HBM for the kernel's own DMAs."""
    batch, chunks = q.shape[0], bt.shape[0] // (q.shape[0] * blocks.pages_per_chunk)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    chunk_map = functools.partial(_chunk_index_map, page_size=page_size, pages_per_chunk=blocks.pages_per_chunk,
                                  chunks=chunks)
    rows = q_block[-2]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, grid_h, chunks),
        in_specs=[pl.BlockSpec((blocks.pages_per_chunk,), chunk_map, memory_space=pltpu.SMEM),
                  pl.BlockSpec(q_block, q_map)] + [pl.BlockSpec(memory_space=pl.ANY)] * len(hbm),
        out_specs=pl.BlockSpec(out_block, out_map),
        scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, out_block[-1]), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        # the chunk axis carries the softmax state, so it must run in order
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=name,
    )(lens, layer, bt, q, *hbm)
