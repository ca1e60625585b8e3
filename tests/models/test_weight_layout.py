"""Weight layouts: "packed" (quantized weights dequantized inside each matmul) vs "compute" (dequantized once at
load, the CPU default). Same values, so the same tokens; the compute layout's decode program unpacks nothing."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from engine_util import engine, prompts, small_config, tiny_model
from jaxserve.engine import SamplingParams
from jaxserve.engine.layouts import weight_layout
from jaxserve.engine.programs import Programs
from jaxserve.engine.batch import dummy_decode
from jaxserve.models import CausalLM
from jaxserve.models.layers import Experts, Linear

INT4 = dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4")
# a uint8 parameter of the compiled program: a page pool's bit patterns, or a packed INT4 weight
_U8_PARAM = re.compile(r"= u8\[[\d,]*\]\S* parameter\(")


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3", seed=3)


@pytest.fixture(scope="module")
def bf16_model(model):
    return CausalLM(model.cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))


def _formats(pr: Programs, phase: str) -> set[tuple[str, str]]:
    ph = getattr(pr, f"{phase}_phase")
    m = nnx.merge(ph.graphdef, ph.state)
    return {(m_.fmt, str(getattr(m_, "weight", getattr(m_, "gate", None))[...].dtype))
            for _, m_ in nnx.iter_graph(m) if isinstance(m_, (Linear, Experts))}


def test_auto_is_compute_on_cpu_and_packed_with_kernels():
    import jax

    cpu = jax.devices()
    assert weight_layout(small_config(**INT4), cpu) == "compute"
    assert weight_layout(small_config(**INT4, use_kernels=True, attention="pallas_interpret"), cpu) == "packed"
    assert weight_layout(small_config(**INT4, weight_layout="packed"), cpu) == "packed"


# f32 in the slow tier: the bf16 case runs the same packing and checks it (CI time)
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_compute_layout_gives_the_packed_layouts_tokens(model, bf16_model, dtype):
    """Dequantized once into the activation dtype = dequantized per matmul into it: bf16 rounding included."""
    model = model if dtype == "float32" else bf16_model
    ps = prompts(4, seed=21)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    packed = engine(model, **INT4, dtype=dtype, weight_layout="packed")
    compute = engine(model, **INT4, dtype=dtype, weight_layout="compute")
    assert ("int4", "uint8") in _formats(packed.programs, "decode")
    dense = "f32" if dtype == "float32" else "bf16"
    assert {f for f, _ in _formats(compute.programs, "decode")} == {dense}
    assert {f for f, _ in _formats(compute.programs, "prefill")} == {dense}
    assert [o.token_ids for o in compute.generate(ps, sp)] == [o.token_ids for o in packed.generate(ps, sp)]
    for e in (packed, compute):  # every page back
        s = e.stats()
        assert s["decode_pages_used"] == 0 and s["prefill_pages_used"] == s["prefix_cache_pages"]


def test_compute_layout_decode_program_reads_no_packed_weight(model):
    """The packed INT4 decode program takes uint8 weight parameters and unpacks them each step (negative control);
    the compute one takes no uint8 parameter but the page pools' own bit patterns, and holds no uint8 weight."""
    def count(layout: str) -> tuple[int, int, int]:
        pr = Programs(model, small_config(**INT4, weight_layout=layout))
        ph = pr.decode_phase
        hlo = pr._decode.lower(ph.params, ph.pages, *dummy_decode(4, 8)).compile().as_text()
        pool_u8 = sum(x.dtype == jnp.uint8 for x in jax.tree.leaves(ph.pages))
        weight_u8 = sum(x.dtype == jnp.uint8 for x in jax.tree.leaves(ph.state))
        entry = hlo[hlo.index("\nENTRY "):]
        entry = entry[:entry.index("\n}\n")]  # the program's own parameters, not its fused computations'
        return len(_U8_PARAM.findall(entry)), pool_u8, weight_u8

    params, pools, weights = count("packed")
    assert weights > 0 and params == pools + weights
    params, pools, weights = count("compute")
    assert weights == 0 and params == pools
