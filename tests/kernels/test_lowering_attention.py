"""Cross-lowering (jax.export on this CPU host) of every paged decode attention kernel at the real per-device
shapes, and the GPU kernels' shared-memory budget of each block choice (TPU VMEM: the compile tier, tests/compile).

Shapes (per device, as the engine calls the kernels inside shard_map):
- MLA, Kimi K2.6 and GLM-5.2 (one geometry: 64 heads / 8 devices = 8 local heads, latent 512 + rope 64);
  the absorbed query is f32, as jaxserve/models/paged.py passes it.
- GQA, GLM-4.5 (96 q / 8 kv heads, head_dim 128): 12 q / 1 kv heads per device, and unsharded 96 / 8.
BF16 and FP8 e4m3 pages, page sizes 16 and 64, decode batch 1..64, block tables for up to 262,144 tokens.

`cuda` lowers the Triton path of pallas_kernels/paged_attention.py (Pallas -> Triton IR only: Triton's PTX
compile runs in XLA's GPU compiler and needs a GPU). `tpu` lowers pallas_kernels/paged_attention_tpu.py to a
Mosaic custom call (Mosaic's own compile runs in libtpu on a TPU, not here). The Pallas TPU lowering asks the
target chip for its tiling (the block-table chunk is a 1-D SMEM block); no TPU is attached here, so the tests
declare one: v6e (kernel_lowering.TPU_V6E, through lower_for's device_kind).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from kernel_lowering import H200_SMEM_BYTES, TPU_V6E, lower_for, sds, stage_bytes, within
from pallas_kernels import paged_attention as gpu
from pallas_kernels import paged_attention_tpu as tpu

F8 = jnp.float8_e4m3fn
MAX_CONTEXT = 262_144
NUM_POOL_PAGES = 4096  # per-device pool size: any value works, the kernels never see it as a loop bound
MLA = dict(heads=8, rank=512, rope=64)  # Kimi K2.6 = GLM-5.2 per device
GQA = {"glm4.5-tp8": (12, 1, 128), "glm4.5-tp1": (96, 8, 128)}  # (q heads, kv heads, head_dim)
TRITON_CALL = "__gpu$xla.gpu.triton"


def _mla_args(batch: int, page_size: int, kv_dtype, q_dtype=jnp.float32, context: int = MAX_CONTEXT):
    dl = MLA["rank"] + MLA["rope"]
    args = [sds((batch, MLA["heads"], dl), q_dtype), sds((NUM_POOL_PAGES, page_size, dl), kv_dtype),
            sds((batch, context // page_size), jnp.int32), sds((batch,), jnp.int32)]
    return args + ([sds((NUM_POOL_PAGES, page_size), jnp.float32)] if kv_dtype == F8 else [])


def _gqa_args(batch: int, page_size: int, kv_dtype, geometry: str, context: int = MAX_CONTEXT):
    hq, hkv, d = GQA[geometry]
    kv = sds((NUM_POOL_PAGES, page_size, hkv, d), kv_dtype)
    args = [sds((batch, hq, d), jnp.bfloat16), kv, kv, sds((batch, context // page_size), jnp.int32),
            sds((batch,), jnp.int32)]
    sc = sds((NUM_POOL_PAGES, page_size, hkv), jnp.float32)
    return args + ([sc, sc] if kv_dtype == F8 else [])


DTYPES = pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, F8], ids=["bf16", "fp8"])
PAGES = pytest.mark.parametrize("page_size", [16, 64])


# ---------------------------------------------------------------- GPU (Triton) --------------------------------------


@DTYPES
@PAGES
@pytest.mark.parametrize("batch,q_dtype", [(1, jnp.float32), (64, jnp.float32), (8, jnp.bfloat16)])
def test_mla_lowers_for_cuda_through_triton(kv_dtype, page_size, batch, q_dtype):
    fn = functools.partial(gpu.paged_mla_decode, kv_lora_rank=MLA["rank"], softmax_scale=0.07,
                           out_dtype=jnp.float32)
    text = lower_for(fn, *_mla_args(batch, page_size, kv_dtype, q_dtype), platform="cuda")
    assert TRITON_CALL in text and "mosaic_gpu" not in text


@DTYPES
@PAGES
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("geometry", list(GQA))
def test_gqa_lowers_for_cuda_through_triton(kv_dtype, page_size, batch, geometry):
    fn = functools.partial(gpu.paged_gqa_decode, softmax_scale=0.088, out_dtype=jnp.float32)
    text = lower_for(fn, *_gqa_args(batch, page_size, kv_dtype, geometry), platform="cuda")
    assert TRITON_CALL in text and "mosaic_gpu" not in text


def _gpu_blocks(kind: str, page_size: int, kv_dtype, q_dtype, geometry: str = "glm4.5-tp8", **override):
    """(DecodeBlocks, smem_tiles kwargs) the wrapper would use at MAX_CONTEXT."""
    max_pages = MAX_CONTEXT // page_size
    fp8 = kv_dtype == F8
    if kind == "mla":
        dl = MLA["rank"] + MLA["rope"]
        tiles = dict(kv_widths=(MLA["rank"], MLA["rope"]), q_width=dl, kv_dtype=kv_dtype, q_dtype=q_dtype,
                     n_scales=int(fp8))
        return gpu.choose_blocks(page_size, max_pages, MLA["heads"], **override, **tiles), tiles
    hq, hkv, d = GQA[geometry]
    tiles = dict(kv_widths=(d, d), q_width=d, kv_dtype=kv_dtype, q_dtype=q_dtype, n_scales=2 * int(fp8))
    return gpu.choose_blocks(page_size, max_pages, hq // hkv, **override, **tiles), tiles


def _gpu_smem(blocks, page_size: int, tiles: dict) -> int:
    staged, once = gpu.smem_tiles(blocks, page_size, **tiles)
    return stage_bytes(staged, buffers=blocks.num_stages) + stage_bytes(once, buffers=1)


@DTYPES
@PAGES
@pytest.mark.parametrize("kind,q_dtype", [("mla", jnp.float32), ("mla", jnp.bfloat16), ("gqa", jnp.bfloat16),
                                          ("gqa", jnp.float32)])
def test_gpu_blocks_fit_h200_shared_memory(kv_dtype, page_size, kind, q_dtype):
    blocks, tiles = _gpu_blocks(kind, page_size, kv_dtype, q_dtype)
    assert _gpu_smem(blocks, page_size, tiles) == gpu.smem_bytes(blocks, page_size, **tiles)  # the model agrees
    # the compiler's measured bytes where known (tests/compile checks them), else the model
    used = gpu.smem_estimate(blocks, page_size, **tiles)
    within(used, H200_SMEM_BYTES, f"{kind} {blocks}")
    assert blocks.tokens_per_step(page_size) >= 16  # Triton's dot minimum


def test_gpu_budget_check_catches_an_oversized_block():
    """Negative control: 256-token steps of a 576-wide BF16 latent beside its f32 copy cannot fit."""
    blocks, tiles = _gpu_blocks("mla", 16, jnp.bfloat16, jnp.float32, pages_per_compute_block=16)
    with pytest.raises(AssertionError, match="budget"):
        within(_gpu_smem(blocks, 16, tiles), H200_SMEM_BYTES, "oversized")


# ---------------------------------------------------------------- TPU (Mosaic) --------------------------------------

TPU_CALL = "tpu_custom_call"


@DTYPES
@PAGES
@pytest.mark.parametrize("batch,q_dtype", [(1, jnp.float32), (64, jnp.float32), (8, jnp.bfloat16)])
def test_mla_lowers_for_tpu(kv_dtype, page_size, batch, q_dtype):
    fn = functools.partial(tpu.paged_mla_decode_tpu, kv_lora_rank=MLA["rank"], softmax_scale=0.07)
    text = lower_for(fn, *_mla_args(batch, page_size, kv_dtype, q_dtype), platform="tpu", device_kind=TPU_V6E)
    assert TPU_CALL in text


@DTYPES
@PAGES
@pytest.mark.parametrize("geometry,batch", [("glm4.5-tp8", 1), ("glm4.5-tp8", 64), ("glm4.5-tp1", 8)])
def test_gqa_lowers_for_tpu(kv_dtype, page_size, geometry, batch):
    fn = functools.partial(tpu.paged_gqa_decode_tpu, softmax_scale=0.088, out_dtype=jnp.float32)
    text = lower_for(fn, *_gqa_args(batch, page_size, kv_dtype, geometry), platform="tpu", device_kind=TPU_V6E)
    assert TPU_CALL in text


# VMEM / SMEM of the TPU kernel: the compiler's, in the compile tier (tests/compile: every geometry compiled for
# v5e / v5p / v6e, and Mosaic refusing an over-budget compute block).
