"""A model with an MTP head, served without speculation: the same tokens as the model without it (the engine drops
the head, so the pools have no MTP layer, and every page returns), in f32 and the serving formats."""
from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

import hf_tiny
from engine_util import engine, pool_is_full, prompts
from jaxserve.config import from_hf_config
from jaxserve.engine import SamplingParams
from jaxserve.models import CausalLM
from jaxserve.models.build import drop_mtp


@pytest.mark.parametrize("formats", [{}, dict(kv_dtype="fp8", decode_weights="int4", prefill_weights="fp8")],
                         ids=["f32", "serving"])
def test_an_mtp_model_serves_the_same_tokens(formats):
    cfg = from_hf_config(dict(hf_tiny.kimi_config().to_dict(), num_nextn_predict_layers=1))
    model = CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ps = prompts(3, seed=2, lengths=(13, 6, 9))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with_head, without = engine(model, **formats), engine(drop_mtp(model), **formats)
    assert with_head.programs.layouts.decode.num_layers == without.programs.layouts.decode.num_layers  # head dropped
    got = [o.token_ids for o in with_head.generate(ps, params)]
    assert got == [o.token_ids for o in without.generate(ps, params)]
    assert pool_is_full(with_head)
