"""Speculative decoding with the model's MTP head (`EngineConfig(speculative="mtp:K")`, engine.mtp_programs /
engine.mtp_draft): greedy output is token-for-token the same engine's output without speculation (the embedded
model with its trained head in f32 and the serving formats, where drafts are accepted; a tiny random model with an
MTP head under preemption and a prefix hit; a stop string; the batch-size switch), every page returns, a model
without a head is refused, and without mtp speculation the head is dropped (no MTP KV layer).

Shapes are pinned as in test_speculative.py (one row bucket, one block-table width, one chunk).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

import hf_tiny
from engine_util import engine, pool_is_full, prompts, small_config, tiny_model
from jaxserve.config import from_hf_config
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.config import Speculative
from jaxserve.errors import ConfigError
from jaxserve.models import CausalLM

EMBEDDED = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"
PIN = dict(min_rows_bucket=8, min_pages_bucket=32, min_chunk_bucket=16)
SERVING = dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef"
TEXTS = [CODE, "import os\nimport sys\n", "for i in range(10):\n    print(i)\n"]


def same_outputs(ref: list, got: list) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]


@pytest.fixture(scope="module", params=[{}, SERVING], ids=["f32", "fp8kv-int4"])
def embedded(request):
    """The embedded model (its trained MTP head), without speculation and with mtp:3, in one format."""
    cfg = small_config(**PIN, **request.param, max_model_len=128)
    spec = dataclasses.replace(cfg, speculative=Speculative("mtp", 3))
    return Engine.from_checkpoint(EMBEDDED, cfg, start=False), Engine.from_checkpoint(EMBEDDED, spec, start=False)


def test_embedded_model_greedy_output_is_unchanged_and_drafts_are_accepted(embedded):
    plain, spec = embedded
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    same_outputs(plain.generate(TEXTS, sp), spec.generate(TEXTS, sp))
    s = spec.stats()
    assert s["accepted_tokens"] > 0 and s["draft_tokens"] >= s["accepted_tokens"]
    # the MTP layer is pool layer num_layers of the speculative engine only; one program each, no recompiles
    assert spec.programs.layouts.decode.num_layers == plain.programs.layouts.decode.num_layers + 1
    assert spec.programs.compiles["verify"] == 1 and spec.programs.compiles["prefill_mtp"] == 1
    assert pool_is_full(spec)


def test_embedded_model_stop_string(embedded):
    plain, spec = embedded
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = plain.generate([CODE], sp)[0]
    text = ref.text
    # a tail of the text's first half that occurs nowhere before it: the stop string ends the output there
    half = text[: len(text) // 2]
    stop = next(half[-n:] for n in range(2, len(half) + 1) if half.find(half[-n:]) == len(half) - n)
    stopped = SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))
    ref, got = plain.generate([CODE], stopped)[0], spec.generate([CODE], stopped)[0]
    assert got.finish_reason == ref.finish_reason == "stop"
    assert got.token_ids == ref.token_ids and got.text == ref.text and stop not in got.text
    assert pool_is_full(spec)


def mtp_model(seed: int = 0) -> CausalLM:
    """A tiny random Kimi-architecture model with an MTP head (hf_tiny's config, one nextn layer)."""
    cfg = from_hf_config(dict(hf_tiny.kimi_config().to_dict(), num_nextn_predict_layers=1))
    return CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))


def test_preemption_and_a_prefix_hit_with_a_random_head():
    model = mtp_model()
    pin = dict(min_rows_bucket=8, min_pages_bucket=16, min_chunk_bucket=16)
    # 12 usable decode pages of 4 tokens for 4 requests wanting up to 10 each: someone is preempted
    plain, spec = engine(model, **pin, num_decode_pages=13), engine(model, **pin, num_decode_pages=13,
                                                                    speculative="mtp:3")
    ps = prompts(4, seed=3, lengths=(11, 23, 15, 19))
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    same_outputs(plain.generate(ps, sp), spec.generate(ps, sp))
    s = spec.stats()
    assert s["preemptions"] > 0 and s["verify_rows"] > 0 and s["draft_tokens"] > 0
    again = ps[0] + [1, 2, 3]  # the first prompt's pages (MTP layer included) are in the prefix cache
    ref, got = plain.generate([again], sp)[0], spec.generate([again], sp)[0]
    assert got.cached_tokens >= 8 and got.token_ids == ref.token_ids
    assert pool_is_full(spec)


def test_speculation_turns_itself_off_above_max_rows():
    model = mtp_model(1)
    pin = dict(min_rows_bucket=8, min_pages_bucket=16, min_chunk_bucket=16)
    ps = prompts(3, seed=4, lengths=(7, 9, 5))
    # 3 rows decode together; the last 8 steps have one row left
    reqs = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 8, 16)]
    ref = engine(model, **pin).generate(ps, reqs)
    one = engine(model, **pin, speculative=Speculative("mtp", 2, max_rows=1))
    same_outputs(ref, one.generate(ps, reqs))
    s = one.stats()
    assert 0 < s["verify_rows"] < sum(sp.max_tokens for sp in reqs) - 3 and pool_is_full(one)


def test_mtp_needs_a_head_and_other_modes_drop_it():
    with pytest.raises(ConfigError, match="MTP head"):
        engine(tiny_model("deepseek_v3"), speculative="mtp:3")
    model = mtp_model()
    for spec in (None, "ngram:2"):
        e = engine(model, speculative=spec)
        assert e.programs.layouts.decode.num_layers == model.cfg.num_layers
        assert e.programs.layouts.prefill.num_layers == model.cfg.num_layers
