"""Grouped (MoE) matmul over expert-sorted tokens with INT4 or FP8 expert weights dequantized in the kernel.

x [M, K] bf16, rows sorted by expert; group_sizes [E] int32 (ragged, empty groups allowed, sum <= M; rows past
the sum give 0). Weights: int4 `w [E, K//2, N] uint8, scale [E, K//g, N] bf16` or fp8
`w [E, K, N] float8_e4m3fn, scale [E, ceil(K/128), ceil(N/128)] f32` (see jaxserve.quant.formats).

Approach (as vLLM's `moe_align_block_size`, simpler than megablox's shared tiles): in XLA, each group's rows
are copied into its own run of whole M-tiles (group sizes padded up to a multiple of block_m), and a small
metadata array `tile_group [T]` names each tile's expert (-1: unused tile, written as zeros). Every tile has
exactly one expert, so each output tile is written by exactly one grid program: no cross-program
accumulation, which GPU grids (parallel programs) need. T = cdiv(M, block_m) + min(E, M) bounds the tiles
statically (each non-empty group adds at most one partial tile). Afterwards rows are gathered back to the
input order. Only activations are moved in XLA; weights are read packed and dequantized per tile:
- int4: the same group loop as pallas_kernels.int4_matmul (even/odd activation split, scale on the f32 partial).
- fp8: per 128-row K block, `acc += (x_blk @ bf16(w_blk)) * scale[e, kb, nb]`; fp8 -> bf16 is exact and the
  block scale is constant over the [128, block_n] tile (block_n divides 128).

Checked here: legacy `interpret=True` on CPU vs pallas_kernels.reference.gmm_reference (tests/test_moe_gmm.py).
Not checked here (no accelerator): GPU Triton lowering and TPU Mosaic lowering, and speed. The expert is chosen
inside the kernel from the metadata input, so the weight BlockSpec spans all E experts (fine for Triton, whose
refs are pointers; on TPU that block would not fit VMEM and should become a scalar-prefetch index_map
`(tile_group[t], 0, j)`), and unused tiles still cost a grid step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.int4_matmul import KernelShapeError, accumulate_int4_groups, split_even_odd

FP8_BLOCK = 128


@dataclass(frozen=True)
class GmmBlocks:
    """Tile sizes: block_m rows (one expert per tile) x block_n output columns per grid program."""

    block_m: int
    block_n: int


def choose_gmm_blocks(m: int, n: int, num_groups: int) -> GmmBlocks:
    """block_m from the mean group size (16 for decode-sized groups, up to 64), block_n the largest of
    128..16 dividing n, else 128 with a partial edge tile; block_n <= 128 keeps one FP8 scale per tile."""
    mean = -(-m // max(num_groups, 1))
    block_m = next((b for b in (16, 32) if mean <= b), 64)
    block_n = next((b for b in (128, 64, 32, 16) if n % b == 0), 128)
    return GmmBlocks(block_m, block_n)


class TileLayout(NamedTuple):
    """Where each row goes: x_pad = x[row_src] masked by row_valid; y = y_pad[row_dst] masked by out_valid.

    A NamedTuple (immutable, and a pytree, so it can leave a jit)."""

    row_src: jax.Array  # [T*bm] int32: source row of each padded row
    row_valid: jax.Array  # [T*bm] bool: padded row holds a real token
    tile_group: jax.Array  # [T] int32: expert of each tile, -1 for unused tiles
    row_dst: jax.Array  # [M] int32: padded row of each input row
    out_valid: jax.Array  # [M] bool: input row lies inside sum(group_sizes)


def tile_layout(group_sizes: jax.Array, m: int, block_m: int) -> TileLayout:
    """Metadata (XLA, O(M + E)) putting each group's rows into whole tiles of block_m rows."""
    num_groups = group_sizes.shape[0]
    n_tiles = -(-m // block_m) + min(num_groups, m)
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    padded = -(-gs // block_m) * block_m
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded

    p = jnp.arange(n_tiles * block_m, dtype=jnp.int32)
    e_p = jnp.searchsorted(padded_ends, p, side="right").astype(jnp.int32)  # E means "past the last group"
    e_c = jnp.minimum(e_p, num_groups - 1)
    r = p - padded_starts[e_c]
    row_valid = (e_p < num_groups) & (r < gs[e_c])
    row_src = jnp.where(row_valid, starts[e_c] + r, 0)
    tile_first = p[::block_m]
    tile_group = jnp.where(tile_first < padded_ends[-1], e_c[::block_m], -1)

    i = jnp.arange(m, dtype=jnp.int32)
    e_i = jnp.minimum(jnp.searchsorted(ends, i, side="right").astype(jnp.int32), num_groups - 1)
    out_valid = i < ends[-1]
    row_dst = jnp.where(out_valid, padded_starts[e_i] + i - starts[e_i], 0)
    return TileLayout(row_src, row_valid, tile_group, row_dst, out_valid)


def _gmm_int4_kernel(meta_ref, x_ref, w_ref, s_ref, o_ref, *, n_groups: int, half: int) -> None:
    """meta_ref [T] int32, x_ref [2, G, bm, half], w_ref [E, K//2, bn] uint8, s_ref [E, G, bn] bf16."""
    e = meta_ref[pl.program_id(0)]

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(e >= 0)
    def _():
        acc = jnp.zeros(o_ref.shape, jnp.float32)
        o_ref[...] = accumulate_int4_groups(x_ref, w_ref, s_ref, (e,), n_groups, half, acc).astype(o_ref.dtype)


def _gmm_fp8_kernel(meta_ref, x_ref, w_ref, s_ref, o_ref, *, k_blocks: int) -> None:
    """meta_ref [T] int32, x_ref [bm, K], w_ref [E, K, bn] fp8, s_ref [E, K//128, 1] f32 (this tile's column)."""
    e = meta_ref[pl.program_id(0)]

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(e >= 0)
    def _():
        def body(kb, acc):
            wt = w_ref[e, pl.ds(kb * FP8_BLOCK, FP8_BLOCK), :].astype(x_ref.dtype)  # exact: e4m3 fits bf16
            part = jnp.dot(x_ref[:, pl.ds(kb * FP8_BLOCK, FP8_BLOCK)], wt, preferred_element_type=jnp.float32)
            return acc + part * s_ref[e, kb, 0]

        acc = jax.lax.fori_loop(0, k_blocks, body, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _check_shapes(x: jax.Array, w: jax.Array, scale: jax.Array, group_sizes: jax.Array, fmt: str) -> None:
    """Raises KernelShapeError naming the first inconsistent operand."""
    m, k = x.shape
    e = w.shape[0]
    if group_sizes.shape != (e,):
        raise KernelShapeError(f"group_sizes shape {group_sizes.shape} != ({e},)", value=tuple(group_sizes.shape),
                          param="group_sizes")
    if fmt == "int4":
        ok = (w.ndim == 3 and 2 * w.shape[1] == k and scale.shape[::2] == (e, w.shape[2])
              and scale.shape[1] > 0 and k % scale.shape[1] == 0 and (k // scale.shape[1]) % 2 == 0)
    elif fmt == "fp8":
        ok = (w.ndim == 3 and w.shape[1] == k and k % FP8_BLOCK == 0
              and scale.shape == (e, k // FP8_BLOCK, -(-w.shape[2] // FP8_BLOCK)))
    else:
        raise KernelShapeError(f"moe_gmm handles 'int4' and 'fp8' weights, not {fmt!r}", value=fmt, param="fmt")
    if not ok:
        raise KernelShapeError(f"moe_gmm {fmt} shapes do not match: x {x.shape}, w {w.shape}, scale {scale.shape}"
                          + (" (fp8 kernel needs K % 128 == 0)" if fmt == "fp8" else ""),
                          value=(tuple(x.shape), tuple(w.shape), tuple(scale.shape)), param="w")


@functools.partial(jax.jit, static_argnames=("fmt", "blocks", "interpret"))
def moe_gmm(x: jax.Array, w: jax.Array, scale: jax.Array, group_sizes: jax.Array, *, fmt: str,
            blocks: GmmBlocks | None = None, interpret: bool = False) -> jax.Array:
    """Expert-sorted x [M, K] bf16 (or f32) x expert weights in `fmt` ("int4" | "fp8") -> [M, N] x.dtype.

    Row r uses expert g where cumsum(group_sizes)[g-1] <= r < cumsum(group_sizes)[g]; rows past the sum are 0.
    Precondition (not checkable under jit): sum(group_sizes) <= M.
    """
    _check_shapes(x, w, scale, group_sizes, fmt)
    m, k = x.shape
    n_experts, _, n = w.shape
    blocks = blocks or choose_gmm_blocks(m, n, n_experts)
    bm, bn = blocks.block_m, blocks.block_n
    if fmt == "fp8" and FP8_BLOCK % bn:
        raise KernelShapeError(f"fp8 block_n {bn} must divide {FP8_BLOCK}", value=bn, param="blocks")
    layout = tile_layout(group_sizes, m, bm)
    n_tiles = layout.tile_group.shape[0]
    x_pad = jnp.where(layout.row_valid[:, None], x[layout.row_src], 0).astype(x.dtype)  # [T*bm, K]
    meta_spec = pl.BlockSpec((n_tiles,), lambda t, j: (0,))
    if fmt == "int4":
        n_groups = scale.shape[1]
        g = k // n_groups
        kernel = functools.partial(_gmm_int4_kernel, n_groups=n_groups, half=g // 2)
        operands = (split_even_odd(x_pad, g), w, scale)
        in_specs = [pl.BlockSpec((2, n_groups, bm, g // 2), lambda t, j: (0, 0, t, 0)),
                    pl.BlockSpec((n_experts, k // 2, bn), lambda t, j: (0, 0, j)),
                    pl.BlockSpec((n_experts, n_groups, bn), lambda t, j: (0, 0, j))]
    else:
        k_blocks = k // FP8_BLOCK
        kernel = functools.partial(_gmm_fp8_kernel, k_blocks=k_blocks)
        operands = (x_pad, w, scale.astype(jnp.float32))
        in_specs = [pl.BlockSpec((bm, k), lambda t, j: (t, 0)),
                    pl.BlockSpec((n_experts, k, bn), lambda t, j: (0, 0, j)),
                    # block of width 1 along the scale columns: block index = the 128-column tile of N block j
                    pl.BlockSpec((n_experts, k_blocks, 1), lambda t, j: (0, 0, (j * bn) // FP8_BLOCK))]
    y_pad = pl.pallas_call(
        kernel,
        grid=(n_tiles, pl.cdiv(n, bn)),
        in_specs=[meta_spec, *in_specs],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((n_tiles * bm, n), x.dtype),
        interpret=interpret,
    )(layout.tile_group, *operands)
    return jnp.where(layout.out_valid[:, None], y_pad[layout.row_dst], 0).astype(x.dtype)
