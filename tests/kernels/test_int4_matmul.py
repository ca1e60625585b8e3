"""Pallas INT4 matmul (interpret mode) vs the dequantize-then-dot reference, and `ops.linear` dispatch.

Tolerance: both sides see the same bf16 activations; the gpu tiling uses the exactly dequantized weights, the
tpu tiling rounds q * scale to bf16 once (relative <= 2^-9 per weight); both accumulate in f32 and round the
output to bf16 (relative 2^-9), so ||out - ref|| / ||ref|| <= 1e-2 is loose (measured ~1.7e-3 gpu, ~2.2e-3
tpu) while a wrong nibble, group or scale index gives errors of order 1. The tpu tiling runs in TPU interpret
mode (`pltpu.InterpretParams()`), the gpu tiling in legacy `interpret=True`.
"""
from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jex_core

from jaxserve.errors import ConfigError
from jaxserve.quant import formats, ops
from pallas_kernels.int4_matmul import Int4Blocks, KernelShapeError, choose_blocks, int4_matmul
from pallas_kernels import reference
from pallas_kernels.reference import int4_matmul_reference

REL_TOL = 1e-2


def _rel_err(out: jax.Array, ref: jax.Array) -> float:
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def _case(seed: int, m: int, k: int, n: int, g: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(0.1, 2.0, size=(1, n)).astype(np.float32)
    wq, scale = formats.quantize(w, "int4", g)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    return x, wq, scale


TPU = pltpu.InterpretParams()  # TPU interpret mode: runs the Mosaic-shaped kernel on CPU, fails on OOB reads


@pytest.mark.parametrize("seed, m, k, n, g, blocks", [
    (0, 1, 256, 128, 32, None),  # decode: one row padded to a 16-row tile
    (1, 7, 512, 200, 128, None),  # N with no power-of-two divisor >= 16: partial edge tile (gpu), full N (tpu)
    (2, 64, 256, 96, 32, None),
    (3, 256, 1024, 256, 128, None),  # prefill-sized: two 128-row tiles, 8 groups of 128
    # explicit blocks: 3 M tiles and 2 N tiles (gpu) / 2 K steps (tpu)
    (4, 33, 128, 64, 32, {"gpu": Int4Blocks(16, 32), "tpu": Int4Blocks(16, 64, 64)}),
    # gpu split-K (4 partials merged in XLA) / tpu 4 K steps in the VMEM accumulator
    (5, 3, 1024, 256, 32, {"gpu": Int4Blocks(16, 64, 0, 4), "tpu": Int4Blocks(16, 128, 256)}),
])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_int4_matmul_matches_reference(backend: str, seed: int, m: int, k: int, n: int, g: int,
                                       blocks: dict[str, Int4Blocks] | None) -> None:
    x, wq, scale = _case(seed, m, k, n, g)
    out = int4_matmul(x, wq, scale, blocks=(blocks or {}).get(backend), backend=backend,
                      interpret=TPU if backend == "tpu" else True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert _rel_err(out, int4_matmul_reference(x, wq, scale)) <= REL_TOL


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("m, k, n", [(1, 7168, 256), (8, 2048, 512)])  # hidden 7168 -> N slice; FFN 2048 -> N
def test_int4_matmul_real_dims(backend: str, m: int, k: int, n: int) -> None:
    # Kimi K2.6 decode dims with the default blocks of each backend (gpu: split-K partials merged in XLA)
    x, wq, scale = _case(6, m, k, n, 32)
    out = int4_matmul(x, wq, scale, backend=backend, interpret=TPU if backend == "tpu" else True)
    assert _rel_err(out, int4_matmul_reference(x, wq, scale)) <= REL_TOL


@pytest.mark.parametrize("fmt, shape, g", [("int4", (256, 96), 32), ("int4", (3, 256, 40), 128),
                                           ("fp8", (256, 96), 128), ("fp8", (2, 200, 130), 128)])
def test_reference_dequantize_is_bit_exact_with_formats(fmt: str, shape: tuple[int, ...], g: int) -> None:
    # pallas_kernels has its own dequantization (it imports nothing from jaxserve); it must be the same one
    rng = np.random.default_rng(len(shape) * 10 + g)
    wq, scale = formats.quantize(rng.standard_normal(shape).astype(np.float32) * 3.0, fmt, g)
    ours = np.asarray(reference.dequantize(wq, scale, fmt))
    theirs = np.asarray(formats.dequantize(wq, scale, fmt))
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_kernel_modules_import_without_jaxserve() -> None:
    code = ("import sys, pallas_kernels.int4_matmul, pallas_kernels.moe_gmm, pallas_kernels.reference; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'jaxserve']; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_choose_blocks_gpu() -> None:
    assert choose_blocks(100, 7168) == Int4Blocks(128, 256)  # prefill tiling unchanged
    assert choose_blocks(4096, 576) == Int4Blocks(128, 64)
    assert choose_blocks(8, 200) == Int4Blocks(16, 64)  # decode: narrower tiles, more programs
    # decode lm_head shard 7168 -> 20480: 160 N blocks x 2 K splits = 320 programs >= 2 per H200 SM
    assert choose_blocks(1, 20480, 7168) == Int4Blocks(16, 128, 0, 2)
    # decode o_proj 1024 -> 7168: block_n 64 gives 112 programs (block_n 256 gave 28); a K split would make the
    # f32 partials more than 25% of the weight bytes, so none
    assert choose_blocks(1, 7168, 1024) == Int4Blocks(16, 64, 0, 1)


def test_choose_blocks_tpu() -> None:
    assert choose_blocks(1, 2048, 7168, backend="tpu") == Int4Blocks(16, 1024, 1024)
    assert choose_blocks(4096, 7168, 1024, group_size=128, backend="tpu") == Int4Blocks(256, 512, 1024)
    assert choose_blocks(4, 1536, 1536, group_size=128, backend="tpu") == Int4Blocks(16, 512, 1536)  # full K


def test_bad_backend_and_shapes_raise_kernel_shape_error() -> None:
    x, wq, scale = _case(8, 2, 128, 64, 32)
    with pytest.raises(KernelShapeError) as e:
        int4_matmul(x, wq, scale, backend="cuda")
    assert e.value.param == "backend" and isinstance(e.value, ValueError)
    with pytest.raises(KernelShapeError) as e:
        int4_matmul(x[:, :64], wq, scale, interpret=True)
    assert e.value.param == "w"


def _no_weight_sized_float_outside_kernel(jaxpr: jex_core.Jaxpr, size: int) -> bool:
    """True if no equation outside pallas_call bodies produces a float array with >= `size` elements."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = v.aval
            if (hasattr(aval, "shape") and jnp.issubdtype(aval.dtype, jnp.floating)
                    and int(np.prod(aval.shape)) >= size and eqn.primitive.name != "pallas_call"):
                return False
        if eqn.primitive.name == "pallas_call":
            continue  # the kernel body works on VMEM/register tiles
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", p)
            if isinstance(sub, jex_core.Jaxpr) and not _no_weight_sized_float_outside_kernel(sub, size):
                return False
    return True


def test_kernel_path_never_materializes_dequantized_weight() -> None:
    m, k, n = 4, 512, 256  # K*N = 131072 floats would be the dequantized weight; activations are 2048
    x, wq, scale = _case(5, m, k, n, 32)
    kernel = jax.make_jaxpr(lambda a, b, c: ops.linear(a, b, c, "int4", use_kernel=True, interpret=True))
    xla = jax.make_jaxpr(lambda a, b, c: ops.linear(a, b, c, "int4"))
    assert _no_weight_sized_float_outside_kernel(kernel(x, wq, scale).jaxpr, k * n)
    assert not _no_weight_sized_float_outside_kernel(xla(x, wq, scale).jaxpr, k * n)  # the check can fail
    for backend, blocks in (("gpu", Int4Blocks(16, 64, 0, 4)), ("tpu", None)):  # split-K partials are [4, 16, N]
        direct = jax.make_jaxpr(lambda a, b, c: int4_matmul(a, b, c, blocks=blocks, backend=backend,
                                                            interpret=True))
        assert _no_weight_sized_float_outside_kernel(direct(x, wq, scale).jaxpr, k * n)


@pytest.mark.parametrize("fmt", ["bf16", "f32", "fp8", "int4"])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_linear_dispatch_matches_dequantize_dot(fmt: str, use_kernel: bool) -> None:
    rng = np.random.default_rng(hash((fmt, use_kernel)) % 2 ** 32)
    k, n = 256, 192
    wq, scale = formats.quantize(rng.standard_normal((k, n)).astype(np.float32), fmt, 32)
    x = jnp.asarray(rng.standard_normal((2, 3, k)), jnp.bfloat16)  # leading dims are flattened and restored
    out = ops.linear(x, wq, scale, fmt, use_kernel=use_kernel, interpret=True)
    assert out.shape == (2, 3, n) and out.dtype == jnp.bfloat16
    ref = jnp.einsum("abk,kn->abn", x.astype(jnp.float32), formats.dequantize(wq, scale, fmt))
    assert _rel_err(out, ref) <= REL_TOL


def test_linear_f32_activations_and_fp8_partial_k() -> None:
    # f32 x keeps f32 out; fp8 with K % 128 != 0 takes the XLA path even with use_kernel
    rng = np.random.default_rng(7)
    wq, scale = formats.quantize(rng.standard_normal((96, 40)).astype(np.float32), "fp8")
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    out = ops.linear(x, wq, scale, "fp8", use_kernel=True, interpret=True)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(x @ formats.dequantize(wq, scale, "fp8")),
                               rtol=1e-5, atol=1e-5)


def test_linear_rejects_bad_format_and_shapes() -> None:
    x = jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(ConfigError) as e:
        ops.linear(x, jnp.ones((64, 8), jnp.bfloat16), None, "int8")
    assert e.value.value == "int8"
    wq, scale = formats.quantize(np.ones((128, 8), np.float32), "int4", 32)
    with pytest.raises(ConfigError) as e:
        ops.linear(x, wq, scale, "int4")
    assert e.value.value == (64, 8)
