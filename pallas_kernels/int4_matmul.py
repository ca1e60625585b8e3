"""W4A16 matmul: activations [M, K] bf16 x packed INT4 weights [K//2, N] uint8 + group scales [K//g, N] bf16.

Two tilings of one contract, chosen by the static `backend`:

- backend="gpu" (Pallas Triton lowering, `plt.CompilerParams(num_warps, num_stages)` from `GPU_TUNING`). The
  wrapper splits the (small) activations into even and odd k, grouped: `xs [2, K//g, M, g//2]`, where
  `xs[p, gi, m, j] = x[m, gi*g + 2j + p]`, so the low nibble of byte row j of group gi pairs with `xs[0, gi]` and
  the high nibble with `xs[1, gi]` and the kernel never interleaves nibbles. Per group:
  `acc += (xs[0,gi] @ (lo - 8) + xs[1,gi] @ (hi - 8)) * scale[gi]` (nibbles are exact in bf16; the scale is
  applied once to the f32 partial [bm, bn], so q * scale is never rounded). Grid (M blocks, N blocks, K splits);
  the group loop is a `lax.fori_loop` inside the kernel. Prefill (M > 64): one K split, the tile is written
  once. Decode (M <= 64, GEMV-shaped): block_n 128 or 64 and up to `k_splits` K ranges per output tile, each
  written to its own f32 partial `[k_splits, M_pad, N]` and summed in XLA (deterministic; no atomics), so an
  H200 (132 SMs) gets >= 2 programs per SM where the partial traffic stays <= 25% of the weight bytes
  (`choose_blocks`). Refs are pointers in Triton: shared memory holds what one loop iteration loads, times
  num_stages (`stage_plan`).
- backend="tpu" (Mosaic TPU, `pltpu.CompilerParams`). Activations split even/odd without grouping,
  `xs [2, M_pad, K//2]`; grid (N blocks, M blocks, K blocks), K last and "arbitrary", an f32 VMEM accumulator.
  Each step dequantizes its whole weight block [bk/2, bn] to x.dtype in VMEM (scale rows broadcast over the
  g/2 byte rows of their group: one MXU dot per nibble instead of one K=16 dot per group, which Mosaic tiles
  badly). Cost: q * scale is rounded to bf16 (relative <= 2^-9 per weight, the order of the output rounding).
  All blocks obey Mosaic's (8, 128)-or-full-dim rule; VMEM per step is `stage_plan` (blocks padded to the TPU
  tiles, double-buffered, plus accumulator and dequantization temporaries), <= 32 MiB (`TPU_VMEM_LIMIT_BYTES`,
  passed as vmem_limit_bytes so v5e's smaller default does not apply).

The Pallas Triton backend is deprecated upstream as of JAX 0.11 (only JAX <= 0.10.2 is installable here).
Path forward, not built: a Mosaic GPU (`plgpu`) kernel with TMA-loaded packed tiles, in-register unpacking and
WGMMA, whose whole pipeline stage must fit the 227 KiB of shared memory (that is what fails today without
compiler_params: Mosaic GPU stages whole BlockSpec blocks in SMEM), or tokamax if it gains an int4 GEMM.

What was checked (CPU only, JAX 0.10.2): legacy `interpret=True` (gpu tiling, incl. split-K) and TPU interpret
mode (`pltpu.InterpretParams()`, tpu tiling, incl. several K steps) against `pallas_kernels.reference` at toy
dims and at K = 7168 and 2048 (tests/test_int4_matmul.py; relative error ~1.7e-3 gpu, ~2.2e-3 tpu); `jax.export`
for cuda (the Triton custom call) and tpu (Mosaic, chip declared v6e; it also lowers with none) of Kimi K2.6's
per-device q_b / o / lm_head at M = 1, 64, 4096 (g = 32; lm_head also g = 128); per-stage bytes from
`stage_plan` at those and the routed-expert shapes, whose tpu blocks are checked equal to the lowered
pallas_call's BlockSpecs (worst cases: gpu 53.5 KiB at g32, 153 KiB at g128 of 227 KiB; tpu 11.9 MiB of 32 MiB)
(tests/test_lowering_matmul.py). What was NOT checked (no accelerator): compiling the exported Triton/Mosaic
modules (ptxas/Triton passes and Mosaic's layout passes run only at compile time on a device: the uint8 -> int32
unpack, the [G, g/2, bn] -> [G*g/2, bn] scale broadcast and the K=16 Triton dots may be rejected or slow there),
whether Triton really keeps only num_stages loop tiles in shared memory, and any speed: the tuning table and
block sizes are plausible defaults, never timed.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

BACKENDS = ("gpu", "tpu")
H200_SMS = 132
GPU_MIN_PROGRAMS = 2 * H200_SMS  # two waves of programs per SM hide load latency in a memory-bound GEMV
DECODE_MAX_M = 64
TPU_VMEM_LIMIT_BYTES = 32 * 2**20
# (max block_m, max block_n, num_warps, num_stages), first match wins; untimed defaults: small decode tiles get
# a deeper load pipeline, 128x256 prefill tiles 8 warps for the [bm, bn] f32 accumulator in registers
GPU_TUNING: tuple[tuple[int, int, int, int], ...] = (
    (16, 128, 4, 4),
    (64, 128, 4, 3),
    (128, 256, 8, 3),
)


class KernelShapeError(ValueError):
    """Operands a kernel cannot take: `value` is the bad value, `param` names the operand."""

    def __init__(self, message: str, *, value: object = None, param: str | None = None) -> None:
        super().__init__(message)
        self.value = value
        self.param = param


@dataclass(frozen=True)
class Int4Blocks:
    """Tiles: block_m rows x block_n columns per program; block_k K per grid step (tpu; 0 = all of K);
    k_splits K ranges merged in XLA (gpu decode split-K)."""

    block_m: int
    block_n: int
    block_k: int = 0
    k_splits: int = 1


Block = tuple[tuple[int, ...], str]  # (block shape, dtype name)


@dataclass(frozen=True)
class StagePlan:
    """What one pipeline stage holds on chip, for budget checks: `pipelined` blocks are held `buffers` times
    (Triton num_stages / Mosaic double buffering), `resident` ones once (accumulators, dequant temporaries)."""

    pipelined: tuple[Block, ...]
    buffers: int
    resident: tuple[Block, ...] = ()
    smem: tuple[Block, ...] = ()  # tpu: scalar memory blocks (held `buffers` times)

    def bytes(self) -> int:
        """On-chip bytes of pipelined blocks x buffers + resident blocks (smem not included)."""
        size = lambda blocks: sum(math.prod(s) * np.dtype(d).itemsize for s, d in blocks)
        return self.buffers * size(self.pipelined) + size(self.resident)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise KernelShapeError(f"backend must be one of {BACKENDS}, got {backend!r}", value=backend,
                               param="backend")


def triton_params(block_m: int, block_n: int) -> plt.CompilerParams:
    """Triton num_warps / num_stages for a [block_m, block_n] output tile, from GPU_TUNING."""
    for max_m, max_n, warps, stages in GPU_TUNING:
        if block_m <= max_m and block_n <= max_n:
            return plt.CompilerParams(num_warps=warps, num_stages=stages)
    _, _, warps, stages = GPU_TUNING[-1]
    return plt.CompilerParams(num_warps=warps, num_stages=stages)


def tpu_tile(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """A VMEM block's shape padded to Mosaic's native tile: 128 lanes x (8 * 4 // itemsize) sublanes."""
    *lead, rows, cols = shape
    sub = 8 * 4 // np.dtype(dtype).itemsize
    return (*lead, -(-rows // sub) * sub, -(-cols // 128) * 128)


def tpu_block_k(k: int, rows_per_scale: int, candidates: tuple[int, ...] = (1024, 512, 256)) -> int:
    """Largest candidate dividing K whose scale block (bk / rows_per_scale rows) is a multiple of 8 and whose
    even/odd activation block (bk/2 lanes) is a multiple of 128; else all of K (a full-dim block is legal)."""
    for bk in candidates:
        if k % bk == 0 and (bk // rows_per_scale) % 8 == 0 and (bk // 2) % 128 == 0:
            return bk
    return k


def tpu_block_n(n: int, largest: int) -> int:
    """Largest multiple of 128 up to `largest` dividing N, else N itself (full-dim block)."""
    return next((b for b in (1024, 512, 256, 128) if b <= largest and n % b == 0), n)


def _pow2_at_least(m: int, lo: int) -> int:
    return max(lo, 1 << max(m - 1, 0).bit_length())


def choose_blocks(m: int, n: int, k: int | None = None, *, group_size: int = 32, backend: str = "gpu",
                  dtype: str = "bfloat16") -> Int4Blocks:
    """Block sizes for int4_matmul of x [m, k] (dtype) @ W [k, n] with scale groups of `group_size`.

    gpu: prefill (m > 64) 128 x (largest of 256..16 dividing n, else 128; at most 128 for g >= 128); decode
    (m <= 64) block_m 16/32/64, block_n 128 (64 if that gives too few programs) and the smallest power-of-two
    k_splits giving
    GPU_MIN_PROGRAMS programs, capped so the f32 partials (written and read) stay <= 25% of the weight bytes.
    tpu: block_m 16 (bf16 sublane pair) up to 256, block_n up to 1024 (decode) / 512 (prefill), block_k from
    `tpu_block_k`.
    """
    check_backend(backend)
    if backend == "tpu":
        bm = min(_pow2_at_least(m, 16 if np.dtype(dtype).itemsize == 2 else 8), 256)
        bn = tpu_block_n(n, 1024 if m <= DECODE_MAX_M else 512)
        return Int4Blocks(bm, bn, tpu_block_k(k, group_size) if k else 0)
    if m > DECODE_MAX_M:  # g >= 128: 64-row byte tiles, so block_n 128 keeps 3 stages well inside 227 KiB
        widest = 256 if group_size <= 64 else 128
        return Int4Blocks(128, next((b for b in (256, 128, 64, 32, 16) if b <= widest and n % b == 0), 128))
    bm = _pow2_at_least(m, 16)
    bn = 128 if pl.cdiv(n, 128) * 4 >= GPU_MIN_PROGRAMS or n <= 128 else 64
    splits = 1
    if k:
        n_groups = k // group_size
        weight_bytes = k * n // 2 + n_groups * n * 2
        while (pl.cdiv(n, bn) * splits < GPU_MIN_PROGRAMS and n_groups % (2 * splits) == 0
               and 2 * (2 * splits) * bm * n * 4 <= weight_bytes // 4):
            splits *= 2
    return Int4Blocks(bm, bn, 0, splits)


def stage_plan(m: int, k: int, n: int, group_size: int, blocks: Int4Blocks, *, backend: str = "gpu",
               dtype: str = "bfloat16", num_stages: int | None = None) -> StagePlan:
    """On-chip bytes per pipeline stage of int4_matmul with `blocks` (see StagePlan).

    gpu: the tiles one group iteration loads (x even/odd [bm, g/2], packed w [g/2, bn], scale [1, bn]) x
    num_stages, plus the two dequantized bf16 dot operands [g/2, bn] (accumulator in registers, not counted).
    tpu: x [2, bm, bk/2], w [bk/2, bn] uint8, scale [bk/g, bn] bf16 and out [bm, bn] double-buffered, plus the
    f32 accumulator and the dequantization temporaries of one block (int32 bytes, f32 scale rows, f32 and
    x.dtype nibbles), all padded to TPU tiles.
    """
    bm, bn, half = blocks.block_m, blocks.block_n, group_size // 2
    if backend == "gpu":
        stages = num_stages or triton_params(bm, bn).num_stages
        return StagePlan(pipelined=(((bm, half), dtype), ((bm, half), dtype), ((half, bn), "uint8"),
                                    ((1, bn), "bfloat16")),
                         buffers=stages, resident=(((half, bn), dtype), ((half, bn), dtype)))
    bk = blocks.block_k or k
    rows = (bk // 2, bn)
    pipelined = ((2, bm, bk // 2), dtype), (rows, "uint8"), ((bk // group_size, bn), "bfloat16"), ((bm, bn), dtype)
    temps = ((bm, bn), "float32"), (rows, "int32"), (rows, "float32"), (rows, "float32"), (rows, "float32"), \
        (rows, dtype), (rows, dtype)
    pad = lambda blocks_: tuple((tpu_tile(s, d), d) for s, d in blocks_)
    return StagePlan(pipelined=pad(pipelined), buffers=2, resident=pad(temps))


def split_even_odd(x: jax.Array, group_size: int) -> jax.Array:
    """[M, K] -> [2, K//g, M, g//2]: xs[p, gi, m, j] = x[m, gi*g + 2j + p] (activations only, cheap)."""
    m, k = x.shape
    return x.reshape(m, k // group_size, group_size // 2, 2).transpose(3, 1, 0, 2)


def accumulate_int4_groups(x_ref, w_ref, s_ref, w_prefix: tuple, n_groups: int, half: int,
                           acc: jax.Array, x_rows: jax.Array | slice = slice(None)) -> jax.Array:
    """acc [bm, bn] f32 += x_tile @ dequant(w_tile), looping over the K groups (gpu tiling).

    x_ref [2, G, rows, half] (even/odd split activations; x_rows [bm] int32 picks the tile's rows, by default all
    bm of them), w_ref [*prefix, G*half, bn] uint8, s_ref [*prefix, G, bn] bf16; `w_prefix` indexes leading axes
    of w_ref/s_ref (the expert for the GMM).
    """
    def body(gi, acc):
        packed = w_ref[(*w_prefix, pl.ds(gi * half, half), slice(None))].astype(jnp.int32)  # [half, bn]
        lo = ((packed & 0xF) - 8).astype(x_ref.dtype)  # k = 2j, exact in bf16
        hi = ((packed >> 4) - 8).astype(x_ref.dtype)  # k = 2j + 1
        part = (jnp.dot(x_ref[0, gi, x_rows], lo, preferred_element_type=jnp.float32)
                + jnp.dot(x_ref[1, gi, x_rows], hi, preferred_element_type=jnp.float32))
        s = s_ref[(*w_prefix, pl.ds(gi, 1), slice(None))].astype(jnp.float32)  # [1, bn]
        return acc + part * s

    return jax.lax.fori_loop(0, n_groups, body, acc)


def dequant_int4_block(packed: jax.Array, scale: jax.Array, group_size: int,
                       dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """tpu tiling: packed [R, bn] uint8 (R = bk/2 byte rows), scale [R*2/g, bn] bf16 -> (W at even k,
    W at odd k), each [R, bn] `dtype` (q * scale computed in f32, then rounded once to `dtype`)."""
    b = packed.astype(jnp.int32)
    rows, bn = b.shape
    s = scale.astype(jnp.float32)
    s_rows = jnp.broadcast_to(s[:, None, :], (s.shape[0], group_size // 2, bn)).reshape(rows, bn)
    lo = (((b & 0xF) - 8).astype(jnp.float32) * s_rows).astype(dtype)
    hi = (((b >> 4) - 8).astype(jnp.float32) * s_rows).astype(dtype)
    return lo, hi


def _gpu_kernel(x_ref, w_ref, s_ref, o_ref, *, n_groups: int, half: int) -> None:
    """One (M block, N block, K split) program: x_ref [2, Gs, bm, half], w_ref [Gs*half, bn] uint8,
    s_ref [Gs, bn] bf16 -> o_ref [bm, bn] (x.dtype, or f32 partial when K is split)."""
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = accumulate_int4_groups(x_ref, w_ref, s_ref, (), n_groups, half, acc).astype(o_ref.dtype)


def _tpu_kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, group_size: int, n_k: int) -> None:
    """One (N block, M block, K block) step: x_ref [2, bm, bk/2], w_ref [bk/2, bn] uint8, s_ref [bk/g, bn] bf16,
    o_ref [bm, bn] x.dtype, acc_ref [bm, bn] f32 VMEM (carried over the K axis)."""
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    lo, hi = dequant_int4_block(w_ref[...], s_ref[...], group_size, x_ref.dtype)
    acc_ref[...] += (jnp.dot(x_ref[0], lo, preferred_element_type=jnp.float32)
                     + jnp.dot(x_ref[1], hi, preferred_element_type=jnp.float32))

    @pl.when(k == n_k - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def check_int4_shapes(x: jax.Array, w: jax.Array, scale: jax.Array) -> int:
    """Returns the group size g, or raises KernelShapeError naming the operand that does not match."""
    m, k = x.shape
    half_k, n = w.shape
    n_groups = scale.shape[0]
    if 2 * half_k != k or scale.shape[1] != n or n_groups == 0 or k % n_groups or (k // n_groups) % 2:
        raise KernelShapeError(f"int4_matmul shapes do not match: x {x.shape}, w {w.shape}, scale {scale.shape}",
                               value=(tuple(x.shape), tuple(w.shape), tuple(scale.shape)), param="w")
    return k // n_groups


def _int4_gpu(x: jax.Array, w: jax.Array, scale: jax.Array, g: int, blocks: Int4Blocks,
              interpret: bool) -> jax.Array:
    m, k = x.shape
    n = w.shape[1]
    n_groups = scale.shape[0]
    bm, bn, splits = blocks.block_m, blocks.block_n, blocks.k_splits
    if n_groups % splits:
        raise KernelShapeError(f"k_splits {splits} must divide the {n_groups} scale groups", value=splits,
                               param="blocks")
    gs, half = n_groups // splits, g // 2
    m_pad = pl.cdiv(m, bm) * bm
    xs = split_even_odd(jnp.pad(x, ((0, m_pad - m), (0, 0))), g)  # zero rows: padded outputs are sliced off
    if splits == 1:
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
        out_shape = jax.ShapeDtypeStruct((m_pad, n), x.dtype)
    else:  # one f32 partial per K split, summed below: every output tile still has exactly one writer
        out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
        out_shape = jax.ShapeDtypeStruct((splits, m_pad, n), jnp.float32)
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, n_groups=gs, half=half),
        grid=(m_pad // bm, pl.cdiv(n, bn), splits),
        in_specs=[
            pl.BlockSpec((2, gs, bm, half), lambda i, j, s: (0, s, i, 0)),
            pl.BlockSpec((gs * half, bn), lambda i, j, s: (s, j)),
            pl.BlockSpec((gs, bn), lambda i, j, s: (s, j)),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=triton_params(bm, bn),
        interpret=interpret,
    )(xs, w, scale)
    if splits > 1:
        out = out.sum(axis=0).astype(x.dtype)
    return out[:m]


def _int4_tpu(x: jax.Array, w: jax.Array, scale: jax.Array, g: int, blocks: Int4Blocks,
              interpret: bool | pltpu.InterpretParams) -> jax.Array:
    m, k = x.shape
    n = w.shape[1]
    bm, bn = blocks.block_m, blocks.block_n
    bk = blocks.block_k or k
    if k % bk or n % bn or bk % g:
        raise KernelShapeError(f"tpu blocks {blocks} must tile K={k} (in whole groups of {g}) and N={n}",
                               value=blocks, param="blocks")
    m_pad = pl.cdiv(m, bm) * bm
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    xs = xp.reshape(m_pad, k // 2, 2).transpose(2, 0, 1)  # [2, M_pad, K/2]: xs[p, m, j] = x[m, 2j + p]
    n_k = k // bk
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, group_size=g, n_k=n_k),
        grid=(n // bn, m_pad // bm, n_k),  # N first: the megacore split has work even for one M block
        in_specs=[
            pl.BlockSpec((2, bm, bk // 2), lambda j, i, kk: (0, i, kk)),
            pl.BlockSpec((bk // 2, bn), lambda j, i, kk: (kk, j)),
            pl.BlockSpec((bk // g, bn), lambda j, i, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda j, i, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=TPU_VMEM_LIMIT_BYTES),
        interpret=interpret,
    )(xs, w, scale)
    return out[:m]


@functools.partial(jax.jit, static_argnames=("blocks", "backend", "interpret"))
def int4_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *, blocks: Int4Blocks | None = None,
                backend: str = "gpu", interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """x [M, K] bf16 (or f32) @ int4 W -> [M, N] x.dtype, accumulating in f32.

    w [K//2, N] uint8 (even k low nibble, nibble = q + 8), scale [K//g, N] bf16 with g = K // scale.shape[0].
    backend: "gpu" (Triton) or "tpu" (Mosaic); interpret: True (legacy, either tiling) or, for "tpu",
    `pltpu.InterpretParams()` to run on CPU.
    """
    check_backend(backend)
    g = check_int4_shapes(x, w, scale)
    m, k = x.shape
    blocks = blocks or choose_blocks(m, w.shape[1], k, group_size=g, backend=backend, dtype=x.dtype.name)
    if backend == "gpu":
        return _int4_gpu(x, w, scale, g, blocks, bool(interpret))
    return _int4_tpu(x, w, scale, g, blocks, interpret)
