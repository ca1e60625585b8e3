"""Plain-jnp references for DSA decode, in float32: sparse absorbed-MLA attention (each row attends to its selected
token indices' latent rows, read by (page, slot) from one layer of the whole pool and dequantized (x * per-token
scale); negative or out-of-table indices are padding) and the lightning indexer's scores of every key slot of each
row's block table."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.reference_paged import _masked_softmax_av


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale"))
def sparse_mla_reference(q: jax.Array, pool: jax.Array, block_tables: jax.Array, indices: jax.Array,
                         scales: jax.Array | None = None, *, layer: int, kv_lora_rank: int,
                         softmax_scale: float) -> jax.Array:
    """q [B, H, latent_dim]; pool [L, P, ps, latent_dim] bf16|f8; scales [L, P, ps] f32 | None; block_tables
    [B, M] int32; indices [B, K] int32. Returns [B, H, kv_lora_rank] f32 (0 for a row with no valid index)."""
    ps = pool.shape[2]
    valid = (indices >= 0) & (indices < block_tables.shape[1] * ps)
    tok = jnp.where(valid, indices, 0)
    page = jnp.take_along_axis(block_tables, tok // ps, axis=1)  # [B, K]
    c = pool[layer][page, tok % ps].astype(jnp.float32)  # [B, K, Dl]
    if scales is not None:
        c = c * scales[layer][page, tok % ps][..., None]
    logits = jnp.einsum("bhd,bkd->bhk", q.astype(jnp.float32), c, precision=jax.lax.Precision.HIGHEST)
    return _masked_softmax_av(logits * softmax_scale, valid[:, None, :], c[..., :kv_lora_rank], "bhk,bkd->bhd")


@jax.jit
def index_scores_reference(q: jax.Array, w: jax.Array, pool: jax.Array, block_tables: jax.Array,
                           scales: jax.Array | None = None, *, layer: int | jax.Array) -> jax.Array:
    """q [B, nh, hd], w [B, nh]; pool [L, P, ps, hd] bf16|f8|f32; scales [L, P, ps] f32 | None; block_tables [B, M]
    int32. Returns [B, M * ps] f32: sum_h w[h] * relu(q[h] . (k * scale) / sqrt(hd)) of each slot's key."""
    b, m = block_tables.shape
    keys = pool[layer][block_tables].astype(jnp.float32).reshape(b, m * pool.shape[2], -1)  # [B, S, hd]
    if scales is not None:
        keys = keys * scales[layer][block_tables].reshape(b, -1)[..., None]
    s = jnp.einsum("bhd,bsd->bhs", q.astype(jnp.float32), keys, precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("bh,bhs->bs", w.astype(jnp.float32), jax.nn.relu(s * q.shape[-1] ** -0.5),
                      precision=jax.lax.Precision.HIGHEST)
