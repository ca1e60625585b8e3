"""Negative controls (the tier can fail: each compiler refuses an over-budget block) and the page pool's HBM layout
(a TPU kernel must not make XLA copy the pool on every call).

Pool layout: XLA:TPU's default layout for a [P, ps, 576] latent pool is page-minor (major_to_minor (1, 2, 0): 576
is not a multiple of 128 lanes, the compact layout avoids the lane padding), likewise [P, ps, 1, 128] GQA pools;
Mosaic requires its operands row-major, so with the default layout the compiled program copies the whole pool
before every kernel call (bf16[4096, 64, 576]: 302 MB in, 336 MB of temporaries). The kernels cannot choose
their caller's layout: a program that holds the pool must pin it row-major (jax.experimental.layout.Format with
Layout(major_to_minor=(0, 1, ...)) on the pool's input, output and creation, and donate it). GQA pools keep XLA's
default layout, in which the GQA kernels' [P, ps, Hkv, D] -> [P, ps * Hkv, D] view is a bitcast (row-major for
Hkv = 8; for Hkv = 1 the default puts the size-1 axis major, while a row-major [P, ps, 1, D] pads every token to
a sublane tile and is copied).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from aot import TPU_TARGETS, compile_for, copies_of, row_major, sds
from pallas_kernels import paged_attention as gpu
from pallas_kernels import paged_attention_tpu as tpu
from kernel_programs import F8, GEOMETRIES, POOL_PAGES, decode_program, prefill_program


def test_triton_refuses_shared_memory_over_h200_budget():
    """16 pages of 16 tokens per step of a 576-wide BF16 latent beside its f32 copy: ~850 KiB of shared memory."""
    t = "h200"
    args = [sds(t, (8, 8, 576), jnp.float32), sds(t, (POOL_PAGES, 16, 576), jnp.bfloat16),
            sds(t, (8, 1024), jnp.int32), sds(t, (8,), jnp.int32)]
    fn = functools.partial(gpu.paged_mla_decode, kv_lora_rank=512, softmax_scale=0.07, pages_per_compute_block=16)
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        compile_for(t, lambda q, p, bt, ln: fn(q, p, bt, ln), *args)


@pytest.mark.parametrize("target", TPU_TARGETS)
def test_mosaic_refuses_vmem_over_scoped_limit(target):
    """32 pages of 1024 tokens per compute block, double-buffered: 2 x 32,768 x 576 BF16 = 72 MiB of VMEM (few,
    large pages: fewer unrolled DMAs to compile than the same bytes in 16-token pages)."""
    args = [sds(target, (8, 8, 576), jnp.float32), sds(target, (64, 1024, 576), jnp.bfloat16, row_major(3)),
            sds(target, (8, 64), jnp.int32), sds(target, (8,), jnp.int32)]
    fn = functools.partial(tpu.paged_mla_decode_tpu, kv_lora_rank=512, softmax_scale=0.07,
                           pages_per_compute_block=32)
    with pytest.raises(Exception, match="(?i)vmem"):
        compile_for(target, lambda q, p, bt, ln: fn(q, p, bt, ln), *args)


def _pool_shape(geo, page_size: int) -> tuple[int, ...]:
    return (POOL_PAGES, page_size, geo.head_dim) if geo.mla else (POOL_PAGES, page_size, geo.kv_heads, geo.head_dim)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("geo", GEOMETRIES[:1] + GEOMETRIES[3:], ids=lambda g: g.name)
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, F8], ids=["bf16", "fp8"])
def test_pool_is_not_copied(kind, geo, kv_dtype):
    """v6e, page size 64: the MLA pool pinned row-major, the GQA pools in XLA's default layout (row-major for 8 kv
    heads; for 1 kv head the size-1 axis goes major, i.e. [P, ps, D] row-major, where a row-major [P, ps, 1, D]
    would pad each token's (1, 128) row to an (8, 128) tile): the program holds no copy of a pool."""
    target, page_size = "v6e", 64
    pinned = {"layout": row_major(3)} if geo.mla else {}
    if kind == "decode":
        fn, args = decode_program(target, geo, page_size, kv_dtype, **pinned)
    else:
        fn, args = prefill_program(target, geo, page_size, kv_dtype, **pinned)
    result = compile_for(target, fn, *args)
    shape = _pool_shape(geo, page_size)
    flat = (POOL_PAGES, page_size * geo.kv_heads, geo.head_dim)
    assert not copies_of(result, shape) and not copies_of(result, flat)


def test_default_layout_copies_the_mla_pool():
    """Pins the cause the engine must handle: XLA:TPU's default (page-minor) layout of the latent pool makes the
    compiled decode program copy the whole pool to the row-major layout Mosaic requires."""
    geo, page_size = GEOMETRIES[0], 64
    fn, args = decode_program("v6e", geo, page_size, jnp.bfloat16)
    result = compile_for("v6e", fn, *args)
    pool_bytes = POOL_PAGES * page_size * geo.head_dim * 2
    assert copies_of(result, _pool_shape(geo, page_size)) and result.temp_bytes >= pool_bytes
