"""TPU-style paged MLA decode attention (absorbed, MQA over the latent), one query token per sequence.

Unlike `paged_attention.py` (whole pool as one block, pages gathered by vector index: fine for Triton, impossible
for Mosaic), the block table and lengths are scalar-prefetch arguments (SMEM) and the pages BlockSpec is ONE
page `(None, page_size, latent_dim)` whose index_map reads the page id from the block table, so the pipeline DMAs
exactly the pages a sequence uses. Grid (batch, head block, page); the page axis is "arbitrary" (sequential) and
carries the online-softmax state (m, l, acc) in VMEM scratch, initialised at page 0 and normalised into the output
at the last page. Pages at or past a sequence's length are skipped with `pl.when`, and their index_map repeats the
last used page id so the pipeline, which skips a copy when the block index is unchanged, issues no new DMA for
them (not observed: interpret mode does not show DMA counts); tokens past the length inside the last page are
masked (logits to a large negative, V rows to 0, so garbage or NaN there cannot leak). FP8 e4m3 pages are
dequantized in the kernel with the per-token f32 scales (a second BlockSpec with the same index map): the scale
multiplies the logits (K side) and the probabilities (V side). A length of 0 gives an output of 0.

What was checked: CPU only, TPU interpret mode (`interpret=pltpu.InterpretParams()`, JAX 0.10.2) against
`reference_paged.paged_mla_reference` in tests/test_paged_attention_tpu.py (page sizes 8 and 16, ragged lengths
0, 1, ps-1, ps, several pages and the full table, random non-contiguous block tables, bf16 and fp8 pages, one
and two head blocks, NaN in tail tokens). What was NOT checked: the real Mosaic lowering (`interpret=False` on a
TPU has never run: tiling/layout constraints such as the (H, 1) softmax-state scratch, the transposed-RHS dot,
or the fp8 -> bf16 cast may be rejected or slow there), the DMA saving for skipped pages, and speed (never
measured anywhere). Legacy `interpret=True` gives the same results on the test shapes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def choose_block_h(num_heads: int, block_h: int | None = None) -> int:
    """Query heads per program.

    Default: all heads in one program, because every MLA head reads the same latent page, so one head block means
    each page is DMA'd once per sequence. An override must divide num_heads and be a multiple of 8 (TPU sublane
    tiling) unless it equals num_heads.
    """
    bh = block_h or num_heads
    if num_heads % bh or (bh != num_heads and bh % 8):
        raise ValueError(f"block_h {bh} must divide num_heads {num_heads} and be a multiple of 8 (or equal it)")
    return bh


def _last_page(b: jax.Array, lens_ref: jax.Array, page_size: int) -> jax.Array:
    """Index of the last page holding a token of sequence b (0 for an empty sequence), int32 scalar."""
    return jnp.maximum(pl.cdiv(lens_ref[b], page_size) - 1, 0)


def _page_index_map(b, h, i, bt_ref, lens_ref, *, page_size: int):
    """Page id for grid step (b, h, i); past the last used page repeat it, so no new DMA is issued."""
    return (bt_ref[b, jnp.minimum(i, _last_page(b, lens_ref, page_size))], 0, 0)


def _mla_decode_kernel(bt_ref, lens_ref, q_ref, kv_ref, *refs, fp8: bool, kv_lora_rank: int, page_size: int,
                       softmax_scale: float):
    """One (sequence b, head block, page i) step.

    bt_ref [B, M] int32, lens_ref [B] int32 (SMEM, scalar prefetch); q_ref [bh, Dl]; kv_ref [ps, Dl] bf16|f8;
    (s_ref [1, ps] f32 for fp8); o_ref [bh, Dv] f32; scratch m_sc, l_sc [bh, 1] f32, acc_sc [bh, Dv] f32.
    """
    if fp8:
        s_ref, o_ref, m_sc, l_sc, acc_sc = refs
    else:
        s_ref, (o_ref, m_sc, l_sc, acc_sc) = None, refs
    b, i = pl.program_id(0), pl.program_id(2)
    length = lens_ref[b]

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(i * page_size < length)  # pages wholly past the length do no work
    def _compute():
        q = q_ref[...]
        kv = kv_ref[...]
        # fp8 e4m3 -> bf16 is exact (bf16 has more exponent and mantissa bits); bf16 feeds the MXU
        kv = kv.astype(jnp.bfloat16) if fp8 else kv.astype(q.dtype)
        # q [bh, Dl] . kv [ps, Dl]^T over the whole latent (nope + rope parts)
        logits = lax.dot_general(q, kv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        scale = s_ref[...] if fp8 else None  # [1, ps]
        if scale is not None:
            logits = logits * scale  # K-side dequant: (q . k8) * s == q . (k8 * s)
        tok = i * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        logits = jnp.where(tok < length, logits * softmax_scale, MASK_VALUE)
        m_prev, l_prev = m_sc[...], l_sc[...]
        m_next = jnp.maximum(m_prev, logits.max(axis=-1, keepdims=True))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next)  # masked entries underflow to exactly 0
        l_sc[...] = correction * l_prev + p.sum(axis=-1, keepdims=True)
        m_sc[...] = m_next
        if scale is not None:
            p = p * scale  # V-side dequant, applied after the sum so l stays the plain softmax denominator
        v = kv[:, :kv_lora_rank]
        # zero V rows past the length: a tail page may hold anything (NaN included) and 0 * NaN would leak
        tok_col = i * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        v = jnp.where(tok_col < length, v, jnp.zeros((), v.dtype))
        acc_sc[...] = correction * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(2) - 1)
    def _finalize():
        l = l_sc[...]
        # empty sequence: l == 0, output 0 rather than 0 / 0
        o_ref[...] = jnp.where(l > 0, acc_sc[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "block_h", "interpret"))
def paged_mla_decode_tpu(q: jax.Array, pages: jax.Array, block_tables: jax.Array, lengths: jax.Array,
                         scales: jax.Array | None = None, *, kv_lora_rank: int, softmax_scale: float,
                         block_h: int | None = None,
                         interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """Absorbed MLA decode attention over paged latents, TPU pipeline (one page per grid step).

    q: [batch, heads, latent_dim] bf16|f32 (absorbed nope part then rope part); pages: [num_pages, page_size,
    latent_dim] bf16|float8_e4m3fn (one layer); block_tables: [batch, max_pages] int32 (ids < num_pages for every
    page below the length); lengths: [batch] int32 (0 allowed; clipped to max_pages * page_size); scales:
    [num_pages, page_size] f32 for fp8 pages, else None. logits = (q . latent) * softmax_scale; value =
    latent[:kv_lora_rank]. interpret: False (Mosaic), or `pltpu.InterpretParams()` / True to run on CPU.
    Returns [batch, heads, kv_lora_rank] f32.
    """
    b, h, dl = q.shape
    num_pages, page_size, dl_p = pages.shape
    if dl != dl_p or not 0 < kv_lora_rank < dl:
        raise ValueError(f"q latent dim {dl}, pages latent dim {dl_p}, kv_lora_rank {kv_lora_rank}")
    fp8 = scales is not None
    if fp8 and scales.shape != (num_pages, page_size):
        raise ValueError(f"scales {scales.shape} != {(num_pages, page_size)}")
    bh = choose_block_h(h, block_h)
    max_pages = block_tables.shape[1]
    bt = block_tables.astype(jnp.int32)
    lens = jnp.clip(lengths.astype(jnp.int32), 0, max_pages * page_size)
    page_map = functools.partial(_page_index_map, page_size=page_size)
    in_specs = [
        pl.BlockSpec((None, bh, dl), lambda b_, h_, i, bt_, lens_: (b_, h_, 0)),  # same block over i: fetched once
        pl.BlockSpec((None, page_size, dl), page_map),  # one page, id read from the prefetched block table
    ]
    args = [q, pages]
    if fp8:
        # [P, 1, ps] so the block's last two dims equal the array's (TPU tiling rule) for a one-page block
        in_specs.append(pl.BlockSpec((None, 1, page_size), page_map))
        args.append(scales.astype(jnp.float32).reshape(num_pages, 1, page_size))
    kernel = functools.partial(_mla_decode_kernel, fp8=fp8, kv_lora_rank=kv_lora_rank, page_size=page_size,
                               softmax_scale=softmax_scale)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, h // bh, max_pages),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bh, kv_lora_rank), lambda b_, h_, i, bt_, lens_: (b_, h_, 0)),
        scratch_shapes=[pltpu.VMEM((bh, 1), jnp.float32), pltpu.VMEM((bh, 1), jnp.float32),
                        pltpu.VMEM((bh, kv_lora_rank), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, h, kv_lora_rank), jnp.float32),
        # page axis carries the softmax state, so it must run in order
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_mla_decode_tpu",
    )(bt, lens, *args)
