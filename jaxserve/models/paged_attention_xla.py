"""Paged decode attention in plain XLA, length-bounded: a while loop over blocks of pages with an online softmax.

The loop runs ceil(live pages / block_pages) times, where live pages is the batch's longest context (a traced
value), so one compiled bucket costs what the batch's real context costs (1030 vs 2000 tokens differ), and the
program's temporaries are one block's: [B, block_pages * page_size, ...] f32, never [B, M * page_size, ...].

Pools come in as bit patterns (`KVLayout.storage_dtype`: uint8 for FP8, uint16 for BF16) with all layers, and
the layer is picked inside the gather: each block gathers its pages' bits and only then views them as values,
so no convert ever touches a pool (XLA:CPU converts a bf16 / float8 array to f32 before gathering from it), and
no layer slice of the pool is materialized as a loop operand. FP8 scales multiply the logits and the softmax
weights ([B, heads, block]) instead of the gathered values.

Rows with length 0 give 0. Page ids past a row's length (padding: the null page) are read and masked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.cache import KVLayout
from jaxserve.cache.pool import from_bits

# Tokens one loop iteration reads per row: 128 and 256 ran alike on the CPU host (16 rows x 2000 tokens: 1.8 ms a
# layer, vs 11-20 ms for gathering the padded context); the smaller block halves the working set.
BLOCK_TOKENS = 128
_HIGHEST = jax.lax.Precision.HIGHEST
_NEG = -1e30  # finite "minus infinity": a block with no valid token leaves the running max (and the sums) alone


def block_pages_for(page_size: int, max_pages: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Pages per loop iteration: block_tokens worth, at least 1, at most the block-table width."""
    return max(1, min(max_pages, block_tokens // page_size))


def _blocks(block_tables: jax.Array, lengths: jax.Array, page_size: int, block_pages: int
            ) -> tuple[jax.Array, jax.Array]:
    """(block tables padded to whole blocks [B, nb * block_pages] int32, trip count: blocks holding any live
    token of the batch, a traced int32 scalar)."""
    b, m = block_tables.shape
    nb = -(-m // block_pages)
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, nb * block_pages - m)))  # pad = null page 0
    live_pages = (jnp.max(lengths, initial=0) + page_size - 1) // page_size
    return bt, jnp.minimum((live_pages + block_pages - 1) // block_pages, nb).astype(jnp.int32)


def _online_step(carry: tuple, logits: jax.Array, valid: jax.Array, p_scale: jax.Array | None,
                 values: jax.Array, spec: str) -> tuple:
    """One block's online-softmax update. carry (m [..., 1], l [..., 1], acc [..., Dv]) f32; logits [..., t] f32;
    valid broadcastable to logits; p_scale (per-token value scale, broadcastable) | None; values [B, t, ...]."""
    m, l, acc = carry
    logits = jnp.where(valid, logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.where(valid, jnp.exp(logits - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1, keepdims=True)
    pv = p if p_scale is None else p * p_scale
    acc = acc * corr + jnp.einsum(spec, pv, values, precision=_HIGHEST)
    return m_new, l, acc


def _finish(l: jax.Array, acc: jax.Array) -> jax.Array:
    return acc / jnp.where(l > 0, l, 1.0)


@functools.partial(jax.jit, static_argnames=("layer", "layout", "kv_lora_rank", "softmax_scale", "block_pages"))
def mla_decode(q: jax.Array, latent: jax.Array, latent_scale: jax.Array | None, block_tables: jax.Array,
               lengths: jax.Array, *, layer: int, layout: KVLayout, kv_lora_rank: int, softmax_scale: float,
               block_pages: int | None = None) -> jax.Array:
    """Absorbed MLA decode (MQA over the latent) of one layer.

    q [B, N, r + dr] (any float, computed in f32); latent [L, P, ps, r + dr] bits (uint8 / uint16);
    latent_scale [L, P, ps] f32 | None (FP8); block_tables [B, M] int32; lengths [B] int32.
    -> [B, N, r] f32 (the attention-weighted latent; 0 for a row of length 0).
    """
    ps = layout.page_size
    bp = block_pages or block_pages_for(ps, block_tables.shape[1])
    bt, trips = _blocks(block_tables, lengths, ps, bp)
    b, n, _ = q.shape
    q = q.astype(jnp.float32)
    t = bp * ps

    def body(j: jax.Array, carry: tuple) -> tuple:
        ids = jax.lax.dynamic_slice_in_dim(bt, j * bp, bp, axis=1)  # [B, bp]
        # one block covers the table at short contexts, so the gathers were loop-invariant: hoisted out, XLA:CPU
        # fused the layer's KV write into them and copied the whole scale pool per layer (bench/spec_profile.py --ops)
        lat, lat_scale = jax.lax.optimization_barrier(((latent, latent_scale), j))[0]
        c = from_bits(lat[layer, ids], layout).astype(jnp.float32).reshape(b, t, -1)  # [B, t, r + dr]
        logits = jnp.einsum("bnd,btd->bnt", q, c, precision=_HIGHEST) * softmax_scale
        s = None
        if latent_scale is not None:
            s = lat_scale[layer, ids].reshape(b, 1, t)
            logits = logits * s
        pos = j * t + jnp.arange(t, dtype=jnp.int32)
        valid = (pos[None, :] < lengths[:, None])[:, None, :]
        # p @ all latent columns, sliced after the loop: slicing c here would copy the block
        return _online_step(carry, logits, valid, s, c, "bnt,btd->bnd")

    init = (jnp.full((b, n, 1), _NEG, jnp.float32), jnp.zeros((b, n, 1), jnp.float32),
            jnp.zeros((b, n, latent.shape[-1]), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, trips, body, init)
    return _finish(l, acc[..., :kv_lora_rank])


@functools.partial(jax.jit, static_argnames=("layer", "layout", "softmax_scale", "block_pages"))
def gqa_decode(q: jax.Array, k: jax.Array, v: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None,
               block_tables: jax.Array, lengths: jax.Array, *, layer: int, layout: KVLayout, softmax_scale: float,
               block_pages: int | None = None) -> jax.Array:
    """GQA decode of one layer. q [B, Hq, D]; k, v [L, P, ps, Hkv, D] bits; k/v_scale [L, P, ps, Hkv] f32 | None;
    block_tables [B, M] int32; lengths [B] int32. -> [B, Hq, D] f32 (0 for a row of length 0)."""
    ps = layout.page_size
    bp = block_pages or block_pages_for(ps, block_tables.shape[1])
    bt, trips = _blocks(block_tables, lengths, ps, bp)
    b, hq, d = q.shape
    hkv = k.shape[3]
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    t = bp * ps

    def body(j: jax.Array, carry: tuple) -> tuple:
        ids = jax.lax.dynamic_slice_in_dim(bt, j * bp, bp, axis=1)
        kb = from_bits(k[layer, ids], layout).astype(jnp.float32).reshape(b, t, hkv, d)
        vb = from_bits(v[layer, ids], layout).astype(jnp.float32).reshape(b, t, hkv, d)
        logits = jnp.einsum("bkgd,btkd->bkgt", qg, kb, precision=_HIGHEST) * softmax_scale
        vs = None
        if k_scale is not None:
            logits = logits * jnp.moveaxis(k_scale[layer, ids].reshape(b, t, hkv), 1, 2)[:, :, None, :]
            vs = jnp.moveaxis(v_scale[layer, ids].reshape(b, t, hkv), 1, 2)[:, :, None, :]
        pos = j * t + jnp.arange(t, dtype=jnp.int32)
        valid = (pos[None, :] < lengths[:, None])[:, None, None, :]
        return _online_step(carry, logits, valid, vs, vb, "bkgt,btkd->bkgd")

    g = hq // hkv
    init = (jnp.full((b, hkv, g, 1), _NEG, jnp.float32), jnp.zeros((b, hkv, g, 1), jnp.float32),
            jnp.zeros((b, hkv, g, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, trips, body, init)
    return _finish(l, acc).reshape(b, hq, d)
