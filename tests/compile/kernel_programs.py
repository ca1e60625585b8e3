"""The attention kernel programs the engine can select, at the real per-device shapes, as ShapeDtypeStructs on a
compile target: `decode_program` / `prefill_program` -> (fn, args) for tests/compile's compile_for.

attention="pallas" selects the Triton kernels (paged_attention.paged_*_decode, paged_prefill backend "gpu"), here
for target "h200"; "pallas_tpu" the Mosaic ones (paged_attention_tpu, paged_prefill backend "tpu"), for each TPU.

Per-device geometry (8 devices): Kimi K2.6 / GLM-5.2 MLA, 64 heads x (512 + 64): TP 8 local heads and all decode
rows, DP all 64 heads and 1/8 of the rows; GLM-4.5 GQA 96 q / 8 kv heads x 128: TP 12 / 1, DP 96 / 8. Contexts:
Kimi 262,144, GLM-5.2 1,048,576, GLM-4.5 131,072 tokens of block table per row.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax.numpy as jnp

from aot import row_major, sds
from pallas_kernels import paged_attention as gpu
from pallas_kernels import paged_attention_tpu as tpu
from pallas_kernels.paged_prefill import paged_prefill_gqa, paged_prefill_mla
from pallas_kernels.dsa_index_scores import dsa_index_scores
from pallas_kernels.dsa_index_scores_tpu import dsa_index_scores_tpu
from pallas_kernels.sparse_mla_decode import sparse_mla_decode
from pallas_kernels.sparse_mla_decode_tpu import sparse_mla_decode_tpu

F8 = jnp.float8_e4m3fn
POOL_PAGES = 4096  # per-device pool: any size, the kernels never loop over it
@dataclass(frozen=True)
class Geometry:
    name: str
    mla: bool
    q_heads: int
    kv_heads: int  # MLA: 1 latent
    head_dim: int  # MLA: latent 512 + 64
    decode_rows: int
    context: int


GEOMETRIES = (
    Geometry("kimi-tp", True, 8, 1, 576, 64, 262_144),
    Geometry("kimi-dp", True, 64, 1, 576, 8, 262_144),
    Geometry("glm5-tp", True, 8, 1, 576, 64, 1_048_576),
    Geometry("glm4.5-tp", False, 12, 1, 128, 64, 131_072),
    Geometry("glm4.5-dp", False, 96, 8, 128, 8, 131_072),
)
RANK = 512
GLM52_LAYERS, GLM52_TOPK = 78, 2048  # the sparse decode reads the whole pool: every main layer, > 2**32 bytes
# the indexer keys: 21 indexer layers x 32 heads x 128, pages as the H200 TP plan's pool (24,157: > 2**32 bytes of
# u8 keys), scored 32,768 tokens (512 pages of 64) per call of dsa.select_topk's blockwise top-k
GLM52_INDEX_LAYERS, GLM52_INDEX_HEADS, GLM52_INDEX_DIM, INDEX_POOL_PAGES, INDEX_BLOCK = 21, 32, 128, 24_157, 32_768
# the TPU sparse decode's pool: 2048 pages of every layer (BF16 pages of 64: 11.8 GB, within a v5e's 16 GB HBM)
TPU_SPARSE_POOL_PAGES = 2048
PREFILL_ROWS, PREFILL_CHUNK = 2, 256  # EngineConfig: 512 prompt tokens per step, 256 per request

def pools(target: str, geo: Geometry, page_size: int, kv_dtype, **layout) -> list:
    """The kernel's pool arguments: MLA (latent, scales | None); GQA (k, v, k_scales | None, v_scales | None)."""
    fp8 = kv_dtype == F8
    if geo.mla:
        lat = sds(target, (POOL_PAGES, page_size, geo.head_dim), kv_dtype, **layout)
        return [lat, sds(target, (POOL_PAGES, page_size), jnp.float32) if fp8 else None]
    kv = sds(target, (POOL_PAGES, page_size, geo.kv_heads, geo.head_dim), kv_dtype, **layout)
    sc = sds(target, (POOL_PAGES, page_size, geo.kv_heads), jnp.float32) if fp8 else None
    return [kv, kv, sc, sc]


def decode_program(target: str, geo: Geometry, page_size: int, kv_dtype, **layout):
    """(fn, args) of the decode kernel attention="pallas" (h200) / "pallas_tpu" selects, as paged.py calls it."""
    b = geo.decode_rows
    tables = [sds(target, (b, geo.context // page_size), jnp.int32), sds(target, (b,), jnp.int32)]
    if geo.mla:
        lat, sc = pools(target, geo, page_size, kv_dtype, **layout)
        q = sds(target, (b, geo.q_heads, geo.head_dim), jnp.float32)  # the absorbed query is f32
        kw = dict(kv_lora_rank=RANK, softmax_scale=0.07)
        if target == "h200":
            fn = functools.partial(gpu.paged_mla_decode, out_dtype=jnp.float32, **kw)
        else:
            fn = functools.partial(tpu.paged_mla_decode_tpu, **kw)
        return (lambda q, lat, bt, ln, sc: fn(q, lat, bt, ln, sc)), [q, lat, *tables, sc]
    kp, vp, ks, vs = pools(target, geo, page_size, kv_dtype, **layout)
    q = sds(target, (b, geo.q_heads, geo.head_dim), jnp.bfloat16)
    kernel = gpu.paged_gqa_decode if target == "h200" else tpu.paged_gqa_decode_tpu
    fn = functools.partial(kernel, softmax_scale=0.088, out_dtype=jnp.float32)
    return (lambda q, kp, vp, bt, ln, ks, vs: fn(q, kp, vp, bt, ln, ks, vs)), [q, kp, vp, *tables, ks, vs]


def prefill_program(target: str, geo: Geometry, page_size: int, kv_dtype, **layout):
    """(fn, args) of the flash prefill kernel for the target's backend, one chunk per row."""
    b, t = PREFILL_ROWS, PREFILL_CHUNK
    backend = "gpu" if target == "h200" else "tpu"
    tables = [sds(target, (b, geo.context // page_size), jnp.int32), sds(target, (b, t), jnp.int32),
              sds(target, (b,), jnp.int32)]
    q = sds(target, (b, t, geo.q_heads, geo.head_dim), jnp.float32)
    if geo.mla:
        lat, sc = pools(target, geo, page_size, kv_dtype, **layout)
        fn = functools.partial(paged_prefill_mla, kv_lora_rank=RANK, softmax_scale=0.07, backend=backend)
        return (lambda q, lat, bt, pos, ln, sc: fn(q, lat, bt, pos, ln, sc)), [q, lat, *tables, sc]
    kp, vp, ks, vs = pools(target, geo, page_size, kv_dtype, **layout)
    fn = functools.partial(paged_prefill_gqa, softmax_scale=0.088, backend=backend)
    return (lambda q, kp, vp, bt, pos, ln, ks, vs: fn(q, kp, vp, bt, pos, ln, ks, vs)), [q, kp, vp, *tables, ks, vs]


def gpu_decode_blocks(geo: Geometry, page_size: int, kv_dtype) -> tuple[gpu.DecodeBlocks, dict]:
    """(blocks, tile kwargs) paged_attention's decode wrapper chooses for decode_program's h200 call."""
    fp8 = int(kv_dtype == F8)
    if geo.mla:
        tiles = dict(kv_widths=(RANK, geo.head_dim - RANK), q_width=geo.head_dim, kv_dtype=kv_dtype,
                     q_dtype=jnp.float32, n_scales=fp8)
        rows = geo.q_heads
    else:
        tiles = dict(kv_widths=(geo.head_dim,) * 2, q_width=geo.head_dim, kv_dtype=kv_dtype, q_dtype=jnp.bfloat16,
                     n_scales=2 * fp8)
        rows = geo.q_heads // geo.kv_heads
    return gpu.choose_blocks(page_size, geo.context // page_size, rows, **tiles), tiles


def sparse_decode_program(geo: Geometry, page_size: int, kv_dtype, **tiling):
    """(fn, args) of the DSA sparse MLA decode attention="pallas" selects on GLM-5.2 (h200), as dsa.py calls it:
    the whole pool's stored bits [layers, pages, ps, 576] (uint8 for fp8, uint16 for bf16) + a layer, the row's
    top-k token indices."""
    t, b = "h200", geo.decode_rows
    bits = jnp.uint8 if kv_dtype == F8 else jnp.uint16
    lead = (GLM52_LAYERS, POOL_PAGES, page_size)
    args = [sds(t, (b, geo.q_heads, geo.head_dim), jnp.float32), sds(t, (*lead, geo.head_dim), bits),
            sds(t, (b, geo.context // page_size), jnp.int32), sds(t, (b, GLM52_TOPK), jnp.int32),
            sds(t, lead, jnp.float32) if kv_dtype == F8 else None, sds(t, (), jnp.int32)]
    fn = functools.partial(sparse_mla_decode, kv_lora_rank=RANK, softmax_scale=0.07, value_dtype=kv_dtype,
                           out_dtype=jnp.float32, **tiling)
    return (lambda q, p, bt, idx, sc, layer: fn(q, p, bt, idx, sc, layer=layer)), args


def sparse_decode_tpu_program(target: str, geo: Geometry, page_size: int, kv_dtype, **tiling):
    """(fn, args) of the DSA sparse MLA decode attention="pallas_tpu" selects on GLM-5.2, as dsa.py calls it: the
    whole pool's stored bits [78, pages, ps, 576] (uint8 for fp8, uint16 for bf16), row-major as the engine pins
    it on TPU (`sharding.pool_format`), + a layer, the row's top-k token indices."""
    t, b = target, geo.decode_rows
    bits = jnp.uint8 if kv_dtype == F8 else jnp.uint16
    lead = (GLM52_LAYERS, TPU_SPARSE_POOL_PAGES, page_size)
    args = [sds(t, (b, geo.q_heads, geo.head_dim), jnp.float32), sds(t, (*lead, geo.head_dim), bits, row_major(4)),
            sds(t, (b, geo.context // page_size), jnp.int32), sds(t, (b, GLM52_TOPK), jnp.int32),
            sds(t, lead, jnp.float32) if kv_dtype == F8 else None, sds(t, (), jnp.int32)]
    fn = functools.partial(sparse_mla_decode_tpu, kv_lora_rank=RANK, softmax_scale=0.07, out_dtype=jnp.float32,
                           **tiling)
    return (lambda q, p, bt, idx, sc, layer: fn(q, p, bt, idx, sc, layer=layer)), args


def index_scores_program(geo: Geometry, page_size: int, kv_dtype, heads: int = GLM52_INDEX_HEADS, **tiling):
    """(fn, args) of the DSA indexer scores attention="pallas" selects on GLM-5.2 decode (h200), as dsa.py calls it:
    the whole index-key pool's stored bits [21, pages, ps, 128] (uint8 for fp8, uint16 for bf16) + a layer, one
    block of the blockwise top-k's table per row; `heads` indexer heads (GLM-5.2's 32 unless a test asks more)."""
    t, b = "h200", geo.decode_rows
    bits = jnp.uint8 if kv_dtype == F8 else jnp.uint16
    lead = (GLM52_INDEX_LAYERS, INDEX_POOL_PAGES, page_size)
    args = [sds(t, (b, heads, GLM52_INDEX_DIM), jnp.float32), sds(t, (b, heads), jnp.float32),
            sds(t, (*lead, GLM52_INDEX_DIM), bits),
            sds(t, (b, INDEX_BLOCK // page_size), jnp.int32),
            sds(t, lead, jnp.float32) if kv_dtype == F8 else None, sds(t, (), jnp.int32)]
    fn = functools.partial(dsa_index_scores, value_dtype=kv_dtype, **tiling)
    return (lambda q, w, p, bt, sc, layer: fn(q, w, p, bt, sc, layer=layer)), args


def index_scores_tpu_program(target: str, geo: Geometry, page_size: int, kv_dtype, **tiling):
    """(fn, args) of the DSA indexer scores attention="pallas_tpu" selects on GLM-5.2 decode, as dsa.py calls it: the
    whole index-key pool's stored bits [21, pages, ps, 128] and its scales, row-major as the engine pins them on
    TPU (`sharding.pool_format`), + a layer, one 32,768-token block of the blockwise top-k's table per row."""
    t, b = target, geo.decode_rows
    bits = jnp.uint8 if kv_dtype == F8 else jnp.uint16
    lead = (GLM52_INDEX_LAYERS, INDEX_POOL_PAGES, page_size)
    args = [sds(t, (b, GLM52_INDEX_HEADS, GLM52_INDEX_DIM), jnp.float32), sds(t, (b, GLM52_INDEX_HEADS), jnp.float32),
            sds(t, (*lead, GLM52_INDEX_DIM), bits, row_major(4)), sds(t, (b, INDEX_BLOCK // page_size), jnp.int32),
            sds(t, lead, jnp.float32, row_major(3)) if kv_dtype == F8 else None, sds(t, (), jnp.int32)]
    fn = functools.partial(dsa_index_scores_tpu, **tiling)
    return (lambda q, w, p, bt, sc, layer: fn(q, w, p, bt, sc, layer=layer)), args
