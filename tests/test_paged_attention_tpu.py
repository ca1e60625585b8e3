"""TPU-style paged MLA decode kernel in TPU interpret mode (`pltpu.InterpretParams()`, CPU) vs paged_mla_reference.

BF16 pages: 1e-2 abs/rel vs the reference on the same pages. FP8 pages: same tolerance vs the reference computed
on the same FP8 pages and scales (quantization error itself is covered by tests/test_paged_attention.py).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.cache.pages import quantize_fp8
from pallas_kernels.paged_attention_tpu import choose_block_h, paged_mla_decode_tpu
from pallas_kernels.reference_paged import paged_mla_reference

TOL = 1e-2
NUM_PAGES, MAX_PAGES = 28, 4
DV, DR, H = 32, 16, 16  # kv_lora_rank, rope dim, query heads (small shapes keep interpret mode fast)
INTERPRET = pltpu.InterpretParams()  # TPU interpret mode; fails loudly on OOB block reads
# (page_size, lengths, block_h): 0, 1, ps-1, ps, several pages, the full table
CASES = [
    (8, [0, 1, 7, 8, 21, 32], None),
    (16, [16, 40, 64], 8),  # two head blocks
]


def _block_tables(key, b: int) -> np.ndarray:
    """Random non-contiguous, non-repeating page ids."""
    perm = np.asarray(jax.random.permutation(key, NUM_PAGES))
    return perm[: b * MAX_PAGES].reshape(b, MAX_PAGES).astype(np.int32)


def _run(q, pages, bt, lens, sc, block_h):
    scale = 1.0 / math.sqrt(DV + DR)
    got = paged_mla_decode_tpu(q, pages, bt, lens, sc, kv_lora_rank=DV, softmax_scale=scale, block_h=block_h,
                               interpret=INTERPRET)
    return got, scale


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,lengths,block_h", CASES)
def test_mla_tpu_kernel_matches_reference(page_size, lengths, block_h, dtype):
    ks = jax.random.split(jax.random.key(page_size + len(lengths)), 3)
    b = len(lengths)
    lens = jnp.asarray(lengths, jnp.int32)
    q = jax.random.normal(ks[0], (b, H, DV + DR)).astype(jnp.bfloat16)
    latent = jax.random.normal(ks[1], (NUM_PAGES, page_size, DV + DR)) + 0.5  # non-zero mean: p @ V not ~0
    bt = jnp.asarray(_block_tables(ks[2], b))
    pages, sc = (latent.astype(jnp.bfloat16), None) if dtype == "bf16" else quantize_fp8(latent)
    got, scale = _run(q, pages, bt, lens, sc, block_h)
    assert got.shape == (b, H, DV) and got.dtype == jnp.float32
    want = paged_mla_reference(q, pages, bt, lens, sc, kv_lora_rank=DV, softmax_scale=scale)
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[np.asarray(lens) == 0], 0.0)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_tail_tokens_holding_nan_do_not_leak():
    """Tokens past a sequence's length in its last page may hold anything: output must equal the clean reference."""
    page_size, lengths = 8, [1, 7, 13, 30]
    b = len(lengths)
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (b, H, DV + DR)).astype(jnp.bfloat16)
    clean = jax.random.normal(ks[1], (NUM_PAGES, page_size, DV + DR)).astype(jnp.bfloat16)
    bt = _block_tables(ks[2], b)
    dirty = np.array(clean.astype(jnp.float32))
    for row, n in enumerate(lengths):
        flat = dirty[bt[row]].reshape(-1, DV + DR)
        flat[n:] = np.nan
        dirty[bt[row]] = flat.reshape(MAX_PAGES, page_size, DV + DR)
    lens = jnp.asarray(lengths, jnp.int32)
    got, scale = _run(q, jnp.asarray(dirty, jnp.bfloat16), jnp.asarray(bt), lens, None, None)
    want = paged_mla_reference(q, clean, jnp.asarray(bt), lens, kv_lora_rank=DV, softmax_scale=scale)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


def test_choose_block_h():
    assert choose_block_h(128) == 128 and choose_block_h(16, 8) == 8
    with pytest.raises(ValueError):
        choose_block_h(16, 4)
