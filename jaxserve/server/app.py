"""The OpenAI-compatible HTTP API over one Engine: `create_app(engine, model_name) -> Flask`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
Server-Sent Events ending in `data: [DONE]`), GET /health, GET /metrics, GET /openapi.json.

Bodies are validated here, field by field, before anything reaches the engine, so a bad request is refused with a
400 naming the field and never touches the scheduler: the body must be declared JSON (415), parse as strict JSON
(no NaN/Infinity) with no lone surrogate in any string, name the served model (404 `model_not_found`), and fit the
context window by its character count before it is tokenized, then by its token count (tokenization stops at the
window). User text is encoded with special tokens disabled: only the chat template writes control tokens.
An admission gate of `AppConfig.max_inflight` generation requests answers the next one 429 + Retry-After at
once; a non-streaming request whose client disconnects is aborted in the engine.

Every error leaves as an OpenAI-shaped body `{"error": {"message", "type", "param", "code"}}` with the status from `jaxserve.errors.http_status` (the one place
that maps exception types to codes). The app factory closes over the engine and its metrics: no global state.
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from jaxserve.engine import Engine, Request, SamplingParams, TokenEvent
from jaxserve.errors import (InvalidRequestError, JaxserveError, NotFoundError, QueueFullError,
                             UnsupportedMediaTypeError, http_status)
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openapi import openapi_spec

log = logging.getLogger("jaxserve.server")

MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits a context window; bounds JSON parsing work
MAX_STOP_STRINGS = 16
MAX_TOOLS = 128
RETRY_AFTER_S = 1
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat's default, bounded so a request without max_tokens cannot hold a slot for long
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function (and participant) names
DISCONNECT_POLL_S = 0.05
MAX_DEPTH = 64  # JSON nesting; deeper bodies would overflow the recursive walks (here, the template's tojson)


@dataclass(frozen=True)
class AppConfig:
    """The HTTP layer's limits. max_inflight: generation requests admitted at once (each holds a WSGI thread until it
    ends: the server needs more threads than this, so /health and refusals always find one)."""

    max_inflight: int = 16
    max_body_bytes: int = MAX_BODY_BYTES
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    retry_after_s: int = RETRY_AFTER_S


# ---- typed request errors (their errors.py base classes carry the HTTP status) -------------------------------
class ModelNotFoundError(NotFoundError):
    """The body names a model this server does not serve (404, as OpenAI and vLLM answer)."""

    code = "model_not_found"


class ContextLengthError(InvalidRequestError):
    """prompt + max_tokens exceeds the engine's context window."""

    code = "context_length_exceeded"


class UnsupportedParameterError(InvalidRequestError):
    """A known OpenAI parameter with a value this server does not implement (n > 1, top alternatives, ...)."""

    code = "unsupported_parameter"


class MalformedBodyError(InvalidRequestError):
    """The body is not a JSON object."""

    code = "invalid_json"


class NotJsonError(UnsupportedMediaTypeError):
    """The body is not declared `application/json` (UTF-8)."""

    code = "unsupported_media_type"


class RequestAbortedError(JaxserveError):
    """The engine ended the request with finish_reason "abort" although this client is still connected."""

    http_status = 503
    error_type = "request_aborted"


def error_body(err: JaxserveError) -> dict[str, Any]:
    """The OpenAI error object for a typed error."""
    return {"error": {"message": err.message, "type": err.error_type, "param": err.param,
                      "code": getattr(err, "code", None)}}


def error_response(err: JaxserveError, retry_after_s: int = RETRY_AFTER_S) -> Response:
    resp = Response(json.dumps(error_body(err)), status=http_status(err), mimetype="application/json")
    if isinstance(err, QueueFullError):
        resp.headers["Retry-After"] = str(retry_after_s)
    return resp


# ---- body validation ------------------------------------------------------------------------------------------
def _kind(value: Any) -> str:
    """A JSON type name for messages (never the value itself, which may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _bad(param: str, message: str, value: Any = None) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}': {message}", value=value, param=param)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")  # json.loads accepts NaN/Infinity/-Infinity; RFC 8259 does not


def _is_utf8_text(s: str) -> bool:
    """No lone surrogate in `s` (ASCII is checked at memory speed; a regex scan would hold the GIL ~10x longer)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_text(value: Any, path: str = "", depth: int = 0) -> None:
    """Refuse the first string (key or value) holding a lone surrogate: valid JSON (a \\ud800 escape), but no
    UTF-8 text, so no tokenizer can take it. Also refuse nesting deeper than MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise MalformedBodyError(f"the request body nests deeper than {MAX_DEPTH} levels (at '{path[:200]}')",
                                 value=depth, param=None)
    if isinstance(value, str):
        if not _is_utf8_text(value):
            raise _bad(path or "body", "is not valid Unicode text (a lone UTF-16 surrogate)")
    elif isinstance(value, dict):
        for k, v in value.items():
            name = f"{path}.{k[:64]}" if path else k[:64]
            if not _is_utf8_text(k):
                raise _bad(path or "body", "has a key that is not valid Unicode text (a lone UTF-16 surrogate)")
            _check_text(v, name, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{path}[{i}]", depth + 1)


def _text_chars(value: Any) -> int:
    """Characters in all strings (keys included) of a JSON value: what the chat template will render."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _text_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


class Body:
    """Typed, range-checked access to a JSON object's fields; each failure is an InvalidRequestError naming the
    field (`prefix` names a nested object, e.g. "messages[2]"). `allowed` is the set of accepted keys: anything
    else is refused, so a typo is not silently ignored."""

    def __init__(self, raw: Any, allowed: frozenset[str], prefix: str = "") -> None:
        self.prefix = prefix
        if not isinstance(raw, dict):
            if prefix:
                raise _bad(prefix, f"must be an object, got {_kind(raw)}", _kind(raw))
            raise MalformedBodyError(f"the request body must be a JSON object, got {_kind(raw)}", value=_kind(raw))
        unknown = sorted(k for k in raw if k not in allowed)
        if unknown:
            raise _bad(self.name(unknown[0][:100]), "unrecognized request argument", unknown[0][:100])
        self.raw = raw

    def name(self, field: str) -> str:
        return f"{self.prefix}.{field}" if self.prefix else field

    def has(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def string(self, name: str, *, required: bool = False, default: str | None = None) -> str | None:
        v = self.raw.get(name)
        if v is None:
            if required:
                raise _bad(self.name(name), "is required")
            return default
        if not isinstance(v, str):
            raise _bad(self.name(name), f"must be a string, got {_kind(v)}", _kind(v))
        return v

    def integer(self, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
        v = self.raw.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):  # bool is an int subclass in Python, not in JSON
            raise _bad(self.name(name), f"must be an integer, got {_kind(v)}", _kind(v))
        if not lo <= v <= hi:
            raise _bad(self.name(name), f"must be in [{lo}, {hi}], got {v if abs(v) < 10**30 else 'a huge number'}",
                       v if abs(v) < 10**30 else None)
        return v

    def number(self, name: str, lo: float, hi: float, default: float, *, open_lo: bool = False) -> float:
        v = self.raw.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _bad(self.name(name), f"must be a number, got {_kind(v)}", _kind(v))
        f = float(v) if not isinstance(v, int) or abs(v) < 10**300 else math.inf
        if not math.isfinite(f) or not (lo < f if open_lo else lo <= f) or f > hi:
            lo_s = f"({lo}" if open_lo else f"[{lo}"
            raise _bad(self.name(name), f"must be a number in {lo_s}, {hi}]", None)
        return f

    def boolean(self, name: str, default: bool) -> bool:
        v = self.raw.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _bad(self.name(name), f"must be a boolean, got {_kind(v)}", _kind(v))
        return v

    def stop(self) -> tuple[str, ...]:
        v = self.raw.get("stop")
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise _bad(self.name("stop"), "must be a non-empty string or an array of non-empty strings")
        if len(items) > MAX_STOP_STRINGS:
            raise _bad(self.name("stop"), f"at most {MAX_STOP_STRINGS} stop strings", len(items))
        return tuple(items)

    def token_ids(self, name: str, vocab: int) -> tuple[int, ...]:
        v = self.raw.get(name)
        if v is None:
            return ()
        if not isinstance(v, list) or not all(_is_token(t, vocab) for t in v):
            raise _bad(self.name(name), f"must be an array of token ids in [0, {vocab})")
        return tuple(v)

    def only(self, name: str, allowed: tuple[Any, ...], why: str) -> None:
        """A known parameter accepted only at its neutral value(s): anything else is an explicit 400."""
        v = self.raw.get(name)
        if v is None or (any(v == a and type(v) is type(a) for a in allowed)):
            return
        raise UnsupportedParameterError(f"'{self.name(name)}': {why}", value=_kind(v), param=self.name(name))


def _is_token(t: Any, vocab: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab


COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                           "stream_options", "n", "user", "presence_penalty", "frequency_penalty",
                           "top_k", "ignore_eos", "stop_token_ids"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                               "tool_choice", "parallel_tool_calls", "response_format"}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@dataclass(frozen=True)
class Generation:
    """A validated generation request: what to submit and how to shape the answer."""

    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool


def _stream_options(body: Body, stream: bool) -> bool:
    raw = body.raw.get("stream_options")
    if raw is None:
        return False
    if not stream:
        raise _bad("stream_options", "is only allowed when 'stream' is true")
    opts = Body(raw, frozenset({"include_usage"}), "stream_options")
    return opts.boolean("include_usage", False)


def _common_params(body: Body, prompt: list[int], max_tokens: int | None, default_max: int, max_len: int,
                   vocab: int, logprobs: bool, prompt_param: str) -> SamplingParams:
    """Sampling parameters shared by both endpoints, with the context-window check OpenAI applies."""
    body.only("n", (1,), "only n=1 is supported")
    body.only("presence_penalty", (0, 0.0), "penalties are not supported (only 0)")
    body.only("frequency_penalty", (0, 0.0), "penalties are not supported (only 0)")
    room = max_len - len(prompt)
    if room < 1:
        n = f"more than {max_len}" if len(prompt) > max_len else str(len(prompt))  # encoding stopped past it
        raise ContextLengthError(f"'{prompt_param}': the prompt has {n} tokens; this model's context "
                                 f"window is {max_len} tokens (prompt + completion)", value=len(prompt),
                                 param=prompt_param)
    if max_tokens is None:
        max_tokens = min(default_max, room)
    elif max_tokens > room:
        raise ContextLengthError(f"this model's context window is {max_len} tokens; you requested {len(prompt)} "
                                 f"prompt + {max_tokens} completion tokens (max_tokens)", value=max_tokens, param="max_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.number("temperature", 0.0, 2.0, 1.0),
        top_p=body.number("top_p", 0.0, 1.0, 1.0, open_lo=True),
        top_k=body.integer("top_k", 0, vocab, 0),
        seed=body.integer("seed", 0, 2**32 - 1),
        stop=body.stop(),
        stop_token_ids=body.token_ids("stop_token_ids", vocab),
        ignore_eos=body.boolean("ignore_eos", False),
        logprobs=logprobs,
    )


def _max_tokens(body: Body, max_len: int, *names: str) -> int | None:
    """The completion length from the first of `names` given; two given with different values is a 400."""
    given = [(name, v) for name in names if (v := body.integer(name, 1, max_len)) is not None]
    if len({v for _, v in given}) > 1:
        (a, va), (b, vb) = given[:2]
        raise _bad(b, f"conflicts with '{a}' ({vb} != {va}); send one of them", vb)
    return given[0][1] if given else None


def _check_model(body: Body, model_name: str) -> None:
    name = body.string("model", required=True)
    if name != model_name:
        raise ModelNotFoundError(f"the model '{name[:100]}' does not exist; this server serves '{model_name}'",
                                 value=name[:100], param="model")


def _tokenizer(engine: Engine, param: str) -> Any:
    if engine.tokenizer is None:
        raise UnsupportedParameterError("this model has no tokenizer: use /v1/completions with token ids",
                                        value=None, param=param)
    return engine.tokenizer


def _check_chars(tokenizer: Any, chars: int, max_len: int, param: str) -> None:
    """Refuse text that cannot fit the window by its length alone, before any of it is tokenized."""
    per_token = tokenizer.max_token_chars
    if per_token is not None and chars > max_len * per_token:
        raise ContextLengthError(f"'{param}': {chars} characters cannot fit this model's context window of {max_len} "
                                 f"tokens (one token covers at most {per_token} characters)", value=chars, param=param)


def _encode_user_text(engine: Engine, text: str, max_len: int) -> list[int]:
    """A prompt string -> ids, special tokens disabled; encoding stops past the window (the caller refuses it)."""
    tok = _tokenizer(engine, "prompt")
    _check_chars(tok, len(text), max_len, "prompt")
    return tok.encode(text, special_tokens=False, limit=max_len)


def parse_completion(raw: Any, engine: Engine, model_name: str, cfg: AppConfig = AppConfig()) -> Generation:
    """Validate a /v1/completions body."""
    body = Body(raw, COMPLETION_FIELDS)
    _check_model(body, model_name)
    body.only("echo", (False,), "echo is not supported")
    body.only("best_of", (1,), "only best_of=1 is supported")
    body.only("suffix", ("",), "suffix is not supported")
    body.string("user")
    vocab, max_len = engine.model_cfg.vocab_size, engine.cfg.max_model_len
    p = body.raw.get("prompt")
    if p is None:
        raise _bad("prompt", "is required")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # the one-element batch forms: ["text"] and [[ids]]
    if isinstance(p, str):
        prompt = _encode_user_text(engine, p, max_len)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < vocab for t in p):
            raise _bad("prompt", f"token ids must be in [0, {vocab})")
        prompt = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise UnsupportedParameterError("'prompt': batched prompts are not supported; send one prompt per request",
                                        value=len(p), param="prompt")
    else:
        raise _bad("prompt", "must be a string, an array of token ids, or a one-element array of either")
    if not prompt:
        raise _bad("prompt", "is empty")
    logprobs = body.integer("logprobs", 0, 5)
    if logprobs:
        raise UnsupportedParameterError("'logprobs': top alternatives are not computed; logprobs=0 returns the "
                                        "sampled tokens' logprobs", value=logprobs, param="logprobs")
    stream = body.boolean("stream", False)
    params = _common_params(body, prompt, _max_tokens(body, max_len, "max_tokens"), DEFAULT_COMPLETION_MAX_TOKENS,
                            max_len, vocab, logprobs is not None, "prompt")
    return Generation(prompt, params, stream, _stream_options(body, stream), logprobs is not None)


def _message_text(msg: Body, i: int) -> str | None:
    content = msg.raw.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            pb = Body(part, frozenset({"type", "text"}), f"messages[{i}].content[{j}]")
            if pb.raw.get("type") != "text":
                raise UnsupportedParameterError(f"'{pb.name('type')}': only 'text' parts are supported",
                                                value=_kind(pb.raw.get("type")), param=pb.name("type"))
            parts.append(pb.string("text", required=True))
        return "".join(parts)
    raise _bad(f"messages[{i}].content", f"must be a string or an array of text parts, got {_kind(content)}")


def _name(b: Body, key: str, *, required: bool = False) -> str | None:
    v = b.string(key, required=required)
    if v is not None and not TOOL_NAME.fullmatch(v):
        raise _bad(b.name(key), "must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", v[:64])
    return v


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Validated `tools`: function tools with well-formed names (they reach the template verbatim)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools", f"must be an array of tool objects, got {_kind(raw)}", _kind(raw))
    if len(raw) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools", len(raw))
    for i, t in enumerate(raw):
        tb = Body(t, frozenset({"type", "function"}), f"tools[{i}]")
        if tb.string("type", required=True) != "function":
            raise _bad(tb.name("type"), "only 'function' tools are supported")
        fb = Body(tb.raw.get("function"), frozenset({"name", "description", "parameters", "strict"}),
                  tb.name("function"))
        _name(fb, "name", required=True)
        fb.string("description")
        fb.boolean("strict", False)
        if fb.has("parameters") and not isinstance(fb.raw["parameters"], dict):
            raise _bad(fb.name("parameters"), "must be a JSON Schema object")
    return raw


def _tool_calls(mb: Body) -> list[Any]:
    calls = mb.raw["tool_calls"]
    if not isinstance(calls, list):
        raise _bad(mb.name("tool_calls"), "must be an array")
    for j, c in enumerate(calls):
        cb = Body(c, frozenset({"id", "type", "function", "index"}), f"{mb.name('tool_calls')}[{j}]")
        cb.string("id")
        if cb.string("type", default="function") != "function":
            raise _bad(cb.name("type"), "only 'function' tool calls are supported")
        fb = Body(cb.raw.get("function"), frozenset({"name", "arguments"}), cb.name("function"))
        _name(fb, "name", required=True)
        fb.string("arguments", required=True)
    return calls


def parse_chat(raw: Any, engine: Engine, model_name: str, cfg: AppConfig = AppConfig()) -> Generation:
    """Validate a /v1/chat/completions body and render its messages with the tokenizer's chat template."""
    body = Body(raw, CHAT_FIELDS)
    _check_model(body, model_name)
    body.string("user")
    body.only("tool_choice", ("auto", "none"), "only 'auto' and 'none' are supported")
    body.only("response_format", ({"type": "text"},), "only {\"type\": \"text\"} is supported")
    body.boolean("parallel_tool_calls", True)
    vocab, max_len = engine.model_cfg.vocab_size, engine.cfg.max_model_len
    msgs = body.raw.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "is required: a non-empty array of message objects")
    messages = []
    for i, m in enumerate(msgs):
        mb = Body(m, MESSAGE_FIELDS, f"messages[{i}]")
        role = mb.string("role", required=True)
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}")
        # OpenAI's newer name for system instructions: the chat templates know only "system"
        out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _message_text(mb, i) or ""}
        if mb.has("name"):
            out["name"] = _name(mb, "name")
        for key in ("tool_call_id", "reasoning_content"):
            if mb.has(key):
                out[key] = mb.string(key)
        if mb.has("tool_calls"):
            out["tool_calls"] = _tool_calls(mb)
        messages.append(out)
    tools = _tools(body.raw.get("tools"))
    tok = _tokenizer(engine, "messages")
    # what the template renders at least once (earlier turns' reasoning may be dropped, so it is not counted)
    rendered = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    _check_chars(tok, _text_chars(rendered) + _text_chars(tools), max_len, "messages")
    prompt = tok.encode_chat(messages, add_generation_prompt=True, tools=tools, limit=max_len)
    top = body.integer("top_logprobs", 0, 20)
    if top:
        raise UnsupportedParameterError("'top_logprobs': top alternatives are not computed; logprobs=true "
                                        "returns the sampled tokens' logprobs", value=top, param="top_logprobs")
    logprobs = body.boolean("logprobs", False)
    stream = body.boolean("stream", False)
    mt = _max_tokens(body, max_len, "max_completion_tokens", "max_tokens")
    params = _common_params(body, prompt, mt, cfg.default_chat_max_tokens, max_len, vocab, logprobs, "messages")
    return Generation(prompt, params, stream, _stream_options(body, stream), logprobs)


# ---- responses ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """How one endpoint shapes its answer (completion text vs chat message)."""

    endpoint: str
    id_prefix: str
    object_name: str
    chunk_object: str
    chat: bool


COMPLETION = Shape("/v1/completions", "cmpl", "text_completion", "text_completion", chat=False)
CHAT = Shape("/v1/chat/completions", "chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


def _usage(end: TokenEvent) -> dict[str, Any]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": end.cached_tokens}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _end_error(end: TokenEvent) -> JaxserveError | None:
    """The error a finished request should report, if it did not end normally."""
    if end.finish_reason == "error":
        return end.error or JaxserveError("the engine failed this request")
    if end.finish_reason == "abort":
        return RequestAbortedError("the engine aborted this request")
    return None


class Admission:
    """At most `limit` generation requests in flight; the next one is refused at once (429), never queued in the
    WSGI layer."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    def enter(self) -> None:
        if not self._free.acquire(blocking=False):
            raise QueueFullError(f"{self.limit} requests in flight (the server's admission limit)", value=self.limit,
                                 param="max_inflight")

    def leave(self) -> None:
        self._free.release()


class DisconnectWatcher:
    """Aborts in the engine the non-streaming requests whose client went away (a stream notices on its next write;
    a blocking request writes nothing until it ends). One polling thread, alive only while something is watched."""

    def __init__(self, abort: Callable[[str], None], poll_s: float = DISCONNECT_POLL_S) -> None:
        self._abort = abort
        self._poll_s = poll_s
        self._watched: dict[str, Callable[[], bool]] = {}
        self._gone: set[str] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, rid: str, disconnected: Callable[[], bool]) -> None:
        with self._lock:
            self._watched[rid] = disconnected
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxserve-disconnects", daemon=True)
                self._thread.start()

    def unwatch(self, rid: str) -> bool:
        """Stop watching; True if the request was aborted because its client disconnected."""
        with self._lock:
            self._watched.pop(rid, None)
            if rid in self._gone:
                self._gone.discard(rid)
                return True
            return False

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
                gone = [rid for rid, disconnected in self._watched.items()
                        if rid not in self._gone and disconnected()]
                self._gone.update(gone)
            for rid in gone:
                self._abort(rid)
            time.sleep(self._poll_s)


def _is_json(content_type: str | None, params: dict[str, str]) -> bool:
    if content_type != "application/json" and not (content_type or "").endswith("+json"):
        return False
    return params.get("charset", "utf-8").lower() in ("utf-8", "utf8")  # RFC 8259: JSON text is UTF-8


def create_app(engine: Engine, model_name: str, cfg: AppConfig | None = None) -> Flask:
    """A Flask app serving `engine` under `model_name` (what clients pass as `model`)."""
    cfg = cfg if cfg is not None else AppConfig(max_inflight=engine.cfg.max_queue)
    app = Flask("jaxserve")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes  # waitress refuses larger bodies first (main.py)
    metrics = ServerMetrics(engine)
    admission = Admission(cfg.max_inflight)
    watcher = DisconnectWatcher(engine.abort)
    created = int(time.time())
    tokenizer = engine.tokenizer

    def token_str(tid: int) -> str:
        return tokenizer.decode([tid]) if tokenizer is not None else ""

    def token_bytes(tid: int) -> list[int] | None:
        if tokenizer is None or not tokenizer.byte_level:
            return None
        return list(tokenizer.token_bytes(tid))

    def logprob_entry(shape: Shape, ev: TokenEvent, offset: int) -> dict[str, Any]:
        if shape.chat:
            return {"token": token_str(ev.token_id), "logprob": ev.logprob, "bytes": token_bytes(ev.token_id),
                    "top_logprobs": []}
        return {"tokens": [token_str(ev.token_id)], "token_logprobs": [ev.logprob], "top_logprobs": None,
                "text_offset": [offset]}

    def parse_json() -> Any:
        if not _is_json(request.mimetype or None, request.mimetype_params):
            got = request.content_type or "none"
            raise NotJsonError(f"the request body must be JSON ('Content-Type: application/json'), got {got[:100]}",
                               value=got[:100], param="Content-Type")
        data = request.get_data(cache=False)
        try:
            raw = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8, bad JSON, >4300-digit ints
            reason = "nesting too deep" if isinstance(e, RecursionError) else str(e)[:200]
            raise MalformedBodyError(f"the request body is not valid JSON: {reason}", value=None, param=None) from e
        _check_text(raw)
        return raw

    def submit(gen: Generation, shape: Shape) -> tuple[str, Iterator[TokenEvent]]:
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        session = request.headers.get("x-session-affinity")
        req = Request(gen.prompt, gen.params, request_id=rid, session_id=session)
        return rid, engine.submit(req)  # raises InvalidRequestError (400) or QueueFullError (429)

    def complete(gen: Generation, shape: Shape, rid: str, events: Iterator[TokenEvent], t0: float) -> Response:
        timer = metrics.timer(t0)
        text: list[str] = []
        lps: list[dict[str, Any]] = []
        offset = 0
        end: TokenEvent | None = None
        disconnected = request.environ.get("waitress.client_disconnected")  # needs channel_request_lookahead > 0
        if disconnected is not None:
            watcher.watch(rid, disconnected)
        try:
            for ev in events:
                if ev.token_id is not None:
                    timer.token()
                    if gen.logprobs:
                        lps.append(logprob_entry(shape, ev, offset))
                    text.append(ev.text)
                    offset += len(ev.text)
                else:
                    end = ev
        finally:
            gone = watcher.unwatch(rid)
            events.close()  # the iterator aborts the request if it did not finish (never leak pages)
        assert end is not None  # the engine always ends a stream with one finish event
        metrics.finished(shape.endpoint, end)
        if gone and end.finish_reason == "abort":
            metrics.disconnect(shape.endpoint)
            return Response(status=499)  # nginx's "client closed request": nobody reads it; /metrics does
        err = _end_error(end)
        if err is not None:
            return error_response(err)
        out = "".join(text)
        if shape.chat:
            lp = {"content": lps} if gen.logprobs else None
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": lp,
                      "finish_reason": end.finish_reason}
        else:
            lp = None
            if gen.logprobs:
                lp = {"tokens": [e["tokens"][0] for e in lps], "token_logprobs": [e["token_logprobs"][0] for e in lps],
                      "top_logprobs": None, "text_offset": [e["text_offset"][0] for e in lps]}
            choice = {"index": 0, "text": out, "logprobs": lp, "finish_reason": end.finish_reason}
        body = {"id": rid, "object": shape.object_name, "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": _usage(end), "system_fingerprint": None}
        return Response(json.dumps(body), mimetype="application/json")

    def stream(gen: Generation, shape: Shape, rid: str, events: Iterator[TokenEvent], t0: float,
               ended: threading.Event) -> Iterator[str]:
        timer = metrics.timer(t0)
        stamp = int(time.time())

        def chunk(delta: dict[str, Any] | str, finish: str | None, lp: Any = None) -> str:
            c: dict[str, Any] = {"index": 0, "logprobs": lp, "finish_reason": finish}
            if shape.chat:
                c["delta"] = delta
            else:
                c["text"] = delta
            obj: dict[str, Any] = {"id": rid, "object": shape.chunk_object, "created": stamp, "model": model_name,
                                   "choices": [c], "system_fingerprint": None}
            if gen.include_usage:
                obj["usage"] = None  # OpenAI: null on every chunk but the last
            return _sse(obj)

        finished = False
        try:
            if shape.chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            offset = 0
            for ev in events:
                if ev.token_id is not None:
                    timer.token()
                    lp = None
                    if gen.logprobs:
                        lp = logprob_entry(shape, ev, offset)
                        lp = {"content": [lp]} if shape.chat else lp
                    offset += len(ev.text)
                    if ev.text or lp is not None:
                        yield chunk({"content": ev.text} if shape.chat else ev.text, None, lp)
                    continue
                finished = True
                ended.set()
                metrics.finished(shape.endpoint, ev)
                err = _end_error(ev)
                if err is not None:
                    yield _sse(error_body(err))  # the status line is long gone: the error travels in-band
                else:
                    yield chunk({} if shape.chat else "", ev.finish_reason)
                    if gen.include_usage:
                        yield _sse({"id": rid, "object": shape.chunk_object, "created": stamp, "model": model_name,
                                    "choices": [], "usage": _usage(ev), "system_fingerprint": None})
            yield "data: [DONE]\n\n"
        except GeneratorExit:
            if not finished:
                metrics.disconnect(shape.endpoint)  # waitress closes the iterator when the client went away
            raise
        finally:
            events.close()  # aborts the engine request and frees its pages if it is still running

    def generate(parse: Callable[[Any, Engine, str, AppConfig], Generation], shape: Shape) -> Response:
        t0 = time.monotonic()
        gen = parse(parse_json(), engine, model_name, cfg)
        admission.enter()  # after validation: a bad request is a 400 even when the server is full
        try:
            rid, events = submit(gen, shape)
        except BaseException:
            admission.leave()
            raise
        if not gen.stream:
            try:
                return complete(gen, shape, rid, events, t0)
            finally:
                admission.leave()
        ended = threading.Event()
        resp = Response(stream(gen, shape, rid, events, t0, ended), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        def closed() -> None:
            if not ended.is_set():
                engine.abort(rid)  # a stream closed before its first chunk never ran the generator's cleanup
            admission.leave()

        resp.call_on_close(closed)
        return resp

    @app.post("/v1/completions")
    def completions() -> Response:
        return generate(parse_completion, COMPLETION)

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        return generate(parse_chat, CHAT)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "jaxserve",
                "max_model_len": engine.cfg.max_model_len}

    @app.get("/v1/models")
    def models() -> Response:
        return Response(json.dumps({"object": "list", "data": [model_card()]}), mimetype="application/json")

    @app.get("/v1/models/<path:name>")
    def model(name: str) -> Response:
        if name != model_name:
            raise ModelNotFoundError(f"the model '{name[:100]}' does not exist", value=name[:100], param="model")
        return Response(json.dumps(model_card()), mimetype="application/json")

    @app.get("/health")
    def health() -> Response:
        s = engine.stats()
        return Response(json.dumps({"status": "ok", "model": model_name, "running": s["running"],
                                    "waiting": s["waiting"]}), mimetype="application/json")

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    spec = openapi_spec(model_name)

    @app.get("/openapi.json")
    def openapi() -> Response:
        return Response(json.dumps(spec), mimetype="application/json")

    @app.errorhandler(JaxserveError)
    def typed_error(err: JaxserveError) -> Response:
        return error_response(err, cfg.retry_after_s)

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException) -> Response:
        kind = "not_found_error" if err.code == 404 else "invalid_request_error"
        body = {"error": {"message": err.description, "type": kind, "param": None, "code": None}}
        return Response(json.dumps(body), status=err.code or 500, mimetype="application/json")

    @app.errorhandler(Exception)
    def unexpected(err: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(JaxserveError(f"internal error: {type(err).__name__}"))

    @app.after_request
    def count(resp: Response) -> Response:
        metrics.request(request.url_rule.rule if request.url_rule else "other", resp.status_code)
        return resp

    return app
