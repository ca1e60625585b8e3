"""TPU sparse (DSA) MLA decode kernel (pallas_kernels/sparse_mla_decode_tpu.py) in interpret mode (legacy
`interpret=True`, the engine's "pallas_tpu_interpret", and TPU interpret mode `pltpu.InterpretParams()`, which
checks the DMAs' bounds and races) vs the plain-jnp reference on the same pool: FP8 / BF16 / F32 pools as the
engine's stored bits, page sizes 8 / 16 / 64, padded indices (negative, past the block table), a row with no
valid index, one and several double-buffered blocks of selected tokens, a split head axis, a traced layer, and
GLM-5.2's per-device dims (8 heads x (512 + 64)); the in-kernel FP8 decoding over all 256 bit patterns."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.cache import quantize_fp8
from pallas_kernels.reference_sparse import sparse_mla_reference
from pallas_kernels.sparse_mla_decode_tpu import _e4m3_to_f32, choose_block_k, sparse_mla_decode_tpu

TOL = 1e-2
LAYERS = 3
BITS = {"fp8": jnp.uint8, "bf16": jnp.uint16, "f32": jnp.uint32}


def _case(seed: int, *, b: int, heads: int, rank: int, rope: int, page_size: int, pages: int, topk: int,
          dtype: str):
    """(q f32, pool values, its stored bits, scales | None, block tables, indices): each row's table is `pages`
    random distinct pool pages (page 0 never used), its indices distinct tokens of its table, ~1/4 of them padding
    (-1, the table's capacity, 10**6); the last row all padding."""
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 2)
    num_pages = 2 * pages + 1
    q = jax.random.normal(ks[0], (b, heads, rank + rope))
    latent = jax.random.normal(ks[1], (LAYERS, num_pages, page_size, rank + rope)) + 0.5
    if dtype == "fp8":
        pool, sc = quantize_fp8(latent)
    else:
        pool, sc = latent.astype(jnp.bfloat16 if dtype == "bf16" else jnp.float32), None
    bt = np.stack([rng.permutation(np.arange(1, num_pages))[:pages] for _ in range(b)]).astype(np.int32)
    idx = np.stack([rng.permutation(pages * page_size)[:topk] for _ in range(b)]).astype(np.int32)
    pad = rng.random(idx.shape) < 0.25
    idx[pad] = rng.choice([-1, pages * page_size, 10 ** 6], size=int(pad.sum()))
    idx[-1] = -1
    bits = jax.lax.bitcast_convert_type(pool, BITS[dtype])
    return q, pool, bits, sc, jnp.asarray(bt), jnp.asarray(idx)


def check(*, b: int = 3, heads: int = 4, rank: int = 32, rope: int = 16, page_size: int = 16, pages: int = 12,
          topk: int = 40, dtype: str = "fp8", layer: int = 1, seed: int = 0, interpret=True, **tiling) -> None:
    q, pool, bits, sc, bt, idx = _case(seed, b=b, heads=heads, rank=rank, rope=rope, page_size=page_size,
                                       pages=pages, topk=topk, dtype=dtype)
    kw = dict(kv_lora_rank=rank, softmax_scale=1.0 / math.sqrt(rank + rope))
    want = sparse_mla_reference(q, pool, bt, idx, sc, layer=layer, **kw)
    fn = jax.jit(lambda q, p, bt, i, s, lay: sparse_mla_decode_tpu(q, p, bt, i, s, layer=lay, interpret=interpret,
                                                                   **kw, **tiling))
    got = np.asarray(fn(q, bits, bt, idx, sc, jnp.int32(layer)))
    assert got.shape == (b, heads, rank) and np.isfinite(got).all()
    np.testing.assert_array_equal(got[-1], 0.0)
    np.testing.assert_allclose(got, np.asarray(want), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "f32"])
@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_kernel_matches_reference(dtype, page_size):
    """top-k 40 of one block (legacy interpret mode, the engine's)"""
    check(dtype=dtype, page_size=page_size, pages=max(2, 96 // page_size), seed=page_size + len(dtype))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_double_buffered_blocks_in_tpu_interpret_mode(dtype):
    """top-k 300: three blocks of 128 (the last mostly padding), each prefetched while the previous is computed;
    TPU interpret mode checks every row DMA's bounds and looks for races on the two buffer slots."""
    check(dtype=dtype, topk=300, pages=24, page_size=16, interpret=pltpu.InterpretParams(detect_races=True),
          seed=11 + len(dtype))


def test_head_blocks_and_a_wider_block():
    """two head blocks of 8 (16 heads), 256 selected tokens per block"""
    check(heads=16, topk=200, pages=16, block_h=8, block_k=256, layer=2, seed=5)


def test_kernel_at_glm52_dims():
    """8 local heads (TP) x (512 + 64), 160 selected tokens (two blocks), FP8 bits; BF16 with bf16 compute"""
    check(b=2, heads=8, rank=512, rope=64, page_size=64, pages=4, topk=160, dtype="fp8", seed=7)
    check(b=2, heads=8, rank=512, rope=64, page_size=16, pages=12, topk=64, dtype="bf16", seed=8,
          compute_dtype=jnp.bfloat16)


def test_fp8_bits_decode_exactly():
    """the kernel's 32-bit-integer decoding of every float8_e4m3fn bit pattern equals the dtype's own conversion
    (NaN for the two NaN patterns)"""
    bits = jnp.arange(256, dtype=jnp.int32)
    want = np.asarray(jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32))
    got = np.asarray(_e4m3_to_f32(bits))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    assert np.signbit(got[128]) and not np.signbit(got[0])  # -0.0 stays negative


def test_block_k_choice_and_rejections():
    assert choose_block_k(2048) == 128 and choose_block_k(40) == 128 and choose_block_k(2048, 512) == 512
    with pytest.raises(ValueError, match="multiple of 128"):
        choose_block_k(2048, 100)
    q, pool, bits, sc, bt, idx = _case(0, b=2, heads=4, rank=32, rope=16, page_size=8, pages=4, topk=8,
                                       dtype="bf16")
    with pytest.raises(ValueError, match="stored bits"):
        sparse_mla_decode_tpu(q, pool, bt, idx, layer=0, kv_lora_rank=32, softmax_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="block_h"):
        sparse_mla_decode_tpu(q, bits, bt, idx, layer=0, kv_lora_rank=32, softmax_scale=0.1, block_h=3,
                              interpret=True)
