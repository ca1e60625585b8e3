"""DSA indexer scores kernel (interpret mode on CPU) vs the plain-jnp reference on the same pool: FP8, BF16 and F32
index-key pools, as values or as the engine's stored bits, a traced layer of several, fewer heads than Triton's
16-row dot (padded in the kernel), one and several pages per program, and GLM-5.2's dims (32 heads x 128)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache import quantize_fp8
from pallas_kernels.dsa_index_scores import MAX_BLOCK_TOKENS, choose_blocks, dsa_index_scores
from pallas_kernels.reference_sparse import index_scores_reference

LAYERS, NUM_PAGES = 3, 20
BITS = {"fp8": jnp.uint8, "bf16": jnp.uint16, "f32": jnp.uint32}


def check(*, b: int = 3, heads: int = 4, hd: int = 16, page_size: int = 8, m: int = 6, dtype: str = "fp8",
          bits: bool = True, layer: int = 1, seed: int = 0, **tiling) -> None:
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, heads, hd))
    w = jax.random.normal(ks[1], (b, heads))
    keys = jax.random.normal(ks[2], (LAYERS, NUM_PAGES, page_size, hd))
    if dtype == "fp8":
        pool, sc = quantize_fp8(keys)
    else:
        pool, sc = keys.astype(jnp.bfloat16 if dtype == "bf16" else jnp.float32), None
    bt = jnp.asarray(np.stack([rng.permutation(np.arange(1, NUM_PAGES))[:m] for _ in range(b)]), jnp.int32)
    want = index_scores_reference(q, w, pool, bt, sc, layer=layer)
    stored = jax.lax.bitcast_convert_type(pool, BITS[dtype]) if bits else pool
    fn = jax.jit(lambda q, w, p, bt, s, lay: dsa_index_scores(
        q, w, p, bt, s, layer=lay, value_dtype=pool.dtype if bits else None, interpret=True, **tiling))
    got = np.asarray(fn(q, w, stored, bt, sc, jnp.int32(layer)))
    assert got.shape == (b, m * page_size) and np.isfinite(got).all()
    assert (got != 0).mean() > 0.5  # relu keeps about half of each head's products: the sums are not empty
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,bits", [("fp8", True), ("fp8", False), ("bf16", True), ("f32", True)],
                         ids=["fp8-bits", "fp8-values", "bf16-bits", "f32-bits"])
def test_kernel_matches_reference(dtype, bits):
    check(dtype=dtype, bits=bits, seed=2 * bits + len(dtype))


@pytest.mark.parametrize("page_size,m,pages", [(4, 8, None), (16, 3, None), (8, 6, 2)])
def test_kernel_tilings(page_size, m, pages):
    """default pages per program (several of 4 tokens; one of 16 when 3 pages admit no power of two), explicit"""
    check(page_size=page_size, m=m, pages=pages, heads=5, layer=2, seed=page_size)


def test_kernel_at_glm52_dims():
    """32 indexer heads x 128, pages of 64, a traced indexer layer."""
    check(b=2, heads=32, hd=128, page_size=64, m=4, layer=0, seed=7)


def test_choose_blocks_divides_the_table():
    assert choose_blocks(128, 64).pages * 64 == MAX_BLOCK_TOKENS  # GLM-5.2: 2 pages of 64 per program
    assert choose_blocks(6, 8).pages == 2 and choose_blocks(5, 8).pages == 1
    with pytest.raises(ValueError, match="must divide"):
        dsa_index_scores(jnp.zeros((1, 2, 16)), jnp.zeros((1, 2)), jnp.zeros((1, 4, 8, 16)),
                         jnp.zeros((1, 3), jnp.int32), layer=0, pages=2, interpret=True)
