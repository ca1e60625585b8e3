"""`EngineConfig(deterministic=True)` (`serve --deterministic`): 8 greedy and 8 seeded requests give the same tokens
alone and in a mixed batch of 16 under page pressure (where the default policy would preempt: this mode admits only
what the decode pool can finish, so it never recomputes), in the serving formats where drift showed (bf16 activations, FP8
KV, FP8 prefill / INT4 decode weights)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import hf_tiny
from engine_util import prompts, small_config
from jaxserve.config import from_hf_config
from jaxserve.engine import Engine, SamplingParams
from jaxserve.models import CausalLM


def test_deterministic_config_pins_every_bucket():
    c = small_config(deterministic=True)
    assert c.row_buckets == [c.max_batch] and c.page_buckets == [c.max_pages_per_seq]
    assert c.chunk_buckets == [c.prefill_chunk] and c.prefill_shapes == [(c.max_batch, c.prefill_chunk)]


def test_greedy_and_seeded_tokens_do_not_depend_on_the_batch_or_preemption():
    cfg = from_hf_config(hf_tiny.CONFIGS["deepseek_v3"]().to_dict())
    model = CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    e = Engine(model, small_config(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4", dtype="bfloat16",
                                   num_decode_pages=40, num_prefill_pages=128, max_batch=8, max_prefill_tokens=64,
                                   prefill_chunk=16, max_model_len=64, deterministic=True), start=False)
    ps = prompts(16, seed=11, lengths=(5, 17, 9, 26, 3, 12, 21, 8))
    params = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in range(8)]
    params += [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=100 + i,
                              **({"top_k": 20} if i % 2 else {"top_p": 0.9})) for i in range(8)]
    alone = [e.generate([p], sp)[0].token_ids for p, sp in zip(ps, params)]
    order = [i for pair in zip(range(8), range(8, 16)) for i in pair]  # greedy and seeded interleaved
    together = e.generate([ps[i] for i in order], [params[i] for i in order])
    assert [t.token_ids for t in together] == [alone[i] for i in order]
    # under page pressure (any 8 of them need more decode pages than the pool holds: the default policy preempts
    # and recomputes, which changes tokens) the deterministic engine waits for pages instead
    most = sorted((-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(ps, params)), reverse=True)
    assert sum(most[-8:]) > e.cfg.num_decode_pages - 1
    assert e.stats()["preemptions"] == 0
