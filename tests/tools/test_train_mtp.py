"""tools.train_mtp: the MTP head's training step learns, its two forwards agree, its export follows hf_tensors' names."""
from __future__ import annotations

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import jaxserve
from jaxserve.convert.converter import convert
from jaxserve.models.mtp import mtp_forward
from tools import train_mtp as tm
from tools import train_tiny as tt

SIZE = tt.ModelSize(vocab_size=4096, hidden_size=64, num_layers=3, num_heads=4, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                    moe_intermediate_size=32, max_position_embeddings=256, yarn_original_max_position=64)
TCFG = replace(tm.DEFAULT_TRAIN, steps=3, minutes=None, batch_size=2, seq_len=32, warmup_steps=1, peak_lr=1e-2,
               bias_rate=1e-2, evals=0, eval_window=32)


@pytest.fixture(scope="module")
def target():
    return tt.build_model(SIZE, 0)[2]


def _batch(seed: int, rows: int = 2, seq: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4090, (rows, seq + 2)).astype(np.int32)


def test_training_step_reduces_the_loss_and_moves_router_bias(target):
    graphdef, template = nnx.split(tm.with_head(target, 0))
    frozen = template.to_pure_dict()
    params = frozen.pop("mtp")
    tx = tt.make_optimizer(TCFG)
    opt_state = tx.init(params)
    step = tm.make_mtp_step(graphdef, template, tx, TCFG.bias_rate)
    batch = jnp.asarray(_batch(1))
    losses = []
    for _ in range(8):  # one fixed batch: the head must fit it
        params, opt_state, metrics = step(frozen, params, opt_state, batch, jnp.float32(3e-3))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert np.abs(np.asarray(params["layer"]["mlp"]["router_bias"])).max() > 0
    assert float(metrics["loads"].sum()) == 2 * 32 * SIZE.num_experts_per_tok


def test_train_loop_and_heldout_metrics(target):
    stream = np.random.default_rng(0).integers(0, 4090, 3000).astype(np.int32)
    model, summary = tm.train_mtp(target, TCFG, stream, progress=False)
    assert summary["steps"] == 3 and summary["tokens_seen"] == 3 * 2 * 32
    assert np.array_equal(np.asarray(model.embed[...]), np.asarray(target.embed[...]))  # the target stays frozen
    ev = tm.evaluate(model, stream[:100], window=32, batch_size=2)
    assert ev["predictions"] == 98 and np.isfinite(ev["ce"])
    assert all(0.0 <= ev[k] <= 1.0 for k in ("top1", "agree_greedy", "target_top1"))


def test_training_forward_equals_served_forward(target):
    """The block-grouped MoE the step trains with computes what jaxserve.models.mtp.mtp_forward serves."""
    model = tm.with_head(target, 0)
    tokens = jnp.asarray(_batch(2))
    h = model.hidden(tokens[:, :-2])
    h_train, _ = tt.hidden_and_loads(model, tokens[:, :-2])
    assert np.abs(np.asarray(h_train) - np.asarray(h)).max() <= 1e-5 * np.abs(np.asarray(h)).max()
    got, ids = tm.mtp_forward_train(model, h, tokens[:, 1:-1])
    ref, _ = mtp_forward(model, h, tokens[:, 1:-1])
    assert ids.shape == (2 * 32, SIZE.num_experts_per_tok)
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() <= 1e-5 * np.abs(np.asarray(ref)).max()


def test_export_follows_the_layer_rule_and_converts_back(target, tmp_path):
    """Layer N = num_hidden_layers carries the MTP names plus the decoder layer named as hf_tensors names layer N;
    a fresh head (a copy of the last layer) exports exactly the last layer's tensors (same transposes, rope rows);
    the converter reads the folder back into the same model, head included."""
    L, H = SIZE.num_layers, SIZE.hidden_size
    model = tm.with_head(target, 0)
    mtp = tt.hf_mtp_tensors(model)
    main = tt.hf_tensors(target)
    last = {k.replace(f"model.layers.{L - 1}.", f"model.layers.{L}."): v for k, v in main.items()
            if k.startswith(f"model.layers.{L - 1}.")}
    extra = {f"model.layers.{L}.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head.norm")}
    assert set(mtp) == set(last) | extra and not set(mtp) & set(main)
    for k, v in last.items():
        assert mtp[k].dtype == np.float32 and np.array_equal(mtp[k], v), k
    assert mtp[f"model.layers.{L}.eh_proj.weight"].shape == (H, 2 * H)
    assert all(mtp[k].shape == (H,) for k in extra - {f"model.layers.{L}.eh_proj.weight"})

    model.mtp.eh_proj.weight[...] = jax.random.normal(jax.random.key(3), (2 * H, H)) * 0.1  # not symmetric
    model.mtp.enorm.weight[...] = model.mtp.enorm.weight[...] * 2
    fresh = tt.hf_mtp_tensors(tm.with_head(model, 0))  # a head already there is replaced, not trained on
    assert all(np.array_equal(fresh[k], v) for k, v in mtp.items())
    out = tm.export_with_mtp(model, tt.hf_config_dict(SIZE), tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    both, alone = load_file(str(out / "model.safetensors")), load_file(str(out / tm.MTP_FILE))
    assert set(both) == set(main) | set(mtp) and set(alone) == set(mtp)
    convert(out, tmp_path / "jx", dtype="float32", progress=False)
    cfg, loaded = jaxserve.load(tmp_path / "jx")
    assert cfg == model.cfg and loaded.mtp is not None
    tokens = jnp.asarray(_batch(4))
    h = model.hidden(tokens[:, :-2])
    ref, _ = mtp_forward(model, h, tokens[:, 1:-1])
    got, _ = mtp_forward(loaded, loaded.hidden(tokens[:, :-2]), tokens[:, 1:-1])
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() <= 1e-5
