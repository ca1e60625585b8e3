"""Speculative decoding of rows with a grammar (engine/spec_grammar.py): a `json_schema` response format and a
forced tool call (Kimi markup) speculate with ngram:3 and mtp:3 drafts, and greedy output is token-for-token the
engine's without speculation (the embedded model, with its tokenizer and trained MTP head, in f32 and with FP8 KV +
INT4 decode weights), beside a row without a grammar; a draft chain stops at the first token the grammar rejects
(the engine's drafts and a chain made to break); the row's matcher commits only the emitted tokens; seeded sampled
grammar rows stay valid and reproducible; every page returns.

Shapes are pinned as in test_speculative_mtp.py (one row bucket, one block-table width, one chunk).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from engine_util import pool_is_full, small_config
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine import speculative
from jaxserve.engine.config import Speculative
from jaxserve.engine.spec_grammar import allows, grammar_drafts
from jaxserve.engine.structured import GrammarCompiler, json_schema_output
from jaxserve.server.toolcalls import ToolSetup
from jaxserve.tokenizer import Tokenizer

EMBEDDED = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"
PIN = dict(min_rows_bucket=8, min_pages_bucket=32, min_chunk_bucket=16)
SERVING = dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}},)
JSON_PROMPTS = ['user = {"name": "bob", "age": 3, "tags": ["a"]}\nuser = ', "def f(x):\n    return {"]
TOOL_PROMPT = "Weather in Paris for 3 days? get_weather(city='Paris', days=3)\n"
FREE_PROMPT = "for i in range(10):\n    print(i)\nfor i in"


def params(max_tokens: int = 40, **kw: object) -> list[SamplingParams]:
    """Two JSON-schema rows, a forced tool call, a row without a grammar."""
    schema = json_schema_output(SCHEMA)
    tools = ToolSetup("kimi", TOOLS, "required").grammar()
    # the row without a grammar ends first: batches keep a grammar row (one sampling form compiled per program)
    return [SamplingParams(max_tokens=max_tokens, structured=schema, **kw)] * 2 + \
        [SamplingParams(max_tokens=max_tokens, structured=tools, **kw), SamplingParams(max_tokens=8, **kw)]


class Engines:
    """The embedded model in one format without speculation ("plain"), with ngram:3 and with mtp:3, each loaded
    (and its programs compiled) on first use."""

    SPECS = {"plain": None, "ngram": Speculative("ngram", 3), "mtp": Speculative("mtp", 3)}

    def __init__(self, formats: dict[str, str]) -> None:
        self.cfg = small_config(**PIN, **formats, max_model_len=128)
        self._loaded: dict[str, Engine] = {}

    def __getitem__(self, name: str) -> Engine:
        if name not in self._loaded:
            cfg = dataclasses.replace(self.cfg, speculative=self.SPECS[name])
            self._loaded[name] = Engine.from_checkpoint(EMBEDDED, cfg, start=False)
        return self._loaded[name]


# the compiles dominate (~25 s of CPU per engine): f32 with n-gram drafts in the default tier, the rest slow
@pytest.fixture(scope="module", params=[{}, pytest.param(SERVING, marks=pytest.mark.slow)], ids=["f32", "fp8kv-int4"])
def engines(request):
    return Engines(request.param)


@pytest.fixture
def chains(monkeypatch):
    """Each grammar row's (proposed drafts, GrammarDrafts) as the speculative step made them."""
    seen: list[tuple[list[int], object]] = []

    def recording(matcher, grammar, proposed, limit):  # noqa: ANN001, ANN202
        out = grammar_drafts(matcher, grammar, proposed, limit)
        seen.append((list(proposed[:limit]), out))
        return out

    monkeypatch.setattr(speculative, "grammar_drafts", recording)
    return seen


@pytest.mark.parametrize("method", ["ngram", pytest.param("mtp", marks=pytest.mark.slow)])
def test_greedy_grammar_rows_speculate_and_equal_the_plain_engine(engines, method, chains):
    plain, spec = engines["plain"], engines[method]
    prompts = JSON_PROMPTS + [TOOL_PROMPT, FREE_PROMPT]
    before = spec.stats()
    ref, got = plain.generate(prompts, params()), spec.generate(prompts, params())
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    assert got[2].text.startswith("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:")
    s = spec.stats()
    assert s["accepted_tokens"] > before["accepted_tokens"] and pool_is_full(spec)
    kept = [g.tokens for _, g in chains]
    assert sum(map(len, kept)) > 0, "no grammar row took drafts: the test does not exercise the path"
    # some drafter chain was cut by the grammar before its end (a draft the grammar rejects mid-chain)
    assert any(0 < len(p) and g.tokens[:j] == p[:j] and not allows(g.masks[j], p[j])
               for p, g in chains for j in range(min(len(p), len(g.tokens) + 1)) if g.tokens[j:j + 1] != p[j:j + 1])


def test_a_chain_stops_at_the_first_token_the_grammar_rejects():
    """A chain with a bad token in the middle: the drafts keep its valid prefix, then the tokens the grammar forces
    there (the next required key); each position's mask is that of a matcher that consumed the drafts before it;
    the row's matcher is untouched."""
    tok = Tokenizer(EMBEDDED)
    g = GrammarCompiler(tok, tok.vocab_size, ())
    good, bad = tok.encode('{"name": "bob"', special_tokens=False), tok.encode("}", special_tokens=False)
    matcher = g.matcher(json_schema_output(SCHEMA))
    assert matcher.validate_tokens(good + bad) == len(good)  # "age" and "tags" are required: no "}" yet
    mask0 = g.bitmask(matcher)
    out = grammar_drafts(matcher, g, good + bad + good, limit=len(good) + 4)
    assert out.tokens[:len(good)] == good and not allows(out.masks[len(good)], bad[0])
    assert tok.decode(out.tokens).startswith('{"name": "bob", "age')  # forced after the cut
    assert len(out.tokens) == len(good) + 4 and len(out.masks) == len(out.tokens) + 1
    assert np.array_equal(g.bitmask(matcher), mask0) and matcher.validate_tokens(out.tokens) == len(out.tokens)
    fresh = g.matcher(json_schema_output(SCHEMA))
    for j, t in enumerate(out.tokens):
        assert np.array_equal(out.masks[j], g.bitmask(fresh)) and fresh.consume_token(t)
    assert np.array_equal(out.masks[-1], g.bitmask(fresh))
    # nothing proposed at the start of the document: the grammar's forced tokens are the drafts
    assert tok.decode(grammar_drafts(matcher, g, [], limit=3).tokens) == '{"name'


def test_sampled_grammar_rows_speculate_valid_and_reproducible(engines):
    e = engines["ngram"]
    sp = params(max_tokens=40, temperature=0.8, seed=11)
    before = e.stats()["verify_rows"]
    outs = e.generate(JSON_PROMPTS + [TOOL_PROMPT, FREE_PROMPT], sp)
    assert e.stats()["verify_rows"] > before
    for o in outs[:2]:
        if o.finish_reason == "stop":  # a complete document matches the schema
            assert set(json.loads(o.text)) == set(SCHEMA["properties"])
    assert e.generate([JSON_PROMPTS[0]], sp[0])[0].token_ids == outs[0].token_ids
    assert pool_is_full(e)
