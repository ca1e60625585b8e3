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
from dataclasses import dataclass, field, replace
from typing import Any

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from jaxserve.engine import Engine, Request, SamplingParams, TokenEvent
from jaxserve.engine.structured import StructuredOutput, json_schema_output
from jaxserve.errors import (InvalidRequestError, JaxserveError, NotFoundError, QueueFullError,
                             UnsupportedMediaTypeError, http_status)
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.toolcalls import (GLM_CALL_BEGIN, GLM_CALL_END, GLM_KEY_BEGIN, GLM_KEY_END, GLM_VALUE_BEGIN,
                                       GLM_VALUE_END, KIMI_ARGS_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END,
                                       KIMI_SECTION_BEGIN, KIMI_SECTION_END, ToolSetup, family_of)
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
MAX_N = 16  # choices per request: each is a sequence in the engine
MAX_LOGIT_BIAS = 300  # OpenAI's limit


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
                           "top_k", "ignore_eos", "stop_token_ids", "logit_bias", "repetition_penalty",
                           "min_tokens", "cache_salt"})
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
    n: int = 1
    tools: ToolSetup | None = None  # a chat whose output is parsed for tool calls
    cache_salt: str | None = None  # prefix-cache pages are shared only within one salt

    def tool_parser(self) -> Any:
        """A fresh per-choice tool-call parser, None when the output is plain text."""
        return None if self.tools is None else self.tools.parser()

    def requests(self, rid: str, session: str | None) -> list[Request]:
        """The engine requests of the n choices (choice i samples with seed + i when a seed is given)."""
        if self.n == 1:
            return [Request(self.prompt, self.params, request_id=rid, session_id=session,
                            cache_salt=self.cache_salt)]
        p = self.params
        return [Request(self.prompt, p if p.seed is None else replace(p, seed=(p.seed + i) % 2**32),
                        request_id=f"{rid}-{i}", session_id=session, cache_salt=self.cache_salt)
                for i in range(self.n)]


MAX_CACHE_SALT_CHARS = 1024


def _cache_salt(body: Body) -> str | None:
    """vLLM's `cache_salt`: a non-empty string; prefix-cache pages are shared only among requests with the same
    salt (or none)."""
    salt = body.string("cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise _bad("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                   len(salt))
    return salt


def _stream_options(body: Body, stream: bool) -> bool:
    raw = body.raw.get("stream_options")
    if raw is None:
        return False
    if not stream:
        raise _bad("stream_options", "is only allowed when 'stream' is true")
    opts = Body(raw, frozenset({"include_usage"}), "stream_options")
    return opts.boolean("include_usage", False)


def _common_params(body: Body, prompt: list[int], max_tokens: int | None, default_max: int, max_len: int,
                   vocab: int, logprobs: bool, prompt_param: str, top_logprobs: int = 0,
                   structured: StructuredOutput | None = None) -> SamplingParams:
    """Sampling parameters shared by both endpoints, with the context-window check OpenAI applies."""
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
        presence_penalty=body.number("presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=body.number("frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=body.number("repetition_penalty", 0.0, 2.0, 1.0, open_lo=True),
        logit_bias=_logit_bias(body, vocab),
        min_tokens=body.integer("min_tokens", 0, max_tokens, 0),
        top_logprobs=top_logprobs,
        structured=structured,
    )


def _logit_bias(body: Body, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object from token ids (as strings) to a bias in [-100, 100]."""
    raw = body.raw.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise _bad("logit_bias", f"must be an object mapping token ids to numbers, got {_kind(raw)}", _kind(raw))
    if len(raw) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", len(raw))
    out = []
    for k, v in raw.items():
        if not (k.isascii() and k.isdigit() and len(k) < 12 and int(k) < vocab):
            raise _bad("logit_bias", f"keys must be token ids in [0, {vocab}), got {k[:20]!r}", k[:20])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise _bad(f"logit_bias.{k}", "must be a number in [-100, 100]", None)
        out.append((int(k), float(v)))
    return tuple(out)


def _n(body: Body) -> int:
    return body.integer("n", 1, MAX_N, 1)


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
    stream = body.boolean("stream", False)
    params = _common_params(body, prompt, _max_tokens(body, max_len, "max_tokens"), DEFAULT_COMPLETION_MAX_TOKENS,
                            max_len, vocab, logprobs is not None, "prompt", top_logprobs=logprobs or 0)
    return Generation(prompt, params, stream, _stream_options(body, stream), logprobs is not None, _n(body),
                      cache_salt=_cache_salt(body))


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
    setup = _tool_setup(body, tools, tok, engine.model_cfg.model_type)
    # what the template renders at least once (earlier turns' reasoning may be dropped, so it is not counted)
    rendered = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    _check_chars(tok, _text_chars(rendered) + _text_chars(tools), max_len, "messages")
    prompt = tok.encode_chat(messages, add_generation_prompt=True, tools=tools, limit=max_len)
    logprobs = body.boolean("logprobs", False)
    top = body.integer("top_logprobs", 0, 20, 0)
    if top and not logprobs:
        raise _bad("top_logprobs", "needs 'logprobs': true", top)
    stream = body.boolean("stream", False)
    mt = _max_tokens(body, max_len, "max_completion_tokens", "max_tokens")
    structured = _response_format(body)
    if setup is not None and setup.choice not in ("auto", "none"):
        if structured is not None:
            raise _bad("response_format", "cannot be combined with a 'required' or named tool_choice")
        structured = setup.grammar()  # the output must be the markup of a call
    params = _common_params(body, prompt, mt, cfg.default_chat_max_tokens, max_len, vocab, logprobs, "messages",
                            top_logprobs=top, structured=structured)
    parsed = setup if setup is not None and setup.choice != "none" else None
    return Generation(prompt, params, stream, _stream_options(body, stream), logprobs, _n(body), parsed,
                      cache_salt=_cache_salt(body))


def _tool_setup(body: Body, tools: list[dict[str, Any]] | None, tok: Any, model_type: str) -> ToolSetup | None:
    """tool_choice ("none", "auto", "required" or {"type": "function", "function": {"name"}}) and
    parallel_tool_calls over the validated tools -> how the output is read (None: plain text)."""
    raw = body.raw.get("tool_choice")
    parallel = body.boolean("parallel_tool_calls", True)
    if raw is None:
        choice = "auto"
    elif isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise _bad("tool_choice", "must be 'none', 'auto', 'required' or a function object", raw[:40])
        choice = raw
    else:
        cb = Body(raw, frozenset({"type", "function"}), "tool_choice")
        if cb.string("type", required=True) != "function":
            raise _bad("tool_choice.type", "must be 'function'")
        choice = _name(Body(cb.raw.get("function"), frozenset({"name"}), "tool_choice.function"), "name",
                       required=True)
    if not tools:
        if choice not in ("auto", "none"):
            raise _bad("tool_choice", "needs 'tools'")
        return None
    names = {t["function"]["name"] for t in tools}
    if choice not in ("none", "auto", "required") and choice not in names:
        raise _bad("tool_choice.function.name", f"'{choice}' is not one of the request's tools", choice)
    family = family_of(tok.chat_template, model_type)
    markers = (KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_ARGS_BEGIN, KIMI_CALL_END,
               GLM_CALL_BEGIN, GLM_CALL_END, GLM_KEY_BEGIN, GLM_KEY_END, GLM_VALUE_BEGIN, GLM_VALUE_END)
    special = {m: i for m in markers if (i := tok.token_to_id(m)) is not None and i in tok.special_token_ids}
    return ToolSetup(family, tuple(tools), choice, parallel, special)


def _response_format(body: Body) -> StructuredOutput | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}} (enforced by constrained decoding either way)."""
    raw = body.raw.get("response_format")
    if raw is None:
        return None
    rb = Body(raw, frozenset({"type", "json_schema"}), "response_format")
    kind = rb.string("type", required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", param="response_format")
    if kind != "json_schema":
        raise _bad("response_format.type", "must be 'text', 'json_object' or 'json_schema'", kind[:40])
    sb = Body(rb.raw.get("json_schema"), frozenset({"name", "schema", "strict", "description"}),
              "response_format.json_schema")
    name = sb.string("name", required=True)
    if not TOOL_NAME.fullmatch(name):
        raise _bad(sb.name("name"), "must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", name[:64])
    sb.string("description")
    sb.boolean("strict", False)
    schema = sb.raw.get("schema")
    if schema is None:
        schema = {}  # OpenAI: an absent schema accepts any JSON
    if not isinstance(schema, dict):
        raise _bad(sb.name("schema"), f"must be a JSON Schema object, got {_kind(schema)}", _kind(schema))
    return json_schema_output(schema, "response_format.json_schema.schema")


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


def _usage(ends: list[TokenEvent]) -> dict[str, Any]:
    """Usage of a request's choices: the prompt counts once (its first choice's), completions add up."""
    first = ends[0]
    completion = sum(e.completion_tokens for e in ends)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


@dataclass
class Choice:
    """One choice's answer as it accumulates. parser: the tool-call parser of a chat with tools, else None."""

    parser: Any = None
    text: list[str] = field(default_factory=list)
    lps: list[dict[str, Any]] = field(default_factory=list)
    offset: int = 0
    end: TokenEvent | None = None


def _indexed(events: Iterator[TokenEvent]) -> Iterator[tuple[int, TokenEvent]]:
    """One request's events as choice 0's."""
    try:
        for ev in events:
            yield 0, ev
    finally:
        events.close()


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
        self._aborts: dict[str, Callable[[str], None]] = {}
        self._gone: set[str] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, rid: str, disconnected: Callable[[], bool],
              abort: Callable[[str], None] | None = None) -> None:
        """Watch `rid`; `abort` (default: the engine's abort of rid) ends it when its client goes away."""
        with self._lock:
            self._watched[rid] = disconnected
            if abort is not None:
                self._aborts[rid] = abort
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxserve-disconnects", daemon=True)
                self._thread.start()

    def unwatch(self, rid: str) -> bool:
        """Stop watching; True if the request was aborted because its client disconnected."""
        with self._lock:
            self._watched.pop(rid, None)
            self._aborts.pop(rid, None)
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
                with self._lock:
                    abort = self._aborts.get(rid, self._abort)
                abort(rid)
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
                    "top_logprobs": [{"token": token_str(t), "logprob": lp, "bytes": token_bytes(t)}
                                     for t, lp in ev.top_logprobs]}
        top = {token_str(t): lp for t, lp in ev.top_logprobs} if ev.top_logprobs else None
        return {"tokens": [token_str(ev.token_id)], "token_logprobs": [ev.logprob], "top_logprobs": [top],
                "text_offset": [offset]}

    def completion_logprobs(entries: list[dict[str, Any]], top: bool) -> dict[str, Any]:
        return {"tokens": [e["tokens"][0] for e in entries], "token_logprobs": [e["token_logprobs"][0] for e in entries],
                "top_logprobs": [e["top_logprobs"][0] for e in entries] if top else None,
                "text_offset": [e["text_offset"][0] for e in entries]}

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

    def submit(gen: Generation, shape: Shape) -> tuple[str, list[str], Iterator[tuple[int, TokenEvent]]]:
        """-> (response id, engine request ids, events as (choice index, event))."""
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        reqs = gen.requests(rid, request.headers.get("x-session-affinity"))
        # raises InvalidRequestError (400) or QueueFullError (429)
        if len(reqs) == 1:
            one = engine.submit(reqs[0])
            return rid, [rid], _indexed(one)
        return rid, [r.request_id for r in reqs], engine.submit_group(reqs)

    def abort_all(ids: list[str]) -> Callable[[str], None]:
        return lambda _rid: [engine.abort(i) for i in ids]

    def complete(gen: Generation, shape: Shape, rid: str, ids: list[str], events: Iterator[tuple[int, TokenEvent]],
                 t0: float) -> Response:
        timer = metrics.timer(t0)
        choices = [Choice(gen.tool_parser()) for _ in range(gen.n)]
        disconnected = request.environ.get("waitress.client_disconnected")  # needs channel_request_lookahead > 0
        if disconnected is not None:
            watcher.watch(rid, disconnected, abort_all(ids))
        try:
            for i, ev in events:
                c = choices[i]
                if ev.token_id is not None:
                    timer.token()
                    if gen.logprobs:
                        c.lps.append(logprob_entry(shape, ev, c.offset))
                    c.text.append(ev.text)
                    c.offset += len(ev.text)
                else:
                    c.end = ev
        finally:
            gone = watcher.unwatch(rid)
            events.close()  # the iterator aborts the requests that did not finish (never leak pages)
        ends = [c.end for c in choices]
        assert all(e is not None for e in ends)  # the engine always ends a stream with one finish event
        for e in ends:
            metrics.finished(shape.endpoint, e)
        if gone and any(e.finish_reason == "abort" for e in ends):
            metrics.disconnect(shape.endpoint)
            return Response(status=499)  # nginx's "client closed request": nobody reads it; /metrics does
        for e in ends:
            err = _end_error(e)
            if err is not None:
                return error_response(err)
        out_choices = []
        for i, c in enumerate(choices):
            out = "".join(c.text)
            if shape.chat:
                message: dict[str, Any] = {"role": "assistant", "content": out}
                finish = c.end.finish_reason
                if c.parser is not None:
                    # invalid markup raises ToolCallParseError (500, reported, never text); an output cut at the
                    # token limit keeps "length" and its complete calls, the unfinished one dropped
                    parsed = c.parser.parse_all(out, truncated=finish == "length")
                    message["content"] = parsed.content or None if parsed.calls else parsed.content
                    if parsed.calls:
                        message["tool_calls"] = [call.openai() for call in parsed.calls]
                        finish = "tool_calls" if finish == "stop" else finish
                lp = {"content": c.lps} if gen.logprobs else None
                out_choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                lp = completion_logprobs(c.lps, gen.params.top_logprobs > 0) if gen.logprobs else None
                out_choices.append({"index": i, "text": out, "logprobs": lp, "finish_reason": c.end.finish_reason})
        body = {"id": rid, "object": shape.object_name, "created": int(time.time()), "model": model_name,
                "choices": out_choices, "usage": _usage(ends), "system_fingerprint": None}
        return Response(json.dumps(body), mimetype="application/json")

    def stream(gen: Generation, shape: Shape, rid: str, events: Iterator[tuple[int, TokenEvent]], t0: float,
               ended: threading.Event) -> Iterator[str]:
        timer = metrics.timer(t0)
        stamp = int(time.time())

        def chunk(i: int, delta: dict[str, Any] | str, finish: str | None, lp: Any = None) -> str:
            c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": finish}
            if shape.chat:
                c["delta"] = delta
            else:
                c["text"] = delta
            obj: dict[str, Any] = {"id": rid, "object": shape.chunk_object, "created": stamp, "model": model_name,
                                   "choices": [c], "system_fingerprint": None}
            if gen.include_usage:
                obj["usage"] = None  # OpenAI: null on every chunk but the last
            return _sse(obj)

        choices = [Choice(gen.tool_parser()) for _ in range(gen.n)]
        finished = False
        try:
            if shape.chat:
                for i in range(gen.n):
                    yield chunk(i, {"role": "assistant", "content": ""}, None)
            for i, ev in events:
                c = choices[i]
                if ev.token_id is not None:
                    timer.token()
                    lp = None
                    if gen.logprobs:
                        lp = logprob_entry(shape, ev, c.offset)
                        lp = {"content": [lp]} if shape.chat else lp
                    c.offset += len(ev.text)
                    if c.parser is not None:
                        text, calls = c.parser.push(ev.text)
                        if text or calls or lp is not None:
                            delta: dict[str, Any] = {"content": text}
                            if calls:
                                delta["tool_calls"] = calls
                            yield chunk(i, delta, None, lp)
                    elif ev.text or lp is not None:
                        yield chunk(i, {"content": ev.text} if shape.chat else ev.text, None, lp)
                    continue
                c.end = ev
                metrics.finished(shape.endpoint, ev)
                err = _end_error(ev)
                if err is not None:
                    finished = True
                    ended.set()
                    yield _sse(error_body(err))  # the status line is long gone: the error travels in-band
                    break
                finish = ev.finish_reason
                if c.parser is not None:
                    # raises ToolCallParseError: reported in-band below; cut at max_tokens: the unfinished call is
                    # dropped and the finish reason stays "length"
                    text, calls = c.parser.finish(truncated=finish == "length")
                    if text or calls:
                        delta = {"content": text}
                        if calls:
                            delta["tool_calls"] = calls
                        yield chunk(i, delta, None)
                    if c.parser.calls and finish == "stop":
                        finish = "tool_calls"
                yield chunk(i, {} if shape.chat else "", finish)
                if all(x.end is not None for x in choices):
                    finished = True
                    ended.set()
                    if gen.include_usage:
                        yield _sse({"id": rid, "object": shape.chunk_object, "created": stamp, "model": model_name,
                                    "choices": [], "usage": _usage([x.end for x in choices]),
                                    "system_fingerprint": None})
            yield "data: [DONE]\n\n"
        except JaxserveError as err:
            finished = True
            ended.set()
            yield _sse(error_body(err))
            yield "data: [DONE]\n\n"
        except GeneratorExit:
            if not finished:
                metrics.disconnect(shape.endpoint)  # waitress closes the iterator when the client went away
            raise
        finally:
            events.close()  # aborts the engine requests and frees their pages if they are still running

    def generate(parse: Callable[[Any, Engine, str, AppConfig], Generation], shape: Shape) -> Response:
        t0 = time.monotonic()
        gen = parse(parse_json(), engine, model_name, cfg)
        admission.enter()  # after validation: a bad request is a 400 even when the server is full
        try:
            rid, ids, events = submit(gen, shape)
        except BaseException:
            admission.leave()
            raise
        if not gen.stream:
            try:
                return complete(gen, shape, rid, ids, events, t0)
            finally:
                admission.leave()
        ended = threading.Event()
        resp = Response(stream(gen, shape, rid, events, t0, ended), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        def closed() -> None:
            if not ended.is_set():
                for i in ids:
                    engine.abort(i)  # a stream closed before its first chunk never ran the generator's cleanup
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
