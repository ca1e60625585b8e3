"""tools.train_eagle3: the exported draft loads back as the same weights (the published layout, torch [out, in]), and a
few training steps lower the loss."""
from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxserve.models.eagle3 import load_eagle3
from tools import train_eagle3 as te
from tools import train_tiny as tt

SIZE = tt.ModelSize(vocab_size=4096, hidden_size=64, num_layers=3, num_heads=4, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                    moe_intermediate_size=32, max_position_embeddings=256, yarn_original_max_position=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    raw, _, target = tt.build_model(SIZE, 0)
    ids = np.sort(np.random.default_rng(0).choice(raw["vocab_size"], 512, replace=False))
    folder = tmp_path_factory.mktemp("draft")
    return target, ids, folder, te.initial_draft(target, te.draft_config(raw, ids), ids, folder, 0)


def test_export_round_trips(setup):
    target, ids, folder, draft = setup
    te.export(draft, folder, target.cfg.vocab_size)
    loaded = load_eagle3(folder, target.cfg, np.float32)
    want = dict(nnx.to_flat_state(nnx.state(draft)))
    for path, var in nnx.to_flat_state(nnx.state(loaded)):
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(want[path].get_value()), str(path))
    np.testing.assert_array_equal(np.asarray(loaded.to_target(np.arange(len(ids)))), ids)


def test_a_few_steps_lower_the_loss(setup):
    target, ids, _, draft = setup
    # a repeated phrase: every window shows the same pattern, so a few steps must fit it better
    tokens = np.tile(np.random.default_rng(1).integers(0, target.cfg.vocab_size, 20), 200).astype(np.int32)
    summary = te.train(target, draft, tokens, ids, minutes=5.0, steps=6, seed=0, batch_size=2, seq_len=16)
    assert summary["steps"] == 6 and summary["last"]["loss"] < summary["first"]["loss"]
