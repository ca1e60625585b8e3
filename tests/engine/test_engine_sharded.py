"""Sharded, disaggregated and multi-process engines give the single-device results (8 simulated CPU devices)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_tiny
from engine_util import engine, prompts, small_config, tiny_model
from jaxserve.config import from_hf_config
from jaxserve.engine import SamplingParams
from jaxserve.models import CausalLM, dsa
from jaxserve.sharding import ShardingError

SP = SamplingParams(max_tokens=6, ignore_eos=True)


def eight_head_model(arch: str) -> CausalLM:
    """The tiny random model with 8 heads (8 kv heads for GQA), so every split of an 8-device mesh divides."""
    d = hf_tiny.CONFIGS[arch]().to_dict()
    d.update(num_attention_heads=8, num_key_value_heads=8)
    return CausalLM(from_hf_config(d), dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model():
    return eight_head_model("deepseek_v3")


@pytest.fixture(scope="module")
def reference(model):
    return {kv: [o.token_ids for o in engine(model, kv_dtype=kv).generate(prompts(3), SP)] for kv in ("bf16", "fp8")}


def _specs(e, phase: str) -> dict[str, str]:
    state = getattr(e.programs, phase).state
    return {".".join(map(str, p)): str(v.get_value().sharding.spec) for p, v in nnx.to_flat_state(state)}


def test_tensor_parallel_8_devices_equals_single_device(model, reference):
    e = engine(model, devices=8)
    specs = _specs(e, "decode_phase")
    assert specs["layers.1.attn.q_b.weight"] == "P(None, 'tp')"  # heads split 8 ways
    assert specs["layers.1.attn.o.weight"] == "P('tp', None)"  # row-parallel
    assert specs["layers.1.mlp.experts.gate"] == "P(None, None, 'tp')"  # expert FFN split
    assert specs["embed"] == "P('tp', None)" and specs["lm_head.weight"] == "P(None, 'tp')"  # vocab-parallel
    assert specs["layers.1.attn.kv_a.weight"] == "P(None, None)"  # the latent path every head reads
    assert [o.token_ids for o in e.generate(prompts(3), SP)] == reference["bf16"]


def test_tensor_parallel_4_devices_equals_single_device(model, reference):
    assert [o.token_ids for o in engine(model, devices=4).generate(prompts(3), SP)] == reference["bf16"]


def test_expert_parallel_8_devices_equals_single_device(model, reference):
    e = engine(model, devices=8, sharding="ep")
    assert _specs(e, "decode_phase")["layers.1.mlp.experts.down"] == "P('tp', None, None)"
    assert [o.token_ids for o in e.generate(prompts(3), SP)] == reference["bf16"]


def test_gqa_tensor_parallel_8_devices_equals_single_device():
    m = eight_head_model("glm4_moe")
    e = engine(m, devices=8, kv_dtype="fp8")
    assert str(e.programs.decode_phase.pages.k.sharding.spec) == "P(None, None, None, 'tp', None)"
    assert [o.token_ids for o in e.generate(prompts(3), SP)] == \
        [o.token_ids for o in engine(m, kv_dtype="fp8").generate(prompts(3), SP)]


def test_a_split_that_does_not_divide_is_an_error_naming_it():
    with pytest.raises(ShardingError, match="num_heads=4 does not divide into 8 shards"):
        engine(tiny_model("deepseek_v3"), devices=8)


def test_disaggregated_4_plus_4_equals_same_device(model, reference):
    e = engine(model, devices=8, disaggregate=True, kv_dtype="fp8")
    p_dev = set(e.programs.prefill_phase.mesh.devices.flat)
    d_dev = set(e.programs.decode_phase.mesh.devices.flat)
    assert len(p_dev) == len(d_dev) == 4 and not p_dev & d_dev
    leaf = e.programs.decode_phase.pages.latent
    assert set(leaf.devices()) == d_dev and e.programs.decode_phase.pages.layout.dtype == "fp8"
    assert [o.token_ids for o in e.generate(prompts(3), SP)] == reference["fp8"]


def test_two_processes_under_jax_distributed(reference):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).with_name("dist_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), "2", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[7:]))
    for r in results:
        assert r["devices"] == 2 and r["local"] == 1
        assert r["tokens"] == reference["bf16"]


def test_replicas_live_on_disjoint_device_slices(model, reference, tmp_path):
    from jaxserve.checkpoint import save
    from jaxserve.engine.router import SessionRouter

    path = save(model, tmp_path / "ckpt")
    router = SessionRouter.replicas(str(path), small_config(devices=4), 2)
    try:
        sets = [set(w.programs.decode_phase.mesh.devices.flat) for w in router.workers]
        assert len(sets[0]) == len(sets[1]) == 4 and not sets[0] & sets[1]
        for w in router.workers:
            assert [o.token_ids for o in w.generate(prompts(3), SP)] == reference["bf16"]
    finally:
        router.close()


def test_dp_attention_8_ranks_equals_single_device(model, reference):
    """DP attention: each of 8 ranks holds its own requests' latent pages (the pool's page axis split 8 ways) and
    batch rows; attention runs per rank on local page ids, experts split over all 8 devices."""
    e = engine(model, devices=8, sharding="dp_attention", kv_dtype="fp8", num_decode_pages=128,
               num_prefill_pages=128)
    pages = e.programs.decode_phase.pages
    assert str(pages.latent.sharding.spec) == "P(None, 'dp', None, None)"
    assert e.scheduler.decode_alloc.shards == 8 and e.cfg.row_buckets[0] == 8
    out = e.generate(prompts(3), SP)
    assert [o.token_ids for o in out] == reference["fp8"]
    # the same prompts again: each is placed on the rank whose prefix cache holds it, and reads its cached pages
    again = e.generate(prompts(3), SP)
    assert [o.token_ids for o in again] == reference["fp8"]
    assert sum(o.cached_tokens for o in again) > 0
    s = e.scheduler
    assert s.decode_alloc.num_used == 0
    assert s.prefill_alloc.num_used == sum(len(c) for c in s.prefix_caches)


@pytest.mark.parametrize("sharding", ["tp", "dp_attention"])
def test_glm5_dsa_sharded_equals_single_device(sharding):
    """GLM-5 DSA per shard (indexer scoring, top-k and sparse attention inside the shard_map: heads split under TP
    attention, rows and pages under DP attention) over an FP8 pool: greedy tokens identical to one device and each
    token's logprob within f32 tolerance. index_topk 4 at page size 4: every table past one page is sparse; 16
    indexer heads make exact score ties at the top-k boundary rare (see tests/models/test_dsa.py)."""
    d = hf_tiny.CONFIGS["glm_moe_dsa"](index_n_heads=16).to_dict()
    d.update(num_attention_heads=8, num_key_value_heads=8)
    m = CausalLM(from_hf_config(d), dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert dsa.is_sparse(2 * 4, m.cfg.index_topk)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True)
    pools = dict(kv_dtype="fp8", num_decode_pages=128, num_prefill_pages=128)
    ref = engine(m, **pools).generate(prompts(4), sp)
    got = engine(m, devices=8, sharding=sharding, **pools).generate(prompts(4), sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    np.testing.assert_allclose([o.logprobs for o in got], [o.logprobs for o in ref], rtol=0, atol=1e-4)
