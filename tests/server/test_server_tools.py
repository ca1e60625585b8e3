"""Tool calling end to end with the openai client against the real WSGI server. The tiny random model never writes a
tool call by itself, so a named or "required" tool_choice forces the Kimi markup through the grammar; the server
then parses what the model wrote (streamed and not) into `tool_calls`, and tool results go back through the
template."""
from __future__ import annotations

import json
import re

import httpx2 as httpx
import jsonschema
import openai
import pytest

from test_server import MODEL, shared_server, tokenizer, wait_idle

TIMEOUT = 600.0  # the forcing grammar's masked programs compile on first use

# small: the tool declarations and the markup (text in this tokenizer) share a 256-token context window
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "Paris?"}]
# no arguments at all: a call is short enough (~42 tokens of markup text) for several in the context window
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                       "additionalProperties": False}}}


@pytest.fixture(scope="module")
def srv():
    return shared_server()


def client(srv) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=f"{srv.base}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def test_named_tool_choice_returns_parsed_tool_calls(srv):
    r = client(srv).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert calls[0].id.startswith("functions.get_weather:")
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert not choice.message.content


def test_required_tool_choice_streams_delta_tool_calls(srv):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS + [NOOP], temperature=0.8, seed=3,
                  tool_choice="required", parallel_tool_calls=False)
    whole = client(srv).chat.completions.create(**kwargs)
    chunks = list(client(srv).chat.completions.create(**kwargs, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"] and whole.choices[0].finish_reason == "tool_calls"
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id and deltas[0].function.name in (
        "get_weather", "noop")
    # the same seed samples the same call, streamed or not
    want = whole.choices[0].message.tool_calls[0]
    assert (deltas[0].function.name, json.loads(deltas[0].function.arguments)) == (
        want.function.name, json.loads(want.function.arguments))
    wait_idle(srv.engine)


def test_parallel_calls_cut_by_max_tokens_finish_with_length_and_what_was_written(srv):
    """tool_choice "required" with the client's default parallel_tool_calls: the model writes calls until
    max_tokens, which is "length" (not invalid markup): the complete calls come back, with unique ids although the
    model repeats one, and the unfinished last call with what it wrote of its arguments, streamed and not. Greedy decoding of this random
    model writes one call and closes the section, so a seed samples several (a seed samples the same tokens)."""
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[PING], tool_choice="required", temperature=0.8, seed=50,
                  max_completion_tokens=160, logprobs=True)
    whole = client(srv).chat.completions.create(**kwargs)
    choice = whole.choices[0]
    out = "".join(t.token for t in choice.logprobs.content)
    written = re.findall(r"functions\.ping:\d+(?=<\|tool_call_argument_begin\|>)", out)
    # the premise: complete calls, one id written twice, then the output stops inside the next call
    assert len(set(written)) < len(written) == out.count("<|tool_call_end|>")
    assert out.rpartition("<|tool_call_end|>")[2].startswith("<|tool_call_begin|>functions.ping:")
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 160
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls[:len(written)]] == [
        ("ping", {})] * len(written)
    # the unfinished call comes back as far as it was written, once its name is (as OpenAI answers "length")
    cut = out.rpartition("<|tool_call_end|>")[2]
    partial = [("ping", cut.partition("<|tool_call_argument_begin|>")[2])] if "argument_begin" in cut else []
    assert [(c.function.name, c.function.arguments) for c in calls[len(written):]] == partial
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids) and ids[0] == written[0] and all(i.startswith("functions.ping:") for i in ids)

    chunks = list(client(srv).chat.completions.create(**kwargs, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert [(d.index, d.id, d.function.name, d.function.arguments) for d in deltas] == [
        (i, c.id, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
    wait_idle(srv.engine)


def test_auto_without_a_call_is_plain_content_and_none_ignores_tools(srv):
    for choice in ("auto", "none"):
        r = client(srv).chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                max_completion_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
        assert isinstance(r.choices[0].message.content, str)


def test_tool_results_render_back_through_the_template(srv):
    first = client(srv).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = client(srv).chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_completion_tokens=4,
                                            temperature=0, extra_body={"ignore_eos": True})
    rendered = tokenizer().apply_chat_template(history, add_generation_prompt=True, tools=TOOLS)
    assert f"<|tool_call_begin|>{call.id}<|tool_call_argument_begin|>{call.function.arguments}" in rendered
    assert f"## Return of {call.id}\nsunny, 21 C" in rendered
    assert r.usage.prompt_tokens == len(tokenizer().encode_chat(history, tools=TOOLS))


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_choice_is_400(srv, body, param):
    r = httpx.post(f"{srv.base}/v1/chat/completions", timeout=TIMEOUT,
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
