"""The OpenAI request protocol: a /v1/completions or /v1/chat/completions body -> a `Generation`.

Each body is validated field by field before anything reaches the engine, so a bad request is refused with a 400
naming the field and never touches the scheduler. The body must name the served model (404 `model_not_found`) and
fit the context window by its character count before it is tokenized, then by its token count (tokenization stops
at the window). User text is encoded with special tokens disabled: only the chat template writes control tokens.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from jaxserve.engine import Engine, Request, SamplingParams
from jaxserve.engine.structured import StructuredOutput, json_schema_output
from jaxserve.errors import ContextLengthError, ModelNotFoundError, UnsupportedParameterError
from jaxserve.server.body import Body, field_error, json_kind
from jaxserve.server.limits import (DEFAULT_COMPLETION_MAX_TOKENS, MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_N,
                                    MAX_TOOLS, AppConfig)
from jaxserve.server.toolcalls import (GLM_CALL_BEGIN, GLM_CALL_END, GLM_KEY_BEGIN, GLM_KEY_END, GLM_VALUE_BEGIN,
                                       GLM_VALUE_END, KIMI_ARGS_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END,
                                       KIMI_SECTION_BEGIN, KIMI_SECTION_END, ToolCallParser, ToolSetup,
                                       family_of)

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function (and participant) names

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
    """A validated generation request, what the handlers consume: the prompt's token ids, the sampling parameters,
    how to shape the answer (stream, usage chunk, logprobs, n choices, tool calls) and the prefix-cache salt."""

    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    n: int = 1
    tools: ToolSetup | None = None  # a chat whose output is parsed for tool calls
    cache_salt: str | None = None  # prefix-cache pages are shared only within one salt

    def tool_parser(self) -> ToolCallParser | None:
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


def _text_chars(value: Any) -> int:
    """Characters in all strings (keys included) of a JSON value: what the chat template will render."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _text_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def _cache_salt(body: Body) -> str | None:
    """vLLM's `cache_salt`: a non-empty string; prefix-cache pages are shared only among requests with the same
    salt (or none)."""
    salt = body.string("cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise field_error("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                          len(salt))
    return salt


def _stream_options(body: Body, stream: bool) -> bool:
    raw = body.raw.get("stream_options")
    if raw is None:
        return False
    if not stream:
        raise field_error("stream_options", "is only allowed when 'stream' is true")
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
        raise field_error("logit_bias", f"must be an object mapping token ids to numbers, got {json_kind(raw)}",
                          json_kind(raw))
    if len(raw) > MAX_LOGIT_BIAS:
        raise field_error("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", len(raw))
    out = []
    for k, v in raw.items():
        if not (k.isascii() and k.isdigit() and len(k) < 12 and int(k) < vocab):
            raise field_error("logit_bias", f"keys must be token ids in [0, {vocab}), got {k[:20]!r}", k[:20])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise field_error(f"logit_bias.{k}", "must be a number in [-100, 100]", None)
        out.append((int(k), float(v)))
    return tuple(out)


def _n(body: Body) -> int:
    return body.integer("n", 1, MAX_N, 1)


def _max_tokens(body: Body, max_len: int, *names: str) -> int | None:
    """The completion length from the first of `names` given; two given with different values is a 400."""
    given = [(name, v) for name in names if (v := body.integer(name, 1, max_len)) is not None]
    if len({v for _, v in given}) > 1:
        (a, va), (b, vb) = given[:2]
        raise field_error(b, f"conflicts with '{a}' ({vb} != {va}); send one of them", vb)
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
        raise field_error("prompt", "is required")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # the one-element batch forms: ["text"] and [[ids]]
    if isinstance(p, str):
        prompt = _encode_user_text(engine, p, max_len)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < vocab for t in p):
            raise field_error("prompt", f"token ids must be in [0, {vocab})")
        prompt = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise UnsupportedParameterError("'prompt': batched prompts are not supported; send one prompt per request",
                                        value=len(p), param="prompt")
    else:
        raise field_error("prompt", "must be a string, an array of token ids, or a one-element array of either")
    if not prompt:
        raise field_error("prompt", "is empty")
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
                                                value=json_kind(pb.raw.get("type")), param=pb.name("type"))
            parts.append(pb.string("text", required=True))
        return "".join(parts)
    raise field_error(f"messages[{i}].content", f"must be a string or an array of text parts, got {json_kind(content)}")


def _name(b: Body, key: str, *, required: bool = False) -> str | None:
    v = b.string(key, required=required)
    if v is not None and not TOOL_NAME.fullmatch(v):
        raise field_error(b.name(key), "must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", v[:64])
    return v


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Validated `tools`: function tools with well-formed names (they reach the template verbatim)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise field_error("tools", f"must be an array of tool objects, got {json_kind(raw)}", json_kind(raw))
    if len(raw) > MAX_TOOLS:
        raise field_error("tools", f"at most {MAX_TOOLS} tools", len(raw))
    for i, t in enumerate(raw):
        tb = Body(t, frozenset({"type", "function"}), f"tools[{i}]")
        if tb.string("type", required=True) != "function":
            raise field_error(tb.name("type"), "only 'function' tools are supported")
        fb = Body(tb.raw.get("function"), frozenset({"name", "description", "parameters", "strict"}),
                  tb.name("function"))
        _name(fb, "name", required=True)
        fb.string("description")
        fb.boolean("strict", False)
        if fb.has("parameters") and not isinstance(fb.raw["parameters"], dict):
            raise field_error(fb.name("parameters"), "must be a JSON Schema object")
    return raw


def _tool_calls(mb: Body) -> list[Any]:
    calls = mb.raw["tool_calls"]
    if not isinstance(calls, list):
        raise field_error(mb.name("tool_calls"), "must be an array")
    for j, c in enumerate(calls):
        cb = Body(c, frozenset({"id", "type", "function", "index"}), f"{mb.name('tool_calls')}[{j}]")
        cb.string("id")
        if cb.string("type", default="function") != "function":
            raise field_error(cb.name("type"), "only 'function' tool calls are supported")
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
        raise field_error("messages", "is required: a non-empty array of message objects")
    messages = []
    for i, m in enumerate(msgs):
        mb = Body(m, MESSAGE_FIELDS, f"messages[{i}]")
        role = mb.string("role", required=True)
        if role not in ROLES:
            raise field_error(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}")
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
        raise field_error("top_logprobs", "needs 'logprobs': true", top)
    stream = body.boolean("stream", False)
    mt = _max_tokens(body, max_len, "max_completion_tokens", "max_tokens")
    structured = _response_format(body)
    if setup is not None and setup.choice not in ("auto", "none"):
        if structured is not None:
            raise field_error("response_format", "cannot be combined with a 'required' or named tool_choice")
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
            raise field_error("tool_choice", "must be 'none', 'auto', 'required' or a function object", raw[:40])
        choice = raw
    else:
        cb = Body(raw, frozenset({"type", "function"}), "tool_choice")
        if cb.string("type", required=True) != "function":
            raise field_error("tool_choice.type", "must be 'function'")
        choice = _name(Body(cb.raw.get("function"), frozenset({"name"}), "tool_choice.function"), "name",
                       required=True)
    if not tools:
        if choice not in ("auto", "none"):
            raise field_error("tool_choice", "needs 'tools'")
        return None
    names = {t["function"]["name"] for t in tools}
    if choice not in ("none", "auto", "required") and choice not in names:
        raise field_error("tool_choice.function.name", f"'{choice}' is not one of the request's tools", choice)
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
        raise field_error("response_format.type", "must be 'text', 'json_object' or 'json_schema'", kind[:40])
    sb = Body(rb.raw.get("json_schema"), frozenset({"name", "schema", "strict", "description"}),
              "response_format.json_schema")
    name = sb.string("name", required=True)
    if not TOOL_NAME.fullmatch(name):
        raise field_error(sb.name("name"), "must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", name[:64])
    sb.string("description")
    sb.boolean("strict", False)
    schema = sb.raw.get("schema")
    if schema is None:
        schema = {}  # OpenAI: an absent schema accepts any JSON
    if not isinstance(schema, dict):
        raise field_error(sb.name("schema"), f"must be a JSON Schema object, got {json_kind(schema)}",
                          json_kind(schema))
    return json_schema_output(schema, "response_format.json_schema.schema")

