"""Plain-jnp paged PREFILL attention (a chunk of T query tokens per row over the row's paged context), f32: the
dense test oracle of the flash prefill kernels (`paged_prefill.py`) and of the engine's blockwise XLA path.

`prefill_mla_dense` / `prefill_gqa_dense` gather the whole context and take a masked softmax over [T, S]; memory
grows as chunk x context.

Contract (shared with `paged_prefill.py`):
    q             MLA [B, T, N, latent_dim] (absorbed query: nope part through kv_b, then rope part);
                  GQA [B, T, Hq, D], Hq a multiple of Hkv; any float dtype, computed in f32.
    pages         MLA [num_pages, page_size, latent_dim]; GQA k_pages / v_pages [num_pages, page_size, Hkv, D];
                  bf16 | f32 | float8_e4m3fn (one layer). The chunk's own KV must already be written.
    scales        fp8 only (x ~= q8 * scale), f32: MLA [num_pages, page_size]; GQA [num_pages, page_size, Hkv].
    block_tables  [B, M] int32, page ids covering prior context + this chunk; padding entries 0 (a valid page).
    positions     [B, T] int32, absolute position of each query token.
    ctx_lens      [B] int32, prior + chunk tokens (clipped to M * page_size).
    Key position s is visible to the query at position p iff s <= p and s < ctx_len. A query that sees no key
    (ctx_len 0, or position < 0) gets 0. Padding query slots get whatever their positions give (finite).
    logits = (q . k) * softmax_scale; MLA value = latent[:kv_lora_rank].
    Returns MLA [B, T, N, kv_lora_rank] f32; GQA [B, T, Hq, D] f32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _dequant(x: jax.Array, scale: jax.Array | None) -> jax.Array:
    """x [..., D] any float, scale [...] | None -> [..., D] f32."""
    x = x.astype(jnp.float32)
    return x if scale is None else x * scale.astype(jnp.float32)[..., None]


def _grouped(q: jax.Array, hkv: int) -> jax.Array:
    """q [B, T, H, D] -> [B, T, Hkv, G, D] f32 (query head h uses kv head h // G)."""
    b, t, h, d = q.shape
    return q.astype(jnp.float32).reshape(b, t, hkv, h // hkv, d)


def _dense(qg: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, ctx_lens: jax.Array,
           softmax_scale: float) -> jax.Array:
    """qg [B, T, Hkv, G, Dk], k [B, S, Hkv, Dk], v [B, S, Hkv, Dv] f32, ctx_lens [B] (clipped to S here)
    -> [B, T, Hkv, G, Dv] f32."""
    ctx_lens = jnp.clip(ctx_lens.astype(jnp.int32), 0, k.shape[1])
    logits = jnp.einsum("btkgd,bskd->btkgs", qg, k, precision=_HI) * softmax_scale
    kpos = jnp.arange(k.shape[1], dtype=jnp.int32)
    # the causal rule: key s is visible to the query at position p iff s <= p and s < ctx_len
    visible = (kpos[None, None, :] <= positions[:, :, None]) & (kpos[None, None, :] < ctx_lens[:, None, None])
    mask = visible[:, :, None, None, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    # zero V rows no query sees: slots past ctx_len may hold anything, NaN included, and 0 * NaN would leak
    v = jnp.where((jnp.arange(v.shape[1]) < ctx_lens[:, None])[:, :, None, None], v, 0.0)
    return jnp.einsum("btkgs,bskd->btkgd", p / jnp.where(denom > 0, denom, 1.0), v, precision=_HI)


def _gather(pages: jax.Array, scales: jax.Array | None, block_tables: jax.Array) -> jax.Array:
    """pages [P, ps, *rest], block_tables [B, M] -> [B, M * ps, *rest] f32 (dequantized)."""
    x = _dequant(pages[block_tables], None if scales is None else scales[block_tables])
    b, m, ps = x.shape[:3]
    return x.reshape(b, m * ps, *x.shape[3:])


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale"))
def prefill_mla_dense(q: jax.Array, pages: jax.Array, block_tables: jax.Array, positions: jax.Array,
                      ctx_lens: jax.Array, scales: jax.Array | None = None, *, kv_lora_rank: int,
                      softmax_scale: float) -> jax.Array:
    """Absorbed MLA prefill, dense (the oracle). Shapes in the module docstring; -> [B, T, N, kv_lora_rank] f32."""
    if q.shape[-1] != pages.shape[-1] or not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"q {q.shape}, pages {pages.shape}, kv_lora_rank {kv_lora_rank}")
    c = _gather(pages, scales, block_tables)[:, :, None]  # [B, S, 1, Dl]: one latent "kv head"
    out = _dense(_grouped(q, 1), c, c[..., :kv_lora_rank], positions, ctx_lens, softmax_scale)
    return out[:, :, 0]


@functools.partial(jax.jit, static_argnames=("softmax_scale",))
def prefill_gqa_dense(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                      positions: jax.Array, ctx_lens: jax.Array, k_scales: jax.Array | None = None,
                      v_scales: jax.Array | None = None, *, softmax_scale: float) -> jax.Array:
    """GQA prefill, dense (the oracle). Shapes in the module docstring; -> [B, T, Hq, D] f32."""
    if k_pages.shape != v_pages.shape or q.shape[-1] != k_pages.shape[-1] or q.shape[2] % k_pages.shape[2]:
        raise ValueError(f"q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    k = _gather(k_pages, k_scales, block_tables)
    v = _gather(v_pages, v_scales, block_tables)
    out = _dense(_grouped(q, k_pages.shape[2]), k, v, positions, ctx_lens, softmax_scale)
    return out.reshape(q.shape)
