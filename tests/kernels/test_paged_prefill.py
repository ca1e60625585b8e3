"""Paged PREFILL attention: the Pallas kernels (GPU layout in legacy interpret mode, TPU layout in TPU interpret
mode) and the blockwise XLA path against the dense f32 reference; cross-lowering for cuda and tpu at real shapes;
per-stage memory budgets of the default blocks; the blockwise path's memory against the context length.

Tolerance (derived, per output element, vs the dense reference on the SAME pages and scales). The kernels differ
from the reference only by rounding: (a) the probabilities are cast to the value dtype (bf16) before P @ V, a
relative error <= 2^-9 on each term, so <= 2^-9 * max_s |v[s, d]| on the output; (b) the TPU MLA kernel rounds
each fp8 row times its scale to bf16 before the dots (GPU and TPU GQA: fp8 -> bf16 is exact, the scales multiply
in f32), an element error e <= 2^-9 |x|. A logit error of at most D = softmax_scale * max_s sum_d |q[d]| e_k[s, d] moves
the softmax by a factor in [exp(-2D), exp(2D)], so
    |o - o_ref| <= (exp(2D) - 1) * max_s |v[s, d]| + max_s e_v[s, d] + 2^-8 * max_s |v[s, d]| + 1e-5,
the 2^-8 covering (a) twice over and the 1e-5 the f32 accumulation order. The blockwise path with f32 dots (its
default) is f32 throughout: 1e-5 * (1 + max |v|); with bf16 dots ("blockwise_bf16", what the engine runs for a bf16
model) it rounds as the GPU kernel does, (a) only (fp8 rows are exact in bf16, their scales multiply in f32).

Every pool slot outside a row's context (tail slots of the last page, the null page 0 that padding table
entries point to, unused pages) holds NaN, so any read of it that is not masked shows up as a non-finite output.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.cache import quantize_fp8
from jaxserve.models.prefill_attention_xla import prefill_gqa_blockwise, prefill_mla_blockwise
from kernel_pools import LAYER, in_pool
from pallas_kernels.paged_prefill import PrefillBlocks, choose_blocks, paged_prefill_gqa, paged_prefill_mla
from pallas_kernels.reference_prefill import prefill_gqa_dense, prefill_mla_dense
from tests.kernel_lowering import (H200_SMEM_BYTES, TPU_SCOPED_VMEM_BYTES, TPU_SMEM_BYTES, lower_for, sds,
                                   stage_bytes)

TPU_INTERPRET = pltpu.InterpretParams()  # TPU interpret mode: out-of-bounds DMAs raise
BF16_ROUND = 2.0 ** -9
IMPLS = ["gpu", "tpu", "blockwise", "blockwise_bf16"]

# (page_size, ctx_lens, chunk_lens, T, M): a chunk in the middle of a sequence, a padding row (chunk 0, ctx 0),
# a chunk at the end of a long context, a first chunk, a one-token chunk
CASES = [
    (8, [20, 0, 48], [12, 0, 5], 12, 7),
    (16, [16, 70, 33], [16, 9, 1], 16, 5),
]
TOY_MLA = dict(heads=4, rank=32, rope=16)
TOY_GQA = dict(hq=6, hkv=2, d=16)
KIMI_MLA = dict(heads=8, rank=512, rope=64)  # Kimi K2.x / GLM-5 per device (TP 8): 8 local heads, 512 + 64
GLM45_GQA = dict(hq=12, hkv=1, d=128)  # GLM-4.5 per device: 12 query heads, 1 kv head, head_dim 128
# small blocks: the toy shapes run several row blocks and several key blocks (None: the defaults)
TOY_BLOCKS = dict(block_r=16, block_k=16)


def _params(grid: list[tuple], fast: set[tuple]) -> list:
    """pytest params over `grid`; interpret-mode kernel runs outside `fast` are marked slow (each costs seconds
    of compilation on CPU; the fast set still covers both backends, both page sizes and both page dtypes)."""
    return [pytest.param(*c, marks=() if (c[0].startswith("blockwise") or c in fast) else pytest.mark.slow,
                         id="-".join(map(str, c))) for c in grid]


TOY_GRID = [(i, c, d) for i in IMPLS for c in range(len(CASES)) for d in ("bf16", "fp8")]
REAL_GRID = [(i, d) for i in IMPLS for d in ("bf16", "fp8")]


# ---------------------------------------------------------------------------------------------------------------
# Batches, pools and the bound.


def _batch(seed: int, page_size: int, ctx_lens, chunk_lens, t: int, m: int):
    """-> (block_tables [B, M] int32: distinct random pages, entries past the context 0; positions [B, T] int32:
    chunk tokens at ctx - chunk + t, padding slots 0 as the scheduler writes them; ctx [B] int32; num_pages)."""
    b = len(ctx_lens)
    num_pages = b * m + 3
    rng = np.random.default_rng(seed)
    bt = rng.permutation(np.arange(1, num_pages))[: b * m].reshape(b, m).astype(np.int32)
    for i, n in enumerate(ctx_lens):
        bt[i, -(-n // page_size):] = 0  # padding entries: the null page
    ctx, chunk = np.asarray(ctx_lens, np.int32), np.asarray(chunk_lens, np.int32)
    tt = np.arange(t)[None]
    pos = np.where(tt < chunk[:, None], ctx[:, None] - chunk[:, None] + tt, 0).astype(np.int32)
    return bt, pos, ctx, num_pages


def _pool(seed: int, shape, bt: np.ndarray, ctx_lens, page_size: int) -> np.ndarray:
    """f32 pool [P, ps, ...], NaN in every slot that is not part of some row's context."""
    x = np.asarray(jax.random.normal(jax.random.key(seed), shape), np.float32) + 0.3  # mean != 0: P @ V not ~0
    live = np.zeros(shape[:2], bool)
    for row, n in zip(bt, ctx_lens):
        for s in range(n):
            live[row[s // page_size], s % page_size] = True
    x[~live] = np.nan
    return x


def _quantize(x: np.ndarray, dtype: str):
    """-> (pages, scales | None, dequantized f32 as the reference sees it)."""
    if dtype == "bf16":
        pages = jnp.asarray(x, jnp.bfloat16)
        return pages, None, np.asarray(pages, np.float32)
    pages, scales = quantize_fp8(jnp.asarray(x))
    return pages, scales, np.asarray(pages, np.float32) * np.asarray(scales)[..., None]


def _context(x: np.ndarray, bt: np.ndarray, page_size: int, n: int, row: int) -> np.ndarray:
    """Row `row`'s first n context rows of a dequantized pool: [n, ...]."""
    return x[bt[row]].reshape(-1, *x.shape[2:])[:n]


def _bound(qg: np.ndarray, k: list, v: list, ctx_lens, softmax_scale: float, rel: float) -> np.ndarray:
    """qg [B, T, Hkv, G, Dk] f32; k[b] [n_b, Hkv, Dk], v[b] [n_b, Hkv, Dv] (context rows); rel: the kernel's
    relative rounding of K/V elements. -> [B, T, Hkv, G, Dv] (the module docstring's bound)."""
    out = np.zeros(qg.shape[:-1] + (v[0].shape[-1],), np.float32)
    for b, n in enumerate(ctx_lens):
        if n == 0:
            continue
        dmax = softmax_scale * np.einsum("tkgd,skd->tkgs", np.abs(qg[b]), rel * np.abs(k[b])).max(-1)
        vmax = np.abs(v[b]).max(0)  # [Hkv, Dv]
        out[b] = np.expm1(2 * dmax)[..., None] * vmax[None, :, None] + (rel + 2 * BF16_ROUND) * vmax[None, :, None]
    return out + 1e-5


def _check(got, want, bound, ctx_lens):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.isfinite(got).all() and np.isfinite(want).all()
    np.testing.assert_array_equal(got[np.asarray(ctx_lens) == 0], 0.0)  # rows that see no key give 0
    err = np.abs(got - want)
    assert np.all(err <= bound), float((err - bound).max())


def _interpret(impl: str):
    return TPU_INTERPRET if impl == "tpu" else True


# ---------------------------------------------------------------------------------------------------------------
# MLA (absorbed): kernels and blockwise vs dense.


def _mla_case(impl, dtype, page_size, ctx_lens, chunk_lens, t, m, dims, blocks, seed):
    bt, pos, ctx, num_pages = _batch(seed, page_size, ctx_lens, chunk_lens, t, m)
    n, r, dr = dims["heads"], dims["rank"], dims["rope"]
    scale = 1.0 / math.sqrt(r + dr)
    q = jax.random.normal(jax.random.key(seed + 1), (len(ctx_lens), t, n, r + dr)).astype(jnp.bfloat16)
    pages, sc, deq = _quantize(_pool(seed + 2, (num_pages, page_size, r + dr), bt, ctx_lens, page_size), dtype)
    args = (q, pages, jnp.asarray(bt), jnp.asarray(pos), jnp.asarray(ctx), sc)
    want = prefill_mla_dense(*args, kv_lora_rank=r, softmax_scale=scale)
    if impl == "blockwise":
        got = prefill_mla_blockwise(*args, kv_lora_rank=r, softmax_scale=scale, block_pages=2)
        tol = 1e-5 * (1 + np.nanmax(np.abs(deq)))
        _check(got, want, tol, ctx_lens)
        return
    if impl == "blockwise_bf16":
        got = prefill_mla_blockwise(*args, kv_lora_rank=r, softmax_scale=scale, block_pages=2, dot_dtype=jnp.bfloat16)
    elif impl in ("gpu_pool", "tpu_pool"):  # the engine's GPU and TPU form: the whole pool's bits and the layer
        backend = impl.split("_")[0]
        got = paged_prefill_mla(q, in_pool(pages), *args[2:5], in_pool(sc), layer=jnp.int32(LAYER), kv_lora_rank=r,
                                softmax_scale=scale, backend=backend, interpret=_interpret(backend), **blocks)
    else:
        got = paged_prefill_mla(*args, kv_lora_rank=r, softmax_scale=scale, backend=impl,
                                interpret=_interpret(impl), **blocks)
    c = [_context(deq, bt, page_size, nn, i)[:, None] for i, nn in enumerate(ctx_lens)]  # one latent "kv head"
    rel = BF16_ROUND if (impl.startswith("tpu") and dtype == "fp8") else 0.0
    qg = np.asarray(q, np.float32)[:, :, None]
    bound = _bound(qg, c, [x[..., :r] for x in c], ctx_lens, scale, rel)[:, :, 0]
    _check(got, want, bound, ctx_lens)


@pytest.mark.parametrize("impl,case,dtype", _params(TOY_GRID, {("gpu", 1, "fp8"), ("tpu", 0, "fp8")}))
def test_mla_toy(impl, case, dtype):
    _mla_case(impl, dtype, *CASES[case], TOY_MLA, TOY_BLOCKS, seed=10 * case)


@pytest.mark.parametrize("impl,dtype", _params(REAL_GRID, {("gpu", "bf16"), ("tpu", "bf16")}))
def test_mla_real_dims(impl, dtype):
    """Kimi / GLM-5 per-device dims, default blocks, few pages (16-token pages, 64-token table)."""
    _mla_case(impl, dtype, 16, [40, 64], [16, 10], 16, 4, KIMI_MLA, {}, seed=5)


# ---------------------------------------------------------------------------------------------------------------
# GQA: kernels and blockwise vs dense.


def _gqa_case(impl, dtype, page_size, ctx_lens, chunk_lens, t, m, dims, blocks, seed):
    bt, pos, ctx, num_pages = _batch(seed, page_size, ctx_lens, chunk_lens, t, m)
    hq, hkv, d = dims["hq"], dims["hkv"], dims["d"]
    scale = 1.0 / math.sqrt(d)
    b = len(ctx_lens)
    q = jax.random.normal(jax.random.key(seed + 1), (b, t, hq, d)).astype(jnp.bfloat16)
    shape = (num_pages, page_size, hkv, d)
    kp, ks, kd = _quantize(_pool(seed + 2, shape, bt, ctx_lens, page_size) * 1.5, dtype)
    vp, vs, vd = _quantize(_pool(seed + 3, shape, bt, ctx_lens, page_size), dtype)
    args = (q, kp, vp, jnp.asarray(bt), jnp.asarray(pos), jnp.asarray(ctx), ks, vs)
    want = prefill_gqa_dense(*args, softmax_scale=scale)
    if impl == "blockwise":
        got = prefill_gqa_blockwise(*args, softmax_scale=scale, block_pages=2)
        _check(got, want, 1e-5 * (1 + np.nanmax(np.abs(vd))), ctx_lens)
        return
    if impl == "blockwise_bf16":
        got = prefill_gqa_blockwise(*args, softmax_scale=scale, block_pages=2, dot_dtype=jnp.bfloat16)
    elif impl in ("gpu_pool", "tpu_pool"):  # the engine's form: the whole pool's bits and the layer
        backend = impl[:3]
        got = paged_prefill_gqa(q, in_pool(kp), in_pool(vp), *args[3:6], in_pool(ks), in_pool(vs),
                                layer=jnp.int32(LAYER), softmax_scale=scale, backend=backend,
                                interpret=_interpret(backend), **blocks)
    else:
        got = paged_prefill_gqa(*args, softmax_scale=scale, backend=impl, interpret=_interpret(impl), **blocks)
    rel = 0.0  # every GQA kernel multiplies the FP8 scales in f32 (the TPU one too, on the logits and probabilities)
    ctx_k = [_context(kd, bt, page_size, n, i) for i, n in enumerate(ctx_lens)]
    ctx_v = [_context(vd, bt, page_size, n, i) for i, n in enumerate(ctx_lens)]
    qg = np.asarray(q, np.float32).reshape(b, t, hkv, hq // hkv, d)
    bound = _bound(qg, ctx_k, ctx_v, ctx_lens, scale, rel).reshape(b, t, hq, d)
    _check(got, want, bound, ctx_lens)


@pytest.mark.parametrize("impl,case,dtype", _params(TOY_GRID, {("gpu", 0, "fp8"), ("tpu", 1, "fp8")}))
def test_gqa_toy(impl, case, dtype):
    _gqa_case(impl, dtype, *CASES[case], TOY_GQA, TOY_BLOCKS, seed=10 * case + 3)


@pytest.mark.parametrize("impl,dtype", _params(REAL_GRID, {("gpu", "bf16"), ("tpu", "bf16")}))
def test_gqa_real_dims(impl, dtype):
    """GLM-4.5 per-device dims (12 query heads, 1 kv head, head_dim 128), default blocks, few pages."""
    _gqa_case(impl, dtype, 16, [40, 64], [16, 10], 16, 4, GLM45_GQA, {}, seed=7)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_kernels_read_a_layer_of_the_whole_pool(dtype):
    """The engine's GPU prefill hands the Triton kernels the whole pool's bits [L, P, ps, ...] and the layer (no layer
    slice for XLA:GPU to copy): the dense reference's output on that layer; NaN in the other layers does not leak."""
    _mla_case("gpu_pool", dtype, *CASES[1], TOY_MLA, TOY_BLOCKS, seed=31)
    _gqa_case("gpu_pool", dtype, *CASES[1], TOY_GQA, TOY_BLOCKS, seed=33)


@pytest.mark.parametrize("dtype,case", [pytest.param("bf16", 1, marks=pytest.mark.slow), ("fp8", 1),
                                        pytest.param("fp8", 0, marks=pytest.mark.slow)])  # fp8: bits + scales
def test_tpu_gqa_kernel_reads_a_layer_of_the_whole_pool(dtype, case):
    """The engine's TPU GQA prefill (and speculative verify, over the FP8 decode pool) hands the Mosaic kernel the
    whole pool's bits, the whole [L, P, ps, Hkv] scale pools and the layer (XLA:TPU copied each layer's K and V
    slice to the kernel's operand, GLM-4.5 on v5p): the dense reference's output on that layer; NaN in the other
    layers' pages and scales does not leak. Case 0 (8-token pages, 16-key blocks, 2 kv heads): several pages'
    scale rows of both heads spread into one block's row."""
    _gqa_case("tpu_pool", dtype, *CASES[case], TOY_GQA, TOY_BLOCKS, seed=35)


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=pytest.mark.slow), "fp8"])
def test_tpu_mla_kernel_reads_a_layer_of_the_whole_pool(dtype):
    """The engine's TPU MLA prefill hands the Mosaic kernel the whole pool's bits [L, P, ps, D] and the layer (a layer
    slice was copied whole per call by XLA:TPU v6e): the dense reference's output on that layer; NaN in the other
    layers does not leak (TPU interpret mode)."""
    _mla_case("tpu_pool", dtype, *CASES[1], TOY_MLA, TOY_BLOCKS, seed=35)


def test_a_layer_goes_with_the_whole_pool():
    """`layer` with one layer's pages (TPU), or the whole pool without it (GPU), is refused."""
    q, pool = jnp.zeros((1, 4, 4, 48), jnp.bfloat16), jnp.zeros((3, 8, 8, 48), jnp.bfloat16)
    bt, pos, ctx = jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="layer"):
        paged_prefill_mla(q, pool[0], bt, pos, ctx, layer=1, kv_lora_rank=32, softmax_scale=0.1, backend="tpu")
    with pytest.raises(ValueError, match="layer"):
        paged_prefill_mla(q, pool, bt, pos, ctx, kv_lora_rank=32, softmax_scale=0.1, backend="gpu", interpret=True)


# ---------------------------------------------------------------------------------------------------------------
# The causal limit: key blocks past a query block's last visible key are never read.


def test_tpu_skips_key_blocks_past_the_causal_limit():
    """Table entries past every query's causal limit hold out-of-range page ids: TPU interpret mode raises on an
    out-of-bounds DMA, so a clean run proves those pages are never copied; the same id inside the limit raises."""
    page_size, r, dr = 8, 32, 16
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, r + dr)).astype(jnp.bfloat16)
    pages = jax.random.normal(jax.random.key(1), (6, page_size, r + dr)).astype(jnp.bfloat16)
    pos = jnp.arange(4, 12, dtype=jnp.int32)[None]  # a chunk at positions 4..11: keys 0..11, pages 0 and 1
    ctx = jnp.asarray([12], jnp.int32)
    run = functools.partial(paged_prefill_mla, kv_lora_rank=r, softmax_scale=0.1, backend="tpu",
                            interpret=TPU_INTERPRET, block_r=16, block_k=page_size)
    bad = 10 ** 6
    got = run(q, pages, jnp.asarray([[3, 5, bad, bad]], jnp.int32), pos, ctx)
    want = prefill_mla_dense(q, pages, jnp.asarray([[3, 5, 0, 0]], jnp.int32), pos, ctx, kv_lora_rank=r,
                             softmax_scale=0.1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-2, rtol=1e-2)
    try:
        with pytest.raises(Exception, match="(?i)out-of-bounds"):  # negative control: a page inside the limit
            jax.block_until_ready(run(q, pages, jnp.asarray([[3, bad, 0, 0]], jnp.int32), pos, ctx))
    finally:
        pltpu.reset_tpu_interpret_mode_state()


# ---------------------------------------------------------------------------------------------------------------
# Cross-lowering at real shapes, and the per-stage budgets of the default blocks.

CONTEXT = 262_144
PAGE = 16
BATCH = 4


def _mla_shapes(t: int, fp8: bool, batch: int = BATCH, context: int = CONTEXT):
    m = context // PAGE
    dt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    dl = KIMI_MLA["rank"] + KIMI_MLA["rope"]
    args = [sds((batch, t, KIMI_MLA["heads"], dl), jnp.bfloat16), sds((m + 1, PAGE, dl), dt),
            sds((batch, m), jnp.int32), sds((batch, t), jnp.int32), sds((batch,), jnp.int32)]
    return args + ([sds((m + 1, PAGE), jnp.float32)] if fp8 else [])


def _gqa_shapes(t: int, fp8: bool, batch: int = BATCH, context: int = CONTEXT):
    m = context // PAGE
    dt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    hq, hkv, d = GLM45_GQA["hq"], GLM45_GQA["hkv"], GLM45_GQA["d"]
    kv = sds((m + 1, PAGE, hkv, d), dt)
    args = [sds((batch, t, hq, d), jnp.bfloat16), kv, kv, sds((batch, m), jnp.int32), sds((batch, t), jnp.int32),
            sds((batch,), jnp.int32)]
    return args + ([sds((m + 1, PAGE, hkv), jnp.float32)] * 2 if fp8 else [])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("chunk", [256, 512])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_cross_lowering_real_shapes(platform, chunk, fp8):
    """Kimi MLA and GLM-4.5 GQA at chunk 256 / 512 over block tables of 262,144 tokens lower for the platform."""
    backend = "gpu" if platform == "cuda" else "tpu"
    target = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    mla = functools.partial(paged_prefill_mla, kv_lora_rank=KIMI_MLA["rank"], softmax_scale=0.07, backend=backend)
    gqa = functools.partial(paged_prefill_gqa, softmax_scale=0.09, backend=backend)
    for fn, shapes in ((mla, _mla_shapes(chunk, fp8)), (gqa, _gqa_shapes(chunk, fp8))):
        assert target in lower_for(fn, *shapes, platform=platform)


def test_cross_lowering_rejects_bad_blocks():
    """Negative control: the lowering checks can fail. Triton needs power-of-two shapes (24 query rows)."""
    mla = functools.partial(paged_prefill_mla, kv_lora_rank=KIMI_MLA["rank"], softmax_scale=0.07, backend="gpu",
                            block_r=24)
    with pytest.raises(ValueError, match="power of 2"):
        lower_for(mla, *_mla_shapes(16, False, batch=1, context=256), platform="cuda")


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def _gpu_smem(blocks: PrefillBlocks, key_widths: list[int], value_tiles: int) -> int:
    """Shared memory of one Triton program (bf16 compute): the query tiles once, the key tiles (and GQA's value
    tile) per pipeline stage, and the bf16 probabilities feeding P @ V. MLA: key_widths [rank, rope], V reuses
    the rank-wide key tile (value_tiles 0); GQA: [D], value_tiles 1."""
    br, bk = blocks.block_r, blocks.block_k
    once = stage_bytes([((br, w), jnp.bfloat16) for w in key_widths] + [((br, bk), jnp.bfloat16)], buffers=1)
    tiles = [((bk, w), jnp.bfloat16) for w in key_widths] + [((bk, key_widths[0]), jnp.bfloat16)] * value_tiles
    return once + stage_bytes(tiles, buffers=blocks.num_stages)


def _tpu_vmem(blocks: PrefillBlocks, dk: int, dv: int, kv_bufs: int, pages_dtype, fp8: bool) -> int:
    """VMEM of one Mosaic program with (8, 128) tiling (lanes padded to 128): double-buffered q / positions / out
    blocks, the two-slot page buffers (and scale columns), the softmax state and the [br, bk] temporaries."""
    br, bk = blocks.block_r, blocks.block_k
    lanes = _pad(dk, 128)
    pipelined = stage_bytes([((br, lanes), jnp.bfloat16), ((br, 128), jnp.int32), ((br, _pad(dv, 128)),
                                                                                   jnp.float32)], buffers=2)
    scratch = stage_bytes([((bk, lanes), pages_dtype)] * kv_bufs + [((bk, 128), jnp.float32)] * (kv_bufs * fp8),
                          buffers=2)
    state = stage_bytes([((br, _pad(dv, 128)), jnp.float32), ((br, 128), jnp.float32), ((br, 128), jnp.float32)],
                        buffers=1)
    temps = stage_bytes([((br, bk), jnp.float32)] * 3 + [((bk, lanes), jnp.float32)] * kv_bufs, buffers=1)
    return pipelined + scratch + state + temps


def test_default_blocks_fit_the_budgets():
    """Default blocks at the real dims: Triton shared memory <= H200's 227 KiB, Mosaic VMEM <= the scoped limit,
    the TPU SMEM (one row's block table, double-buffered, plus the scalar prefetch) bounded at 262,144 tokens.
    Negative controls: larger blocks exceed each budget, so the check can fail."""
    r, dr, n = KIMI_MLA["rank"], KIMI_MLA["rope"], KIMI_MLA["heads"]
    g, d = GLM45_GQA["hq"] // GLM45_GQA["hkv"], GLM45_GQA["d"]
    for chunk in (256, 512):
        gpu_mla = choose_blocks("gpu", mla=True, rows=chunk * n, page_size=PAGE)
        gpu_gqa = choose_blocks("gpu", mla=False, rows=chunk * g, page_size=PAGE)
        assert _gpu_smem(gpu_mla, [r, dr], 0) <= H200_SMEM_BYTES
        assert _gpu_smem(gpu_gqa, [d], 1) <= H200_SMEM_BYTES
        for fp8, dt in ((False, jnp.bfloat16), (True, jnp.float8_e4m3fn)):
            tpu_mla = choose_blocks("tpu", mla=True, rows=chunk * n, page_size=PAGE)
            tpu_gqa = choose_blocks("tpu", mla=False, rows=chunk * g, page_size=PAGE)
            assert _tpu_vmem(tpu_mla, r + dr, r, 1, dt, fp8) <= TPU_SCOPED_VMEM_BYTES
            assert _tpu_vmem(tpu_gqa, d, d, 2, dt, fp8) <= TPU_SCOPED_VMEM_BYTES
        row_blocks = 8 * -(-chunk * g // tpu_gqa.block_r)  # scalar prefetch: key-block counts at batch 8
        smem = 2 * _pad(CONTEXT // PAGE, 128) * 4 + 4 * (row_blocks + 8)
        assert smem <= TPU_SMEM_BYTES // 4
    big = PrefillBlocks(block_r=128, block_k=128, num_warps=8, num_stages=2)
    assert _gpu_smem(big, [r, dr], 0) > H200_SMEM_BYTES
    assert _tpu_vmem(PrefillBlocks(4096, 2048), r + dr, r, 1, jnp.bfloat16, False) > TPU_SCOPED_VMEM_BYTES


def test_choose_blocks_rules():
    assert choose_blocks("gpu", mla=True, rows=4096, page_size=16) == PrefillBlocks(64, 32, 8, 2)
    assert choose_blocks("tpu", mla=False, rows=12 * 512, page_size=16).block_r == 256
    assert choose_blocks("gpu", mla=False, rows=24, page_size=128).block_k == 128  # at least one page
    with pytest.raises(ValueError):
        choose_blocks("gpu", mla=True, rows=64, page_size=16, block_k=24)  # not a multiple of the page
    with pytest.raises(ValueError):
        choose_blocks("cpu", mla=True, rows=64, page_size=16)


# ---------------------------------------------------------------------------------------------------------------
# Memory: the blockwise XLA path's temporaries do not grow with the context; the dense reference's do.


def _temp_bytes(fn, shapes, **kw) -> int:
    return fn.lower(*shapes, **kw).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_blockwise_memory_does_not_grow_with_context(kind):
    """Chunk 256 at 8k and 16k tokens of context (batch 1, real dims): the blockwise temporaries may grow by at
    most the block table's own growth (+ 64 KiB of slack); the dense reference's grow by >= T * H * dS * 4 bytes
    (its [T, S] logits)."""
    t, small, large = 256, 8192, 16384
    if kind == "mla":
        shapes = lambda s: _mla_shapes(t, False, batch=1, context=s)  # noqa: E731
        kw, heads = dict(kv_lora_rank=KIMI_MLA["rank"], softmax_scale=0.07), KIMI_MLA["heads"]
        blockwise, dense = prefill_mla_blockwise, prefill_mla_dense
    else:
        shapes = lambda s: _gqa_shapes(t, False, batch=1, context=s)  # noqa: E731
        kw, heads = dict(softmax_scale=0.09), GLM45_GQA["hq"]
        blockwise, dense = prefill_gqa_blockwise, prefill_gqa_dense
    bw = [_temp_bytes(blockwise, shapes(s), **kw) for s in (small, large)]
    dn = [_temp_bytes(dense, shapes(s), **kw) for s in (small, large)]
    table_growth = (large - small) // PAGE * 4
    assert bw[1] - bw[0] <= table_growth + 64 * 1024, bw
    assert dn[1] - dn[0] >= t * heads * (large - small) * 4, dn
    assert bw[1] < dn[0] / 4, (bw, dn)  # and the blockwise path is far below the dense one at 8k already
