"""W4A16 matmul: activations [M, K] bf16 x packed INT4 weights [K//2, N] uint8 + group scales [K//g, N] bf16.

The packed weight is read from HBM as bytes and expanded only in registers/VMEM, one scale group at a time:

- The wrapper splits the (small) activations into even and odd k, grouped: `xs [2, K//g, M, g//2]`, where
  `xs[p, gi, m, j] = x[m, gi*g + 2j + p]`. Then, for byte row j of group gi, the low nibble pairs with
  `xs[0, gi]` and the high nibble with `xs[1, gi]`, so the kernel never interleaves nibbles (no value reshape).
- Per group: `acc += (xs[0,gi] @ (lo - 8) + xs[1,gi] @ (hi - 8)) * scale[gi]`. The nibble values are exact in
  bf16 and the scale is constant over the group's K, so it is applied once to the f32 partial product
  [bm, bn] instead of to the weight tile (fewer multiplies, and no bf16 rounding of q * scale).
- Grid (M blocks, N blocks); the K loop is a `lax.fori_loop` over groups inside the kernel, so each output
  tile is written once (needed on GPU, where grid programs run in parallel).

Checked here: legacy `interpret=True` on CPU against `pallas_kernels.reference` (tests/test_int4_matmul.py).
Not checked here (no accelerator in this session): Triton lowering on GPU (block shapes are powers of two for
every loaded tile: [bm, g//2], [g//2, bn], [1, bn]; `jnp.dot` K-dim g//2 = 16 or 64 meets Triton's >= 16) and
Mosaic lowering on TPU (dynamic sublane slices of a uint8 tile with g//2 = 16 rows may need g = 64+ there),
and any performance: block sizes are plausible defaults, not tuned.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl



class KernelShapeError(ValueError):
    """Operands a kernel cannot take: `value` is the bad value, `param` names the operand."""

    def __init__(self, message: str, *, value: object = None, param: str | None = None) -> None:
        super().__init__(message)
        self.value = value
        self.param = param


@dataclass(frozen=True)
class Int4Blocks:
    """Tile sizes: block_m rows of activations x block_n output columns per grid program."""

    block_m: int
    block_n: int


def choose_blocks(m: int, n: int) -> Int4Blocks:
    """Decode (m <= 16) uses 16-row tiles (padded), prefill up to 128; block_n is the largest of 256..16
    dividing n, else 128 with a partial edge tile."""
    block_m = next(b for b in (16, 32, 64, 128) if m <= b) if m <= 128 else 128
    block_n = next((b for b in (256, 128, 64, 32, 16) if n % b == 0), 128)
    return Int4Blocks(block_m, block_n)


def split_even_odd(x: jax.Array, group_size: int) -> jax.Array:
    """[M, K] -> [2, K//g, M, g//2]: xs[p, gi, m, j] = x[m, gi*g + 2j + p] (activations only, cheap)."""
    m, k = x.shape
    return x.reshape(m, k // group_size, group_size // 2, 2).transpose(3, 1, 0, 2)


def accumulate_int4_groups(x_ref, w_ref, s_ref, w_prefix: tuple, n_groups: int, half: int,
                           acc: jax.Array) -> jax.Array:
    """acc [bm, bn] f32 += x_tile @ dequant(w_tile), looping over the K groups.

    x_ref [2, G, bm, half] (even/odd split activations), w_ref [*prefix, G*half, bn] uint8,
    s_ref [*prefix, G, bn] bf16; `w_prefix` indexes leading axes of w_ref/s_ref (the expert for the GMM).
    """
    def body(gi, acc):
        packed = w_ref[(*w_prefix, pl.ds(gi * half, half), slice(None))].astype(jnp.int32)  # [half, bn]
        lo = ((packed & 0xF) - 8).astype(x_ref.dtype)  # k = 2j, exact in bf16
        hi = ((packed >> 4) - 8).astype(x_ref.dtype)  # k = 2j + 1
        part = (jnp.dot(x_ref[0, gi], lo, preferred_element_type=jnp.float32)
                + jnp.dot(x_ref[1, gi], hi, preferred_element_type=jnp.float32))
        s = s_ref[(*w_prefix, pl.ds(gi, 1), slice(None))].astype(jnp.float32)  # [1, bn]
        return acc + part * s

    return jax.lax.fori_loop(0, n_groups, body, acc)


def _int4_matmul_kernel(x_ref, w_ref, s_ref, o_ref, *, n_groups: int, half: int) -> None:
    """One (M block, N block) output tile: x_ref [2, G, bm, half], w_ref [K//2, bn], s_ref [G, bn]."""
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = accumulate_int4_groups(x_ref, w_ref, s_ref, (), n_groups, half, acc).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def int4_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *, blocks: Int4Blocks | None = None,
                interpret: bool = False) -> jax.Array:
    """x [M, K] bf16 (or f32) @ int4 W -> [M, N] x.dtype, accumulating in f32.

    w [K//2, N] uint8 (even k low nibble, nibble = q + 8), scale [K//g, N] bf16 with g = K // scale.shape[0].
    """
    m, k = x.shape
    half_k, n = w.shape
    n_groups = scale.shape[0]
    if 2 * half_k != k or scale.shape[1] != n or k % n_groups or (k // n_groups) % 2:
        raise KernelShapeError(f"int4_matmul shapes do not match: x {x.shape}, w {w.shape}, scale {scale.shape}",
                          value=(tuple(x.shape), tuple(w.shape), tuple(scale.shape)), param="w")
    g = k // n_groups
    blocks = blocks or choose_blocks(m, n)
    bm, bn = blocks.block_m, blocks.block_n
    m_pad = pl.cdiv(m, bm) * bm
    xs = split_even_odd(jnp.pad(x, ((0, m_pad - m), (0, 0))), g)  # zero rows: padded outputs are sliced off
    kernel = functools.partial(_int4_matmul_kernel, n_groups=n_groups, half=g // 2)
    out = pl.pallas_call(
        kernel,
        grid=(m_pad // bm, pl.cdiv(n, bn)),
        in_specs=[
            pl.BlockSpec((2, n_groups, bm, g // 2), lambda i, j: (0, 0, i, 0)),
            pl.BlockSpec((half_k, bn), lambda i, j: (0, j)),
            pl.BlockSpec((n_groups, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
        interpret=interpret,
    )(xs, w, scale)
    return out[:m]
