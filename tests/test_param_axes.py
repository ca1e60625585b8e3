"""Every parameter of every model family declares its logical axes where it is created, and they agree with the
parameter-path table below (a check on the declarations, in every weight format)."""
from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from flax import nnx

import hf_tiny
from jaxserve.config import from_hf_config
from jaxserve.models import CausalLM
from jaxserve.quant.weight_format import WeightFormat, WeightPlan
from jaxserve.sharding import ShardingError, param_axes

# (path regex, logical axes). Quantized weights and their scales keep the dense weight's axes.
PARAM_AXES: tuple[tuple[str, tuple], ...] = (
    (r"^embed$", ("vocab", "embed")),
    (r"^lm_head\.(weight|scale)$", ("embed", "vocab")),
    (r"^lm_head\.bias$", ("vocab",)),
    (r"attn\.indexer\.(wq_b|wk|weights_proj)\.(weight|scale)$", (None, None)),
    (r"attn\.indexer\.", (None,)),
    (r"attn\.(q_b|kv_b)\.(weight|scale)$", (None, "heads")),
    (r"attn\.(q_proj|q)\.(weight|scale)$", ("embed", "heads")),
    (r"attn\.q\.bias$", ("heads",)),
    (r"attn\.(k|v)\.(weight|scale)$", ("embed", "kv_heads")),
    (r"attn\.(k|v)\.bias$", ("kv_heads",)),
    (r"attn\.o\.(weight|scale)$", ("heads", "embed")),
    (r"attn\.o\.bias$", ("embed",)),
    (r"mlp(\.shared)?\.(gate|up)\.(weight|scale)$", ("embed", "ffn")),
    (r"mlp(\.shared)?\.down\.(weight|scale)$", ("ffn", "embed")),
    (r"mlp\.experts\.(gate|up)(_scale)?$", ("experts", "embed", "expert_ffn")),
    (r"mlp\.experts\.down(_scale)?$", ("experts", "expert_ffn", "embed")),
    (r"attn\.(q_a|kv_a)\.(weight|scale)$", (None, None)),
    (r"^mtp\.eh_proj\.(weight|scale)$", (None, None)),
    (r"attn\.(q_a|kv_a)\.bias$", (None,)),
    (r"(norm|q_a_norm|kv_a_norm|q_norm|k_norm)\.(weight|bias)$", (None,)),
    (r"mlp\.router$", (None, None)),
    (r"mlp\.router_bias$", (None,)),
)


def _table(path: str) -> tuple:
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path):
            return axes
    raise AssertionError(f"{path} is in no row of the table")


CONFIGS = {"kimi": lambda: hf_tiny.kimi_config().to_dict(),
           "kimi_no_q_lora": lambda: dict(hf_tiny.kimi_config().to_dict(), q_lora_rank=None, attention_bias=True),
           "glm5": lambda: hf_tiny.glm5_config().to_dict(),
           "glm4": lambda: hf_tiny.glm4_config().to_dict(),
           # with the MTP head (layer num_hidden_layers: its own decoder layer, eh_proj and norms)
           "kimi_mtp": lambda: dict(hf_tiny.kimi_config().to_dict(), num_nextn_predict_layers=1),
           "glm5_mtp": lambda: dict(hf_tiny.glm5_config().to_dict(), num_nextn_predict_layers=1),
           "glm4_mtp": lambda: dict(hf_tiny.glm4_config().to_dict(), num_nextn_predict_layers=1)}
FORMATS = [WeightFormat(), WeightFormat("fp8", attention=True), WeightFormat("int4", 16, True, int4_scope="mlps")]


@pytest.mark.parametrize("wf", FORMATS, ids=lambda wf: wf.fmt)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_parameter_declares_the_tables_axes(name, wf):
    cfg = from_hf_config(CONFIGS[name]())
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), weights=WeightPlan(wf)))
    seen = set()
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name_ = ".".join(map(str, path))
        axes = param_axes(name_, var)
        assert axes == _table(name_), name_
        assert len(axes) == var.get_value().ndim, name_
        seen.add(name_)
    assert wf.fmt == "bf16" or any(n.endswith("scale") for n in seen)
    # the MTP decoder layer is quantized like the others (its routed experts in every quantized format)
    assert (cfg.mtp_layers == 1) == any(n.startswith("mtp.layer.mlp.experts.") for n in seen)
    assert wf.fmt == "bf16" or not cfg.mtp_layers or "mtp.layer.mlp.experts.gate_scale" in seen


def test_a_parameter_without_axes_is_an_error():
    with pytest.raises(ShardingError, match="no declared logical axes"):
        param_axes("x", nnx.Param(jnp.zeros((2,))))
