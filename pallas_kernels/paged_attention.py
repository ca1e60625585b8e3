"""Paged decode attention (one query token per sequence) for MLA (absorbed, MQA over the latent) and GQA.

Pages are read through the block table; BF16 or FP8 e4m3 pages are dequantized inside the kernel with the
per-token (MLA) or per-token-and-head (GQA) f32 scales loaded beside them: K scales multiply the logits, V scales
multiply the probabilities. Online softmax over blocks of pages, split-K over the sequence (flash-decoding), the
splits merged by log-sum-exp in XLA. Ragged lengths in one batch; a length of 0 gives an output of 0.

Grid: MLA (batch, head block, split); GQA (batch, kv head, split), one kv head's query group per program.

What was checked: CPU only, legacy `interpret=True`, against `reference_paged.py` (tests/test_paged_attention.py:
page sizes 8 and 16, batch 1 and 3, ragged lengths 0..several pages, both layouts, bf16 and fp8, random
non-contiguous block tables). What was NOT checked: any compiled lowering. No GPU was available, so the Triton
lowering (`interpret=False` on GPU) has never run; the kernel follows the structure of JAX's own
`pallas/ops/gpu/paged_attention.py` (whole pool as one block, vector page-id gathers, `fori_loop` with a dynamic
trip count, power-of-two loaded shapes: the MLA latent is read as a 512-wide value part and a 64-wide rope part).
It is not meant for TPU Mosaic as written: the pool is one block and pages are gathered with vector indices;
a TPU version needs `memory_space=pl.ANY` pages and manual async copies. Performance was not measured anywhere.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class DecodeBlocks:
    """Static tiling: query heads per program, pages per inner step, and sequence splits (pages_per_split)."""

    block_h: int
    pages_per_compute_block: int
    k_splits: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_blocks(page_size: int, max_pages: int, heads_per_program: int, *, block_h: int | None = None,
                  pages_per_compute_block: int | None = None, k_splits: int | None = None) -> DecodeBlocks:
    """Default tiling; any argument given overrides it.

    block_h: power of two >= 16 (Triton's dot minimum), at most 64. Inner step ~64 tokens. Splits: each split keeps
    at least 4 inner steps, at most 16 splits.
    """
    bh = block_h or min(64, max(16, _next_pow2(heads_per_program)))
    ppcb = pages_per_compute_block or min(max(1, 64 // page_size), _next_pow2(max_pages))
    steps = -(-max_pages // ppcb)
    ks = k_splits or min(16, max(1, _next_pow2(steps // 4 + 1) // 2))
    return DecodeBlocks(bh, ppcb, ks)


def _decode_kernel(bt_ref, len_ref, *refs, mla: bool, fp8: bool, value_dim: int, page_size: int,
                   pages_per_compute_block: int, softmax_scale: float):
    """One (sequence, head block, split) program.

    MLA refs: q [bh, Dv], q_rope [bh, Dr], latent pages [P, ps, Dv+Dr], (scales [P, ps]), outputs.
    GQA refs: q [bh, D], k pages [P, ps, D], v pages [P, ps, D], (k scales, v scales [P, ps]), outputs.
    Outputs: o [bh, Dv] f32 (unnormalized), l [bh] f32 (sum of exp), m [bh] f32 (running max).
    """
    if mla:
        q_ref, qr_ref, kv_ref, *rest = refs
        s_ref, o_ref, l_ref, m_ref = rest if fp8 else (None, *rest)
    else:
        q_ref, k_ref, v_ref, *rest = refs
        ks_ref, vs_ref, o_ref, l_ref, m_ref = rest if fp8 else (None, None, *rest)
    split = pl.program_id(2)
    pages_per_split = bt_ref.shape[0]
    block_k = pages_per_compute_block * page_size
    length = len_ref[0]
    first_page = split * pages_per_split
    n_pages = jnp.clip(pl.cdiv(length, page_size) - first_page, 0, pages_per_split)
    n_steps = pl.cdiv(n_pages, pages_per_compute_block)

    q = q_ref[...]
    block_h = q.shape[0]
    qr = qr_ref[...] if mla else None

    def load(ids):
        """-> (logits [bh, bk] f32 before scaling, v [bk, Dv] in q dtype, v_scale [1, bk] f32 | None)."""
        if mla:
            c = kv_ref[ids, :, pl.ds(0, value_dim)].reshape(block_k, value_dim).astype(q.dtype)
            cr = kv_ref[ids, :, pl.ds(value_dim, qr.shape[-1])].reshape(block_k, qr.shape[-1]).astype(q.dtype)
            logits = (jnp.dot(q, c.T, preferred_element_type=jnp.float32)
                      + jnp.dot(qr, cr.T, preferred_element_type=jnp.float32))
            scale = s_ref[ids].reshape(1, block_k) if fp8 else None
            return (logits if scale is None else logits * scale), c, scale
        k = k_ref[ids].reshape(block_k, value_dim).astype(q.dtype)
        v = v_ref[ids].reshape(block_k, value_dim).astype(q.dtype)
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        if fp8:
            logits = logits * ks_ref[ids].reshape(1, block_k)
        return logits, v, (vs_ref[ids].reshape(1, block_k) if fp8 else None)

    def body(i, carry):
        o_prev, m_prev, l_prev = carry
        ids = bt_ref[pl.ds(i * pages_per_compute_block, pages_per_compute_block)]
        logits, v, v_scale = load(ids)
        tok = (first_page + i * pages_per_compute_block) * page_size + lax.broadcasted_iota(
            jnp.int32, (1, block_k), 1)
        valid = tok < length  # [1, bk]
        logits = jnp.where(valid, logits * softmax_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp2((m_prev - m_next) * _LOG2E)
        p = jnp.exp2((logits - m_next[:, None]) * _LOG2E)  # masked entries underflow to exactly 0
        l_next = correction * l_prev + p.sum(axis=-1)
        if v_scale is not None:
            p = p * v_scale
        # zero masked V rows: tail pages may hold anything (NaN included) and 0 * NaN would leak
        v = jnp.where(valid.reshape(block_k, 1), v, jnp.zeros((), v.dtype))
        o_next = correction[:, None] * o_prev + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o_next, m_next, l_next

    init = (jnp.zeros((block_h, value_dim), jnp.float32), jnp.full((block_h,), jnp.finfo(jnp.float32).min),
            jnp.zeros((block_h,), jnp.float32))
    o, m, l = lax.fori_loop(0, n_steps, body, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def _merge_splits(o: jax.Array, l: jax.Array, m: jax.Array) -> jax.Array:
    """o [S, ..., Dv], l/m [S, ...] -> [..., Dv] f32; rows with no tokens (l == 0 everywhere) give 0."""
    m_all = m.max(axis=0)
    corr = jnp.exp(m - m_all[None])
    l_all = (l * corr).sum(axis=0)
    o_all = (o * corr[..., None]).sum(axis=0)
    return jnp.where(l_all[..., None] > 0, o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)


def _prepare_tables(block_tables: jax.Array, lengths: jax.Array, page_size: int,
                    blocks: DecodeBlocks) -> tuple[jax.Array, jax.Array, int]:
    """Pad block tables [B, M] with page 0 to k_splits * pages_per_split; clip lengths to the table's capacity."""
    b, m = block_tables.shape
    steps = -(-m // blocks.pages_per_compute_block)
    pages_per_split = -(-steps // blocks.k_splits) * blocks.pages_per_compute_block
    padded = blocks.k_splits * pages_per_split
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - m)))  # page 0 = null page, masked
    lens = jnp.clip(lengths.astype(jnp.int32), 0, m * page_size).reshape(b, 1)
    return bt, lens, pages_per_split


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "block_h", "pages_per_compute_block",
                                             "k_splits", "interpret", "out_dtype"))
def paged_mla_decode(q: jax.Array, pages: jax.Array, block_tables: jax.Array, lengths: jax.Array,
                     scales: jax.Array | None = None, *, kv_lora_rank: int, softmax_scale: float,
                     block_h: int | None = None, pages_per_compute_block: int | None = None,
                     k_splits: int | None = None, interpret: bool = False,
                     out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Absorbed MLA decode attention over paged latents.

    q: [batch, heads, latent_dim] bf16|f32 (absorbed nope part then rope part); pages: [num_pages, page_size,
    latent_dim] bf16|float8_e4m3fn (one layer); scales: [num_pages, page_size] f32 for fp8 pages, else None;
    block_tables: [batch, max_pages] int32 (valid ids; padding 0); lengths: [batch] int32 (0 allowed).
    logits = (q . latent) * softmax_scale; value = latent[:kv_lora_rank].
    Returns [batch, heads, kv_lora_rank] in out_dtype (default q.dtype).
    """
    b, h, dl = q.shape
    num_pages, page_size, dl_p = pages.shape
    if dl != dl_p or not 0 < kv_lora_rank < dl:
        raise ValueError(f"q latent dim {dl}, pages latent dim {dl_p}, kv_lora_rank {kv_lora_rank}")
    fp8 = scales is not None
    blocks = choose_blocks(page_size, block_tables.shape[1], h, block_h=block_h,
                           pages_per_compute_block=pages_per_compute_block, k_splits=k_splits)
    bt, lens, pps = _prepare_tables(block_tables, lengths, page_size, blocks)
    hp = -(-h // blocks.block_h) * blocks.block_h
    qp = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
    dr = dl - kv_lora_rank
    bh, s = blocks.block_h, blocks.k_splits
    kernel = functools.partial(_decode_kernel, mla=True, fp8=fp8, value_dim=kv_lora_rank, page_size=page_size,
                               pages_per_compute_block=blocks.pages_per_compute_block, softmax_scale=softmax_scale)
    in_specs = [
        pl.BlockSpec((None, pps), lambda i, j, k: (i, k)),  # block table slice of this split
        pl.BlockSpec((None, 1), lambda i, j, k: (i, 0)),  # length
        pl.BlockSpec((None, bh, kv_lora_rank), lambda i, j, k: (i, j, 0)),  # q value part
        pl.BlockSpec((None, bh, dr), lambda i, j, k: (i, j, 0)),  # q rope part
        pl.BlockSpec((num_pages, page_size, dl), lambda i, j, k: (0, 0, 0)),  # whole pool: gathered by page id
    ]
    args = [bt, lens, qp[..., :kv_lora_rank], qp[..., kv_lora_rank:], pages]
    if fp8:
        in_specs.append(pl.BlockSpec((num_pages, page_size), lambda i, j, k: (0, 0)))
        args.append(scales.astype(jnp.float32))
    o, l, m = pl.pallas_call(
        kernel,
        grid=(b, hp // bh, s),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, bh, kv_lora_rank), lambda i, j, k: (k, i, j, 0)),
                   pl.BlockSpec((None, None, bh), lambda i, j, k: (k, i, j)),
                   pl.BlockSpec((None, None, bh), lambda i, j, k: (k, i, j))],
        out_shape=[jax.ShapeDtypeStruct((s, b, hp, kv_lora_rank), jnp.float32),
                   jax.ShapeDtypeStruct((s, b, hp), jnp.float32),
                   jax.ShapeDtypeStruct((s, b, hp), jnp.float32)],
        interpret=interpret,
        name="paged_mla_decode",
    )(*args)
    return _merge_splits(o, l, m)[:, :h].astype(out_dtype or q.dtype)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "pages_per_compute_block", "k_splits", "interpret",
                                             "out_dtype"))
def paged_gqa_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                     lengths: jax.Array, k_scales: jax.Array | None = None, v_scales: jax.Array | None = None, *,
                     softmax_scale: float, pages_per_compute_block: int | None = None, k_splits: int | None = None,
                     interpret: bool = False, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """GQA decode attention over paged K/V.

    q: [batch, q_heads, head_dim] bf16|f32; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]
    bf16|float8_e4m3fn (one layer); k_scales, v_scales: [num_pages, page_size, kv_heads] f32 for fp8, else None;
    block_tables: [batch, max_pages] int32; lengths: [batch] int32. q_heads must be a multiple of kv_heads.
    Returns [batch, q_heads, head_dim] in out_dtype (default q.dtype).
    """
    b, hq, d = q.shape
    num_pages, page_size, hkv, d_k = k_pages.shape
    if d != d_k or hq % hkv or k_pages.shape != v_pages.shape:
        raise ValueError(f"q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("pass both k_scales and v_scales or neither")
    fp8 = k_scales is not None
    group = hq // hkv
    # one program holds a kv head's whole query group (padded to block_h rows)
    blocks = choose_blocks(page_size, block_tables.shape[1], group, pages_per_compute_block=pages_per_compute_block,
                           k_splits=k_splits)
    bt, lens, pps = _prepare_tables(block_tables, lengths, page_size, blocks)
    gp = max(blocks.block_h, _next_pow2(group))
    qg = jnp.pad(q.reshape(b, hkv, group, d), ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    s = blocks.k_splits
    kernel = functools.partial(_decode_kernel, mla=False, fp8=fp8, value_dim=d, page_size=page_size,
                               pages_per_compute_block=blocks.pages_per_compute_block, softmax_scale=softmax_scale)
    kv_spec = pl.BlockSpec((num_pages, page_size, None, d), lambda i, j, k: (0, 0, j, 0))  # this kv head, all pages
    in_specs = [
        pl.BlockSpec((None, pps), lambda i, j, k: (i, k)),
        pl.BlockSpec((None, 1), lambda i, j, k: (i, 0)),
        pl.BlockSpec((None, None, gp, d), lambda i, j, k: (i, j, 0, 0)),
        kv_spec, kv_spec,
    ]
    args = [bt, lens, qg, k_pages, v_pages]
    if fp8:
        sc_spec = pl.BlockSpec((num_pages, page_size, None), lambda i, j, k: (0, 0, j))
        in_specs += [sc_spec, sc_spec]
        args += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    o, l, m = pl.pallas_call(
        kernel,
        grid=(b, hkv, s),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, j, k: (k, i, j, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, j, k: (k, i, j, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, j, k: (k, i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((s, b, hkv, gp, d), jnp.float32),
                   jax.ShapeDtypeStruct((s, b, hkv, gp), jnp.float32),
                   jax.ShapeDtypeStruct((s, b, hkv, gp), jnp.float32)],
        interpret=interpret,
        name="paged_gqa_decode",
    )(*args)
    out = _merge_splits(o, l, m)[:, :, :group]
    return out.reshape(b, hq, d).astype(out_dtype or q.dtype)
