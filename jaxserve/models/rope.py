"""Rotary position embeddings: default and YaRN frequencies (as transformers computes them), half-split rotation.

Interleaved checkpoints (DeepSeek-V3 / Kimi / GLM-5 MLA) are permuted to half-split order at conversion time,
so the model only ever applies the half-split (NeoX) rotation.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.config import RopeConfig, yarn_get_mscale


def inv_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """-> (inv_freq [dim // 2] f32, attention_factor multiplying cos and sin)."""
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    if rope.rope_type == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)
    orig = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def cos_sin(positions: jnp.ndarray, rope: RopeConfig, dim: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions [B, T] int32 -> cos, sin [B, T, dim // 2] f32 (already times the attention factor)."""
    inv, attention_factor = inv_frequencies(rope, dim)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Half-split rotation of the last dim. x [B, T, H, dim]; cos, sin [B, T, dim // 2]."""
    half = x.shape[-1] // 2
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def interleave_to_half_split(n: int) -> np.ndarray:
    """Row permutation taking interleaved pairs (x0,x1),(x2,x3).. to [evens | odds] order, for `n` rope dims."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
