"""The Mosaic TPU tiling of `moe_gmm`: a grouped matmul over expert-sorted rows read in place, no padded copy.

x [M, K] (rows sorted by expert, M a multiple of block_m) is cut into M/bm row tiles; a tile may hold rows of
several experts. The grid walks *visits* (megablox-style): one per (expert, tile it overlaps), in row order, so a
tile shared by two experts is visited twice in a row and its output block stays resident in VMEM between the two
(each visit writes only its expert's rows: `where(row in [lo, hi), acc, o_ref)`). After the experts' visits come
one *zero visit* per tile past sum(group_sizes) (writes 0), then unused visits (a static bound: V = M/bm +
min(E, M)) that repeat the last used visit's block indices, so the pipeline issues no DMA and writes nothing for
them. A tile's first visit starts from 0 rather than from the block's old contents.

Why not padded tiles: one expert per tile meant an XLA-built copy of x in [T*bm, K] tiles (T = M/bm + E). At Kimi
K2.6's v5p decode (384 experts a chip, 512 routed rows, bm 16) that copy was 13x the rows, and XLA:TPU relaid it
out before the Mosaic call (a transpose, two copies and a reshape of bf16[6656, 7168] a layer). Here the kernel
reads x's [bm, bk] blocks in place, and the output is [M, N] in the sorted order (no un-padding gather).

Scalar-prefetched (SMEM) per visit v: tile[v] (row tile of the output), group[v] (expert; -1 zero visit, -2
unused), x_tile[v] / w_group[v] (the x tile and expert the step's input blocks use: non-expert visits pin the last
expert visit's, so no DMA), lo[v] / hi[v] (the expert's sorted rows), first[v] (1: first visit of its tile).
Grid (N blocks, V, K blocks); N "parallel", the rest sequential. int4 takes x's even and odd K columns as two [M, K/2]
arrays (split in XLA by the caller); int4 / fp8 blocks and dequantization as before
(`int4_matmul.dequant_int4_block`; fp8 one K=128 dot per scale row, the expert's [K/128, N/128] scales in SMEM).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.int4_matmul import TPU_VMEM_LIMIT_BYTES, dequant_int4_block

FP8_BLOCK = 128


class VisitLayout(NamedTuple):
    """Per visit [V] int32 arrays (see the module docstring); a NamedTuple, so it can leave a jit."""

    tile: jax.Array
    group: jax.Array
    x_tile: jax.Array
    w_group: jax.Array
    lo: jax.Array
    hi: jax.Array
    first: jax.Array


def visit_layout(group_sizes: jax.Array, m: int, block_m: int) -> VisitLayout:
    """Visits (XLA, O(V + E)) of M sorted rows (M % block_m == 0) in tiles of block_m over group_sizes [E]."""
    n_groups = group_sizes.shape[0]
    n_tiles = m // block_m
    n_visits = n_tiles + min(n_groups, m)
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    total = ends[-1]
    count = jnp.where(gs > 0, (ends - 1) // block_m - starts // block_m + 1, 0)  # tiles each expert overlaps
    count_end = jnp.cumsum(count)
    n_expert_visits = count_end[-1]
    tail = -(-total // block_m)  # first tile holding no row below the sum
    n_used = n_expert_visits + n_tiles - tail

    v = jnp.arange(n_visits, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(count_end, v, side="right").astype(jnp.int32), n_groups - 1)
    is_expert = v < n_expert_visits
    is_zero = ~is_expert & (v < n_used)
    raw = jnp.where(is_expert, starts[g] // block_m + v - (count_end[g] - count[g]), tail + v - n_expert_visits)
    last = jnp.maximum(n_used - 1, 0)
    tile = jnp.where(v < n_used, raw, raw[last])
    last_expert = jnp.maximum(n_expert_visits - 1, 0)
    pin = lambda a: jnp.where(is_expert, a, jnp.where(n_expert_visits > 0, a[last_expert], 0))
    first = (v < n_used) & ((v == 0) | (raw != jnp.roll(raw, 1)))
    return VisitLayout(
        tile=tile.astype(jnp.int32), group=jnp.where(is_expert, g, jnp.where(is_zero, -1, -2)).astype(jnp.int32),
        x_tile=pin(raw).astype(jnp.int32), w_group=pin(g).astype(jnp.int32),
        lo=jnp.where(is_expert, starts[g], 0).astype(jnp.int32), hi=jnp.where(is_expert, ends[g], 0).astype(jnp.int32),
        first=first.astype(jnp.int32))


def _finish(meta: tuple, acc_ref, o_ref, *, block_m: int, n_k: int) -> None:
    """At the visit's last K step: write its expert's rows of the tile (a zero visit: none), other rows kept, or 0
    on the tile's first visit. Unused visits write nothing."""
    tile_ref, group_ref, _, _, lo_ref, hi_ref, first_ref = meta
    v = pl.program_id(1)

    @pl.when((group_ref[v] >= -1) & (pl.program_id(2) == n_k - 1))
    def _():
        row = tile_ref[v] * block_m + jax.lax.broadcasted_iota(jnp.int32, o_ref.shape, 0)
        mine = (row >= lo_ref[v]) & (row < hi_ref[v])
        kept = jnp.where(first_ref[v] == 1, jnp.zeros(o_ref.shape, o_ref.dtype), o_ref[...])
        o_ref[...] = jnp.where(mine, acc_ref[...].astype(o_ref.dtype), kept)


def _gmm_int4_kernel(*refs, group_size: int, block_m: int, n_k: int) -> None:
    """Step (j, v, k): xe_ref / xo_ref [bm, bk/2] (x's even / odd K columns), w_ref [bk/2, bn] uint8 (expert
    w_group[v]), s_ref [bk/g, bn] bf16, o_ref [bm, bn], acc_ref [bm, bn] f32."""
    meta, (xe_ref, xo_ref, w_ref, s_ref, o_ref, acc_ref) = refs[:7], refs[7:]
    expert = meta[1][pl.program_id(1)] >= 0

    @pl.when(expert & (pl.program_id(2) == 0))
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(expert)
    def _():
        lo, hi = dequant_int4_block(w_ref[...], s_ref[...], group_size, xe_ref.dtype)
        acc_ref[...] += (jnp.dot(xe_ref[...], lo, preferred_element_type=jnp.float32)
                         + jnp.dot(xo_ref[...], hi, preferred_element_type=jnp.float32))

    _finish(meta, acc_ref, o_ref, block_m=block_m, n_k=n_k)


def _gmm_fp8_kernel(*refs, block_m: int, n_k: int) -> None:
    """Step (j, v, k): x_ref [bm, bk], w_ref [bk, bn] fp8, s_ref [K/128, ceil(N/128)] f32 in SMEM (the expert's
    scales), o_ref [bm, bn], acc_ref [bm, bn] f32."""
    meta, (x_ref, w_ref, s_ref, o_ref, acc_ref) = refs[:7], refs[7:]
    j, k = pl.program_id(0), pl.program_id(2)
    expert = meta[1][pl.program_id(1)] >= 0
    bk, bn = w_ref.shape
    widths = [min(FP8_BLOCK, bn - c) for c in range(0, bn, FP8_BLOCK)]  # scale columns of this N block
    col0 = j * (bn // FP8_BLOCK)  # bn is a multiple of 128, or all of N (j == 0)

    @pl.when(expert & (k == 0))
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(expert)
    def _():
        for kk in range(bk // FP8_BLOCK):
            rows = slice(kk * FP8_BLOCK, (kk + 1) * FP8_BLOCK)
            part = jnp.dot(x_ref[:, rows], w_ref[rows, :].astype(x_ref.dtype), preferred_element_type=jnp.float32)
            kb = k * (bk // FP8_BLOCK) + kk
            row = jnp.concatenate([jnp.full((1, wd), s_ref[kb, col0 + c], jnp.float32)
                                   for c, wd in enumerate(widths)], axis=1)  # [1, bn]
            acc_ref[...] += part * row

    _finish(meta, acc_ref, o_ref, block_m=block_m, n_k=n_k)


def gmm_tpu(xs: tuple[jax.Array, ...], group_sizes: jax.Array, w: jax.Array, scale: jax.Array, fmt: str,
            block_m: int, block_n: int, block_k: int, interpret: bool | pltpu.InterpretParams) -> jax.Array:
    """xs: the sorted rows, M % block_m == 0 (fp8: (x [M, K],); int4: (x's even K columns, its odd ones), each
    [M, K/2]: the packed byte's low nibble is the even K row), w / scale as moe_gmm -> [M, N] x.dtype; rows past
    sum(group_sizes) are 0. Blocks must tile K (in whole scale groups) and N (checked by the caller)."""
    m, k = xs[0].shape[0], xs[0].shape[1] * len(xs)
    n = w.shape[2]
    bm, bn, bk = block_m, block_n, block_k
    n_k = k // bk
    lay = visit_layout(group_sizes, m, bm)
    n_visits = lay.tile.shape[0]

    def kb(v, kk, group):
        return jnp.where(group[v] >= 0, kk, n_k - 1)  # non-expert visits pin the last K block: no DMA

    if fmt == "int4":
        g = k // scale.shape[1]
        x_specs = [pl.BlockSpec((bm, bk // 2), lambda j, v, kk, t, gr, xt, wg, *_: (xt[v], kb(v, kk, gr)))] * 2
        w_spec = pl.BlockSpec((None, bk // 2, bn), lambda j, v, kk, t, gr, xt, wg, *_: (wg[v], kb(v, kk, gr), j))
        s_spec = pl.BlockSpec((None, bk // g, bn), lambda j, v, kk, t, gr, xt, wg, *_: (wg[v], kb(v, kk, gr), j))
        kernel = functools.partial(_gmm_int4_kernel, group_size=g, block_m=bm, n_k=n_k)
        scale_op = scale
    else:
        x_specs = [pl.BlockSpec((bm, bk), lambda j, v, kk, t, gr, xt, wg, *_: (xt[v], kb(v, kk, gr)))]
        w_spec = pl.BlockSpec((None, bk, bn), lambda j, v, kk, t, gr, xt, wg, *_: (wg[v], kb(v, kk, gr), j))
        s_spec = pl.BlockSpec((None, k // FP8_BLOCK, scale.shape[2]),
                              lambda j, v, kk, t, gr, xt, wg, *_: (wg[v], 0, 0), memory_space=pltpu.SMEM)
        kernel = functools.partial(_gmm_fp8_kernel, block_m=bm, n_k=n_k)
        scale_op = scale.astype(jnp.float32)
    # w / scale pinned to HBM: unpinned, XLA:TPU prefetched an operand that fits VMEM (a v6e chip's 12 Kimi experts'
    # scales, 11 MB; at one decode row their 88 MB weight stacks too) whole, where the kernel reads the routed ones
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(lay),
        grid=(n // bn, n_visits, n_k),  # N outermost ("parallel"): visits and K stay sequential on each core
        in_specs=[*x_specs, w_spec, s_spec],
        out_specs=pl.BlockSpec((bm, bn), lambda j, v, kk, t, *_: (t[v], j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), xs[0].dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=TPU_VMEM_LIMIT_BYTES),
        interpret=interpret,
    )(*lay, *xs, *(a if interpret else pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in (w, scale_op)))
