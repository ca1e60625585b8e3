"""Every paged attention kernel the engine can select, compiled (not lowered) for H200 and TPU v5e / v5p / v6e at
the real per-device shapes (kernel_programs.py): decode (MLA, GQA) and flash prefill (MLA, GQA), BF16 and FP8
pages, page sizes 16 (EngineConfig's default) and 64 (PlanSpec's), TP and DP attention.

Budgets are the compiler's: Triton's allocated shared memory <= the H200's 232,448 B; Mosaic's scoped VMEM as
XLA:TPU reports it on the compiled call (Mosaic itself refuses a kernel over its limit: test_compile_controls.py).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from aot import ALL_TARGETS, check_budget, compile_for, kernel_smem, sds
from kernel_programs import F8, GEOMETRIES, decode_program, gpu_decode_blocks, prefill_program
from pallas_kernels import paged_attention as gpu

GEOMS = pytest.mark.parametrize("geo", GEOMETRIES, ids=lambda g: g.name)
DTYPES = pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, F8], ids=["bf16", "fp8"])
PAGES = pytest.mark.parametrize("page_size", [16, 64])
TARGETS = pytest.mark.parametrize("target", ALL_TARGETS)


@TARGETS
@GEOMS
@DTYPES
@PAGES
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_attention_compiles(kind, target, geo, kv_dtype, page_size):
    program = decode_program if kind == "decode" else prefill_program
    fn, args = program(target, geo, page_size, kv_dtype)
    result = compile_for(target, fn, *args)
    name = "paged_" + ("" if kind == "decode" else "prefill_") + ("mla" if geo.mla else "gqa")
    name += "_decode" * (kind == "decode") + "_tpu" * (kind == "decode" and target != "h200")
    check_budget(target, result, name)
    if kind == "decode" and target == "h200":  # blocks chosen by the compiler's measured bytes must still be its own
        blocks, tiles = gpu_decode_blocks(geo, page_size, kv_dtype)
        assert kernel_smem(result, name) == gpu.measured_smem(blocks, page_size, **tiles)


@pytest.mark.parametrize("geo", [GEOMETRIES[0], GEOMETRIES[3]], ids=lambda g: g.name)
def test_h200_decode_reads_a_layer_of_a_pool_over_4gb(geo):
    """The engine's H200 decode hands the Triton kernels the whole pool's FP8 bits [L, P, 64, ...] (> 2^32 bytes:
    Pallas' Triton lowering switches the kernel's offsets to 64 bits) and the layer as a traced int32: it compiles
    within the shared memory of the one-layer form, and nothing outside the kernel copies the pool or a layer."""
    page_size, layers = 64, 8 if geo.mla else 16
    pages = 40_000 if not geo.mla else 16_384
    row = (geo.head_dim,) if geo.mla else (geo.kv_heads, geo.head_dim)
    pool = sds("h200", (layers, pages, page_size, *row), jnp.uint8)
    assert layers * pages * page_size * math.prod(row) > 2**32
    scales = sds("h200", (layers, pages, page_size, *row[:-1]), jnp.float32)
    b = geo.decode_rows
    tables = [sds("h200", (b, geo.context // page_size), jnp.int32), sds("h200", (b,), jnp.int32)]
    layer = sds("h200", (), jnp.int32)
    if geo.mla:
        q = sds("h200", (b, geo.q_heads, geo.head_dim), jnp.float32)
        fn = lambda q, p, bt, ln, s, i: gpu.paged_mla_decode(q, p, bt, ln, s, layer=i, kv_lora_rank=512,  # noqa: E731
                                                             softmax_scale=0.07, out_dtype=jnp.float32)
        args, name = [q, pool, *tables, scales, layer], "paged_mla_decode"
    else:
        q = sds("h200", (b, geo.q_heads, geo.head_dim), jnp.bfloat16)
        fn = lambda q, k, v, bt, ln, ks, vs, i: gpu.paged_gqa_decode(q, k, v, bt, ln, ks, vs, layer=i,  # noqa: E731
                                                                     softmax_scale=0.088, out_dtype=jnp.float32)
        args, name = [q, pool, pool, *tables, scales, scales, layer], "paged_gqa_decode"
    result = compile_for("h200", fn, *args)
    blocks, tiles = gpu_decode_blocks(geo, page_size, F8)
    assert kernel_smem(result, name) == gpu.measured_smem(blocks, page_size, **tiles)
    assert result.temp_bytes < pages * page_size * math.prod(row), result.temp_bytes  # no layer copied
