"""Speculative decoding with an EAGLE-3 draft (`EngineConfig(speculative="eagle3:PATH:K")`, engine.eagle3_programs):
greedy output is token-for-token the same engine's output without speculation (a tiny random draft on the tests'
tiny model, f32 and FP8 KV + INT4 decode weights with f32 activations; its acceptance is low, exactness must hold),
every page returns, the draft's K/V take their extra pool layers, a stale page under a draft run fails only its
request, and the `eagle3:PATH:K[:MAX_ROWS]` text parses.

Shapes are pinned as in test_speculative.py (one row bucket, one block-table width, one chunk).
"""
from __future__ import annotations

import pytest

from eagle3_tiny import write_draft
from engine_util import engine, pool_is_full, prompts, stale_page_fails_only_its_request, tiny_model
from jaxserve.engine import EngineConfig, SamplingParams
from jaxserve.engine.config import Speculative
from jaxserve.errors import ConfigError
from jaxserve.models.eagle3 import read_config
from jaxserve.models.paged_eagle3 import pool_layers

PIN = dict(min_rows_bucket=8, min_pages_bucket=32, min_chunk_bucket=16)
SERVING = dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3")
    write_draft(folder, tiny_model("deepseek_v3").cfg)
    return folder


@pytest.fixture(scope="module", params=[{}, SERVING], ids=["f32", "fp8kv-int4"])
def engines(request, draft_dir):
    """The tiny model without speculation and with eagle3:DRAFT:3, in one format."""
    model = tiny_model("deepseek_v3")
    spec = Speculative("eagle3", 3, path=str(draft_dir))
    return engine(model, **PIN, **request.param), engine(model, **PIN, **request.param, speculative=spec)


def test_greedy_output_is_unchanged(engines, draft_dir):
    plain, spec = engines
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    ps = prompts(6, seed=3)
    ref, got = plain.generate(ps, sp), spec.generate(ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    s = spec.stats()
    assert s["verify_rows"] > 0 and s["draft_tokens"] > 0 and s["accepted_tokens"] <= s["draft_tokens"]
    # the draft's K/V: packed pool layers after the target's; one program each, no recompiles
    layout = plain.programs.layouts.decode
    extra = pool_layers(read_config(draft_dir, spec.model_cfg), layout)
    assert spec.programs.layouts.decode.num_layers == layout.num_layers + extra > layout.num_layers
    assert spec.programs.compiles["verify"] == 1 and spec.programs.compiles["prefill_eagle3"] == 1
    assert pool_is_full(spec)


def test_a_stale_page_under_a_draft_run_fails_only_its_request(engines):
    stale_page_fails_only_its_request(engines[1], prompts(3, seed=5), SamplingParams(max_tokens=16, ignore_eos=True))


def test_eagle3_text_parses():
    assert Speculative.parse("eagle3:/d/draft:3") == Speculative("eagle3", 3, path="/d/draft")
    assert Speculative.parse("eagle3:/d/a:b:4:8") == Speculative("eagle3", 4, 8, path="/d/a:b")
    for bad in ("eagle3:3", "mtp:3:/d", "eagle3:/d:x"):
        with pytest.raises(ConfigError):
            Speculative.parse(bad)
    with pytest.raises(ConfigError):
        Speculative("ngram", 3, path="/d")
    assert EngineConfig(speculative="eagle3:/d:2:4").speculative == Speculative("eagle3", 2, 4, path="/d")
    with pytest.raises(ConfigError, match="role both"):
        EngineConfig(speculative="eagle3:/d:3", role="decode")
