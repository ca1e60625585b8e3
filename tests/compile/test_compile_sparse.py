"""The DSA decode kernels compiled for an H200 (sm_90a) at GLM-5.2's per-device shapes: the sparse MLA decode
(pallas_kernels/sparse_mla_decode.py, kernel_programs.sparse_decode_program): TP (8 heads, 64 rows) and DP (64
heads, 8 rows), FP8 and BF16 pools as stored bits, pages of 16 and 64, the whole 78-layer pool (over 2**32 bytes:
64-bit offsets); the indexer scores (pallas_kernels/dsa_index_scores.py, kernel_programs.index_scores_program):
TP and DP rows, 32 heads x 128, FP8 and BF16 keys as stored bits, the whole 21-layer index-key pool of the H200
plan (over 2**32 bytes of u8 keys), one 32,768-token block of the blockwise top-k per row.
Budget: Triton's allocated shared memory (the compiler's) <= the H200's; the pool reaches the kernel uncopied;
negative controls: an over-budget step / head block is refused by the compiler.
TPU (v5e / v5p / v6e, XLA:TPU + Mosaic): the Mosaic sparse MLA decode (pallas_kernels/sparse_mla_decode_tpu.py,
kernel_programs.sparse_decode_tpu_program) at the same geometries, the 78-layer pool row-major as the engine pins
it: one Mosaic call with its scoped VMEM reported, no copy of the pool, no [rows, 2048, 576] array of gathered
rows outside the kernel; the Mosaic indexer scores (pallas_kernels/dsa_index_scores_tpu.py,
kernel_programs.index_scores_tpu_program): the 21-layer index-key pool and its scales uncopied, no gathered keys
outside; over-budget blocks are refused by Mosaic. The Triton kernels themselves are still refused by the TPU
lowering."""
from __future__ import annotations

import math
import re
import traceback

import jax.numpy as jnp
import pytest

from aot import check_budget, compile_for, copies_of, mosaic_operands_in_vmem, sds
from kernel_programs import (F8, GEOMETRIES, GLM52_INDEX_DIM, GLM52_INDEX_LAYERS, GLM52_LAYERS, GLM52_TOPK,
                             INDEX_BLOCK, INDEX_POOL_PAGES, POOL_PAGES, TPU_SPARSE_POOL_PAGES, index_scores_program,
                             index_scores_tpu_program, sparse_decode_program, sparse_decode_tpu_program)

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


@pytest.mark.parametrize("geo", [GLM5_TP, GLM5_DP], ids=lambda g: g.name)
@pytest.mark.parametrize("kv_dtype,page_size", [(F8, 64), (jnp.bfloat16, 64), (F8, 16)], ids=["fp8", "bf16", "fp8-p16"])
def test_index_scores_compile_within_shared_memory(geo, kv_dtype, page_size):
    fn, args = index_scores_program(geo, page_size, kv_dtype)
    result = compile_for("h200", fn, *args)
    check_budget("h200", result, "dsa_index_scores")
    assert not copies_of(result, (GLM52_INDEX_LAYERS, INDEX_POOL_PAGES, page_size, GLM52_INDEX_DIM))


def test_triton_refuses_an_over_budget_index_block():
    """512 indexer heads: the [512, 128] f32 query block alone is 256 KB of shared memory (GLM-5.2's 32: 16 KB; the
    keys go to the dot from registers, so more tokens per program add none)."""
    fn, args = index_scores_program(GLM5_TP, 64, F8, heads=512)
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        compile_for("h200", fn, *args)


def _shapes_outside(hlo: str) -> list[tuple[int, ...]]:
    """The array shapes the HLO instructions outside the Mosaic calls produce (tuple results skipped)."""
    out = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(ROOT )?%\S+ = \w+\[([\d,]*)\]", line)
        if m and "tpu_custom_call" not in line and m.group(2):
            out.append(tuple(map(int, m.group(2).split(","))))
    return out


@pytest.mark.parametrize("target", ["v5e", "v5p", "v6e"])
@pytest.mark.parametrize("geo", [GLM5_TP, GLM5_DP], ids=lambda g: g.name)
@pytest.mark.parametrize("kv_dtype,page_size", [(F8, 64), (jnp.bfloat16, 64), (F8, 16)], ids=["fp8", "bf16", "fp8-p16"])
def test_tpu_sparse_decode_compiles_within_vmem(target, geo, kv_dtype, page_size):
    """attention="pallas_tpu"'s sparse decode: one Mosaic call (its scoped VMEM reported: Mosaic refuses one over
    its limit), the row-major pool read in place (no copy), no gathered [rows, 2048, 576] rows outside it."""
    fn, args = sparse_decode_tpu_program(target, geo, page_size, kv_dtype)
    result = compile_for(target, fn, *args)
    check_budget(target, result)
    assert len(result.vmem) == 1, result.vmem
    assert not copies_of(result, (GLM52_LAYERS, TPU_SPARSE_POOL_PAGES, page_size, geo.head_dim))
    rows = geo.decode_rows * GLM52_TOPK * geo.head_dim  # the XLA path's gathered latent rows
    assert not any(math.prod(s) == rows for s in _shapes_outside(result.hlo))


def test_mosaic_refuses_an_over_budget_sparse_block():
    """2048 selected tokens per block: two [2048, 576] u32 slots (9.4 MB) and [64, 2048] f32 logits and their
    [2048, 2048] validity column are over v5p's scoped VMEM (the default 128-token blocks: ~1.4 MB)."""
    fn, args = sparse_decode_tpu_program("v5p", GLM5_DP, 64, F8, block_k=2048)
    with pytest.raises(Exception, match="ScopedVmemOom|exceed.*vmem"):
        compile_for("v5p", fn, *args)


@pytest.mark.parametrize("target", ["v5e", "v5p", "v6e"])
@pytest.mark.parametrize("geo", [GLM5_TP, GLM5_DP], ids=lambda g: g.name)
@pytest.mark.parametrize("kv_dtype,page_size", [(F8, 64), (jnp.bfloat16, 64), (F8, 16)], ids=["fp8", "bf16", "fp8-p16"])
def test_tpu_index_scores_compile_within_vmem(target, geo, kv_dtype, page_size):
    """attention="pallas_tpu"'s indexer scores: one Mosaic call (scoped VMEM reported), the index-key pool and its
    scales read in place (no copy, left in HBM: the call's last operands), no gathered [rows, 32768, 128] keys
    outside it."""
    fn, args = index_scores_tpu_program(target, geo, page_size, kv_dtype)
    result = compile_for(target, fn, *args)
    check_budget(target, result)
    assert len(result.vmem) == 1, result.vmem
    pools = 2 if kv_dtype == F8 else 1
    calls = mosaic_operands_in_vmem(result, "dsa_index_scores_tpu")
    assert len(calls) == 1 and not any(calls[0][-pools:]), calls
    lead = (GLM52_INDEX_LAYERS, INDEX_POOL_PAGES, page_size)
    assert not copies_of(result, (*lead, GLM52_INDEX_DIM)) and not copies_of(result, lead)
    keys = geo.decode_rows * INDEX_BLOCK * GLM52_INDEX_DIM
    assert not any(math.prod(s) == keys for s in _shapes_outside(result.hlo))


def test_mosaic_refuses_an_over_budget_index_block():
    """1024 pages of 64 per block: two [1024, 64, 128] bf16 slots (32 MB) and their f32 values are over v5p's scoped
    VMEM (the default 8 pages: ~0.6 MB). BF16: an FP8 block this size takes Mosaic minutes (the scale spreading)."""
    fn, args = index_scores_tpu_program("v5p", GLM5_DP, 64, jnp.bfloat16, pages_per_block=1024)
    with pytest.raises(Exception, match="ScopedVmemOom|exceed.*vmem"):
        compile_for("v5p", fn, *args)


@pytest.mark.parametrize("target", ["v5e", "v5p", "v6e"])
@pytest.mark.parametrize("program", [sparse_decode_program, index_scores_program], ids=["sparse_decode", "index"])
def test_tpu_refuses_the_triton_dsa_kernels(program, target):
    """The asserted refusal: both Triton DSA kernels (GPU compiler params) are rejected by Pallas' TPU lowering;
    models/dsa.py selects them under attention="pallas" only (under "pallas_tpu" the Mosaic kernels above)."""
    fn, args = program(GLM5_TP, 64, F8)
    tpu_args = [None if a is None else sds(target, a.shape, a.dtype) for a in args]
    with pytest.raises((AssertionError, ValueError)) as refused:
        compile_for(target, fn, *tpu_args)
    # its check (as an assert, or as "Compiler params for platform gpu cannot be used for tpu lowering" once the GPU
    # plugin is loaded in the process): the params must be TPU CompilerParams
    chain = "".join(traceback.format_exception(refused.value))
    assert re.search(r"pallas_call_tpu_lowering_rule|platform gpu cannot be used for tpu lowering", chain)
