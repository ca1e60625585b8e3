"""Pallas paged decode attention (interpret mode on CPU) vs the plain-jnp references, BF16 and FP8 pages.

FP8 bound (derived, checked per output element). Let e[t, d] = |k[t, d] - k8[t, d]| be the actual quantization
error (each within half an e4m3 ulp, see test_pages.fp8_bound), delta[t] = softmax_scale * sum_d |q[d]| e[t, d]
the logit error, D = max over valid t. softmax(l + eps) / softmax(l) lies in [exp(-2D), exp(2D)], so
sum_t |p8[t] - p[t]| <= exp(2D) - 1 and, per output dim d,
    |o8[d] - o[d]| <= (exp(2D) - 1) * max_t |v8[t, d]| + max_t |v8[t, d] - v[t, d]|.
The kernel's own rounding (probabilities cast to bf16 before P @ V) adds at most the BF16 tolerance below.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache.pages import quantize_fp8
from pallas_kernels.paged_attention import choose_blocks, paged_gqa_decode, paged_mla_decode
from pallas_kernels.reference_paged import paged_gqa_reference, paged_mla_reference

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


def _block_tables(key, b: int) -> np.ndarray:
    """Random non-contiguous, non-repeating page ids (page 0 = null page never used)."""
    perm = np.asarray(jax.random.permutation(key, np.arange(1, NUM_PAGES)))
    return perm[: b * MAX_PAGES].reshape(b, MAX_PAGES).astype(np.int32)


def _gather_f32(x, bt):
    x = np.asarray(x, np.float32)[bt]
    return x.reshape(bt.shape[0], -1, *x.shape[3:])


def _fp8_output_bound(q, k, k8, v, v8, lengths, softmax_scale):
    """Per-element bound of |attn(q, k8, v8) - attn(q, k, v)|; k, v [B, T, (Hkv,) Dk] f32, q [B, Hkv, G, Dk]."""
    out = []
    for b, n in enumerate(lengths):
        if n == 0:
            out.append(np.zeros((q.shape[1], q.shape[2], v.shape[-1])))
            continue
        e_k = np.abs(k[b, :n] - k8[b, :n])  # [T, Hkv, Dk]
        delta = softmax_scale * np.einsum("kgd,tkd->kgt", np.abs(q[b]), e_k)
        dmax = delta.max(-1)  # [Hkv, G]
        vmax = np.abs(v8[b, :n]).max(0)  # [Hkv, Dv]
        evmax = np.abs(v8[b, :n] - v[b, :n]).max(0)
        out.append(np.expm1(2 * dmax)[..., None] * vmax[:, None, :] + evmax[:, None, :])
    return np.stack(out)


def _check(got, want, fp8_src=None, bound=None):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=BF16_TOL, rtol=BF16_TOL)
    if fp8_src is not None:
        err = np.abs(got - fp8_src)
        assert np.all(err <= bound + BF16_TOL), (err - bound).max()


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,lengths,tiling", CASES)
def test_mla_kernel_matches_reference(page_size, lengths, tiling, dtype):
    ks = jax.random.split(jax.random.key(page_size * 10 + len(lengths)), 3)
    b = len(lengths)
    lens = jnp.asarray(lengths, jnp.int32)
    q = jax.random.normal(ks[0], (b, H, DV + DR)).astype(jnp.bfloat16)
    latent = jax.random.normal(ks[1], (NUM_PAGES, page_size, DV + DR))  # f32 "true" rows
    bt = _block_tables(ks[2], b)
    scale = 1.0 / math.sqrt(DV + DR)
    if dtype == "bf16":
        pages, sc = latent.astype(jnp.bfloat16), None
    else:
        pages, sc = quantize_fp8(latent)
    got = paged_mla_decode(q, pages, jnp.asarray(bt), lens, sc, kv_lora_rank=DV, softmax_scale=scale,
                           interpret=True, out_dtype=jnp.float32, **tiling)
    assert got.shape == (b, H, DV)
    want = paged_mla_reference(q, pages, jnp.asarray(bt), lens, sc, kv_lora_rank=DV, softmax_scale=scale)
    zero = np.asarray(lens) == 0
    np.testing.assert_array_equal(np.asarray(got)[zero], 0.0)
    if dtype == "bf16":
        _check(got, want)
        return
    exact = paged_mla_reference(q, latent, jnp.asarray(bt), lens, kv_lora_rank=DV, softmax_scale=scale)
    c = _gather_f32(latent, bt)[:, :, None]  # [B, T, 1, Dl]: one shared latent "head"
    c8 = np.asarray(_gather_f32(pages, bt) * np.asarray(sc)[bt].reshape(b, -1, 1))[:, :, None]
    qf = np.asarray(q, np.float32)[:, None]  # [B, 1, H, Dl]
    bound = _fp8_output_bound(qf, c, c8, c[..., :DV], c8[..., :DV], lengths, scale)[:, 0]
    _check(got, want, np.asarray(exact), bound)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,lengths,tiling", CASES)
def test_gqa_kernel_matches_reference(page_size, lengths, tiling, dtype):
    ks = jax.random.split(jax.random.key(page_size * 7 + len(lengths)), 4)
    b = len(lengths)
    lens = jnp.asarray(lengths, jnp.int32)
    q = jax.random.normal(ks[0], (b, HQ, D)).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (NUM_PAGES, page_size, HKV, D)) * 2.0
    v = jax.random.normal(ks[2], (NUM_PAGES, page_size, HKV, D))
    bt = _block_tables(ks[3], b)
    scale = 1.0 / math.sqrt(D)
    if dtype == "bf16":
        kp, vp, k_s, v_s = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None
    else:
        (kp, k_s), (vp, v_s) = quantize_fp8(k), quantize_fp8(v)
    got = paged_gqa_decode(q, kp, vp, jnp.asarray(bt), lens, k_s, v_s, softmax_scale=scale, interpret=True,
                           out_dtype=jnp.float32, **tiling)
    assert got.shape == (b, HQ, D)
    want = paged_gqa_reference(q, kp, vp, jnp.asarray(bt), lens, k_s, v_s, softmax_scale=scale)
    np.testing.assert_array_equal(np.asarray(got)[np.asarray(lens) == 0], 0.0)
    if dtype == "bf16":
        _check(got, want)
        return
    exact = paged_gqa_reference(q, k, v, jnp.asarray(bt), lens, softmax_scale=scale)
    deq = lambda x, s: _gather_f32(x, bt) * _gather_f32(s, bt)[..., None]  # noqa: E731
    qf = np.asarray(q, np.float32).reshape(b, HKV, HQ // HKV, D)
    bound = _fp8_output_bound(qf, _gather_f32(k, bt), deq(kp, k_s), _gather_f32(v, bt), deq(vp, v_s), lengths,
                              scale).reshape(b, HQ, D)
    _check(got, want, np.asarray(exact), bound)


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
