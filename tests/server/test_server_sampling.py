"""The OpenAI sampling fields end to end (openai client against the real WSGI server): n choices sharing one prefill,
top logprobs, presence / frequency / repetition penalties, logit_bias, min_tokens, and json_schema structured output
validated with jsonschema."""
from __future__ import annotations

import collections
import json

import httpx2 as httpx
import jsonschema
import openai
import pytest

from test_server import MODEL, shared_server, tokenizer, wait_idle

# each new sampling structure (penalties, masks, top logprobs) compiles its programs on first use: minutes on a
# loaded shared CPU
TIMEOUT = 600.0


class _Srv:
    def __init__(self, served) -> None:  # noqa: ANN001
        self.served, self.base, self.engine = served, served.base, served.engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def srv():
    return _Srv(shared_server())


REPETITIVE = "a b a b a b a b a b a b a b a b"


def completion_ids(srv, **body) -> list[int]:
    """Token ids of a greedy completion (from its logprob tokens' bytes, exact for the byte-level vocabulary)."""
    extra = {"ignore_eos": True, **body.pop("extra_body", {})}
    r = srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": REPETITIVE}],
                                             temperature=0, logprobs=True, extra_body=extra, **body)
    text_bytes = [bytes(c.bytes) for c in r.choices[0].logprobs.content]
    tok = tokenizer()
    return [tok.encode(b.decode("utf-8", "replace"), special_tokens=False)[0] if b else -1 for b in text_bytes]


def test_n_returns_n_choices_sharing_one_prefill(srv):
    client = srv.client()
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    assert len(tokenizer().encode(prompt)) > 16  # at least two full 8-token pages to share
    before = srv.engine.stats()["cached_tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=5,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(tokenizer().encode(prompt))
    # choices 1 and 2 found choice 0's prompt pages in the prefix cache
    assert srv.engine.stats()["cached_tokens"] - before >= 2 * 16
    assert len({c.text for c in r.choices}) > 1  # seeds seed, seed+1, seed+2 sample differently
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                          max_completion_tokens=4, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 3 and chat.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                                 max_completion_tokens=4, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    texts = collections.defaultdict(str)
    finishes = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert len(set(texts.values())) == 1  # greedy: three equal choices
    wait_idle(srv.engine)


def test_top_logprobs_returns_that_many_alternatives(srv):
    r = srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                             max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
                                             extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for c in content:
        assert len(c.top_logprobs) == 5
        lps = [t.logprob for t in c.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
    comp = httpx.post(f"{srv.base}/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": "x = ", "max_tokens": 3, "temperature": 0, "logprobs": 3, "ignore_eos": True}).json()
    tops = comp["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == 3 and all(1 <= len(t) <= 3 for t in tops)  # a dict by token text (equal texts merge)


def repeats(ids: list[int]) -> int:
    """Tokens that repeat an earlier token of the completion."""
    return len(ids) - len(set(ids))


def test_penalties_change_repetition_in_the_expected_direction(srv):
    a, b = tokenizer().encode("a")[0], tokenizer().encode(" b")[0]
    forced = {str(a): 10, str(b): 10}  # the prompt's two tokens pushed to the top: "a b a b ..." unpenalized
    base = completion_ids(srv, max_completion_tokens=24, logit_bias=forced)
    assert repeats(base) >= 20
    for field in ("frequency_penalty", "presence_penalty"):
        pen = completion_ids(srv, max_completion_tokens=24, logit_bias=forced, **{field: 2.0})
        assert repeats(pen) < repeats(base), (field, pen)
    rep = completion_ids(srv, max_completion_tokens=24, logit_bias=forced, extra_body={"repetition_penalty": 2.0})
    assert repeats(rep) <= repeats(base)
    # unforced: rewarding repetition (negative penalties, repetition_penalty < 1) makes the completion repeat more
    free = completion_ids(srv, max_completion_tokens=24)
    assert repeats(completion_ids(srv, max_completion_tokens=24, presence_penalty=-2.0)) > repeats(free)
    assert repeats(completion_ids(srv, max_completion_tokens=24, frequency_penalty=-2.0)) > repeats(free)
    prompt_ids = set(tokenizer().encode(REPETITIVE))
    sticky = completion_ids(srv, max_completion_tokens=24, extra_body={"repetition_penalty": 0.2})
    assert sum(t in prompt_ids for t in sticky) >= sum(t in prompt_ids for t in free)
    assert repeats(sticky) > repeats(free)


def test_logit_bias_and_min_tokens(srv):
    client = srv.client()
    forced = tokenizer().encode("Z")[0]
    r = client.completions.create(model=MODEL, prompt="q", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "ZZZZ"
    # a banned greedy first token is never produced
    first = client.completions.create(model=MODEL, prompt="q", max_tokens=1, temperature=0).choices[0].text
    first_id = tokenizer().encode(first, special_tokens=False)[0]
    again = client.completions.create(model=MODEL, prompt="q", max_tokens=1, temperature=0,
                                      logit_bias={str(first_id): -100}).choices[0].text
    assert again != first
    # the end token, pushed to the top by the bias, waits for min_tokens
    eos = 4090
    r = httpx.post(f"{srv.base}/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": "q", "max_tokens": 8, "temperature": 0, "logit_bias": {str(eos): 100},
        "min_tokens": 5}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 6


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "tags"],
    "additionalProperties": False,
}


def test_json_schema_output_validates_for_20_prompts(srv):
    client = srv.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for i in range(20):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"person #{i}"}],
                                           max_completion_tokens=80, temperature=1.0 if i % 2 else 0, seed=i,
                                           response_format=fmt)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # json_object: any JSON object, streamed
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "obj"}],
                                                 max_completion_tokens=120, temperature=0, stream=True,
                                                 response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:  # ran out of tokens: still a prefix of an object
        assert finish == ["length"] and text.startswith("{")
    wait_idle(srv.engine)
