"""Matmuls over runtime weight formats (see jaxserve.quant.formats): dense `linear` and expert `grouped_linear`.

Dispatch, with the static choice `use_kernel` (Pallas) / `interpret` (run Pallas kernels in interpret mode,
for CPU tests):

| fmt        | use_kernel=False (XLA)                          | use_kernel=True (Pallas)                              |
|------------|-------------------------------------------------|-------------------------------------------------------|
| bf16, f32  | jnp.matmul / lax.ragged_dot                     | same (no kernel needed)                               |
| fp8        | dequantize to x.dtype in XLA, matmul/ragged_dot | moe_gmm fp8 (linear: one group); K % 128 != 0 -> XLA  |
| int4       | unpack + dequantize in XLA, matmul/ragged_dot   | int4_matmul (linear) / moe_gmm int4 (grouped)         |

The XLA paths materialize the dequantized weight (a fallback for CPU and small models); the kernel paths read
the packed weight and never write a dequantized copy to HBM. All paths accumulate in f32 and return x.dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.errors import ConfigError
from jaxserve.quant.formats import FP8_BLOCK, check_fmt, dequantize
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.moe_gmm import moe_gmm


def _dense_weight(w: jax.Array, scale: jax.Array | None, fmt: str, dtype: jnp.dtype) -> jax.Array:
    """The weight as a dense array in the dot's operand dtype (XLA path)."""
    return w if fmt in ("bf16", "f32") else dequantize(w, scale, fmt).astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "use_kernel", "interpret"))
def linear(x: jax.Array, w: jax.Array, scale: jax.Array | None, fmt: str, *, use_kernel: bool = False,
           interpret: bool = False) -> jax.Array:
    """x [..., K] bf16/f32 @ W [K, N] in `fmt` -> [..., N] x.dtype (f32 accumulation)."""
    check_fmt(fmt)
    k = x.shape[-1]
    k_w = 2 * w.shape[0] if fmt == "int4" else w.shape[0]
    if w.ndim != 2 or k_w != k:
        raise ConfigError(f"linear: x {x.shape} does not match {fmt} weight {w.shape}", value=tuple(w.shape),
                          param="w")
    x2 = x.reshape(-1, k)
    if use_kernel and fmt == "int4":
        out = int4_matmul(x2, w, scale, interpret=interpret)
    elif use_kernel and fmt == "fp8" and k % FP8_BLOCK == 0:
        # a dense layer is a grouped matmul with a single group holding every row
        group_sizes = jnp.full((1,), x2.shape[0], jnp.int32)
        out = moe_gmm(x2, w[None], scale[None], group_sizes, fmt="fp8", interpret=interpret)
    else:
        wd = _dense_weight(w, scale, fmt, x.dtype)
        out = jnp.matmul(x2, wd, preferred_element_type=jnp.float32)
    return out.astype(x.dtype).reshape(*x.shape[:-1], -1)


@functools.partial(jax.jit, static_argnames=("fmt", "use_kernel", "interpret"))
def grouped_linear(x_sorted: jax.Array, w: jax.Array, scale: jax.Array | None, group_sizes: jax.Array, fmt: str,
                   *, use_kernel: bool = False, interpret: bool = False) -> jax.Array:
    """Expert-sorted x [M, K] bf16/f32, expert weights W [E, K, N] in `fmt`, group_sizes [E] int32 -> [M, N].

    Row r uses expert g with cumsum(group_sizes)[g-1] <= r < cumsum(group_sizes)[g]; empty groups are allowed;
    rows at or past sum(group_sizes) (which must be <= M) are 0. Output dtype x.dtype, f32 accumulation.
    """
    check_fmt(fmt)
    m, k = x_sorted.shape
    k_w = 2 * w.shape[1] if fmt == "int4" else w.shape[1]
    if w.ndim != 3 or k_w != k or group_sizes.shape != (w.shape[0],):
        raise ConfigError(f"grouped_linear: x {x_sorted.shape}, group_sizes {group_sizes.shape} do not match "
                          f"{fmt} expert weight {w.shape}", value=tuple(w.shape), param="w")
    if use_kernel and (fmt == "int4" or (fmt == "fp8" and k % FP8_BLOCK == 0)):
        return moe_gmm(x_sorted, w, scale, group_sizes, fmt=fmt, interpret=interpret)
    wd = _dense_weight(w, scale, fmt, x_sorted.dtype)
    dtype = jnp.promote_types(x_sorted.dtype, wd.dtype)  # ragged_dot wants one operand dtype (bf16 x, f32 w)
    out = jax.lax.ragged_dot(x_sorted.astype(dtype), wd.astype(dtype), group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    rows = jnp.arange(m)[:, None]
    # explicit zero tail: the contract must not depend on a backend's ragged_dot padding behaviour
    return jnp.where(rows < jnp.sum(group_sizes), out, 0.0).astype(x_sorted.dtype)
