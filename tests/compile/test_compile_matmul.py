"""The quantized matmul kernels compiled (not lowered) for H200 (backend "gpu", Triton) and TPU v5e / v5p / v6e
(backend "tpu", Mosaic) at the real per-device shapes, with the blocks their choosers pick.

int4_matmul (decode weights "int4", EngineConfig.int4_group_size 32): Kimi K2.6 per device (8 devices) q_b [1536,
1536], o [1024, 7168], lm_head [7168, 20480], at M = 1 (one decode row), 64 (the largest decode batch) and 4096.
moe_gmm, "int4" (g 32) and "fp8" (128 x 128 blocks, the prefill weights): routed experts per device, gate/up
(hidden -> FFN) and down (FFN -> hidden), M = 4096 routed rows (a 512-token prefill chunk x top-8) for every model
and M = 64 (decode) for Kimi EP.
"""
from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from aot import ALL_TARGETS, check_budget, compile_for, mosaic_operands_in_vmem, sds
from jaxserve.quant import ops
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.moe_gmm import moe_gmm
from tests.kernels.test_lowering_matmul import DENSE, MOE_SHARDS  # the per-device shapes the lowering tests use

GROUP = 32


def weight_args(target: str, fmt: str, k: int, n: int, experts: int | None = None) -> list:
    lead = () if experts is None else (experts,)
    if fmt == "int4":
        return [sds(target, (*lead, k // 2, n), jnp.uint8), sds(target, (*lead, k // GROUP, n), jnp.bfloat16)]
    return [sds(target, (*lead, k, n), jnp.float8_e4m3fn), sds(target, (*lead, k // 128, -(-n // 128)), jnp.float32)]


@pytest.mark.parametrize("target", ALL_TARGETS)
@pytest.mark.parametrize("proj", list(DENSE))
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_int4_matmul_compiles(target, proj, m):
    k, n = DENSE[proj]
    backend = "gpu" if target == "h200" else "tpu"
    args = [sds(target, (m, k), jnp.bfloat16), *weight_args(target, "int4", k, n)]
    check_budget(target, compile_for(target, lambda x, w, s: int4_matmul(x, w, s, backend=backend), *args))


GMM_CASES = [(s, fmt, proj, 4096) for s in MOE_SHARDS for fmt in ("int4", "fp8") for proj in ("gate_up", "down")]
GMM_CASES += [(MOE_SHARDS[0], fmt, proj, 64) for fmt in ("int4", "fp8") for proj in ("gate_up", "down")]


@pytest.mark.parametrize("target", ALL_TARGETS)
@pytest.mark.parametrize("shard,fmt,proj,m", GMM_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_moe_gmm_compiles(target, shard, fmt, proj, m):
    k, n = (shard.hidden, shard.ffn) if proj == "gate_up" else (shard.ffn, shard.hidden)
    backend = "gpu" if target == "h200" else "tpu"
    args = [sds(target, (m, k), jnp.bfloat16), *weight_args(target, fmt, k, n, shard.experts),
            sds(target, (shard.experts,), jnp.int32)]
    fn = lambda x, w, s, gs: moe_gmm(x, w, s, gs, fmt=fmt, backend=backend)  # noqa: E731
    result = compile_for(target, fn, *args)
    check_budget(target, result)
    if target != "h200":  # the expert weights and scales (the call's last two operands) read by its DMAs from HBM
        calls = mosaic_operands_in_vmem(result, "moe_gmm")
        assert calls and not [c for c in calls if c[-2] or c[-1]], calls


@pytest.mark.parametrize("k,n", [(1536, 1536), (2048, 2048)])  # Kimi K2.6's / GLM-5.2's q_b per device
def test_one_row_bf16_linear_reads_its_weight_once_on_h200(k, n):
    """At one row XLA:GPU would strength-reduce the vector-matrix dot into an f32 [K, N] multiply and a reduce (in
    the decode step a separate fusion writing the product to HBM); ops.linear keeps it a GEMM: no instruction but
    the parameter has the weight's shape."""
    fn = lambda x, w: ops.linear(x, w, None, "bf16")  # noqa: E731
    hlo = compile_for("h200", fn, sds("h200", (1, k), jnp.bfloat16), sds("h200", (k, n), jnp.bfloat16)).hlo
    written = [line.strip() for line in hlo.splitlines()
               if re.search(rf"= \w+\[{k},{n}\]", line) and " parameter(" not in line]
    assert not written, written
    assert re.search(r"custom_call_target=\"__cublas|__triton_gemm|kind=kCustom", hlo), "no GEMM in the program"
