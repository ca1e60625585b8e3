"""The engine picks one kernel backend per attention impl, for every Pallas call of both programs: "pallas*" the
Triton (GPU) tilings, "pallas_tpu*" the Mosaic (TPU) ones, attention and quantized matmuls (int4_matmul,
moe_gmm) alike. Read off the traced programs: each pallas_call carries its backend's compiler params."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from engine_util import engine, prompts, small_config, tiny_model
from jaxserve.engine import SamplingParams
from jaxserve.engine.programs import Programs
from jaxserve.engine.batch import dummy_decode, dummy_prefill
from jaxserve.quant import formats, ops

PARAMS = {"gpu": plgpu.CompilerParams, "tpu": pltpu.CompilerParams}


def _pallas_calls(jaxpr: jax.extend.core.Jaxpr) -> list[dict]:
    """The params of every pallas_call in a jaxpr, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(eqn.params)
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    out.extend(_pallas_calls(inner))
    return out


def _backends(calls: list[dict]) -> set[str]:
    return {b for c in calls for b, cls in PARAMS.items() if isinstance(c["compiler_params"], cls)}


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3")


@pytest.mark.parametrize("attention,backend", [("pallas_interpret", "gpu"), ("pallas_tpu_interpret", "tpu")])
def test_every_pallas_call_of_both_programs_uses_one_backend(model, attention, backend):
    cfg = small_config(kv_dtype="fp8", decode_weights="int4", prefill_weights="fp8", use_kernels=True,
                       attention=attention)
    pr = Programs(model, cfg)
    for ph in (pr.prefill_phase, pr.decode_phase):
        mods = [m for _, m in nnx.iter_graph(nnx.merge(ph.graphdef, ph.state)) if hasattr(m, "use_kernel")]
        assert mods and all(m.backend == backend and m.use_kernel for m in mods)
    ph, dh = pr.prefill_phase, pr.decode_phase
    prefill = pr._prefill.trace(ph.params, ph.pages, *dummy_prefill(2, 16, 8)).jaxpr.jaxpr
    decode = pr._decode.trace(dh.params, dh.pages, *dummy_decode(2, 8)).jaxpr.jaxpr
    for jaxpr in (prefill, decode):
        calls = _pallas_calls(jaxpr)
        names = {str(c["name"] or "") + str(c["grid_mapping"].grid) for c in calls}
        assert len(calls) >= 3, names  # attention + dense int4/fp8 matmuls + grouped expert matmuls
        assert _backends(calls) == {backend}, names


def test_ops_pass_the_backend_to_the_matmul_kernels():
    """ops.linear / grouped_linear with backend="tpu" run the Mosaic tiling, and it gives the Triton tiling's
    result up to rounding (interpret mode; f32 accumulation in a different order, bf16 outputs: an element may
    land one bf16 step away, <= 2^-7 of the largest output)."""
    rng = np.random.default_rng(0)
    wq, scale = formats.quantize(rng.standard_normal((256, 128)).astype(np.float32), "int4", 32)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    out = {}
    for b in ("gpu", "tpu"):
        f = lambda x: ops.linear(x, wq, scale, "int4", use_kernel=True, interpret=True, backend=b)  # noqa: E731
        assert _backends(_pallas_calls(jax.make_jaxpr(f)(x).jaxpr)) == {b}
        out[b] = np.asarray(f(x), np.float32)
    assert np.abs(out["tpu"] - out["gpu"]).max() <= 2 ** -7 * np.abs(out["gpu"]).max()
    we, se = formats.quantize(rng.standard_normal((3, 256, 64)).astype(np.float32), "fp8", 32)
    gs = jnp.asarray([2, 0, 3], jnp.int32)
    xe = jnp.asarray(rng.standard_normal((6, 256)), jnp.bfloat16)
    for b in ("gpu", "tpu"):
        f = lambda x: ops.grouped_linear(x, we, se, gs, "fp8", use_kernel=True, interpret=True,  # noqa: E731
                                         backend=b)
        assert _backends(_pallas_calls(jax.make_jaxpr(f)(xe).jaxpr)) == {b}
        out[b] = np.asarray(f(xe), np.float32)
    assert np.abs(out["tpu"] - out["gpu"]).max() <= 2 ** -7 * np.abs(out["gpu"]).max()


@pytest.mark.slow
def test_engine_with_the_mosaic_matmul_tilings(model):
    """INT4 decode / FP8 prefill weights through the TPU-tiled kernels (interpret) vs the XLA dequant path."""
    ps = prompts(2, seed=14)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    kw = dict(kv_dtype="fp8", decode_weights="int4", prefill_weights="fp8")
    ref = engine(model, **kw).generate(ps, sp)
    got = engine(model, use_kernels=True, attention="pallas_tpu_interpret", **kw).generate(ps, sp)
    agree = sum(a == b for r, g in zip(ref, got) for a, b in zip(r.token_ids, g.token_ids))
    assert agree >= 5  # bf16 operands in the kernels vs f32 dequant in XLA: a near-tie may flip one of 6
