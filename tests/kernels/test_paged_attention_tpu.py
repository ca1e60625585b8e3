"""TPU-shaped paged decode kernels (MLA and GQA) in TPU interpret mode (`pltpu.InterpretParams()`, CPU) and in
legacy `interpret=True` (the engine's "pallas_tpu_interpret") vs the references.

Tolerances as in tests/test_paged_attention.py (its check_mla / check_gqa): BF16_TOL abs/rel vs the reference on
the same pages; FP8 pages also vs the exact f32 pages within reference_paged.fp8_error_bound + BF16_TOL.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention_tpu import (choose_block_h, choose_tpu_blocks, paged_gqa_decode_tpu,
                                                paged_mla_decode_tpu)
from pallas_kernels.reference_paged import paged_mla_reference
from kernel_pools import LAYER, in_pool
from test_paged_attention import check_gqa, check_mla

TOL = 1e-2
INTERPRET = pltpu.InterpretParams()  # TPU interpret mode; fails loudly on OOB copies
NUM_PAGES = 41  # toy pool (page 0 unused)
DV, DR, H = 32, 16, 16  # toy MLA dims (kv_lora_rank, rope dim, query heads)
# (page_size, lengths, tiling): 0, 1, ps-1, ps, several compute blocks, the full table
CASES = [
    (8, [0, 1, 7, 8, 21, 32], dict(pages_per_compute_block=2)),
    (16, [16, 40, 64], dict(block_h=8)),  # two head blocks, default compute block
]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,lengths,tiling", CASES)
def test_mla_tpu_kernel_matches_reference(page_size, lengths, tiling, dtype):
    check_mla(paged_mla_decode_tpu, page_size=page_size, lengths=lengths, dtype=dtype, heads=H, rank=DV, rope=DR,
              num_pages=NUM_PAGES, max_pages=4, seed=page_size + len(lengths), interpret=INTERPRET, **tiling)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("page_size,lengths,tiling", [
    (8, [0, 1, 7, 8, 21, 32], dict(pages_per_compute_block=2)),
    pytest.param(16, [16, 40, 64], {}, marks=pytest.mark.slow),  # default tiling; the real-dim test covers it
])
def test_gqa_tpu_kernel_matches_reference(page_size, lengths, tiling, dtype):
    check_gqa(paged_gqa_decode_tpu, page_size=page_size, lengths=lengths, dtype=dtype, q_heads=6, kv_heads=2,
              head_dim=16, num_pages=NUM_PAGES, max_pages=4, seed=page_size * 3 + len(lengths), interpret=INTERPRET,
              **tiling)


@pytest.mark.parametrize("kind", ["mla", pytest.param("gqa", marks=pytest.mark.slow)])  # one chunk path for both
def test_several_block_table_chunks(kind):
    """Lengths past one chunk (128 table entries): the softmax state carries across the chunk grid axis, a chunk
    wholly past a length is skipped. Legacy interpret mode, the engine's path."""
    page_size, max_pages = 4, 300
    lengths = [4 * 128 + 9, 0, 3, 4 * 300]  # 2nd chunk partial; empty; first chunk only; the full 3 chunks
    kw = dict(page_size=page_size, lengths=lengths, dtype="fp8", num_pages=len(lengths) * max_pages + 1,
              max_pages=max_pages, seed=5, interpret=True, pages_per_chunk=128, pages_per_compute_block=8)
    if kind == "mla":
        check_mla(paged_mla_decode_tpu, heads=8, rank=DV, rope=DR, **kw)
    else:
        check_gqa(paged_gqa_decode_tpu, q_heads=4, kv_heads=2, head_dim=16, **kw)


# Real per-device dims, few pages and rows: Kimi K2.6 / GLM-5.2 MLA 8 heads x (512 + 64) (the engine's f32
# absorbed query and a bf16 one); GLM-4.5 GQA 12 q / 1 kv heads x 128.
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_mla_tpu_kernel_at_real_dims(dtype, q_dtype):
    check_mla(paged_mla_decode_tpu, page_size=16, lengths=[35, 64, 0], dtype=dtype, heads=8, rank=512, rope=64,
              q_dtype=q_dtype, num_pages=13, max_pages=4, seed=21, interpret=INTERPRET, pages_per_compute_block=2)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gqa_tpu_kernel_at_real_dims(dtype):
    check_gqa(paged_gqa_decode_tpu, page_size=16, lengths=[37, 64], dtype=dtype, q_heads=12, kv_heads=1,
              head_dim=128, num_pages=9, max_pages=4, seed=22, interpret=INTERPRET, pages_per_compute_block=2)


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=pytest.mark.slow), "fp8"])  # fp8: bits + scales
def test_gqa_tpu_kernel_reads_a_layer_of_the_whole_pool(dtype):
    """The engine's form: the whole pool's bits [L, P, ps, Hkv, D] and the layer (a layer slice handed to the call
    was copied by XLA:TPU every step, GLM-4.5 on v5p); the other layers hold NaN, which must not leak."""
    def on_pool(q, kp, vp, bt, lens, ks, vs, **kw):  # noqa: ANN001, ANN003, ANN202
        return paged_gqa_decode_tpu(q, in_pool(kp), in_pool(vp), bt, lens, in_pool(ks), in_pool(vs),
                                    layer=jnp.int32(LAYER), **kw)

    check_gqa(on_pool, page_size=8, lengths=[0, 7, 21], dtype=dtype, q_heads=6, kv_heads=2, head_dim=16,
              num_pages=NUM_PAGES, max_pages=4, seed=23, interpret=INTERPRET, pages_per_compute_block=2)


def test_tail_tokens_holding_nan_do_not_leak():
    """Tokens past a sequence's length (in its last page and in a copied block) may hold anything."""
    page_size, lengths, max_pages = 8, [1, 7, 13, 30], 4
    b = len(lengths)
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (b, H, DV + DR)).astype(jnp.bfloat16)
    clean = jax.random.normal(ks[1], (NUM_PAGES, page_size, DV + DR)).astype(jnp.bfloat16)
    bt = np.asarray(jax.random.permutation(ks[2], NUM_PAGES))[: b * max_pages].reshape(b, max_pages)
    dirty = np.array(clean.astype(jnp.float32))
    for row, n in enumerate(lengths):
        flat = dirty[bt[row]].reshape(-1, DV + DR)
        flat[n:] = np.nan
        dirty[bt[row]] = flat.reshape(max_pages, page_size, DV + DR)
    lens = jnp.asarray(lengths, jnp.int32)
    scale = 1.0 / math.sqrt(DV + DR)
    got = paged_mla_decode_tpu(q, jnp.asarray(dirty, jnp.bfloat16), jnp.asarray(bt, jnp.int32), lens,
                               kv_lora_rank=DV, softmax_scale=scale, pages_per_compute_block=4, interpret=INTERPRET)
    want = paged_mla_reference(q, clean, jnp.asarray(bt, jnp.int32), lens, kv_lora_rank=DV, softmax_scale=scale)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("value_dtype,bits_dtype", [(jnp.float8_e4m3fn, jnp.uint8),
                                                   pytest.param(jnp.bfloat16, jnp.uint16, marks=pytest.mark.slow)])
def test_mla_whole_pool_bits_with_layer_equals_the_layer_slice(value_dtype, bits_dtype):
    """The engine's TPU decode hands the kernel the whole pool's bit patterns [L, P, ps, Dl] and the layer (no slice
    materialized): the output is exactly the kernel's on that layer's value view, scales [L, P, ps] likewise."""
    page_size, lengths, layers = 8, [0, 5, 19, 32], 3
    ks = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(ks[0], (len(lengths), H, DV + DR)).astype(jnp.bfloat16)
    vals = jax.random.normal(ks[1], (layers, NUM_PAGES, page_size, DV + DR)).astype(value_dtype)
    scales = jax.random.uniform(ks[2], (layers, NUM_PAGES, page_size), minval=0.5, maxval=2.0)
    bt = jax.random.permutation(ks[3], NUM_PAGES)[: 4 * len(lengths)].reshape(len(lengths), 4).astype(jnp.int32)
    lens = jnp.asarray(lengths, jnp.int32)
    fp8 = value_dtype == jnp.float8_e4m3fn
    kw = dict(kv_lora_rank=DV, softmax_scale=0.1, pages_per_compute_block=2, interpret=INTERPRET)
    bits = jax.lax.bitcast_convert_type(vals, bits_dtype)
    for layer in (0, 2):
        got = paged_mla_decode_tpu(q, bits, bt, lens, scales if fp8 else None, layer=jnp.int32(layer), **kw)
        want = paged_mla_decode_tpu(q, vals[layer], bt, lens, scales[layer] if fp8 else None, **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="layer"):
        paged_mla_decode_tpu(q, bits, bt, lens, scales if fp8 else None, **kw)


def test_choose_tpu_blocks():
    assert choose_block_h(128) == 128 and choose_block_h(16, 8) == 8
    with pytest.raises(ValueError):
        choose_block_h(16, 4)
    blk = choose_tpu_blocks(16, 262_144 // 16, 8)
    assert (blk.block_h, blk.pages_per_compute_block, blk.pages_per_chunk) == (8, 16, 1024)
    blk = choose_tpu_blocks(4, 6, 8)  # a short table: one 128-entry chunk, one compute block covers it
    assert (blk.pages_per_compute_block, blk.pages_per_chunk) == (8, 128)
    with pytest.raises(ValueError):
        choose_tpu_blocks(16, 1024, 8, pages_per_chunk=100)  # not a multiple of 128


@pytest.mark.slow  # ~10 s: the race detector tracks every VMEM access
def test_double_buffer_has_no_dma_races():
    """The TPU interpreter's race detector (DMAs executed eagerly, uninitialised VMEM = NaN) finds no read of a
    buffer slot while its copy is in flight, across several slot swaps (one page per compute block). Negative
    control, run by hand: the kernel with its waits deleted is flagged (races_found True)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # races: no public accessor in 0.10.2

    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager", uninitialized_memory="nan")
    kw = dict(page_size=8, lengths=[21, 32], dtype="fp8", num_pages=NUM_PAGES, max_pages=4, seed=9,
              interpret=params, pages_per_compute_block=1)
    check_mla(paged_mla_decode_tpu, heads=8, rank=DV, rope=DR, **kw)
    assert not interpret_pallas_call.races.races_found
    check_gqa(paged_gqa_decode_tpu, q_heads=2, kv_heads=1, head_dim=16, **{**kw, "lengths": [21]})
    assert not interpret_pallas_call.races.races_found
