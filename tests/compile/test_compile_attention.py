"""Every paged attention kernel the engine can select, compiled (not lowered) for H200 and TPU v5e / v5p / v6e at
the real per-device shapes (kernel_programs.py): decode (MLA, GQA) and flash prefill (MLA, GQA), BF16 and FP8
pages, page sizes 16 (EngineConfig's default) and 64 (PlanSpec's), TP and DP attention.

Budgets are the compiler's: Triton's allocated shared memory <= the H200's 232,448 B; Mosaic's scoped VMEM as
XLA:TPU reports it on the compiled call (Mosaic itself refuses a kernel over its limit: test_compile_controls.py).
"""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from aot import ALL_TARGETS, check_budget, compile_for, kernel_smem
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
def test_decode_compiles(target, geo, kv_dtype, page_size):
    fn, args = decode_program(target, geo, page_size, kv_dtype)
    result = compile_for(target, fn, *args)
    name = ("paged_mla_decode" if geo.mla else "paged_gqa_decode") + ("" if target == "h200" else "_tpu")
    check_budget(target, result, name)
    if target == "h200":  # the blocks were chosen from the compiler's measured bytes: they must still be its bytes
        blocks, tiles = gpu_decode_blocks(geo, page_size, kv_dtype)
        assert kernel_smem(result, name) == gpu.measured_smem(blocks, page_size, **tiles)


@TARGETS
@GEOMS
@DTYPES
@PAGES
def test_prefill_compiles(target, geo, kv_dtype, page_size):
    fn, args = prefill_program(target, geo, page_size, kv_dtype)
    result = compile_for(target, fn, *args)
    check_budget(target, result, "paged_prefill_mla" if geo.mla else "paged_prefill_gqa")
