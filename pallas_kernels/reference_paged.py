"""Plain-jnp references for paged decode attention (one query token per sequence), in float32, and the derived
per-element bound of FP8 quantization's effect on the output (fp8_error_bound, numpy) that the kernel tests use.

Gather pages through the block table, dequantize (x * per-token scale), masked softmax, weighted sum.

FP8 bound (derived, per output element). Let e[t, d] = |k[t, d] - k8[t, d]| be the actual quantization error,
delta[t] = softmax_scale * sum_d |q[d]| e[t, d] the logit error, D = max over valid t. softmax(l + eps) /
softmax(l) lies in [exp(-2D), exp(2D)], so sum_t |p8[t] - p[t]| <= exp(2D) - 1 and, per output dim d,
    |o8[d] - o[d]| <= (exp(2D) - 1) * max_t |v8[t, d]| + max_t |v8[t, d] - v[t, d]|.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _gather(pages: jax.Array, scales: jax.Array | None, block_tables: jax.Array) -> jax.Array:
    """pages [P, ps, *rest], scales [P, ps, *rest[:-1]] | None, block_tables [B, M] -> [B, M*ps, *rest] f32."""
    x = pages[block_tables].astype(jnp.float32)  # [B, M, ps, ...]
    if scales is not None:
        x = x * scales[block_tables].astype(jnp.float32)[..., None]
    b, m, ps = x.shape[:3]
    return x.reshape(b, m * ps, *x.shape[3:])


def _length_mask(lengths: jax.Array, t: int) -> jax.Array:
    return jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]


def _masked_softmax_av(logits: jax.Array, mask: jax.Array, v: jax.Array, spec: str) -> jax.Array:
    """logits [B, ..., T] f32, mask broadcastable; rows with no valid token give 0, not NaN."""
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum(spec, p, v, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale"))
def paged_mla_reference(q: jax.Array, pages: jax.Array, block_tables: jax.Array, lengths: jax.Array,
                        scales: jax.Array | None = None, *, kv_lora_rank: int, softmax_scale: float) -> jax.Array:
    """Absorbed MLA decode: MQA over the latent.

    q [B, H, latent_dim]; pages [P, ps, latent_dim] bf16|f8; scales [P, ps] f32 | None;
    block_tables [B, M] int32; lengths [B] int32. Returns [B, H, kv_lora_rank] f32.
    """
    c = _gather(pages, scales, block_tables)  # [B, T, Dl]
    logits = jnp.einsum("bhd,btd->bht", q.astype(jnp.float32), c, precision=jax.lax.Precision.HIGHEST)
    mask = _length_mask(lengths, c.shape[1])[:, None, :]
    return _masked_softmax_av(logits * softmax_scale, mask, c[..., :kv_lora_rank], "bht,btd->bhd")


@functools.partial(jax.jit, static_argnames=("softmax_scale",))
def paged_gqa_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                        lengths: jax.Array, k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                        *, softmax_scale: float) -> jax.Array:
    """GQA decode. q [B, Hq, D]; k/v_pages [P, ps, Hkv, D]; k/v_scales [P, ps, Hkv] | None. Returns [B, Hq, D] f32."""
    k = _gather(k_pages, k_scales, block_tables)  # [B, T, Hkv, D]
    v = _gather(v_pages, v_scales, block_tables)
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    logits = jnp.einsum("bkgd,btkd->bkgt", qg, k, precision=jax.lax.Precision.HIGHEST)
    mask = _length_mask(lengths, k.shape[1])[:, None, None, :]
    out = _masked_softmax_av(logits * softmax_scale, mask, v, "bkgt,btkd->bkgd")
    return out.reshape(b, hq, d)


def fp8_error_bound(q: np.ndarray, k: np.ndarray, k8: np.ndarray, v: np.ndarray, v8: np.ndarray,
                    lengths: list[int], softmax_scale: float) -> np.ndarray:
    """Per-element bound of |attn(q, k8, v8) - attn(q, k, v)| (see the module docstring).

    q [B, Hkv, G, Dk]; k, k8 [B, T, Hkv, Dk] and v, v8 [B, T, Hkv, Dv] f32 (exact and dequantized, gathered).
    Returns [B, Hkv, G, Dv] f64 (0 for an empty row).
    """
    out = []
    for b, n in enumerate(lengths):
        if n == 0:
            out.append(np.zeros((q.shape[1], q.shape[2], v.shape[-1])))
            continue
        e_k = np.abs(k[b, :n] - k8[b, :n])  # [T, Hkv, Dk]
        delta = softmax_scale * np.einsum("kgd,tkd->kgt", np.abs(q[b]), e_k)
        dmax = delta.max(-1)  # [Hkv, G]
        vmax = np.abs(v8[b, :n]).max(0)  # [Hkv, Dv]
        evmax = np.abs(v8[b, :n] - v[b, :n]).max(0)
        out.append(np.expm1(2 * dmax)[..., None] * vmax[:, None, :] + evmax[:, None, :])
    return np.stack(out)


def copy_pages_reference(pool: jax.Array, chunk: jax.Array, page_ids: jax.Array) -> jax.Array:
    """pool [L, P, ...] with pool[:, page_ids[i]] = chunk[:, i] for each i with 0 <= page_ids[i] < P (others
    skipped); chunk [L, n, ...] (the oracle of `page_copy_tpu.copy_pages_tpu`)."""
    ids = jnp.where(page_ids < 0, pool.shape[1], page_ids)  # negative ids would wrap, not drop
    return jnp.asarray(pool).at[:, ids].set(chunk, mode="drop")
