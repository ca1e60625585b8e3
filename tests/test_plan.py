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
    # the pool is what the compiled decode leaves (its other arguments and unaliased outputs too, #30), and the
    # decode is compiled again at that pool: it fits, and its tokens (less the null page) are the plan's
    budget = spec.memory_bytes - spec.reserve_bytes
    assert 0 < tp["kv_pool_bytes"] <= int(budget - tp["resident_weight_bytes"] - tp["temp_bytes"])
    assert tp["kv_tokens"] <= tp["kv_pool_bytes"] // tp["kv_bytes_per_token_as_laid_out"]
    m = dec["memory"]
    assert dec["fits"] and m["argument"] + m["temp"] + m["output"] - m["alias"] <= dec["need_bytes"] <= budget
    assert tp["kv_tokens"] == (dec["pool_pages"] - 1) * spec.page_size
    # DP attention replicates attention weights but splits the latent pool: more tokens in all
    assert dp["phases"]["decode"]["weight_bytes"] > dec["weight_bytes"]
    assert dp["kv_tokens"] == dp["kv_tokens_per_device"] * 8 > tp["kv_tokens"]
    assert "all-reduce" in table(p)


@pytest.mark.slow
def test_kimi_k26_fits_8_h200_with_the_seeds_kv_capacity():
    """The real decode and prefill programs compiled on 8 CPU devices (~3 min on a quiet 2-core host)."""
    p = plan("kimi-k2.6", PlanSpec(), progress=False)
    tp = p["modes"]["tp"]
    assert tp["phases"]["decode"]["weight_bytes"] <= 80e9
    assert tp["temp_bytes"] == tp["phases"]["decode"]["temp_bytes"] > 0  # disaggregated: the decode program's
    assert tp["kv_tokens"] >= 1.37e6
    assert math.isclose(tp["kv_bytes_per_token_per_device"], 61 * (576 + 4))


def test_presets_build_real_configs():
    from jaxserve.config import from_hf_config

    cfgs = {k: from_hf_config(v) for k, v in PRESETS.items()}
    assert cfgs["glm-5.2"].indexer_types.count("full") == 21 and cfgs["glm-5.2"].num_layers == 78
    assert cfgs["kimi-k2.6"].latent_dim == 576 and cfgs["glm-4.5"].num_kv_heads == 8


def _kimi_decode_temp(layers: int) -> int:
    """Compiled temporaries of the 8-device TP decode program at Kimi K2.6's real per-device shapes (384 INT4 g32
    experts of 7168 x 2048 split 8 ways, 8 local heads, latent 512 + 64), 64 rows x 8k context, `layers` layers."""
    import jax

    from jaxserve.config import from_hf_config
    from jaxserve.models.build import shard_model
    from jaxserve.plan import _abstract, _compile
    from jaxserve.sharding import Parallel, ShardingRules, make_mesh

    cfg = from_hf_config(dict(PRESETS["kimi-k2.6"], num_hidden_layers=layers))
    spec = PlanSpec()
    par = Parallel(make_mesh(jax.devices()[:8], dp=1), ShardingRules.preset("tp"))
    temp, _, _ = _compile(cfg, shard_model(_abstract(cfg, "int4", spec), par), par, spec, "decode")
    return temp


def test_decode_temporaries_do_not_grow_with_layers_at_kimi_shapes():
    """Each layer's temporaries are dead before the next layer's: no per-layer stack of expert tiles, no f32 copy
    of a layer's whole expert scale stack hoisted out of the tile loop, no context-sized attention gather (each
    was 0.2-0.5 GB per layer at these shapes and made 61 layers cost 32 GB of temporaries)."""
    t2, t4 = _kimi_decode_temp(2), _kimi_decode_temp(4)
    assert t4 - t2 < 64e6, (t2, t4)
    assert t4 < 1.2e9, t4
