"""`jaxserve plan`: abstract model, per-device bytes from the sharding table, compiled programs' temporaries and
collectives on 8 CPU devices, KV tokens under TP and DP attention."""
from __future__ import annotations

import math

import pytest

import hf_tiny
from jaxserve.plan import PRESETS, PlanSpec, plan, table


def _tiny() -> dict:
    d = hf_tiny.kimi_config().to_dict()
    d.update(num_attention_heads=8, num_key_value_heads=8, model_type="deepseek_v3")
    return d


def test_plan_of_a_small_model_compiles_and_accounts():
    spec = PlanSpec(memory_bytes=2e9, reserve_bytes=0.5e9, group_size=4, prefill_weights="bf16", decode_rows=8, decode_context=256, prefill_chunk=32,
                    prefill_context=256, page_size=16)
    p = plan(_tiny(), spec, progress=False)
    tp, dp = p["modes"]["tp"], p["modes"]["dp"]
    dec = tp["phases"]["decode"]
    assert dec["temp_bytes"] > 0 and dec["collectives"]
    # activations only: no collective as large as a weight or the pool
    assert max(c["bytes"] for c in dec["collectives"]) <= 8 * 64 * 4
    assert tp["kv_pool_bytes"] == int(spec.memory_bytes - tp["resident_weight_bytes"] - tp["temp_bytes"]
                                      - spec.reserve_bytes)
    assert tp["kv_tokens"] == tp["kv_pool_bytes"] // tp["kv_bytes_per_token_per_device"]
    # DP attention replicates attention weights but splits the latent pool: more tokens in all
    assert dp["phases"]["decode"]["weight_bytes"] > dec["weight_bytes"]
    assert dp["kv_tokens"] == dp["kv_tokens_per_device"] * 8 > tp["kv_tokens"]
    assert "all-reduce" in table(p)


@pytest.mark.slow
def test_kimi_k26_fits_8_h200_with_the_seeds_kv_capacity_before_temporaries():
    p = plan("kimi-k2.6", PlanSpec(compile=False), progress=False)
    tp = p["modes"]["tp"]
    assert tp["phases"]["decode"]["weight_bytes"] <= 80e9
    assert tp["kv_tokens"] >= 1.37e6
    assert math.isclose(tp["kv_bytes_per_token_per_device"], 61 * (576 + 4))


def test_presets_build_real_configs():
    from jaxserve.config import from_hf_config

    cfgs = {k: from_hf_config(v) for k, v in PRESETS.items()}
    assert cfgs["glm-5.2"].indexer_types.count("full") == 21 and cfgs["glm-5.2"].num_layers == 78
    assert cfgs["kimi-k2.6"].latent_dim == 576 and cfgs["glm-4.5"].num_kv_heads == 8
