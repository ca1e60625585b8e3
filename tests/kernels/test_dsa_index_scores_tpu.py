"""TPU DSA indexer scores kernel (pallas_kernels/dsa_index_scores_tpu.py) in interpret mode (legacy `interpret=True`,
the engine's, and TPU interpret mode, which checks DMA bounds and races) vs the plain-jnp reference on the same
pool: FP8 / BF16 / F32 index-key pools as the engine's stored bits, page sizes 8 / 16 / 64, a traced layer, a
table shorter than one chunk (padded, dropped), several double-buffered blocks and several chunks, GLM-5.2's
dims (32 heads x 128)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.cache import quantize_fp8
from pallas_kernels.dsa_index_scores_tpu import choose_index_blocks, dsa_index_scores_tpu
from pallas_kernels.reference_sparse import index_scores_reference

LAYERS = 3
BITS = {"fp8": jnp.uint8, "bf16": jnp.uint16, "f32": jnp.uint32}


def check(*, b: int = 3, heads: int = 4, hd: int = 16, page_size: int = 16, m: int = 6, dtype: str = "fp8",
          layer: int = 1, seed: int = 0, interpret=True, **tiling) -> None:
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 3)
    num_pages = m + 5
    q = jax.random.normal(ks[0], (b, heads, hd))
    w = jax.random.normal(ks[1], (b, heads))
    keys = jax.random.normal(ks[2], (LAYERS, num_pages, page_size, hd))
    if dtype == "fp8":
        pool, sc = quantize_fp8(keys)
    else:
        pool, sc = keys.astype(jnp.bfloat16 if dtype == "bf16" else jnp.float32), None
    bt = jnp.asarray(np.stack([rng.permutation(np.arange(1, num_pages))[:m] for _ in range(b)]), jnp.int32)
    want = index_scores_reference(q, w, pool, bt, sc, layer=layer)
    fn = jax.jit(lambda q, w, p, bt, s, lay: dsa_index_scores_tpu(q, w, p, bt, s, layer=lay, interpret=interpret,
                                                                  **tiling))
    got = np.asarray(fn(q, w, jax.lax.bitcast_convert_type(pool, BITS[dtype]), bt, sc, jnp.int32(layer)))
    assert got.shape == (b, 1, m * page_size) and np.isfinite(got).all()
    assert (got != 0).mean() > 0.5  # relu keeps about half of each head's products: the sums are not empty
    np.testing.assert_allclose(got[:, 0], np.asarray(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "f32"])
@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_kernel_matches_reference(dtype, page_size):
    """a table of 6 pages: one block of 128-aligned tokens, padded to one chunk (legacy interpret mode)"""
    check(dtype=dtype, page_size=page_size, seed=page_size + len(dtype))


def test_blocks_and_chunks_in_tpu_interpret_mode():
    """pages of 16, 8 per block (128 tokens), chunks of 128 pages: a 140-page table is 2 chunks (the last padded),
    16 double-buffered blocks each; TPU interpret mode checks the page DMAs' bounds and races"""
    check(b=1, page_size=16, m=140, pages_per_block=8, interpret=pltpu.InterpretParams(detect_races=True), seed=3)


def test_kernel_at_glm52_dims():
    """32 indexer heads x 128, pages of 64, a traced indexer layer."""
    check(b=2, heads=32, hd=128, page_size=64, m=16, layer=0, seed=7)


def test_choose_index_blocks():
    assert choose_index_blocks(512, 64) == (8, 512)  # GLM-5.2 decode: 32,768 tokens a call, one chunk
    assert choose_index_blocks(6, 16) == (32, 128) and choose_index_blocks(3000, 16) == (32, 1024)
    with pytest.raises(ValueError, match="multiple of 128 tokens"):
        choose_index_blocks(8, 16, pages_per_block=4)
