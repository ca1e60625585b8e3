"""Grouped (MoE) matmul over expert-sorted tokens with INT4 or FP8 expert weights dequantized in the kernel.

x [M, K] bf16, rows sorted by expert; group_sizes [E] int32 (ragged, empty groups allowed, sum <= M; rows past
the sum give 0). Weights: int4 `w [E, K//2, N] uint8, scale [E, K//g, N] bf16` or fp8
`w [E, K, N] float8_e4m3fn, scale [E, K//128, ceil(N/128)] f32` (the layouts of jaxserve.quant.formats).

Rows to tiles (as vLLM's `moe_align_block_size`): each group's rows go to its own run of whole M-tiles (group
sizes padded up to a multiple of block_m; `tile_layout`'s `row_src` names the row of x each tile row reads) and
`tile_group [T]` names each tile's expert (-1: unused tile). Every tile has exactly one expert, so each output
tile has exactly one writer: no cross-program accumulation. T = cdiv(M, block_m) + min(E, M) bounds the tiles
statically; used tiles come first (the gpu tiling). With `rows` the sorted rows are named in the caller's tokens (row r is
x[rows[r]]), so no sorted copy of x is made either. Rows are gathered back to the sorted order afterwards (M rows
of the padded output). Weights are read packed.

- backend="gpu" (Pallas Triton, `plt.CompilerParams` from `int4_matmul.GPU_TUNING`): grid (T, N blocks); each
  program gathers its tile's rows of x by `row_src` (a vector load from the whole x: no padded copy of x is
  written, which at Kimi's decode shapes was T*bm = 13x the routed rows) and chooses the expert from
  `tile_group` by pointer offset (the weight BlockSpec spans all E experts, which costs nothing in Triton: refs
  are pointers, and shared memory holds only what one K-loop iteration loads, times num_stages:
  `gmm_stage_plan`). int4: the group loop of int4_matmul (scale on the f32 partial) over x split even/odd once
  ([2, K/g, M, g/2], M rows); fp8: per 128-row K block `acc += (x_blk @ bf16(w_blk)) * scale[e, kb, nb]` (exact
  cast, one scale per [128, block_n] tile since block_n divides 128). An unused tile writes nothing.
- backend="tpu" (Mosaic TPU, megablox-style: pallas_kernels/moe_gmm_tpu.py): the sorted rows (x[rows] gathered in
  XLA when `rows` is given) are read in place in row tiles that may span experts; the grid visits each (expert,
  tile it overlaps) in row order with the visit table in SMEM, and each visit writes only its expert's rows. No
  padded copy of x and no un-padding gather of the output. The weight BlockSpec is ONE expert's [bk, bn] tile: never
  the expert stack. VMEM per step: `gmm_stage_plan`.

The Pallas Triton backend is deprecated upstream as of JAX 0.11. Path forward, not built: Mosaic GPU
(`plgpu`), e.g. a scalar-prefetched expert index like the tpu path with TMA tiles that fit 227 KiB of SMEM per
stage (jax's ragged_dot_mgpu.py is the shape to follow), or tokamax's ragged dot if it gains int4/fp8 weights.

What was checked (CPU only, JAX 0.10.2): legacy `interpret=True` (gpu tiling) and TPU interpret mode
(`pltpu.InterpretParams()`, tpu tiling) against `pallas_kernels.reference.gmm_reference` at toy dims and at
hidden 7168 / FFN 2048 with a few experts (tests/test_moe_gmm.py); `jax.export` for cuda (Triton) and tpu
(Mosaic) at the per-device Kimi K2.6 (EP: 48 local experts, TP: 384 experts of FFN 256), GLM-5.2 (32 local) and
GLM-4.5 (20 local, FFN 1536) shapes, gate/up and the transposed down projection, INT4 g32/g128 and FP8, M = 1
and 4096 (tpu: chip declared v6e; it also lowers with none); per-stage bytes from `gmm_stage_plan`, whose tpu
blocks are checked equal to the lowered pallas_call's BlockSpecs (worst cases: gpu 128 KiB (fp8) of 227 KiB; tpu
16.8 MiB (int4 g128, GLM-4.5 down, full-K block 1536) of 32 MiB, SMEM scales <= 28 KiB per buffer)
(tests/test_lowering_matmul.py). Since then both tilings are compiled by the real compilers on this CPU (Triton for
sm_90a; Mosaic for v5e / v5p / v6e: tests/compile/test_compile_matmul.py), and the tpu tiling's visit table is
checked row by row (tests/kernels/test_moe_gmm.py). What was NOT checked (no accelerator): that the pipeline really
skips DMAs for unused visits and keeps a revisited tile's output block resident (interpret mode does not count
DMAs; the results match the reference there), and speed (untimed; no GPU split-K for tiny decode groups).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.int4_matmul import (Int4Blocks, KernelShapeError, StagePlan, accumulate_int4_groups,
                                        check_backend, split_even_odd, stage_plan, tpu_block_k, tpu_block_n, tpu_tile,
                                        triton_params)
from pallas_kernels.moe_gmm_tpu import gmm_tpu

FP8_BLOCK = 128


@dataclass(frozen=True)
class GmmBlocks:
    """Tiles: block_m rows (one expert per tile) x block_n output columns per program; block_k K per grid step
    (tpu only; 0 = all of K)."""

    block_m: int
    block_n: int
    block_k: int = 0


def choose_gmm_blocks(m: int, n: int, num_groups: int, k: int | None = None, *, fmt: str = "int4",
                      group_size: int = 32, backend: str = "gpu", dtype: str = "bfloat16") -> GmmBlocks:
    """Blocks for moe_gmm of x [m, k] over `num_groups` experts of [k, n].

    gpu: block_m from the mean group size (16 for decode-sized groups, up to 64), block_n the largest of 128..16
    dividing n, else 128 with a partial edge tile (block_n <= 128 keeps one FP8 scale per tile).
    tpu: block_m the power of two >= the mean group size in [16, 256] (8 for f32 x), block_n up to 1024 for
    decode-sized groups (bigger DMAs per grid step) or 512, block_k 1024..256 (int4: `tpu_block_k`, so the
    scale block has a multiple of 8 rows; fp8: a multiple of 128 dividing K), else all of K.
    """
    check_backend(backend)
    mean = -(-m // max(num_groups, 1))
    if backend == "gpu":
        block_m = next((b for b in (16, 32) if mean <= b), 64)
        block_n = next((b for b in (128, 64, 32, 16) if n % b == 0), 128)
        return GmmBlocks(block_m, block_n)
    low = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    block_m = min(max(low, 1 << max(mean - 1, 0).bit_length()), 256)
    block_n = tpu_block_n(n, 1024 if mean <= 16 else 512)
    if not k:
        return GmmBlocks(block_m, block_n)
    if fmt == "int4":
        return GmmBlocks(block_m, block_n, tpu_block_k(k, group_size))
    return GmmBlocks(block_m, block_n, next((b for b in (1024, 512, 256, 128) if k % b == 0), k))


def gmm_stage_plan(k: int, n: int, blocks: GmmBlocks, *, fmt: str, group_size: int = 32, backend: str = "gpu",
                   dtype: str = "bfloat16", num_stages: int | None = None) -> StagePlan:
    """On-chip bytes per pipeline stage of moe_gmm with `blocks` (see int4_matmul.StagePlan).

    int4: as int4_matmul.stage_plan for the same tile (tpu: x's even / odd halves as two blocks). fp8 gpu: x [bm, 128], w [128, bn] fp8 per K iteration x
    num_stages, plus the bf16 cast of w. fp8 tpu: x [bm, bk], w [bk, bn] fp8 and out [bm, bn] double-buffered,
    the f32 accumulator, one [128, bn] cast and one [bm, bn] f32 partial; the expert's scales in SMEM.
    """
    bm, bn = blocks.block_m, blocks.block_n
    if fmt == "int4":
        plan = stage_plan(bm, k, n, group_size, Int4Blocks(bm, bn, blocks.block_k), backend=backend, dtype=dtype,
                          num_stages=num_stages)
        if backend == "gpu":
            return plan
        # the tpu gmm takes x's even and odd K columns as two [bm, bk/2] blocks (int4_matmul: one [2, bm, bk/2])
        (x_shape, x_dtype), *rest = plan.pipelined
        return replace(plan, pipelined=((x_shape[1:], x_dtype), (x_shape[1:], x_dtype), *rest))
    if backend == "gpu":
        stages = num_stages or triton_params(bm, bn).num_stages
        return StagePlan(pipelined=(((bm, FP8_BLOCK), dtype), ((FP8_BLOCK, bn), "float8_e4m3fn")),
                         buffers=stages, resident=(((FP8_BLOCK, bn), dtype),))
    bk = blocks.block_k or k
    pad = lambda blocks_: tuple((tpu_tile(s, d), d) for s, d in blocks_)
    return StagePlan(
        pipelined=pad((((bm, bk), dtype), ((bk, bn), "float8_e4m3fn"), ((bm, bn), dtype))), buffers=2,
        resident=pad((((bm, bn), "float32"), ((FP8_BLOCK, bn), dtype), ((bm, bn), "float32"))),
        smem=((tpu_tile((k // FP8_BLOCK, -(-n // FP8_BLOCK)), "float32"), "float32"),))


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


# ----------------------------------------------------------------------------------------------- gpu tiling


def _gmm_int4_kernel(meta_ref, rows_ref, x_ref, w_ref, s_ref, o_ref, *, n_groups: int, half: int) -> None:
    """meta_ref [T] int32, rows_ref [bm] int32 (this tile's rows of x), x_ref [2, G, M, half], w_ref [E, K//2, bn]
    uint8, s_ref [E, G, bn] bf16. An unused tile writes nothing (its rows are never gathered)."""
    e = meta_ref[pl.program_id(0)]

    @pl.when(e >= 0)
    def _():
        acc = jnp.zeros(o_ref.shape, jnp.float32)
        o_ref[...] = accumulate_int4_groups(x_ref, w_ref, s_ref, (e,), n_groups, half, acc,
                                            rows_ref[...]).astype(o_ref.dtype)


def _gmm_fp8_kernel(meta_ref, rows_ref, x_ref, w_ref, s_ref, o_ref, *, k_blocks: int) -> None:
    """meta_ref [T] int32, rows_ref [bm] int32 (this tile's rows of x), x_ref [M, K], w_ref [E, K, bn] fp8,
    s_ref [E, K//128, 1] f32 (this tile's column). An unused tile writes nothing."""
    e = meta_ref[pl.program_id(0)]

    @pl.when(e >= 0)
    def _():
        rows = rows_ref[...]

        def body(kb, acc):
            wt = w_ref[e, pl.ds(kb * FP8_BLOCK, FP8_BLOCK), :].astype(x_ref.dtype)  # exact: e4m3 fits bf16
            part = jnp.dot(x_ref[rows, pl.ds(kb * FP8_BLOCK, FP8_BLOCK)], wt, preferred_element_type=jnp.float32)
            return acc + part * s_ref[e, kb, 0]

        acc = jax.lax.fori_loop(0, k_blocks, body, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _gmm_gpu(x: jax.Array, row_src: jax.Array, tile_group: jax.Array, w: jax.Array, scale: jax.Array, fmt: str,
             blocks: GmmBlocks, interpret: bool) -> jax.Array:
    """x [X, K], row_src [T*bm] int32 (the row of x each tile row reads) -> y_pad [T*bm, N] x.dtype
    (unused tiles' rows undefined). The kernel gathers its tile's rows of x by row_src (a vector load, as the MLA
    decode kernel gathers pages): no padded copy of x is written."""
    m, k = x.shape
    n_experts, _, n = w.shape
    bm, bn = blocks.block_m, blocks.block_n
    if fmt == "fp8" and FP8_BLOCK % bn:
        raise KernelShapeError(f"fp8 block_n {bn} must divide {FP8_BLOCK}", value=bn, param="blocks")
    n_tiles = tile_group.shape[0]
    meta_spec = pl.BlockSpec((n_tiles,), lambda t, j: (0,))
    rows_spec = pl.BlockSpec((bm,), lambda t, j: (t,))
    if fmt == "int4":
        n_groups = scale.shape[1]
        g = k // n_groups
        kernel = functools.partial(_gmm_int4_kernel, n_groups=n_groups, half=g // 2)
        operands = (split_even_odd(x, g), w, scale)
        in_specs = [pl.BlockSpec((2, n_groups, m, g // 2), lambda t, j: (0, 0, 0, 0)),
                    pl.BlockSpec((n_experts, k // 2, bn), lambda t, j: (0, 0, j)),
                    pl.BlockSpec((n_experts, n_groups, bn), lambda t, j: (0, 0, j))]
    else:
        k_blocks = k // FP8_BLOCK
        kernel = functools.partial(_gmm_fp8_kernel, k_blocks=k_blocks)
        operands = (x, w, scale.astype(jnp.float32))
        in_specs = [pl.BlockSpec((m, k), lambda t, j: (0, 0)),
                    pl.BlockSpec((n_experts, k, bn), lambda t, j: (0, 0, j)),
                    # block of width 1 along the scale columns: block index = the 128-column tile of N block j
                    pl.BlockSpec((n_experts, k_blocks, 1), lambda t, j: (0, 0, (j * bn) // FP8_BLOCK))]
    return pl.pallas_call(
        kernel,
        grid=(n_tiles, pl.cdiv(n, bn)),
        in_specs=[meta_spec, rows_spec, *in_specs],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((n_tiles * bm, n), x.dtype),
        compiler_params=triton_params(bm, bn),
        interpret=interpret,
    )(tile_group, row_src, *operands)


# ----------------------------------------------------------------------------------------------- tpu tiling


def _tpu(x: jax.Array, rows: jax.Array | None, group_sizes: jax.Array, w: jax.Array, scale: jax.Array, fmt: str,
         blocks: GmmBlocks, interpret: bool | pltpu.InterpretParams) -> jax.Array:
    """x [X, K], rows [M] (sorted row r is x[rows[r]]; None: x itself) -> [M, N]: `moe_gmm_tpu.gmm_tpu` on the
    sorted rows gathered in XLA (int4: x's even and odd K columns, [M_pad, K/2] each), padded to whole row tiles."""
    k = x.shape[1]
    m = x.shape[0] if rows is None else rows.shape[0]
    n = w.shape[2]
    bm, bn = blocks.block_m, blocks.block_n
    bk = blocks.block_k or k
    g = k // scale.shape[1] if fmt == "int4" else FP8_BLOCK
    if k % bk or n % bn or bk % g or (bn % FP8_BLOCK and bn != n):
        raise KernelShapeError(f"tpu blocks {blocks} must tile K={k} (in whole groups of {g}) and N={n} "
                               f"(block_n a multiple of 128 or all of N)", value=blocks, param="blocks")
    pad = -m % bm
    if rows is None:
        rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    src = jnp.pad(rows.astype(jnp.int32), (0, pad))  # padded rows read row 0: past the sum, written 0
    # int4: x's even and odd K columns (the packed byte's two nibbles' rows), each sliced from the caller's rows
    # (fewer than the sorted ones) and gathered in its natural layout: one stacked array was relaid out by XLA:TPU
    xs = (x[:, 0::2][src], x[:, 1::2][src]) if fmt == "int4" else (x[src],)
    y = gmm_tpu(xs, group_sizes, w, scale, fmt, bm, bn, bk, interpret)
    return y[:m] if pad else y


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


@functools.partial(jax.jit, static_argnames=("fmt", "blocks", "backend", "interpret"))
def moe_gmm(x: jax.Array, w: jax.Array, scale: jax.Array, group_sizes: jax.Array, *, fmt: str,
            blocks: GmmBlocks | None = None, backend: str = "gpu",
            interpret: bool | pltpu.InterpretParams = False, rows: jax.Array | None = None) -> jax.Array:
    """Expert-sorted x [M, K] bf16 (or f32) x expert weights in `fmt` ("int4" | "fp8") -> [M, N] x.dtype.

    Row r uses expert g where cumsum(group_sizes)[g-1] <= r < cumsum(group_sizes)[g]; rows past the sum are 0.
    rows [M] int32 (optional): the sorted row r is x[rows[r]] (x then [X, K], any X), so the caller's tokens are
    read in place (the gpu kernel gathers them; tpu gathers them in XLA) rather than copied in sorted order.
    Precondition (not checkable under jit): sum(group_sizes) <= M. backend: "gpu" (Triton) or "tpu" (Mosaic);
    interpret: True (legacy, either tiling) or, for "tpu", `pltpu.InterpretParams()` to run on CPU.
    """
    check_backend(backend)
    _check_shapes(x, w, scale, group_sizes, fmt)
    if rows is not None and (rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer)):
        raise KernelShapeError(f"rows must be a 1-D integer array, got {rows.dtype}{list(rows.shape)}",
                               value=tuple(rows.shape), param="rows")
    m = x.shape[0] if rows is None else rows.shape[0]
    k = x.shape[1]
    n_experts, _, n = w.shape
    g = k // scale.shape[1] if fmt == "int4" else FP8_BLOCK
    blocks = blocks or choose_gmm_blocks(m, n, n_experts, k, fmt=fmt, group_size=g, backend=backend,
                                         dtype=x.dtype.name)
    if backend == "tpu":  # the sorted rows read in place by row tiles (a tile may span experts): no padded copy
        return _tpu(x, rows, group_sizes, w, scale, fmt, blocks, interpret)
    layout = tile_layout(group_sizes, m, blocks.block_m)
    src = layout.row_src if rows is None else rows.astype(jnp.int32)[layout.row_src]  # [T*bm] rows of x
    y_pad = _gmm_gpu(x, src, layout.tile_group, w, scale, fmt, blocks, bool(interpret))
    return jnp.where(layout.out_valid[:, None], y_pad[layout.row_dst], 0).astype(x.dtype)
