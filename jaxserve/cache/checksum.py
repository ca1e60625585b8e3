"""Per-page checksums of a page pool, computed on the device: what the prefill and decode sides of a KV transfer
between processes compare (`engine.kv_transfer`), since a generation tag witnesses ownership, not contents.

Each field's bits are read as uint32 words (uint8 / uint16 storage widened, f32 scales bitcast), and each page's
words are summed with odd position weights, modulo 2^32: changing any one byte changes its word by d * 256^k
(0 < |d| < 256), times an odd weight, which is never 0 mod 2^32, so one corrupted byte always changes the sum; the
weights also make swapped words visible.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.cache.pool import KVPages

CHECKED_FIELDS = ("latent", "latent_scale", "k", "v", "k_scale", "v_scale", "index_k", "index_k_scale")


def present_fields(pages: KVPages) -> tuple[str, ...]:
    """The page fields a pool (or a hand-off chunk) carries, in `CHECKED_FIELDS` order."""
    return tuple(f for f in CHECKED_FIELDS if getattr(pages, f) is not None)


def _words(x: jax.Array) -> jax.Array:
    """Bits of x as uint32 words, same shape: narrower integers widened, 4-byte values bitcast."""
    if x.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return x.astype(jnp.uint32)


def _field_sums(x: jax.Array, page_ids: jax.Array) -> jax.Array:
    """x [layers, pages, ...] -> [n] uint32: the weighted word sum of each page page_ids [n] names (all layers)."""
    w = _words(x[:, page_ids])
    w = jnp.moveaxis(w, 1, 0).reshape(page_ids.shape[0], -1)
    weights = jnp.arange(w.shape[1], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(w * weights[None, :], axis=1, dtype=jnp.uint32)


@jax.jit
def page_checksums(pages: KVPages, page_ids: jax.Array) -> jax.Array:
    """pages: a pool or a compact chunk; page_ids [n] int32 -> [n, F] uint32, one column per present field
    (`present_fields` order)."""
    ids = page_ids.astype(jnp.int32)
    return jnp.stack([_field_sums(getattr(pages, f), ids) for f in present_fields(pages)], axis=1)
