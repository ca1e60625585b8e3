"""The DSA sparse MLA decode kernel (pallas_kernels/sparse_mla_decode.py) compiled for an H200 (sm_90a) at GLM-5.2's
per-device shapes (kernel_programs.sparse_decode_program): TP (8 heads, 64 rows) and DP (64 heads, 8 rows), FP8
and BF16 pools as stored bits, pages of 16 and 64, the whole 78-layer pool (over 2**32 bytes: 64-bit offsets).
Budget: Triton's allocated shared memory (the compiler's) <= the H200's; the pool reaches the kernel uncopied;
negative control: an over-budget step is refused by the compiler."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from aot import check_budget, compile_for, copies_of
from kernel_programs import F8, GEOMETRIES, GLM52_LAYERS, POOL_PAGES, sparse_decode_program

GLM5_TP = next(g for g in GEOMETRIES if g.name == "glm5-tp")
GLM5_DP = GLM5_TP.__class__("glm5-dp", True, 64, 1, 576, 8, GLM5_TP.context)


@pytest.mark.parametrize("geo", [GLM5_TP, GLM5_DP], ids=lambda g: g.name)
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, F8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_sparse_decode_compiles_within_shared_memory(geo, kv_dtype, page_size):
    fn, args = sparse_decode_program(geo, page_size, kv_dtype)
    result = compile_for("h200", fn, *args)
    check_budget("h200", result, "sparse_mla_decode")
    assert not copies_of(result, (GLM52_LAYERS, POOL_PAGES, page_size, geo.head_dim))


def test_triton_refuses_an_over_budget_sparse_step():
    """256 selected tokens per step for a 64-head block: a [256, 576] f32 operand alone is 590 KB."""
    fn, args = sparse_decode_program(GLM5_DP, 64, F8, block_k=256)
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        compile_for("h200", fn, *args)
