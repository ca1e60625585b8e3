"""Sparse (DSA) MLA decode kernel (interpret mode on CPU) vs the plain-jnp reference on the same pool: BF16 and FP8
pools, as values or as the engine's stored bits, top-k smaller than the context, padded indices (negative and
past the block table), a row with no valid index, several layers picked by a traced layer, split and step
tilings, and GLM-5.2's per-device dims (8 heads x (512 + 64))."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache import quantize_fp8
from pallas_kernels.reference_sparse import sparse_mla_reference
from pallas_kernels.sparse_mla_decode import choose_blocks, sparse_mla_decode

TOL = 1e-2
LAYERS, NUM_PAGES, MAX_PAGES = 3, 20, 6


def _case(seed: int, *, b: int, heads: int, rank: int, rope: int, page_size: int, topk: int, dtype: str):
    """(q f32, pool, scales | None, block tables, indices): each row's table is random distinct pages (page 0
    never used), its indices distinct tokens of a random context longer than topk, some replaced by padding."""
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 2)
    q = jax.random.normal(ks[0], (b, heads, rank + rope))
    latent = jax.random.normal(ks[1], (LAYERS, NUM_PAGES, page_size, rank + rope)) + 0.5
    pool, sc = (latent.astype(jnp.bfloat16), None) if dtype == "bf16" else quantize_fp8(latent)
    bt = np.stack([rng.permutation(np.arange(1, NUM_PAGES))[:MAX_PAGES] for _ in range(b)]).astype(np.int32)
    idx = np.stack([rng.permutation(MAX_PAGES * page_size)[:topk] for _ in range(b)]).astype(np.int32)
    pad = rng.random(idx.shape) < 0.25
    idx[pad] = rng.choice([-1, MAX_PAGES * page_size, 10 ** 6], size=int(pad.sum()))
    idx[-1] = -1  # the last row has no valid index: its output is 0
    return q, pool, sc, jnp.asarray(bt), jnp.asarray(idx)


def check(*, b: int = 3, heads: int = 4, rank: int = 32, rope: int = 16, page_size: int = 8, topk: int = 40,
          dtype: str = "bf16", bits: bool = False, layer: int = 1, seed: int = 0, **tiling) -> None:
    q, pool, sc, bt, idx = _case(seed, b=b, heads=heads, rank=rank, rope=rope, page_size=page_size, topk=topk,
                                 dtype=dtype)
    kw = dict(kv_lora_rank=rank, softmax_scale=1.0 / math.sqrt(rank + rope))
    want = sparse_mla_reference(q, pool, bt, idx, sc, layer=layer, **kw)
    stored = jax.lax.bitcast_convert_type(pool, jnp.uint8 if dtype == "fp8" else jnp.uint16) if bits else pool
    fn = jax.jit(lambda q, p, bt, i, s, lay: sparse_mla_decode(
        q, p, bt, i, s, layer=lay, value_dtype=pool.dtype if bits else None, interpret=True,
        out_dtype=jnp.float32, **kw, **tiling))
    got = np.asarray(fn(q, stored, bt, idx, sc, jnp.int32(layer)))
    assert got.shape == (b, heads, rank) and np.isfinite(got).all()
    np.testing.assert_array_equal(got[-1], 0.0)
    np.testing.assert_allclose(got, np.asarray(want), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("bits", [False, True], ids=["values", "bits"])
@pytest.mark.parametrize("tiling", [{}, dict(block_k=16, k_splits=2)], ids=["default", "splits"])
def test_kernel_matches_reference(dtype, bits, tiling):
    """top-k 40: default 2 steps of 32 in one split; 16-token steps: 2 splits of 2 steps, the last padded"""
    check(dtype=dtype, bits=bits, seed=len(tiling) * 4 + bits * 2 + (dtype == "fp8"), **tiling)


@pytest.mark.parametrize("page_size,topk", [(16, 8), (64, 40)])  # top-k below one step; pages of 64
def test_kernel_shapes(page_size, topk):
    check(page_size=page_size, topk=topk, heads=5, layer=2, dtype="fp8", bits=True, seed=page_size)


def test_kernel_at_glm52_dims():
    """8 local heads (TP) x (512 + 64), 64 selected of a longer context, f32 and bf16 compute."""
    check(b=2, heads=8, rank=512, rope=64, page_size=16, topk=64, dtype="fp8", bits=True, seed=7)
    check(b=2, heads=8, rank=512, rope=64, page_size=16, topk=64, dtype="bf16", seed=8, compute_dtype=jnp.bfloat16)


def test_choose_blocks_fills_the_gpu_and_keeps_steps_per_split():
    tp = choose_blocks(64, 8, 2048)  # GLM-5.2 TP decode at c = 64: 8 heads in one 16-row block
    assert (tp.block_h, tp.block_k) == (16, 32) and 64 * tp.k_splits >= 128
    one = choose_blocks(1, 8, 2048)
    assert one.k_splits > tp.k_splits and 2048 // (one.block_k * one.k_splits) >= 2
    dp = choose_blocks(8, 64, 2048)  # DP attention: all 64 heads in one block, few splits (their f32 outputs)
    assert (dp.block_h, dp.block_k) == (64, 16) and 1 < dp.k_splits and dp.block_h * dp.k_splits <= 128
