"""Plain-jnp reference for sparse (DSA) absorbed-MLA decode attention, in float32: each row attends to its selected
token indices' latent rows, read by (page, slot) from one layer of the whole pool and dequantized (x * per-token
scale); negative or out-of-table indices are padding."""
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
