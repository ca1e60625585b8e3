"""Lenient, documented request fields: every field of OpenAI's current chat, completions and responses request
schemas is accepted (null is "unset"), those with meaning here are honored, an unknown field is named in the
`x-jaxserve-ignored-fields` header (or refused under `strict_fields`), and a known field of the wrong type is
still a 400."""
from __future__ import annotations

import atexit
import functools

import httpx2 as httpx
import pytest

from test_server import MODEL, TIMEOUT, Served, serve, session_ids, shared_server

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
RESPONSES = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
# each field of item 2 with a value a real client sends (and null, which is always unset)
FIELDS = [
    ("metadata", {"trace": "abc"}), ("store", False), ("service_tier", "auto"), ("reasoning_effort", "low"),
    ("prompt_cache_key", "conversation-7"), ("safety_identifier", "user-hash"), ("verbosity", "low"),
    ("modalities", ["text"]), ("audio", None), ("prediction", {"type": "content", "content": "hi"}),
    ("web_search_options", {}), ("user", "u1"), ("seed", 3), ("stop", ["\n\n"]), ("n", 1), ("logit_bias", {"5": 1}),
    ("stream_options", None),
]
CHAT_ONLY = [("parallel_tool_calls", True), ("max_completion_tokens", 2), ("top_logprobs", None),
             ("functions", None), ("function_call", None), ("chat_template_kwargs", {"thinking": False})]
# /v1/responses' own fields (and the chat ones it shares), each with a value the openai client sends
RESPONSES_FIELDS = [
    ("metadata", {"trace": "abc"}), ("store", False), ("service_tier", "auto"), ("prompt_cache_key", "conv-7"),
    ("safety_identifier", "user-hash"), ("user", "u1"), ("include", ["reasoning.encrypted_content"]),
    ("truncation", "disabled"), ("parallel_tool_calls", True), ("max_tool_calls", 3), ("top_logprobs", 0),
    ("reasoning", {"effort": "low", "summary": "auto"}), ("text", {"format": {"type": "text"}, "verbosity": "low"}),
    ("background", False), ("prompt_cache_retention", "in_memory"), ("instructions", "Be brief."),
    ("previous_response_id", None), ("stream_options", None), ("tool_choice", "auto"), ("tools", []),
    ("conversation", None), ("prompt", None), ("seed", 3), ("top_k", 5),
]


@functools.cache
def strict_server() -> Served:
    """The shared engine behind a second app that refuses unknown fields (only refusals are sent to it)."""
    served = serve(shared_server().engine, strict_fields=True)
    atexit.register(lambda: (served.server.close(), served.server.task_dispatcher.shutdown(timeout=5)))
    return served


@pytest.fixture(scope="module")
def srv() -> Served:
    return shared_server()


@pytest.mark.parametrize("path,base,field,value", [
    *[("/v1/chat/completions", CHAT, f, v) for f, v in FIELDS + CHAT_ONLY],
    *[("/v1/completions", COMPLETION, f, v) for f, v in FIELDS],
    *[("/v1/responses", RESPONSES, f, v) for f, v in RESPONSES_FIELDS],
    *[(p, b, f, None) for p, b in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION))
      for f, _ in FIELDS],
])
def test_every_known_field_is_accepted(srv, path, base, field, value):
    r = httpx.post(f"{srv.base}{path}", json={**base, field: value}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert "x-jaxserve-ignored-fields" not in r.headers


def test_a_dumped_assistant_message_goes_back_as_it_is(srv):
    """What the openai client's `message.model_dump()` sends back: refusal, annotations, audio, function_call."""
    msg = {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None,
           "function_call": None, "tool_calls": None}
    r = httpx.post(f"{srv.base}/v1/chat/completions", timeout=TIMEOUT,
                   json={**CHAT, "messages": [*CHAT["messages"], msg, {"role": "user", "content": "again"}]})
    assert r.status_code == 200 and "x-jaxserve-ignored-fields" not in r.headers, r.text


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                       ("/v1/responses", RESPONSES)])
def test_unknown_fields_are_named_in_a_header_or_refused_when_strict(srv, path, base):
    body = {**base, "banana": 1, "stream_options": None, "zz_extra": {"a": 1}}
    r = httpx.post(f"{srv.base}{path}", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["x-jaxserve-ignored-fields"] == "banana, zz_extra"
    r = httpx.post(f"{strict_server().base}{path}", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "banana"
    assert "unrecognized request argument" in r.json()["error"]["message"]


def test_unknown_field_names_are_escaped_in_the_header(srv):
    """A name with non-latin-1 characters, quotes or a line break is named with JSON escapes, not a 500."""
    body = {**CHAT, "\U000ad741x": 1, 'a"\r\nb': 2}
    r = httpx.post(f"{srv.base}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.headers["x-jaxserve-ignored-fields"] == 'a\\"\\r\\nb, \\uda75\\udf41x'  # sorted


@pytest.mark.parametrize("field,value", [
    ("metadata", "x"), ("metadata", {"k": 1}), ("store", "yes"), ("service_tier", 1), ("verbosity", "loud"),
    ("reasoning_effort", "max"), ("prompt_cache_key", ""), ("modalities", "text"), ("modalities", ["audio"]),
    ("audio", {"voice": "alloy", "format": "mp3"}), ("prediction", "hi"), ("user", 5), ("functions", {}),
    ("chat_template_kwargs", {"messages": []}), ("max_thinking_tokens", "16"), ("max_thinking_tokens", -1),
])
def test_a_known_field_of_the_wrong_type_is_still_400(srv, field, value):
    r = httpx.post(f"{srv.base}/v1/chat/completions", json={**CHAT, field: value}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_prompt_cache_key_routes_like_the_session_affinity_header(srv):
    assert session_ids(srv.engine, "conv-9", lambda: httpx.post(
        f"{srv.base}/v1/chat/completions", timeout=TIMEOUT,
        json={**CHAT, "prompt_cache_key": "conv-9", "ignore_eos": True})) == (200, ["conv-9"])


def test_legacy_functions_are_tools(srv):
    fn = {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
    r = httpx.post(f"{srv.base}/v1/chat/completions", timeout=600.0,
                   json={**CHAT, "max_tokens": 60, "functions": [fn], "function_call": {"name": "ping"}})
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls[0]["function"]["name"] == "ping"
