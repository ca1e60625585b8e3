"""/v1/responses end to end with the openai client against the real WSGI server: a Responses body runs as a chat
request (same template, sampling, tool-call grammar, reasoning split) and comes back as a response object or its
typed stream events; previous_response_id continues a stored response; store=false is never stored."""
from __future__ import annotations

import json

import httpx2 as httpx
import jsonschema
import openai
import pytest

from test_server import MODEL, Served, shared_server, tokenizer
from test_server_reasoning import K25_TEMPLATE, thinking_server

TIMEOUT = 600.0  # the forcing grammar's masked programs compile on first use
BASE = {"model": MODEL, "max_output_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def srv() -> Served:
    return shared_server()


def client(srv: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def test_plain_create_with_instructions(srv):
    r = client(srv).responses.create(**BASE, instructions="Be brief.", input="hi", metadata={"k": "v"})
    assert r.object == "response" and r.output_text and r.output[0].type == "message"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # ignore_eos: cut at 6
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert r.usage.input_tokens == len(tokenizer().encode_chat(history))
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.metadata == {"k": "v"} and r.instructions == "Be brief." and r.max_output_tokens == 6


def test_streamed_events_in_order_join_to_the_whole_text(srv):
    whole = client(srv).responses.create(**BASE, input="hi")
    events = list(client(srv).responses.create(**BASE, input="hi", stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == 6


def test_forced_tool_call_then_its_output_continues(srv):
    c = client(srv)
    first = c.responses.create(model=MODEL, input="Paris?", tools=[TOOL], temperature=0,
                               tool_choice={"type": "function", "name": "get_weather"})
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    second = c.responses.create(**BASE, previous_response_id=first.id, tools=[TOOL],
                                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                        "output": "sunny"}])
    assert second.previous_response_id == first.id and second.output_text
    history = [{"role": "user", "content": "Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": calls[0].call_id, "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
               {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}]
    assert second.usage.input_tokens == len(tokenizer().encode_chat(history, tools=CHAT_TOOLS))
    assert c.responses.retrieve(second.id).output_text == second.output_text


def test_streamed_tool_call_events(srv):
    events = list(client(srv).responses.create(model=MODEL, input="Paris?", tools=[TOOL], temperature=0,
                                               tool_choice="required", parallel_tool_calls=False, stream=True))
    types = [e.type for e in events]
    assert types[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    done = events[-2].item
    assert done.type == "function_call" and done.name == "get_weather" and done.arguments == events[3].delta
    assert events[-1].response.output[0].call_id == done.call_id


def test_text_format_json_schema_constrains_the_output(srv):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    r = client(srv).responses.create(model=MODEL, input="person", temperature=0, max_output_tokens=60,
                                     text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                      "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_store_false_cannot_be_continued(srv):
    c = client(srv)
    r = c.responses.create(**BASE, input="hi", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(**BASE, input="again", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id" and r.id in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


@pytest.mark.parametrize("field,value,param", [
    ("max_output_tokens", 0, "max_output_tokens"), ("input", [], "input"),
    ("tools", [{"type": "web_search"}], "tools[0].type"), ("text", {"format": {"type": "xml"}}, "text.format.type"),
    ("reasoning", {"effort": "max"}, "reasoning.effort"), ("tool_choice", "sometimes", "tool_choice"),
    ("input", [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}], "input[0].content[0].type"),
    ("background", True, "background"),
])
def test_bad_fields_are_400_naming_the_responses_field(srv, field, value, param):
    r = httpx.post(f"{srv.base}/v1/responses", json={"model": MODEL, "input": "hi", field: value}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def thinking() -> Served:
    served = thinking_server(K25_TEMPLATE)  # its own server, with the K2.5-like template
    yield served
    served.close()


def test_a_thinking_model_answers_with_a_reasoning_item(thinking):
    c = client(thinking)
    r = c.responses.create(**BASE, input="2+2?")
    assert [item.type for item in r.output] == ["reasoning", "message"]  # the block never closes: no text
    reasoning = r.output[0].content[0].text
    assert reasoning and r.output_text == "" and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(c.responses.create(**BASE, input="2+2?", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert events[-1].response.output[0].content[0].text == reasoning
    off = c.responses.create(**BASE, input="2+2?", reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"] and off.output_text
    again = c.responses.create(**BASE, input="and 3+3?", previous_response_id=r.id)
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "", "reasoning_content": reasoning},
               {"role": "user", "content": "and 3+3?"}]
    assert again.usage.input_tokens == len(thinking.engine.tokenizer.encode_chat(history))


def test_openapi_describes_the_responses_paths(srv):
    spec = httpx.get(f"{srv.base}/openapi.json", timeout=TIMEOUT).json()
    assert {"/v1/responses", "/v1/responses/{response_id}"} <= set(spec["paths"])
    assert set(spec["components"]["schemas"]) >= {"ResponsesRequest", "Response"}
