"""Matmuls over runtime weight formats (see jaxserve.quant.formats): dense `linear` and expert `grouped_linear`.

Dispatch, with the static choice `use_kernel` (Pallas) / `interpret` (run Pallas kernels in interpret mode,
for CPU tests) / `backend` (the kernels' tiling: "gpu" Triton, "tpu" Mosaic; see the kernel headers):

| fmt        | use_kernel=False (XLA)                          | use_kernel=True (Pallas)                              |
|------------|-------------------------------------------------|-------------------------------------------------------|
| bf16, f32  | jnp.matmul / expert-tile loop (below)          | same (no kernel needed)                               |
| fp8        | dequantize to x.dtype in XLA, matmul / tiles    | moe_gmm fp8 (linear: one group); K % 128 != 0 -> XLA  |
| int4       | unpack + dequantize in XLA, matmul / tiles      | int4_matmul (linear) / moe_gmm int4 (grouped)         |

The XLA paths materialize the dequantized weight (a fallback for CPU and small models); the kernel paths read
the packed weight and never write a dequantized copy to HBM. All paths accumulate in f32 and return x.dtype.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.errors import ConfigError
from jaxserve.quant.formats import FP8_BLOCK, check_fmt, dequantize
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.moe_gmm import moe_gmm, tile_layout


def _dense_weight(w: jax.Array, scale: jax.Array | None, fmt: str, dtype: jnp.dtype) -> jax.Array:
    """The weight as a dense array in the dot's operand dtype (XLA path)."""
    return w if fmt in ("bf16", "f32") else dequantize(w, scale, fmt).astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "use_kernel", "interpret", "backend"))
def linear(x: jax.Array, w: jax.Array, scale: jax.Array | None, fmt: str, *, use_kernel: bool = False,
           interpret: bool = False, backend: str = "gpu") -> jax.Array:
    """x [..., K] bf16/f32 @ W [K, N] in `fmt` -> [..., N] x.dtype (f32 accumulation)."""
    check_fmt(fmt)
    k = x.shape[-1]
    k_w = 2 * w.shape[0] if fmt == "int4" else w.shape[0]
    if w.ndim != 2 or k_w != k:
        raise ConfigError(f"linear: x {x.shape} does not match {fmt} weight {w.shape}", value=tuple(w.shape),
                          param="w")
    x2 = x.reshape(-1, k)
    if use_kernel and fmt == "int4":
        out = int4_matmul(x2, w, scale, backend=backend, interpret=interpret)
    elif use_kernel and fmt == "fp8" and k % FP8_BLOCK == 0:
        # a dense layer is a grouped matmul with a single group holding every row
        group_sizes = jnp.full((1,), x2.shape[0], jnp.int32)
        out = moe_gmm(x2, w[None], scale[None], group_sizes, fmt="fp8", backend=backend, interpret=interpret)
    else:
        wd = _dense_weight(w, scale, fmt, x.dtype)
        out = _matmul_f32(x2, wd)
    return out.astype(x.dtype).reshape(*x.shape[:-1], -1)


# XLA:GPU's DotStrengthReduction turns a vector-matrix dot of (N + 1) * K under this many elements into a multiply
# and a reduce (xla/service/gpu/transforms/dot_strength_reduction.cc)
XLA_GPU_DOT_TO_REDUCE_ELEMENTS = 10_000_000


def _matmul_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] f32 (f32 accumulation); one row under XLA's strength-reduction size is
    computed as two on GPU (`one_row_as_two`: Kimi's q_b at c = 1 wrote and read 9.4 MB a layer)."""
    dot = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)  # noqa: E731
    k, n = w.shape
    if x.shape[0] != 1 or (n + 1) * k >= XLA_GPU_DOT_TO_REDUCE_ELEMENTS:
        return dot(x, w)
    return one_row_as_two(dot, x, w)


def one_row_as_two(f: Callable[..., jax.Array], x: jax.Array, *rest: jax.Array) -> jax.Array:
    """f(x, *rest) for x [1, ...] whose rows are independent in f. On GPU x is padded to two rows and row 0 of f's
    result kept: XLA:GPU strength-reduces a one-row (vector-matrix) dot into a multiply and a reduce, and unless
    they fuse the f32 product of the whole weight is written to HBM and read back; a 2-row dot stays a GEMM that
    reads the weight once in its stored dtype. Other platforms run f(x, *rest) as it is (CPU numerics unchanged)."""
    def padded(a: jax.Array, *r: jax.Array) -> jax.Array:
        return f(jnp.pad(a, ((0, 1),) + ((0, 0),) * (a.ndim - 1)), *r)[:1]

    return jax.lax.platform_dependent(x, *rest, cuda=padded, default=f)


@functools.partial(jax.jit, static_argnames=("fmt", "use_kernel", "interpret", "backend"))
def grouped_linear(x_sorted: jax.Array, w: jax.Array, scale: jax.Array | None, group_sizes: jax.Array, fmt: str,
                   *, use_kernel: bool = False, interpret: bool = False, backend: str = "gpu",
                   rows: jax.Array | None = None) -> jax.Array:
    """Expert-sorted x [M, K] bf16/f32, expert weights W [E, K, N] in `fmt`, group_sizes [E] int32 -> [M, N].

    Row r uses expert g with cumsum(group_sizes)[g-1] <= r < cumsum(group_sizes)[g]; empty groups are allowed;
    rows at or past sum(group_sizes) (which must be <= M) are 0. Output dtype x.dtype, f32 accumulation.
    rows [M] int32 (optional): sorted row r is x_sorted[rows[r]] (the kernel reads it in place; XLA gathers it).
    """
    check_fmt(fmt)
    k = x_sorted.shape[1]
    k_w = 2 * w.shape[1] if fmt == "int4" else w.shape[1]
    if w.ndim != 3 or k_w != k or group_sizes.shape != (w.shape[0],):
        raise ConfigError(f"grouped_linear: x {x_sorted.shape}, group_sizes {group_sizes.shape} do not match "
                          f"{fmt} expert weight {w.shape}", value=tuple(w.shape), param="w")
    if use_kernel and (fmt == "int4" or (fmt == "fp8" and k % FP8_BLOCK == 0)):
        return moe_gmm(x_sorted, w, scale, group_sizes, fmt=fmt, backend=backend, interpret=interpret, rows=rows)
    return _grouped_tiles(x_sorted if rows is None else x_sorted[rows], w, scale, group_sizes, fmt)


def _bits(a: jax.Array, live: jax.Array) -> jax.Array:
    """A float array smaller than 32 bits as its unsigned-integer bit pattern (others unchanged); `live` (a traced
    True) is selected on in the same pass, so the view is not made before `live` is known."""
    if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4:
        bits = jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16}[a.dtype.itemsize])
        return jnp.where(live, bits, jnp.zeros((), bits.dtype))
    return a


def _unbits(a: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)


XLA_MIN_TILE_ROWS = 16  # rows per expert tile on the XLA path at decode sizes: small groups waste little padding
XLA_MAX_TILE_ROWS = 128  # ... and the cap at prefill sizes, where each loop trip's fixed cost is worth amortizing


def xla_tile_rows(m: int, experts: int) -> int:
    """Rows per tile for M sorted rows over E experts: the power of two at or below the mean group (M / E),
    clamped to [XLA_MIN_TILE_ROWS, XLA_MAX_TILE_ROWS] -> int. A static choice: M and E are shapes."""
    mean = max(1, m // max(1, experts))
    return min(XLA_MAX_TILE_ROWS, max(XLA_MIN_TILE_ROWS, 1 << (mean.bit_length() - 1)))


def _grouped_tiles(x: jax.Array, w: jax.Array, scale: jax.Array | None, group_sizes: jax.Array, fmt: str
                   ) -> jax.Array:
    """The XLA grouped matmul: each group's rows in whole tiles of `xla_tile_rows` (as moe_gmm lays them out), a
    sequential loop over the used tiles only, each reading (and dequantizing) only its own expert's weight and
    writing its rows straight into the [M, N] output.

    XLA:CPU lowers lax.ragged_dot densely (every row against every expert: E times the work and an [M, E, K]
    temporary). Here the trip count is the number of used tiles (a traced value: work follows the routed pairs,
    not the M / tile + E worst case the static shape allows), and the only temporaries are one tile and the
    output: no [tiles, tile rows, N] stack, which at Kimi's decode shapes (416 tiles x 16 x 7168 f32, 190 MB a
    projection) was the bulk of the compiled decode program's temporaries.
    """
    m, _ = x.shape
    n = w.shape[2]
    rows = xla_tile_rows(m, w.shape[0])
    layout = tile_layout(group_sizes, m, rows)
    # used tiles come first: tile_group is -1 only past the last group's padded end
    n_used = jnp.sum(layout.tile_group >= 0)
    # the loop slices one expert out of integer bits: XLA:CPU upcasts a bf16/fp8 dynamic-slice to f32 and then
    # hoists that convert of the whole [E, ...] stack out of the loop (88 MB a projection for Kimi's INT4 scales,
    # the whole FP8 expert stack in prefill)
    # ... and the bit views depend on this layer's routing (a predicate XLA cannot fold), so each is made when its
    # layer runs: made from the weights alone, XLA:CPU schedules every layer's view at the program's start
    live = n_used >= 0
    w_bits = _bits(w, live)
    s_bits = None if scale is None else _bits(scale, live)

    def tile(t: jax.Array, out: jax.Array) -> jax.Array:
        lo = t * rows
        src = jax.lax.dynamic_slice_in_dim(layout.row_src, lo, rows)
        valid = jax.lax.dynamic_slice_in_dim(layout.row_valid, lo, rows)
        xt = jnp.where(valid[:, None], x[src], 0).astype(x.dtype)
        e = layout.tile_group[t]
        we = _dense_weight(_unbits(w_bits[e], w.dtype), None if scale is None else _unbits(s_bits[e], scale.dtype),
                           fmt, x.dtype)
        yt = jnp.matmul(xt, we, preferred_element_type=jnp.float32)
        # a padded position's output row is the sorted row it was read from; padding rows write nowhere
        return out.at[jnp.where(valid, src, m)].set(yt.astype(out.dtype), mode="drop")

    return jax.lax.fori_loop(0, n_used, tile, jnp.zeros((m, n), x.dtype))