"""The XLA decode attention (jaxserve/models/paged_attention_xla.py: a while loop over page blocks with an online
softmax, reading the pool's bits) equals the plain gather-everything references (pallas_kernels/reference_paged)
in f32 on the same BF16 / FP8 pages: ragged lengths, zero-length rows, blocks that do not divide the table,
several layers (the layer is picked inside the loop's gathers). Its trip count follows the batch's longest row,
and its compiled temporaries are one block's, not the whole padded context's."""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache import KVLayout, KVPages, quantize_fp8
from jaxserve.models import paged_attention_xla as pax
from pallas_kernels.reference_paged import paged_gqa_reference, paged_mla_reference

LAYERS, NUM_PAGES, MAX_PAGES = 2, 70, 10
RANK, ROPE, HEADS = 32, 16, 4
HQ, HKV, D = 6, 2, 16
TOL = 2e-5
# (page_size, lengths, block_pages): several blocks, a partial last block, rows ending mid-block, empty rows,
# a batch of only empty rows, one page per block, one block covering the whole table
CASES = [
    (4, [0, 1, 4, 5, 17, 40], 3),
    (4, [13, 0, 0], 1),
    (8, [80, 3], 4),
    (8, [0, 0], 2),
    (4, [7, 33], 16),
]


def _tables(seed: int, b: int) -> np.ndarray:
    """Random distinct page ids per row (page 0, the null page, never used)."""
    perm = np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))
    return perm[: b * MAX_PAGES].reshape(b, MAX_PAGES).astype(np.int32)


def _pool(kind: str, dtype: str, ps: int, seed: int) -> KVPages:
    ks = jax.random.split(jax.random.key(seed), 2)
    if kind == "mla":
        lay = KVLayout.mla(LAYERS, RANK, ROPE, page_size=ps, dtype=dtype)
        x = jax.random.normal(ks[0], (LAYERS, NUM_PAGES, ps, RANK + ROPE)) + 0.5
        if dtype == "bf16":
            return KVPages.from_values(lay, latent=x)
        q, s = quantize_fp8(x)
        return KVPages.from_values(lay, latent=q, latent_scale=s)
    lay = KVLayout.gqa(LAYERS, HKV, D, page_size=ps, dtype=dtype)
    shape = (LAYERS, NUM_PAGES, ps, HKV, D)
    k, v = jax.random.normal(ks[0], shape) * 2.0, jax.random.normal(ks[1], shape) + 0.5
    if dtype == "bf16":
        return KVPages.from_values(lay, k=k, v=v)
    (kq, kss), (vq, vss) = quantize_fp8(k), quantize_fp8(v)
    return KVPages.from_values(lay, k=kq, v=vq, k_scale=kss, v_scale=vss)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("ps,lengths,block_pages", CASES)
def test_mla_equals_reference(ps, lengths, block_pages, dtype):
    pages = _pool("mla", dtype, ps, seed=ps)
    bt, lens = jnp.asarray(_tables(len(lengths), len(lengths))), jnp.asarray(lengths, jnp.int32)
    q = jax.random.normal(jax.random.key(7), (len(lengths), HEADS, RANK + ROPE))
    scale = 1.0 / math.sqrt(RANK + ROPE)
    for layer in range(LAYERS):
        got = pax.mla_decode(q, pages.latent, pages.latent_scale, bt, lens, layer=layer, layout=pages.layout,
                             kv_lora_rank=RANK, softmax_scale=scale, block_pages=block_pages)
        lat, sc = pages.layer(layer)
        want = paged_mla_reference(q, lat, bt, lens, sc, kv_lora_rank=RANK, softmax_scale=scale)
        assert got.shape == (len(lengths), HEADS, RANK) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)
        assert not np.asarray(got)[np.asarray(lengths) == 0].any()


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("ps,lengths,block_pages", CASES)
def test_gqa_equals_reference(ps, lengths, block_pages, dtype):
    pages = _pool("gqa", dtype, ps, seed=ps + 1)
    bt, lens = jnp.asarray(_tables(len(lengths) + 1, len(lengths))), jnp.asarray(lengths, jnp.int32)
    q = jax.random.normal(jax.random.key(8), (len(lengths), HQ, D))
    for layer in range(LAYERS):
        got = pax.gqa_decode(q, pages.k, pages.v, pages.k_scale, pages.v_scale, bt, lens, layer=layer,
                             layout=pages.layout, softmax_scale=0.25, block_pages=block_pages)
        kp, vp, ks, vs = pages.layer(layer)
        want = paged_gqa_reference(q, kp, vp, bt, lens, ks, vs, softmax_scale=0.25)
        assert got.shape == (len(lengths), HQ, D) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)
        assert not np.asarray(got)[np.asarray(lengths) == 0].any()


def test_trip_count_follows_the_longest_row():
    """ceil(live pages / block_pages), capped by the table: the loop stops at the batch's real context."""
    bt = jnp.zeros((3, 10), jnp.int32)
    trips = lambda lengths, bp: int(pax._blocks(bt, jnp.asarray(lengths, jnp.int32), 4, bp)[1])  # noqa: E731
    assert trips([0, 0, 0], 3) == 0
    assert trips([1, 0, 0], 3) == 1 and trips([12, 0, 0], 3) == 1 and trips([13, 5, 0], 3) == 2
    assert trips([40, 0, 0], 3) == 4 and trips([40, 0, 0], 1) == 10 and trips([40, 0, 0], 16) == 1


_SHAPE = re.compile(r"= \w+\[([\d,]*)\]")


def _max_temp_elems(hlo: str, op: str) -> int:
    """Elements of the largest result of an HLO op of kind `op` (gather, convert, ...)."""
    sizes = [int(np.prod([int(d) for d in m.group(1).split(",") if d])) for line in hlo.splitlines()
             if f" {op}(" in line and (m := _SHAPE.search(line))]
    return max(sizes, default=0)


def test_kimi_shaped_program_holds_one_block_not_the_padded_context():
    """At Kimi K2.6's per-device decode shapes (8 local heads, latent 512 + 64, FP8 pages of 16, 64 rows x 8192
    tokens of table, 61 layers) the compiled attention has a while loop, no gather or convert larger than one
    block, and temporaries O(rows x block x latent); the gather-everything reference needs the whole padded
    context in f32 (the check can fail)."""
    b, m, ps, latent, pages = 64, 512, 16, 576, 4000
    lay = KVLayout.mla(61, 512, 64, page_size=ps, dtype="fp8")
    pool = jax.ShapeDtypeStruct((61, pages, ps, latent), jnp.uint8)
    scale = jax.ShapeDtypeStruct((61, pages, ps), jnp.float32)
    q = jax.ShapeDtypeStruct((b, 8, latent), jnp.float32)
    bt, lens = jax.ShapeDtypeStruct((b, m), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)
    fn = jax.jit(lambda q, p, s, bt, n: pax.mla_decode(q, p, s, bt, n, layer=60, layout=lay, kv_lora_rank=512,
                                                      softmax_scale=0.1))
    compiled = fn.lower(q, pool, scale, bt, lens).compile()
    hlo = compiled.as_text()
    block = b * pax.block_pages_for(ps, m) * ps * latent
    whole = b * m * ps * latent
    assert re.search(r"\bwhile\(", hlo)
    assert 0 < _max_temp_elems(hlo, "gather") <= block and _max_temp_elems(hlo, "convert") <= block
    assert compiled.memory_analysis().temp_size_in_bytes <= 3 * block * 4  # a few f32 blocks; whole is 32 blocks
    ref = jax.jit(lambda q, p, s, bt, n: paged_mla_reference(q, p[60], bt, n, s[60], kv_lora_rank=512,
                                                             softmax_scale=0.1))
    f8 = jax.ShapeDtypeStruct((61, pages, ps, latent), jnp.float8_e4m3fn)
    ref_compiled = ref.lower(q, f8, scale, bt, lens).compile()
    assert ref_compiled.memory_analysis().temp_size_in_bytes >= whole * 4
