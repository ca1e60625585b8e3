"""tools.train_tiny: a few steps of training, HF export, conversion back; logits equal in all three places."""
from __future__ import annotations

import json
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxserve
from tools import train_tiny as tt
from jaxserve.convert.converter import convert
from jaxserve.models import forward

SIZE = tt.ModelSize(vocab_size=4096, hidden_size=64, num_layers=3, num_heads=4, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                    moe_intermediate_size=32, max_position_embeddings=256, yarn_original_max_position=64)
TCFG = replace(tt.TrainConfig(), steps=5, batch_size=2, seq_len=64, warmup_steps=2, peak_lr=1e-2, bias_rate=1e-2,
               evals=2, minutes=5.0)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_tiny")
    stream = np.random.default_rng(0).integers(0, 4090, 5000).astype(np.int32)
    model, summary = tt.train(SIZE, TCFG, stream, stream[:257], progress=False)
    tt.export_hf(model, tt.hf_config_dict(SIZE), tmp / "hf")
    convert(tmp / "hf", tmp / "jx", dtype="float32", progress=False)
    return model, summary, tmp


def _tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 4090, (2, 40)).astype(np.int32)


def test_training_ran_and_moved_router_bias(exported):
    model, summary, _ = exported
    assert summary["steps"] == 5 and summary["tokens_seen"] == 5 * 2 * 64
    assert len(summary["evals"]) == 1 and np.isfinite(summary["evals"][0]["loss"])
    bias = np.asarray(summary["final_router_bias"])
    assert bias.shape == (2, 8) and np.abs(bias).max() > 0  # the aux-loss-free nudges happened
    loads = np.asarray(summary["final_expert_loads"])
    np.testing.assert_allclose(loads.sum(-1), 1.0, rtol=1e-6)


def test_training_forward_equals_model_forward(exported):
    """The block-grouped MoE used for training computes the same function as the served MoE."""
    model, _, _ = exported
    tokens = jnp.asarray(_tokens())
    got, loads = tt.logits_and_loads(model, tokens)
    ref = np.asarray(forward(model, tokens))
    assert np.abs(np.asarray(got) - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.asarray(loads).sum(-1).tolist() == [2 * 40 * 2] * 2


def test_converted_export_equals_trained_model(exported):
    model, _, tmp = exported
    cfg, loaded = jaxserve.load(tmp / "jx")
    assert cfg == model.cfg
    tokens = jnp.asarray(_tokens())
    ref = np.asarray(forward(model, tokens))
    got = np.asarray(forward(loaded, tokens))
    assert np.abs(got - ref).max() <= 1e-5


def test_transformers_loads_export_with_same_logits(exported):
    model, _, tmp = exported
    raw = json.loads((tmp / "hf" / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v3" and raw["rope_interleave"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert isinstance(hf.config, transformers.DeepseekV3Config)
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    got = np.asarray(forward(model, jnp.asarray(tokens)))
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4


def test_fixed_steps_are_not_cut_by_the_default_wall_time():
    """`--steps N` alone runs its whole cosine schedule; the 40-minute default only applies to a fitted schedule,
    and an explicit --minutes still bounds either."""
    from tools.train_tiny import TrainConfig, wall_budget

    assert wall_budget(None, 2300) is None
    assert wall_budget(None, None) == TrainConfig.minutes
    assert wall_budget(100.0, 1624) == 100.0
    with pytest.raises(ValueError, match="fixed step count"):
        TrainConfig(minutes=None)
