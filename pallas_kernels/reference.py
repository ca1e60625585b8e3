"""Plain-jnp references for the INT4 matmul and the grouped MoE matmul: dequantize to f32, then dot.

The dequantization is written here (pallas_kernels imports nothing from jaxserve) for the two runtime formats
of `jaxserve.quant.formats`, and tests/test_int4_matmul.py checks it equals `jaxserve.quant.formats.dequantize`
bit-exactly. Operands are f32 throughout, so the kernels' only extra error is bf16 activations and the kernels'
own summation order.

- int4: `w [..., K//2, N] uint8`, byte [j, n] holds k = 2j in the low nibble and k = 2j + 1 in the high one,
  nibble = q + 8; `scale [..., K//g, N] bf16`; W[k, n] = (nib(k, n) - 8) * scale[k // g, n].
- fp8: `w [..., K, N] float8_e4m3fn`, `scale [..., ceil(K/128), ceil(N/128)] f32`;
  W[k, n] = w[k, n] * scale[k // 128, n // 128].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_BLOCK = 128


def dequantize_int4(w: jax.Array, scale: jax.Array) -> jax.Array:
    """int4 w [..., K//2, N] uint8 + scale [..., K//g, N] bf16 -> W [..., K, N] f32."""
    *lead, half, n = w.shape
    g = 2 * half // scale.shape[-2]
    b = w.astype(jnp.int32)
    q = jnp.stack([(b & 0xF) - 8, (b >> 4) - 8], axis=-2).reshape(*lead, 2 * half, n)  # low nibble first
    return q.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), g, axis=-2)


def dequantize_fp8(w: jax.Array, scale: jax.Array) -> jax.Array:
    """fp8 w [..., K, N] float8_e4m3fn + scale [..., ceil(K/128), ceil(N/128)] f32 -> W [..., K, N] f32."""
    k, n = w.shape[-2:]
    full = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)
    return w.astype(jnp.float32) * full[..., :k, :n]  # edge tiles are partial


def dequantize(w: jax.Array, scale: jax.Array | None, fmt: str) -> jax.Array:
    """Runtime `(w, scale)` in `fmt` ("int4" | "fp8" | "bf16" | "f32") -> f32 [..., K, N]."""
    if fmt == "int4":
        return dequantize_int4(w, scale)
    if fmt == "fp8":
        return dequantize_fp8(w, scale)
    if fmt in ("bf16", "f32"):
        return w.astype(jnp.float32)
    raise ValueError(f"unknown weight format {fmt!r}")


def int4_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] @ dequant(int4 w [K//2, N] uint8, scale [K//g, N] bf16) -> [M, N] f32."""
    return jnp.dot(x.astype(jnp.float32), dequantize_int4(w, scale), precision=jax.lax.Precision.HIGHEST)


def gmm_reference(x: jax.Array, w: jax.Array, scale: jax.Array | None, group_sizes: jax.Array,
                  fmt: str) -> jax.Array:
    """Grouped matmul for rows sorted by group: x [M, K], w [E, ...] in `fmt`, group_sizes [E] int32 -> [M, N] f32.

    Row r belongs to the group g with cumsum(group_sizes)[g-1] <= r < cumsum(group_sizes)[g]; rows past
    sum(group_sizes) are 0.
    """
    wf = dequantize(w, scale, fmt)  # [E, K, N] f32
    out = jax.lax.ragged_dot(x.astype(jnp.float32), wf, group_sizes.astype(jnp.int32),
                             precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    rows = jnp.arange(x.shape[0])[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, 0.0)  # explicit: do not rely on ragged_dot's tail
