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
