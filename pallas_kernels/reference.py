"""Plain-jnp references for the INT4 matmul and the grouped MoE matmul: dequantize to f32, then dot.

They use `jaxserve.quant.formats.dequantize` (itself checked bit-exactly against the NumPy HF layouts in
`jaxserve.quant.hf_formats`) and f32 operands throughout, so the kernels' only extra error is bf16 activations
and the kernels' own summation order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.quant.formats import dequantize


def int4_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] @ dequant(int4 w [K//2, N] uint8, scale [K//g, N] bf16) -> [M, N] f32."""
    return jnp.dot(x.astype(jnp.float32), dequantize(w, scale, "int4"), precision=jax.lax.Precision.HIGHEST)


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
