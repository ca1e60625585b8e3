"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) read as a chat request.

A Responses body is validated here field by field (unknown fields follow the chat rule: named in a header, or a 400
under --strict-fields), then rewritten into a chat completions body: `instructions` becomes a system message,
`input` items (messages, `function_call`, `function_call_output`, `reasoning`) become chat messages (tool calls,
tool results, reasoning_content), flat function `tools` become chat tools, `text.format` becomes
`response_format`, `reasoning.effort` becomes `reasoning_effort`, `max_output_tokens` becomes
`max_completion_tokens`. That body goes through `parse_chat`, so the template, sampling, tool-call grammars and
reasoning split are the chat path's; a chat error's `param` is renamed to the Responses field. The chat answer
(whole, or its SSE chunks) is then reshaped into a response object or typed events (`server.response_output`).

`previous_response_id` continues a stored response (`server.response_store`): its conversation and output items
come before this request's input; `store: false` keeps an answer out of the store.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from flask import Response

from jaxserve.engine import Engine, TokenEvent
from jaxserve.errors import JaxserveError, ResponseNotFoundError, UnsupportedParameterError
from jaxserve.server.body import Body, UnknownFields, field_error, json_kind
from jaxserve.server.chat_request import parse_chat
from jaxserve.server.fields import EFFORTS, RESPONSES_EXTENSIONS, RESPONSES_FIELDS, STREAM_OPTIONS
from jaxserve.server.limits import AppConfig
from jaxserve.server.protocol import Generation
from jaxserve.server.response_output import OutputBuilder, stream_events, whole_response
from jaxserve.server.response_store import ResponseStore, StoredResponse
from jaxserve.server.responses import Reply, Shape

RESPONSES = Shape("/v1/responses", "resp", "response", "response.chunk", chat=True)
MESSAGE_ITEM = frozenset({"type", "role", "content", "id", "status", "phase"})
CONTENT_PART = frozenset({"type", "text", "annotations", "logprobs"})
CALL_ITEM = frozenset({"type", "call_id", "name", "arguments", "id", "status", "namespace"})
CALL_OUTPUT_ITEM = frozenset({"type", "call_id", "output", "id", "status"})
REASONING_ITEM = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})
TOOL = frozenset({"type", "name", "description", "parameters", "strict"})
TEXT = frozenset({"format", "verbosity"})
TEXT_FORMAT = frozenset({"type", "name", "schema", "strict", "description"})
REASONING = frozenset({"effort", "summary", "generate_summary"})
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# chat parameter names -> the Responses fields they came from (a chat error names what the client sent)
RENAMED = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("reasoning_effort", "reasoning.effort"), ("tool_choice.function", "tool_choice"))


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated /v1/responses body: the chat Generation it runs as, the conversation it continues (chat messages,
    instructions excluded), whether its answer is stored, and the request fields the response object echoes."""

    gen: Generation
    messages: tuple[dict[str, Any], ...]
    store: bool
    echo: dict[str, Any]


class Conversation:
    """Responses items -> chat messages. A reasoning item's text goes to the next assistant turn's
    reasoning_content; consecutive function calls join one assistant message's tool_calls."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)
        self._reasoning = ""

    def read(self, body: Body, items: list[Any], param: str) -> None:
        readers = {"message": (MESSAGE_ITEM, self._message), "function_call": (CALL_ITEM, self._call),
                   "function_call_output": (CALL_OUTPUT_ITEM, self._call_output),
                   "reasoning": (REASONING_ITEM, self._reasoning_item)}
        for i, item in enumerate(items):
            name = f"{param}[{i}]"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in readers:
                raise UnsupportedParameterError(f"'{name}.type': only message, function_call, function_call_output "
                                                f"and reasoning items are supported", value=str(kind)[:40],
                                                param=f"{name}.type")
            fields, reader = readers[kind]
            reader(body.child(item, fields, name))

    def _assistant(self, content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self._reasoning:
            msg["reasoning_content"], self._reasoning = self._reasoning, ""
        self.messages.append(msg)
        return msg

    def _message(self, ib: Body) -> None:
        role = ib.choice("role", INPUT_ROLES) or "user"
        text = _text(ib, "content", required=True)
        if role == "assistant":
            self._assistant(text)
        else:
            self.messages.append({"role": role, "content": text})

    def _call(self, ib: Body) -> None:
        call = {"id": ib.string("call_id", required=True), "type": "function",
                "function": {"name": ib.string("name", required=True),
                             "arguments": ib.string("arguments", required=True)}}
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning:
            last = self._assistant("")
        last.setdefault("tool_calls", []).append(call)

    def _call_output(self, ib: Body) -> None:
        self.messages.append({"role": "tool", "tool_call_id": ib.string("call_id", required=True),
                              "content": _text(ib, "output", required=True)})

    def _reasoning_item(self, ib: Body) -> None:
        ib.string("encrypted_content")
        text = _text(ib, "content") or _text(ib, "summary")  # the full reasoning when sent, else its summary
        self._reasoning += text


def _text(b: Body, key: str, *, required: bool = False) -> str:
    """A string, or the joined text of an array of text parts (input_text, output_text, reasoning_text, ...)."""
    raw = b.raw.get(key)
    if raw is None and required:
        raise field_error(b.name(key), "is required")
    if raw is None or isinstance(raw, str):
        return raw or ""
    if not isinstance(raw, list):
        raise field_error(b.name(key), f"must be a string or an array of text parts, got {json_kind(raw)}")
    out = []
    for j, part in enumerate(raw):
        pb = b.child(part, CONTENT_PART, f"{b.name(key)}[{j}]")
        if pb.raw.get("type") not in TEXT_PARTS:
            raise UnsupportedParameterError(f"'{pb.name('type')}': only text parts are supported",
                                            value=str(pb.raw.get("type"))[:40], param=pb.name("type"))
        out.append(pb.string("text", required=True))
    return "".join(out)


def _tools(body: Body) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat tools (the chat path validates names and schemas)."""
    raw = body.raw.get("tools")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise field_error("tools", f"must be an array of tool objects, got {json_kind(raw)}", json_kind(raw))
    out = []
    for i, t in enumerate(raw):
        tb = body.child(t, TOOL, f"tools[{i}]")
        kind = tb.string("type", required=True)
        if kind != "function":
            raise UnsupportedParameterError(f"'tools[{i}].type': only function tools are supported",
                                            value=kind[:40], param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}})
    return out


def _tool_choice(body: Body) -> str | dict[str, Any] | None:
    raw = body.raw.get("tool_choice")
    if raw is None or isinstance(raw, str):
        return raw
    cb = body.child(raw, frozenset({"type", "name"}), "tool_choice")
    if cb.string("type", required=True) != "function":
        raise UnsupportedParameterError("'tool_choice.type': only 'function' (or none/auto/required) is supported",
                                        value=str(raw.get("type"))[:40], param="tool_choice.type")
    return {"type": "function", "function": {"name": cb.string("name", required=True)}}


def _response_format(body: Body) -> dict[str, Any] | None:
    """`text.format` -> chat's response_format ({"type": "json_schema", "name", "schema", ...} is flat here)."""
    tb = body.child(body.raw["text"], TEXT, "text") if body.has("text") else None
    if tb is None or not tb.has("format"):
        return None
    tb.choice("verbosity", ("low", "medium", "high"))
    fb = tb.child(tb.raw["format"], TEXT_FORMAT, "text.format")
    kind = fb.string("type", required=True)
    if kind != "json_schema":
        return {"type": kind}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fb.raw.items() if k != "type" and v is not None}}


def _effort(body: Body) -> str | None:
    if not body.has("reasoning"):
        return None
    rb = body.child(body.raw["reasoning"], REASONING, "reasoning")
    for key in ("summary", "generate_summary"):
        rb.choice(key, ("auto", "concise", "detailed"))
    return rb.choice("effort", EFFORTS)


def _check_accepted(body: Body) -> None:
    """Type-check the accepted fields that change nothing here; refuse those this server cannot do."""
    for name, why in (("background", "background responses are not supported"),
                      ("conversation", "conversations are not supported: use previous_response_id"),
                      ("prompt", "prompt templates are not supported")):
        if body.has(name) and body.raw[name] is not False:
            raise UnsupportedParameterError(f"'{name}': {why}", value=json_kind(body.raw[name]), param=name)
    body.integer("max_tool_calls", 1, 1 << 20)
    body.integer("top_logprobs", 0, 20)
    body.choice("truncation", ("auto", "disabled"))
    body.choice("prompt_cache_retention", ("in_memory", "24h"))
    include = body.raw.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(s, str) for s in include)):
        raise field_error("include", "must be an array of strings", json_kind(include))
    if body.has("stream_options"):
        body.child(body.raw["stream_options"], STREAM_OPTIONS, "stream_options").boolean("include_obfuscation", False)


def _chat_body(body: Body, messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    """The chat completions body this Responses body runs as."""
    chat: dict[str, Any] = {"model": body.raw.get("model"), "messages": messages, "stream": stream,
                            "tools": _tools(body), "tool_choice": _tool_choice(body),
                            "response_format": _response_format(body), "reasoning_effort": _effort(body),
                            "max_completion_tokens": body.raw.get("max_output_tokens")}
    for key in ("temperature", "top_p", "parallel_tool_calls", "user", "metadata", "prompt_cache_key",
                "safety_identifier", "service_tier", *RESPONSES_EXTENSIONS):
        chat[key] = body.raw.get(key)
    if stream:
        chat["stream_options"] = {"include_usage": True}  # the usage chunk feeds response.completed
    return {k: v for k, v in chat.items() if v is not None}


def _renamed(err: JaxserveError) -> JaxserveError:
    """A chat parsing error renamed to the Responses field it came from."""
    param = err.param or ""
    for chat, responses in RENAMED:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            err.param = responses + param[len(chat):]
            err.message = err.message.replace(f"'{param}'", f"'{err.param}'")
            return err
    m = re.fullmatch(r"tools\[(\d+)\]\.function(.*)", param)
    if m:
        err.param = f"tools[{m.group(1)}]{m.group(2)}"
        err.message = err.message.replace(f"'{param}'", f"'{err.param}'")
    return err


def _echo(body: Body, previous: str | None, store: bool) -> dict[str, Any]:
    """The request fields a response object carries back."""
    raw = body.raw
    effort = raw.get("reasoning", {}).get("effort") if isinstance(raw.get("reasoning"), dict) else None
    return {"instructions": raw.get("instructions"), "metadata": raw.get("metadata") or {},
            "max_output_tokens": raw.get("max_output_tokens"), "parallel_tool_calls": body.boolean(
                "parallel_tool_calls", True), "previous_response_id": previous,
            "reasoning": {"effort": effort, "summary": None}, "store": store,
            "temperature": body.number("temperature", 0.0, 2.0, 1.0),
            "top_p": body.number("top_p", 0.0, 1.0, 1.0, open_lo=True),
            "text": raw.get("text") or {"format": {"type": "text"}}, "tool_choice": raw.get("tool_choice") or "auto",
            "tools": raw.get("tools") or [], "truncation": raw.get("truncation") or "disabled",
            "user": raw.get("user"), "background": False, "service_tier": raw.get("service_tier"),
            "prompt_cache_key": raw.get("prompt_cache_key"), "safety_identifier": raw.get("safety_identifier")}


def parse_responses(raw: Any, engine: Engine, model_name: str, cfg: AppConfig,
                    store: ResponseStore) -> ResponsesRequest:
    """Validate a /v1/responses body and run it through the chat path's parsing."""
    body = Body(raw, RESPONSES_FIELDS, unknown=UnknownFields(cfg.strict_fields))
    _check_accepted(body)
    keep = body.boolean("store", True)
    previous = body.string("previous_response_id")
    conv = Conversation([])
    if previous is not None:
        stored = store.get(previous)
        if stored is None:
            raise ResponseNotFoundError(f"Previous response with id '{previous[:100]}' not found (never stored, "
                                        "sent with store: false, or expired)", value=previous[:100],
                                        param="previous_response_id")
        conv = Conversation(list(stored.messages))
        conv.read(body, list(stored.output), "previous_response_id")
    items = body.raw.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not (items or conv.messages):
        raise field_error("input", "is required: a string or a non-empty array of input items", json_kind(items))
    conv.read(body, items, "input")
    instructions = body.string("instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    stream = body.boolean("stream", False)
    try:
        gen = parse_chat(_chat_body(body, head + conv.messages, stream), engine, model_name, cfg)
    except JaxserveError as err:
        raise _renamed(err) from None
    gen = replace(gen, ignored=tuple(body.unknown.names))
    return ResponsesRequest(gen, tuple(conv.messages), keep, _echo(body, previous, keep))


class Runner(Protocol):
    """What the app's generation handler offers this endpoint (`app.GenerationHandler`)."""

    engine: Engine
    model_name: str
    cfg: AppConfig

    def check_open(self) -> None: ...

    def start(self, gen: Generation, shape: Shape) -> tuple[Reply, list[str], Iterator[tuple[int, TokenEvent]]]: ...

    def whole(self, reply: Reply, ids: list[str], events: Iterator[tuple[int, TokenEvent]], t0: float
              ) -> Response: ...

    def streamed(self, reply: Reply, ids: list[str], events: Iterator[tuple[int, TokenEvent]],
                 t0: float) -> Response: ...


class ResponsesApi:
    """The /v1/responses handlers over the app's generation handler, with the store of recent answers."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.store = ResponseStore(runner.cfg.stored_responses, runner.cfg.stored_response_ttl_s)

    def create(self, raw: Any) -> tuple[Response, tuple[str, ...]]:
        """POST /v1/responses -> (the answer, the unknown fields the body carried)."""
        t0 = time.monotonic()
        r = self.runner
        r.check_open()
        req = parse_responses(raw, r.engine, r.model_name, r.cfg, self.store)
        reply, ids, events = r.start(req.gen, RESPONSES)
        builder = OutputBuilder("resp_" + reply.rid.partition("-")[2], r.model_name, req.echo, self._count_tokens)
        if req.gen.stream:
            resp = r.streamed(reply, ids, events, t0)
            resp.response = stream_events(builder, resp.response, lambda body: self._keep(req, body))
            return resp, req.gen.ignored
        chat = r.whole(reply, ids, events, t0)
        if chat.status_code != 200:
            return chat, req.gen.ignored
        body = whole_response(builder, json.loads(chat.get_data()))
        self._keep(req, body)
        return Response(json.dumps(body), mimetype="application/json"), req.gen.ignored

    def get(self, response_id: str) -> Response:
        """GET /v1/responses/{id}: a stored response object."""
        stored = self.store.get(response_id)
        if stored is None:
            raise ResponseNotFoundError(f"Response with id '{response_id[:100]}' not found", value=response_id[:100],
                                        param="response_id")
        return Response(json.dumps(stored.body), mimetype="application/json")

    def _keep(self, req: ResponsesRequest, body: dict[str, Any]) -> None:
        if req.store and body["status"] in ("completed", "incomplete"):
            self.store.put(body["id"], StoredResponse(req.messages, tuple(body["output"]), body))

    def _count_tokens(self, text: str) -> int:
        tok = self.runner.engine.tokenizer
        return len(tok.encode(text, special_tokens=False)) if text and tok is not None else 0
