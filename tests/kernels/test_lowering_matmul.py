"""Cross-lowering of the matmul kernels at the real per-device shapes, and their per-stage on-chip byte budgets.

Lowering: `jax.export` for `cuda` with backend="gpu" (must be the Triton custom call: without compiler_params
the GPU lowering would be Mosaic GPU, which fails its shared-memory check at these shapes) and for `tpu` with
backend="tpu" (Mosaic; enforces the (8, 128)-or-full-dim block rule), with the chip declared as v6e
(kernel_lowering.TPU_V6E, whose 32 MiB scoped VMEM is the budget below); these kernels also lower with no chip
kind on this CPU host. Lowering is not compiling: Triton's and Mosaic's own passes run only on a device (see
the kernel headers).

Budgets, from the block shapes: gpu (Triton, refs are pointers) = the tiles one K-loop iteration loads x
num_stages + the dequantized dot operands <= H200 shared memory; tpu = every VMEM BlockSpec block of the
lowered pallas_call (read from its jaxpr, padded to TPU tiles) x 2 buffers + VMEM scratch + dequantization
temporaries <= the scoped VMEM limit, SMEM blocks <= SMEM. The kernels' `stage_plan` / `gmm_stage_plan` must
list exactly the jaxpr's blocks, so the plan cannot drift from the BlockSpecs. Negative controls: an oversized
block fails the budget, a Mosaic-illegal block fails the tpu lowering.

Shapes (8 devices): Kimi K2.6 hidden 7168, expert FFN 2048, 384 experts -> EP 48 local experts or TP all 384 of
FFN 256; dense q_b [1536, 1536], o [1024, 7168], lm_head [7168, 20480]; GLM-5.2 hidden 6144, 32 local experts
of FFN 2048; GLM-4.5 hidden 5120, 20 local experts of FFN 1536. M: 1 (decode) to 4096 (prefill chunk x top-8).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from kernel_lowering import (H200_SMEM_BYTES, TPU_SCOPED_VMEM_BYTES, TPU_SMEM_BYTES, TPU_V6E, lower_for, sds,
                             stage_bytes, tpu_padded)
from pallas_kernels.int4_matmul import (Int4Blocks, StagePlan, choose_blocks, int4_matmul, stage_plan,
                                        triton_params)
from pallas_kernels.moe_gmm import GmmBlocks, choose_gmm_blocks, gmm_stage_plan, moe_gmm

PLATFORM = {"gpu": "cuda", "tpu": "tpu"}
CUSTOM_CALL = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


@dataclass(frozen=True)
class MoeShard:
    """Per-device routed experts: `experts` local experts of hidden -> ffn (gate/up) and ffn -> hidden (down)."""

    name: str
    experts: int
    hidden: int
    ffn: int


MOE_SHARDS = (
    MoeShard("kimi-k2.6-ep8", 48, 7168, 2048),
    MoeShard("kimi-k2.6-tp8", 384, 7168, 256),
    MoeShard("glm-5.2-ep8", 32, 6144, 2048),
    MoeShard("glm-4.5-ep8", 20, 5120, 1536),
)
DENSE = {"q_b": (1536, 1536), "o": (1024, 7168), "lm_head": (7168, 20480)}  # Kimi K2.6 [K, N] per device
M_GMM = (1, 4096)  # routed rows: one decode token's expert row .. a 512-token prefill chunk x top-8
M_DENSE = (1, 64, 4096)  # decode row, the largest decode batch (GEMV tiling), prefill


def _int4_args(m: int, k: int, n: int, g: int, experts: int | None = None) -> tuple[jax.ShapeDtypeStruct, ...]:
    lead = () if experts is None else (experts,)
    return sds((m, k), jnp.bfloat16), sds((*lead, k // 2, n), jnp.uint8), sds((*lead, k // g, n), jnp.bfloat16)


def _fp8_args(m: int, k: int, n: int, experts: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (sds((m, k), jnp.bfloat16), sds((experts, k, n), jnp.float8_e4m3fn),
            sds((experts, k // 128, -(-n // 128)), jnp.float32))


def _gmm_fn(fmt: str, backend: str, blocks: GmmBlocks | None = None) -> Callable:
    return lambda x, w, s, gs: moe_gmm(x, w, s, gs, fmt=fmt, blocks=blocks, backend=backend)


def _assert_lowers(fn: Callable, args: tuple, backend: str, tile: tuple[int, int] | None = None) -> None:
    """Lowers fn for the backend's platform; gpu: the Triton call carries the tuning table's warps/stages for
    the [block_m, block_n] `tile`."""
    text = lower_for(fn, *args, platform=PLATFORM[backend], device_kind=TPU_V6E if backend == "tpu" else None)
    assert f"custom_call @{CUSTOM_CALL[backend]}(" in text  # gpu: the Triton call, not Mosaic GPU
    if backend == "gpu" and tile is not None:
        params = triton_params(*tile)
        assert f"num_warps = {params.num_warps} : i32" in text and f"num_stages = {params.num_stages} : i32" in text


def _gmm_cases() -> list:
    cases = []
    for shard in MOE_SHARDS:
        for proj, (k, n) in (("gate_up", (shard.hidden, shard.ffn)), ("down", (shard.ffn, shard.hidden))):
            g128 = (("int4", 128),) if shard.name == "kimi-k2.6-ep8" else ()
            for fmt, g in (("int4", 32), ("fp8", 128), *g128):
                cases.append(pytest.param(shard.experts, k, n, fmt, g, id=f"{shard.name}-{proj}-{fmt}-g{g}"))
    return cases


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("experts, k, n, fmt, g", _gmm_cases())
def test_moe_gmm_lowers_at_real_shapes(backend: str, experts: int, k: int, n: int, fmt: str, g: int) -> None:
    for m in M_GMM:
        x, w, s = _int4_args(m, k, n, g, experts) if fmt == "int4" else _fp8_args(m, k, n, experts)
        blocks = choose_gmm_blocks(m, n, experts, k, fmt=fmt, group_size=g, backend=backend)
        _assert_lowers(_gmm_fn(fmt, backend), (x, w, s, sds((experts,), jnp.int32)), backend,
                       (blocks.block_m, blocks.block_n))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("layer", list(DENSE))
def test_dense_linears_lower_at_real_shapes(backend: str, layer: str) -> None:
    k, n = DENSE[layer]
    for m in M_DENSE:
        for g in (32, 128) if layer == "lm_head" else (32,):
            blocks = choose_blocks(m, n, k, group_size=g, backend=backend)
            _assert_lowers(lambda x, w, s: int4_matmul(x, w, s, backend=backend), _int4_args(m, k, n, g), backend,
                           (blocks.block_m, blocks.block_n))
        # an fp8 dense layer is a one-group moe_gmm (as jaxserve.quant.ops.linear calls it)
        _assert_lowers(_gmm_fn("fp8", backend), (*_fp8_args(m, k, n, 1), sds((1,), jnp.int32)), backend)


def test_mosaic_rejects_an_illegal_tpu_block() -> None:
    # negative control for the lowering: block_n 64 is neither a multiple of 128 nor all of N = 2048
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        lower_for(lambda x, w, s: int4_matmul(x, w, s, blocks=Int4Blocks(16, 64, 1024), backend="tpu"),
                  *_int4_args(1, 7168, 2048, 32), platform="tpu", device_kind=TPU_V6E)


# ------------------------------------------------------------------------------------------------- budgets


def _pallas_call(jaxpr: jex_core.Jaxpr) -> jex_core.JaxprEqn | None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return eqn
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", p)
            if isinstance(sub, jex_core.Jaxpr) and (found := _pallas_call(sub)) is not None:
                return found
    return None


def _tpu_blocks(fn: Callable, *args: object) -> tuple[Counter, Counter]:
    """(VMEM in/out blocks, SMEM blocks) of the one pallas_call in fn, padded by kernel_lowering.tpu_padded (not
    by the kernel's own helper), as Counters of (shape, dtype name). Reads the jaxpr's grid mapping (jax
    internals, pinned JAX 0.10.2)."""
    eqn = _pallas_call(jax.make_jaxpr(fn)(*args).jaxpr)
    vmem, smem = Counter(), Counter()
    for mapping in eqn.params["grid_mapping"].block_mappings:
        aval = mapping.block_aval
        dtype = np.dtype(aval.dtype).name
        if "smem" in str(aval.memory_space):
            smem[(tpu_padded(aval.shape, "float32"), dtype)] += 1  # SMEM words are 32-bit
        else:
            vmem[(tpu_padded(aval.shape, dtype), dtype)] += 1
    return vmem, smem


def _plan_bytes(plan: StagePlan) -> int:
    return stage_bytes(plan.pipelined, plan.buffers) + stage_bytes(plan.resident, buffers=1)


def _check_tpu_plan(plan: StagePlan, fn: Callable, args: tuple) -> None:
    vmem, smem = _tpu_blocks(fn, *args)
    assert Counter((tuple(s), d) for s, d in plan.pipelined) == vmem  # the plan lists the real BlockSpecs
    assert Counter((tuple(s), d) for s, d in plan.smem) == smem
    assert _plan_bytes(plan) <= TPU_SCOPED_VMEM_BYTES
    assert stage_bytes(plan.smem, 2) <= TPU_SMEM_BYTES // 2  # half of SMEM: the prefetched tile metadata too


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_moe_gmm_blocks_fit_on_chip(backend: str) -> None:
    worst = 0
    for shard in MOE_SHARDS:
        for k, n in ((shard.hidden, shard.ffn), (shard.ffn, shard.hidden)):
            for fmt, g in (("int4", 32), ("int4", 128), ("fp8", 128)):
                for m in (1, 64, 512, 4096):
                    blocks = choose_gmm_blocks(m, n, shard.experts, k, fmt=fmt, group_size=g, backend=backend)
                    plan = gmm_stage_plan(k, n, blocks, fmt=fmt, group_size=g, backend=backend)
                    worst = max(worst, _plan_bytes(plan))
                    if backend == "gpu":
                        assert _plan_bytes(plan) <= H200_SMEM_BYTES, (shard, k, n, fmt, m, blocks)
                    elif m in (1, 4096):
                        x, w, s = _int4_args(m, k, n, g, shard.experts) if fmt == "int4" else \
                            _fp8_args(m, k, n, shard.experts)
                        _check_tpu_plan(plan, _gmm_fn(fmt, "tpu"), (x, w, s, sds((shard.experts,), jnp.int32)))
    assert worst > 0


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_int4_matmul_blocks_fit_on_chip(backend: str) -> None:
    shapes = [*DENSE.values(), *((s.hidden, s.ffn) for s in MOE_SHARDS), *((s.ffn, s.hidden) for s in MOE_SHARDS)]
    for k, n in shapes:
        for g in (32, 128):
            for m in (1, 16, 64, 65, 4096):
                blocks = choose_blocks(m, n, k, group_size=g, backend=backend)
                plan = stage_plan(m, k, n, g, blocks, backend=backend)
                if backend == "gpu":
                    assert _plan_bytes(plan) <= H200_SMEM_BYTES, (k, n, g, m, blocks)
                elif m in (1, 4096):
                    _check_tpu_plan(plan, lambda x, w, s: int4_matmul(x, w, s, backend="tpu"),
                                    _int4_args(m, k, n, g))


def test_decode_gemv_tiling_gives_an_h200_enough_programs() -> None:
    # lm_head shard at decode: the old [16, 256] tiling had 80 programs; now N blocks x K splits >= 2 per SM
    blocks = choose_blocks(1, 20480, 7168, group_size=32)
    assert _programs(1, 20480, blocks) >= 2 * 132
    # o_proj 1024 -> 7168: 28 programs before (block_n 256), 112 now (block_n 64, no split: see choose_blocks)
    assert _programs(1, 7168, choose_blocks(1, 7168, 1024, group_size=32)) == 112


def _programs(m: int, n: int, blocks: Int4Blocks) -> int:
    return math.ceil(m / blocks.block_m) * math.ceil(n / blocks.block_n) * blocks.k_splits


def test_oversized_blocks_fail_the_budget() -> None:
    # negative controls: the same checks reject blocks that cannot fit
    big_tpu = gmm_stage_plan(7168, 2048, GmmBlocks(512, 2048, 4096), fmt="int4", group_size=32, backend="tpu")
    assert _plan_bytes(big_tpu) > TPU_SCOPED_VMEM_BYTES
    big_fp8 = gmm_stage_plan(7168, 2048, GmmBlocks(1024, 2048, 7168), fmt="fp8", backend="tpu")
    assert _plan_bytes(big_fp8) > TPU_SCOPED_VMEM_BYTES
    # gpu: a 128 x 256 prefill tile with g = 128 groups, 4 stages deep, overflows 227 KiB
    big_gpu = stage_plan(4096, 7168, 2048, 128, Int4Blocks(128, 256), backend="gpu", num_stages=4)
    assert _plan_bytes(big_gpu) > H200_SMEM_BYTES
    # the default tile is inside (3 stages)
    assert _plan_bytes(stage_plan(4096, 7168, 2048, 128, Int4Blocks(128, 256), backend="gpu")) <= H200_SMEM_BYTES
