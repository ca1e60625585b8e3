"""Weight layouts: "packed" (quantized weights dequantized inside each matmul) vs "compute" (dequantized once at
load, the CPU default). Same values, so the same tokens; the compute layout's decode program unpacks nothing."""
from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from flax import nnx

from engine_util import engine, prompts, small_config, tiny_model
from jaxserve.engine import SamplingParams
from jaxserve.engine.programs import Programs, weight_layout
from jaxserve.engine.scheduler import dummy_decode
from jaxserve.models import CausalLM
from jaxserve.models.layers import Experts, Linear

INT4 = dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4")
# INT4 unpacking: a logical shift of the packed uint8 nibbles (the only u8 shifts in a decode program)
_U8_SHIFT = re.compile(r"= u8\[[\d,]*\]\S* shift-right-logical\(")


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
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


def test_compute_layout_decode_program_unpacks_nothing(model):
    """The packed INT4 decode program shifts uint8 nibbles apart every step (negative control); the compute one
    has no such op and holds no uint8 weight."""
    def hlo(layout: str) -> str:
        pr = Programs(model, small_config(**INT4, weight_layout=layout))
        ph = pr.decode_phase
        return pr._decode.lower(ph.state, ph.pages, *dummy_decode(4, 8)).compile().as_text()

    assert _U8_SHIFT.search(hlo("packed"))
    assert not _U8_SHIFT.search(hlo("compute"))
