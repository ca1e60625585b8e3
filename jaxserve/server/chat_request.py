"""The chat request: a /v1/chat/completions body -> a `Generation`.

Messages (OpenAI's, including the legacy `function` role and assistant `function_call`), tools (or the legacy
`functions` / `function_call`), tool_choice and response_format are validated field by field; the messages are
rendered by the checkpoint's own chat template with the request's `chat_template_kwargs` (`reasoning_effort`
none/minimal turns thinking off). A thinking template's output is split into reasoning and content
(`server.reasoning`); a response_format or forced tool call then constrains only what follows the thinking.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxserve.engine import Engine
from jaxserve.engine.structured import StructuredOutput, json_schema_output
from jaxserve.errors import UnsupportedParameterError
from jaxserve.server.body import Body, UnknownFields, field_error, json_kind
from jaxserve.server.fields import CHAT_FIELDS, MESSAGE_FIELDS, NO_THINKING, read_extras
from jaxserve.server.limits import MAX_TOOLS, AppConfig
from jaxserve.server.protocol import (Generation, cache_salt, check_chars, check_model, choices_n, common_params,
                                      max_tokens_of, stream_options, tokenizer_of)
from jaxserve.server.reasoning import THINK_BEGIN, THINK_END, ReasoningSetup
from jaxserve.server.toolcalls import (GLM_CALL_BEGIN, GLM_CALL_END, GLM_KEY_BEGIN, GLM_KEY_END, GLM_VALUE_BEGIN,
                                       GLM_VALUE_END, KIMI_ARGS_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END,
                                       KIMI_SECTION_BEGIN, KIMI_SECTION_END, ToolSetup, family_of)

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function (and participant) names
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})


def _text_chars(value: Any) -> int:
    """Characters in all strings (keys included) of a JSON value: what the chat template will render."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _text_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def _message_text(msg: Body, i: int) -> str | None:
    content = msg.raw.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            pb = msg.child(part, frozenset({"type", "text"}), f"messages[{i}].content[{j}]")
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


def _tools(body: Body) -> list[dict[str, Any]] | None:
    """Validated `tools` (or the legacy `functions`): function tools with well-formed names (they reach the
    template verbatim)."""
    raw = body.raw.get("tools")
    if body.has("functions"):
        if raw is not None:
            raise field_error("functions", "is the legacy form of 'tools': send one of them")
        if not isinstance(body.raw["functions"], list):
            raise field_error("functions", "must be an array of function objects")
        raw = [{"type": "function", "function": f} for f in body.raw["functions"]]
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise field_error("tools", f"must be an array of tool objects, got {json_kind(raw)}", json_kind(raw))
    if len(raw) > MAX_TOOLS:
        raise field_error("tools", f"at most {MAX_TOOLS} tools", len(raw))
    for i, t in enumerate(raw):
        tb = body.child(t, frozenset({"type", "function"}), f"tools[{i}]")
        if tb.string("type", required=True) != "function":
            raise field_error(tb.name("type"), "only 'function' tools are supported")
        fb = tb.child(tb.raw.get("function"), frozenset({"name", "description", "parameters", "strict"}),
                      tb.name("function"))
        _name(fb, "name", required=True)
        fb.string("description")
        fb.boolean("strict", False)
        if fb.has("parameters") and not isinstance(fb.raw["parameters"], dict):
            raise field_error(fb.name("parameters"), "must be a JSON Schema object")
    return raw


def _tool_calls(mb: Body, calls: Any) -> list[Any]:
    if not isinstance(calls, list):
        raise field_error(mb.name("tool_calls"), "must be an array")
    for j, c in enumerate(calls):
        cb = mb.child(c, frozenset({"id", "type", "function", "index"}), f"{mb.name('tool_calls')}[{j}]")
        cb.string("id")
        if cb.string("type", default="function") != "function":
            raise field_error(cb.name("type"), "only 'function' tool calls are supported")
        fb = cb.child(cb.raw.get("function"), frozenset({"name", "arguments"}), cb.name("function"))
        _name(fb, "name", required=True)
        fb.string("arguments", required=True)
    return calls


def _messages(body: Body) -> list[dict[str, Any]]:
    """The validated `messages`, as the chat template reads them."""
    msgs = body.raw.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise field_error("messages", "is required: a non-empty array of message objects")
    messages = []
    for i, m in enumerate(msgs):
        mb = body.child(m, MESSAGE_FIELDS, f"messages[{i}]")
        role = mb.string("role", required=True)
        if role not in ROLES:
            raise field_error(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}")
        mb.string("refusal")
        # OpenAI's newer name for system instructions (the chat templates know only "system"); a legacy function
        # result is a tool result
        out: dict[str, Any] = {"role": {"developer": "system", "function": "tool"}.get(role, role),
                               "content": _message_text(mb, i) or ""}
        if mb.has("name"):
            out["name"] = _name(mb, "name")
        for key in ("tool_call_id", "reasoning_content"):
            if mb.has(key):
                out[key] = mb.string(key)
        if mb.has("function_call"):  # a legacy assistant call: the one tool call of its turn
            out["tool_calls"] = _tool_calls(mb, [{"id": "call_0", "type": "function",
                                                  "function": mb.raw["function_call"]}])
        if mb.has("tool_calls"):
            out["tool_calls"] = _tool_calls(mb, mb.raw["tool_calls"])
        messages.append(out)
    return messages


def _template_variables(body: Body, effort: str | None) -> dict[str, Any]:
    """`chat_template_kwargs` for the template (e.g. {"thinking": false}); a reasoning_effort of none/minimal
    turns thinking off under both families' names for it, unless the request set them."""
    raw = body.obj("chat_template_kwargs") or {}
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & set(raw)
    if reserved:
        raise field_error(f"chat_template_kwargs.{min(reserved)}", "is set by the server")
    variables = dict(raw)
    if effort is not None:
        variables.setdefault("reasoning_effort", effort)
        if effort in NO_THINKING:
            variables.setdefault("thinking", False)
            variables.setdefault("enable_thinking", False)
    return variables


def _reasoning(body: Body, tok: Any, prompt: list[int], tools: ToolSetup | None) -> ReasoningSetup | None:
    """How the output of a thinking model splits, from what the template rendered last (None: not a thinking
    template, or thinking off)."""
    if THINK_BEGIN not in (tok.chat_template or ""):
        return None
    setup = ReasoningSetup.of(tok.decode(prompt[-8:]))
    if setup is None:
        return None
    special = {m: i for m in (THINK_BEGIN, THINK_END)
               if (i := tok.token_to_id(m)) is not None and i in tok.special_token_ids}
    return ReasoningSetup(setup.opened, tools.start_marker() if tools is not None else "", special)


def _thinking_budget(body: Body, tok: Any, reasoning: ReasoningSetup | None, max_len: int
                     ) -> tuple[int, tuple[int, ...]] | None:
    """`max_thinking_tokens` -> the engine's thinking_budget (N, the ids of `</think>`: its special token, else its
    text's tokens). Ignored with thinking off (nothing to bound); refused when the template leaves `<think>` to the
    model (the budget counts from an open block)."""
    n = body.integer("max_thinking_tokens", 0, max_len)
    if n is None or reasoning is None:
        return None
    if not reasoning.opened:
        raise UnsupportedParameterError("'max_thinking_tokens' needs a chat template that opens the thinking block "
                                        "itself; this one leaves <think> to the model", value=n,
                                        param="max_thinking_tokens")
    special = reasoning.special.get(THINK_END)
    return n, (special,) if special is not None else tuple(tok.encode(THINK_END, special_tokens=False))


def parse_chat(raw: Any, engine: Engine, model_name: str, cfg: AppConfig = AppConfig()) -> Generation:
    """Validate a /v1/chat/completions body and render its messages with the tokenizer's chat template."""
    body = Body(raw, CHAT_FIELDS, unknown=UnknownFields(cfg.strict_fields))
    check_model(body, model_name)
    extras = read_extras(body)
    vocab, max_len = engine.model_cfg.vocab_size, engine.cfg.max_model_len
    messages = _messages(body)
    tools = _tools(body)
    tok = tokenizer_of(engine, "messages")
    setup = _tool_setup(body, tools, tok, engine.model_cfg.model_type)
    variables = _template_variables(body, extras.effort)
    # what the template renders at least once (earlier turns' reasoning may be dropped, so it is not counted)
    rendered = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    check_chars(tok, _text_chars(rendered) + _text_chars(tools) + _text_chars(variables), max_len, "messages")
    prompt = tok.encode_chat(messages, add_generation_prompt=True, tools=tools, limit=max_len, variables=variables)
    logprobs = body.boolean("logprobs", False)
    top = body.integer("top_logprobs", 0, 20, 0)
    if top and not logprobs:
        raise field_error("top_logprobs", "needs 'logprobs': true", top)
    stream = body.boolean("stream", False)
    mt = max_tokens_of(body, max_len, "max_completion_tokens", "max_tokens")
    parsed = setup if setup is not None and setup.choice != "none" else None
    reasoning = _reasoning(body, tok, prompt, parsed)
    params = common_params(body, prompt, mt, cfg.default_chat_max_tokens, max_len, vocab, logprobs, "messages",
                           top_logprobs=top, structured=_structured(body, setup, reasoning))
    params = dataclasses.replace(params, thinking_budget=_thinking_budget(body, tok, reasoning, max_len))
    return Generation(prompt, params, stream, stream_options(body, stream), logprobs, choices_n(body), parsed,
                      cache_salt=cache_salt(body), reasoning=reasoning, extras=extras,
                      ignored=tuple(body.unknown.names))


def _structured(body: Body, setup: ToolSetup | None, reasoning: ReasoningSetup | None) -> StructuredOutput | None:
    """The output's grammar: response_format or a forced tool call, after the thinking block if there is one."""
    structured = _response_format(body)
    if setup is not None and setup.choice not in ("auto", "none"):
        if structured is not None:
            raise field_error("response_format", "cannot be combined with a 'required' or named tool_choice")
        structured = setup.grammar()  # the output must be the markup of a call
    return structured if reasoning is None else reasoning.grammar(structured)


def _tool_setup(body: Body, tools: list[dict[str, Any]] | None, tok: Any, model_type: str) -> ToolSetup | None:
    """tool_choice ("none", "auto", "required" or {"type": "function", "function": {"name"}}) and
    parallel_tool_calls over the validated tools -> how the output is read (None: plain text)."""
    raw = body.raw.get("tool_choice")
    if body.has("function_call"):  # the legacy form: "none", "auto" or {"name"}
        legacy = body.raw["function_call"]
        raw = legacy if isinstance(legacy, str) else {"type": "function", "function": legacy}
    parallel = body.boolean("parallel_tool_calls", True)
    if raw is None:
        choice = "auto"
    elif isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise field_error("tool_choice", "must be 'none', 'auto', 'required' or a function object", raw[:40])
        choice = raw
    else:
        cb = body.child(raw, frozenset({"type", "function"}), "tool_choice")
        if cb.string("type", required=True) != "function":
            raise field_error("tool_choice.type", "must be 'function'")
        choice = _name(cb.child(cb.raw.get("function"), frozenset({"name"}), "tool_choice.function"), "name",
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
    rb = body.child(raw, frozenset({"type", "json_schema"}), "response_format")
    kind = rb.string("type", required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", param="response_format")
    if kind != "json_schema":
        raise field_error("response_format.type", "must be 'text', 'json_object' or 'json_schema'", kind[:40])
    sb = rb.child(rb.raw.get("json_schema"), frozenset({"name", "schema", "strict", "description"}),
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

