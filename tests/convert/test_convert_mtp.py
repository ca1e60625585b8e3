"""The MTP head through the converter, the Orbax checkpoint (save / load / quantize) and `jaxserve plan`: layer
num_hidden_layers' tensors kept when present (its decoder layer in the same layouts as the others, the
embed_tokens / shared_head.head copies ignored), dropped (mtp_layers 0) when a config declares a head the
safetensors lack."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import hf_tiny
import jaxserve
from jaxserve import checkpoint
from jaxserve.checkpoint import model_params
from jaxserve.config import from_hf_config
from jaxserve.convert.converter import convert
from jaxserve.engine.layouts import kv_layout
from jaxserve.models.mtp import mtp_forward
from jaxserve.plan import PlanSpec, plan
from jaxserve.quant.apply import compute_layout
from jaxserve.quant.checkpoint import QuantizeSpec, quantize_checkpoint


@pytest.fixture(scope="module")
def kimi_mtp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kimi_mtp")
    hf = hf_tiny.build("deepseek_v3")
    ref = hf_tiny.save_with_mtp(hf, tmp / "hf")
    convert(tmp / "hf", tmp / "jx", dtype="float32", progress=False)
    return tmp, ref


def test_converter_keeps_the_mtp_layer(kimi_mtp):
    tmp, ref = kimi_mtp
    manifest = json.loads((tmp / "jx" / "jaxserve.json").read_text())
    assert manifest["model"]["mtp_layers"] == 1 and manifest["groups"][-1] == "mtp"
    cfg, model = jaxserve.load(tmp / "jx")
    params = model_params(model)
    n = cfg.num_layers
    state = {k: v.numpy() for k, v in ref.state().items()}
    np.testing.assert_array_equal(params["mtp.eh_proj.weight"], state[f"model.layers.{n}.eh_proj.weight"].T)
    for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("norm", "shared_head.norm"),
                         ("layer.input_norm", "input_layernorm")):
        np.testing.assert_array_equal(params[f"mtp.{ours}.weight"], state[f"model.layers.{n}.{theirs}.weight"])
    np.testing.assert_array_equal(params["mtp.layer.mlp.router"], state[f"model.layers.{n}.mlp.gate.weight"].T)
    # the main embedding and lm_head are the head's (the stored copies are not read)
    assert not any("embed" in k or "lm_head" in k for k in params if k.startswith("mtp."))


def test_mtp_head_round_trips_through_orbax(kimi_mtp, tmp_path):
    tmp, _ = kimi_mtp
    _, model = jaxserve.load(tmp / "jx")
    checkpoint.save(model, tmp_path / "again")
    cfg2, model2 = jaxserve.load(tmp_path / "again")
    assert cfg2.mtp_layers == 1 and (tmp_path / "again" / "params" / "mtp").is_dir()
    a, b = model_params(model), model_params(model2)
    assert sorted(a) == sorted(b) and any(k.startswith("mtp.layer.attn.") for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_quantized_checkpoint_has_an_int4_mtp_layer(kimi_mtp, tmp_path):
    tmp, _ = kimi_mtp
    quantize_checkpoint(tmp / "jx", tmp_path / "q", QuantizeSpec("int4", "fp8", group_size=16), progress=False)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
    for fmt in ("int4", "fp8"):
        _, model = jaxserve.load(tmp_path / "q", weights=fmt)
        experts = model.mtp.layer.mlp.experts
        assert experts.fmt == fmt and experts.gate_scale is not None  # routed experts, as every other sparse layer
        hidden = model.hidden(tokens)
        logits, _ = mtp_forward(model, hidden[:, :-1], tokens[:, 1:])
        # the packed head computes what its weights' dense values compute (the compute layout: dequantized once)
        dense = compute_layout(model, jnp.float32)
        want, _ = mtp_forward(dense, dense.hidden(tokens)[:, :-1], tokens[:, 1:])
        assert float(jnp.abs(logits - want).max()) <= 1e-4 * float(jnp.abs(want).max())


def test_a_declared_head_without_tensors_is_not_served(tmp_path):
    hf_tiny.save(hf_tiny.build("glm4_moe"), tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(raw, num_nextn_predict_layers=1)))
    assert from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text())).mtp_layers == 1
    convert(tmp_path / "hf", tmp_path / "jx", dtype="float32", progress=False)
    cfg, model = jaxserve.load(tmp_path / "jx")
    assert cfg.mtp_layers == 0 and model.mtp is None and not (tmp_path / "jx" / "params" / "mtp").exists()
    assert kv_layout(cfg, 4, "fp8").num_layers == cfg.num_layers  # serving unchanged: no MTP KV layer


def test_plan_counts_the_mtp_layer():
    raw = dict(hf_tiny.kimi_config().to_dict(), num_attention_heads=8, num_key_value_heads=8)
    spec = PlanSpec(memory_bytes=2e9, reserve_bytes=0.5e9, group_size=4, prefill_weights="bf16", compile=False,
                    page_size=16)
    without = plan(dict(raw, num_nextn_predict_layers=0), spec, progress=False)["modes"]["tp"]
    with_mtp = plan(dict(raw, num_nextn_predict_layers=1), spec, progress=False)["modes"]["tp"]
    cfg = from_hf_config(raw)
    # one more latent row (fp8 + its f32 scale) per token, and the head's weights in both phases
    assert with_mtp["kv_bytes_per_token_per_device"] - without["kv_bytes_per_token_per_device"] == cfg.latent_dim + 4
    for phase in ("decode", "prefill"):
        assert with_mtp["phases"][phase]["weight_bytes"] > without["phases"][phase]["weight_bytes"]


def test_load_can_leave_the_head_unread(kimi_mtp):
    tmp, _ = kimi_mtp
    cfg, model = jaxserve.load(tmp / "jx", mtp=False)
    assert cfg.mtp_layers == 0 and model.mtp is None
    _, full = jaxserve.load(tmp / "jx")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 6)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(full(tokens)))
