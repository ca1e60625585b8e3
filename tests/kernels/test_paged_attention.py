"""Pallas paged decode attention (interpret mode on CPU) vs the plain-jnp references, BF16 and FP8 pages.

FP8 bound: reference_paged.fp8_error_bound (derived there, checked per output element; each quantization error
within half an e4m3 ulp, see test_pages.fp8_bound). The kernel's own rounding (probabilities cast to bf16
before P @ V) adds at most the BF16 tolerance below.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache import quantize_fp8
from kernel_pools import LAYER, LAYERS, in_pool
from pallas_kernels.paged_attention import TARGET_PROGRAMS, choose_blocks, paged_gqa_decode, paged_mla_decode
from pallas_kernels.reference_paged import fp8_error_bound, paged_gqa_reference, paged_mla_reference

BF16_TOL = 1e-2
NUM_PAGES, MAX_PAGES = 24, 6
DV, DR, H = 32, 16, 4  # MLA: kv_lora_rank, rope dim, query heads
HQ, HKV, D = 6, 2, 16  # GQA
# (page_size, lengths, tiling): lengths cover 0, 1, page-1, page, several pages, the full table
CASES = [
    (8, [1, 7, 8], dict(pages_per_compute_block=2, k_splits=2)),  # several inner steps, an empty split
    (8, [29], dict(pages_per_compute_block=2, k_splits=2)),
    (16, [0, 16, 96], {}),  # default tiling
    (16, [33], dict(pages_per_compute_block=1, k_splits=3)),
    (16, [0, 37, 96], dict(pages_per_compute_block=1, page_splits=4, k_splits=2)),  # pages read in 4 parts
]


def _block_tables(key, b: int, num_pages: int = NUM_PAGES, max_pages: int = MAX_PAGES) -> np.ndarray:
    """Random non-contiguous, non-repeating page ids (page 0 = null page never used)."""
    perm = np.asarray(jax.random.permutation(key, np.arange(1, num_pages)))
    return perm[: b * max_pages].reshape(b, max_pages).astype(np.int32)


def _gather_f32(x, bt):
    x = np.asarray(x, np.float32)[bt]
    return x.reshape(bt.shape[0], -1, *x.shape[3:])


def _check(got, want, fp8_src=None, bound=None):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=BF16_TOL, rtol=BF16_TOL)
    if fp8_src is not None:
        err = np.abs(got - fp8_src)
        assert np.all(err <= bound + BF16_TOL), (err - bound).max()


def check_mla(kernel, *, page_size: int, lengths: list[int], dtype: str, heads: int = H, rank: int = DV,
              rope: int = DR, q_dtype=jnp.bfloat16, num_pages: int = NUM_PAGES, max_pages: int = MAX_PAGES,
              seed: int = 0, **kernel_kwargs) -> float:
    """Run `kernel` (paged_mla_decode's contract) on random pages; check it against the reference on the same
    pages (BF16_TOL) and, for fp8, against the exact f32 pages within fp8_error_bound + BF16_TOL. -> max abs
    error vs the same-pages reference."""
    ks = jax.random.split(jax.random.key(seed), 3)
    b = len(lengths)
    lens = jnp.asarray(lengths, jnp.int32)
    q = jax.random.normal(ks[0], (b, heads, rank + rope)).astype(q_dtype)
    latent = jax.random.normal(ks[1], (num_pages, page_size, rank + rope)) + 0.5  # f32 "true" rows; p @ V not ~0
    bt = _block_tables(ks[2], b, num_pages, max_pages)
    scale = 1.0 / math.sqrt(rank + rope)
    pages, sc = (latent.astype(jnp.bfloat16), None) if dtype == "bf16" else quantize_fp8(latent)
    got = kernel(q, pages, jnp.asarray(bt), lens, sc, kv_lora_rank=rank, softmax_scale=scale, **kernel_kwargs)
    assert got.shape == (b, heads, rank) and got.dtype == jnp.float32
    want = paged_mla_reference(q, pages, jnp.asarray(bt), lens, sc, kv_lora_rank=rank, softmax_scale=scale)
    np.testing.assert_array_equal(np.asarray(got)[np.asarray(lens) == 0], 0.0)
    if dtype == "bf16":
        _check(got, want)
    else:
        exact = paged_mla_reference(q, latent, jnp.asarray(bt), lens, kv_lora_rank=rank, softmax_scale=scale)
        c = _gather_f32(latent, bt)[:, :, None]  # [B, T, 1, Dl]: one shared latent "head"
        c8 = np.asarray(_gather_f32(pages, bt) * np.asarray(sc)[bt].reshape(b, -1, 1))[:, :, None]
        qf = np.asarray(q, np.float32)[:, None]  # [B, 1, H, Dl]
        bound = fp8_error_bound(qf, c, c8, c[..., :rank], c8[..., :rank], lengths, scale)[:, 0]
        _check(got, want, np.asarray(exact), bound)
    return float(np.abs(np.asarray(got) - np.asarray(want)).max())


def check_gqa(kernel, *, page_size: int, lengths: list[int], dtype: str, q_heads: int = HQ, kv_heads: int = HKV,
              head_dim: int = D, q_dtype=jnp.bfloat16, num_pages: int = NUM_PAGES, max_pages: int = MAX_PAGES,
              seed: int = 0, **kernel_kwargs) -> float:
    """As check_mla, for paged_gqa_decode's contract."""
    ks = jax.random.split(jax.random.key(seed), 4)
    b = len(lengths)
    lens = jnp.asarray(lengths, jnp.int32)
    q = jax.random.normal(ks[0], (b, q_heads, head_dim)).astype(q_dtype)
    k = jax.random.normal(ks[1], (num_pages, page_size, kv_heads, head_dim)) * 2.0
    v = jax.random.normal(ks[2], (num_pages, page_size, kv_heads, head_dim)) + 0.5
    bt = _block_tables(ks[3], b, num_pages, max_pages)
    scale = 1.0 / math.sqrt(head_dim)
    if dtype == "bf16":
        kp, vp, k_s, v_s = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None
    else:
        (kp, k_s), (vp, v_s) = quantize_fp8(k), quantize_fp8(v)
    got = kernel(q, kp, vp, jnp.asarray(bt), lens, k_s, v_s, softmax_scale=scale, out_dtype=jnp.float32,
                 **kernel_kwargs)
    assert got.shape == (b, q_heads, head_dim)
    want = paged_gqa_reference(q, kp, vp, jnp.asarray(bt), lens, k_s, v_s, softmax_scale=scale)
    np.testing.assert_array_equal(np.asarray(got)[np.asarray(lens) == 0], 0.0)
    if dtype == "bf16":
        _check(got, want)
    else:
        exact = paged_gqa_reference(q, k, v, jnp.asarray(bt), lens, softmax_scale=scale)
        deq = lambda x, s: _gather_f32(x, bt) * _gather_f32(s, bt)[..., None]  # noqa: E731
        qf = np.asarray(q, np.float32).reshape(b, kv_heads, q_heads // kv_heads, head_dim)
        bound = fp8_error_bound(qf, _gather_f32(k, bt), deq(kp, k_s), _gather_f32(v, bt), deq(vp, v_s), lengths,
                                scale).reshape(b, q_heads, head_dim)
        _check(got, want, np.asarray(exact), bound)
    return float(np.abs(np.asarray(got) - np.asarray(want)).max())


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,lengths,tiling", CASES)
def test_mla_kernel_matches_reference(page_size, lengths, tiling, dtype):
    check_mla(paged_mla_decode, page_size=page_size, lengths=lengths, dtype=dtype,
              seed=page_size * 10 + len(lengths), interpret=True, out_dtype=jnp.float32, **tiling)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,lengths,tiling", CASES)
def test_gqa_kernel_matches_reference(page_size, lengths, tiling, dtype):
    check_gqa(paged_gqa_decode, page_size=page_size, lengths=lengths, dtype=dtype,
              seed=page_size * 7 + len(lengths), interpret=True, **tiling)


# Real per-device dims (Kimi K2.6 / GLM-5.2 MLA: 8 heads x (512 + 64); GLM-4.5 GQA: 12 q / 1 kv heads x 128),
# few pages and rows so interpret mode stays fast; default tiling (the H200 smem model picks it).
REAL_PAGES, REAL_TABLE = 13, 4  # pool pages (page 0 unused), table entries per row


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,q_dtype", [(16, jnp.bfloat16), (64, jnp.float32)])  # 64 + f32: page halves
def test_mla_kernel_at_real_dims(page_size, q_dtype, dtype):
    lengths = [0, 2 * page_size + 3, REAL_TABLE * page_size]
    check_mla(paged_mla_decode, page_size=page_size, lengths=lengths, dtype=dtype, heads=8, rank=512, rope=64,
              q_dtype=q_dtype, num_pages=REAL_PAGES, max_pages=REAL_TABLE, seed=11, interpret=True,
              out_dtype=jnp.float32)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gqa_kernel_at_real_dims(dtype):
    check_gqa(paged_gqa_decode, page_size=16, lengths=[37, 64], dtype=dtype, q_heads=12, kv_heads=1, head_dim=128,
              num_pages=REAL_PAGES, max_pages=REAL_TABLE, seed=12, interpret=True)


def _mla_in_pool(q, pages, bt, lens, scales, **kw):
    return paged_mla_decode(q, in_pool(pages), bt, lens, in_pool(scales), layer=jnp.int32(LAYER), **kw)


def _gqa_in_pool(q, kp, vp, bt, lens, ks, vs, **kw):
    return paged_gqa_decode(q, in_pool(kp), in_pool(vp), bt, lens, in_pool(ks), in_pool(vs),
                            layer=jnp.int32(LAYER), **kw)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,lengths,tiling", [CASES[0], CASES[4]])  # page-id vector / one page in parts
def test_whole_pool_bits_at_a_layer_match_the_reference(page_size, lengths, tiling, dtype):
    """The engine's GPU decode hands the kernels the whole pool's bits [L, P, ps, ...] and the layer (no layer slice
    for XLA:GPU to copy): the output is the reference's on that layer; NaN in the other layers does not leak."""
    check_mla(_mla_in_pool, page_size=page_size, lengths=lengths, dtype=dtype, seed=5, interpret=True,
              out_dtype=jnp.float32, **tiling)
    check_gqa(_gqa_in_pool, page_size=page_size, lengths=lengths, dtype=dtype, seed=6, interpret=True, **tiling)


def test_whole_pool_needs_the_layer():
    q = jnp.zeros((1, H, DV + DR), jnp.bfloat16)
    bt, lens = jnp.ones((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    pool = jnp.zeros((LAYERS, NUM_PAGES, 8, DV + DR), jnp.uint16)
    with pytest.raises(ValueError, match="layer"):
        paged_mla_decode(q, pool, bt, lens, kv_lora_rank=DV, softmax_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="layer"):
        paged_mla_decode(q, pool[0], bt, lens, layer=1, kv_lora_rank=DV, softmax_scale=0.1, interpret=True)


def test_tail_pages_holding_nan_do_not_leak():
    """Pages past a sequence's length (same block) may hold anything: output must equal the clean reference."""
    page_size, lengths, tiling = CASES[0]
    b = len(lengths)
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (b, H, DV + DR)).astype(jnp.bfloat16)
    clean = jax.random.normal(ks[1], (NUM_PAGES, page_size, DV + DR)).astype(jnp.bfloat16)
    bt = _block_tables(ks[2], b)
    lens = jnp.asarray(lengths, jnp.int32)
    dirty = np.array(clean.astype(jnp.float32))
    for row, n in enumerate(lengths):
        flat = dirty[bt[row]].reshape(-1, DV + DR)
        flat[n:] = np.nan
        dirty[bt[row]] = flat.reshape(MAX_PAGES, page_size, DV + DR)
    dirty = jnp.asarray(dirty, jnp.bfloat16)
    scale = 1.0 / math.sqrt(DV + DR)
    got = paged_mla_decode(q, dirty, jnp.asarray(bt), lens, kv_lora_rank=DV, softmax_scale=scale,
                           interpret=True, out_dtype=jnp.float32, **tiling)
    want = paged_mla_reference(q, clean, jnp.asarray(bt), lens, kv_lora_rank=DV, softmax_scale=scale)
    _check(got, want)


def test_choose_blocks_defaults():
    blk = choose_blocks(16, 16384 // 16, 64)
    assert blk.block_h == 64 and blk.pages_per_compute_block * 16 == 64 and blk.k_splits == 16
    blk = choose_blocks(16, 4, 3)
    assert blk.block_h == 16 and blk.k_splits == 1


def test_choose_blocks_splits_only_until_the_gpu_is_full():
    """Kimi K2.6 TP decode (8 heads in one 16-row block, 16K context): 16 splits for one row, and batch x splits
    stops at the first count reaching TARGET_PROGRAMS (more would only add f32 partials for the merge)."""
    one = choose_blocks(16, 16384 // 16, 8)
    assert one.k_splits == 16
    for batch in (8, 16, 64, 200):
        ks = choose_blocks(16, 16384 // 16, 8, batch=batch).k_splits
        assert batch * ks >= TARGET_PROGRAMS or ks == one.k_splits
        assert ks == 1 or batch * ks // 2 < TARGET_PROGRAMS
    assert choose_blocks(16, 16384 // 16, 8, batch=64).k_splits == 2
