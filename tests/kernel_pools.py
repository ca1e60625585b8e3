"""Test helper: one layer's pages placed in a multi-layer pool stored as bits, the form the engine hands the GPU
(Triton) attention kernels (the whole pool + the layer)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

LAYER, LAYERS = 2, 3  # a non-zero layer of a 3-layer pool
_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float8_e4m3fn): jnp.uint8}


def in_pool(x: jax.Array | None) -> jax.Array | None:
    """One layer's pages (or scales) [...] placed at LAYER of a [LAYERS, ...] pool whose other layers are NaN;
    bf16 / fp8 pages as the engine's pool stores them (bits: uint16 / uint8), f32 (scales, f32 pages) as is."""
    if x is None:
        return None
    x = jnp.asarray(x)
    pool = jnp.full((LAYERS, *x.shape), jnp.nan, x.dtype).at[LAYER].set(x)
    bits = _BITS.get(jnp.dtype(x.dtype))
    return pool if bits is None else jax.lax.bitcast_convert_type(pool, bits)
