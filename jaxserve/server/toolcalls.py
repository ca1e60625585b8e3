"""Tool calls: the Kimi K2 and GLM markup a model writes, parsed into OpenAI `tool_calls`, and grammars that force it.

Formats (as the models' own chat templates render assistant tool calls, and as the reference parsers read them:
vLLM `tool_parsers/kimi_k2_tool_parser.py` and `glm4_moe_tool_parser.py` / `glm47_moe_tool_parser.py`, SGLang
`function_call/kimik2_detector.py` and `glm4_moe_detector.py`; Kimi-K2-Instruct `tokenizer_config.json` chat template
and its docs/tool_call_guidance.md; GLM-4.5 / GLM-4.7 `chat_template.jinja`):

  Kimi K2:  <|tool_calls_section_begin|>
            <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|>
            ... more calls ...
            <|tool_calls_section_end|>
            The call id is the string before <|tool_call_argument_begin|> ("functions.NAME:IDX"); the template renders
            a tool result as "## Return of ID" + content, so the id goes back to the client unchanged, unless an
            earlier call of the same output has it (clients key tool results by id): then IDX becomes the call's
            position in the output (or the next index no earlier call has).
  GLM:      <tool_call>NAME
            <arg_key>KEY</arg_key>
            <arg_value>VALUE</arg_value>
            ...
            </tool_call>
            (GLM-4.7 / 5 drop the newlines.) A value is raw text when the tool's schema types that parameter as a
            string, JSON otherwise. Calls get fresh ids ("call_" + 24 hex digits).

The code is our own. Invalid markup (an unknown tool, arguments that are not a JSON object, an unterminated call) is
a `ToolCallParseError` (reported to the client), never silently passed on as text. An output cut by the token limit
(finish_reason "length") is not invalid: its complete calls stand and the unfinished last one is returned as far as
it was written (its name and partial argument text, as OpenAI does), or dropped while its name is still unfinished.

`ToolSetup.grammar()` writes a Lark grammar (llguidance's dialect, engine.structured) that admits exactly the markup
of one call (a named tool_choice, or parallel_tool_calls=false) or of one or more calls (tool_choice "required"),
each tool's arguments constrained by its parameter schema (`%json`). A marker that is a special token of the
tokenizer is written as that token (`<[id]>`), otherwise as text (the embedded tiny tokenizer has no tool tokens).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from jaxserve.engine.structured import JSON_OPTIONS, StructuredOutput
from jaxserve.errors import JaxserveError

Family = Literal["kimi", "glm"]

KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGS_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
GLM_CALL_BEGIN = "<tool_call>"
GLM_CALL_END = "</tool_call>"
GLM_KEY_BEGIN, GLM_KEY_END = "<arg_key>", "</arg_key>"
GLM_VALUE_BEGIN, GLM_VALUE_END = "<arg_value>", "</arg_value>"

_KIMI_ID = re.compile(r"\s*((?:functions\.)?([A-Za-z0-9_.\-]+?):(\d+))\s*")
_GLM_NAME_DONE = re.compile(r"\s*\S+\s")  # a GLM call's name, then the newline that ends it
_GLM_PARTIAL_ARG = re.compile(re.escape(GLM_KEY_BEGIN) + r"(.*?)(?:" + re.escape(GLM_KEY_END) + r"\s*(?:"
                              + re.escape(GLM_VALUE_BEGIN) + r"(.*))?)?", re.DOTALL)
_GLM_ARG = re.compile(re.escape(GLM_KEY_BEGIN) + r"(.*?)" + re.escape(GLM_KEY_END) + r"\s*"
                      + re.escape(GLM_VALUE_BEGIN) + r"(.*?)" + re.escape(GLM_VALUE_END), re.DOTALL)


class ToolCallParseError(JaxserveError):
    """The model wrote tool-call markup that does not parse into a call of a declared tool."""

    http_status = 500
    error_type = "invalid_tool_call"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[ToolCall]


def family_of(chat_template: str | None, model_type: str) -> Family:
    """Which markup the model writes: from its chat template, else from its architecture."""
    template = chat_template or ""
    if KIMI_SECTION_BEGIN in template:
        return "kimi"
    if GLM_KEY_BEGIN in template:
        return "glm"
    return "glm" if model_type.startswith("glm") else "kimi"


def _bad(message: str, text: str) -> ToolCallParseError:
    return ToolCallParseError(f"the model wrote an invalid tool call: {message}", value=text[:500],
                              param="tool_calls")


@dataclass(frozen=True)
class ToolSetup:
    """The request's tools and how its output is read. tools: the validated OpenAI `tools`; choice: "auto",
    "required" or a tool name; parallel: parallel_tool_calls; special: marker -> token id for markers that are
    special tokens of the tokenizer."""

    family: Family
    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    parallel: bool = True
    special: dict[str, int] = field(default_factory=dict)

    def schema(self, name: str) -> dict[str, Any] | None:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        return None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self)

    # ---- parsing ---------------------------------------------------------------------------------------------
    def start_marker(self) -> str:
        return KIMI_SECTION_BEGIN if self.family == "kimi" else GLM_CALL_BEGIN

    def parse_section(self, text: str) -> tuple[list[ToolCall], int]:
        """Complete calls at the start of `text` (which begins at a start marker) -> (calls, characters used).
        Raises ToolCallParseError for a complete but invalid call."""
        return self._parse_kimi(text) if self.family == "kimi" else self._parse_glm(text)

    def _parse_kimi(self, text: str) -> tuple[list[ToolCall], int]:
        calls: list[ToolCall] = []
        pos = len(KIMI_SECTION_BEGIN)
        while True:
            rest = text[pos:]
            stripped = len(rest) - len(rest.lstrip())
            rest = rest.lstrip()
            if rest.startswith(KIMI_SECTION_END):
                return calls, pos + stripped + len(KIMI_SECTION_END)
            if not rest.startswith(KIMI_CALL_BEGIN):
                if rest and not KIMI_CALL_BEGIN.startswith(rest) and not KIMI_SECTION_END.startswith(rest):
                    raise _bad(f"expected {KIMI_CALL_BEGIN} or {KIMI_SECTION_END}", rest)
                return calls, pos  # incomplete: wait for more text
            end = rest.find(KIMI_CALL_END)
            if end < 0:
                return calls, pos
            body = rest[len(KIMI_CALL_BEGIN):end]
            head, sep, args = body.partition(KIMI_ARGS_BEGIN)
            m = _KIMI_ID.fullmatch(head)
            if not sep or m is None:
                raise _bad(f"expected 'functions.NAME:INDEX{KIMI_ARGS_BEGIN}'", body)
            calls.append(self._call(m.group(1), m.group(2), _json_object(args, m.group(2))))
            pos += stripped + end + len(KIMI_CALL_END)

    def _parse_glm(self, text: str) -> tuple[list[ToolCall], int]:
        end = text.find(GLM_CALL_END)
        if end < 0:
            return [], 0
        body = text[len(GLM_CALL_BEGIN):end]
        cut = body.find(GLM_KEY_BEGIN)
        name = (body if cut < 0 else body[:cut]).strip()
        args, rest = self._glm_values(name, "" if cut < 0 else body[cut:])
        if rest.strip():
            raise _bad("text after the last argument", rest)
        call = self._call(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args, ensure_ascii=False))
        return [call], end + len(GLM_CALL_END)

    def _glm_values(self, name: str, args_text: str) -> tuple[dict[str, Any], str]:
        """The complete `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs of `args_text` -> (arguments, the text
        after the last pair)."""
        props = (self.schema(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        pos = 0
        for m in _GLM_ARG.finditer(args_text):
            if args_text[pos:m.start()].strip():
                raise _bad("text between arguments", args_text[pos:m.start()])
            pos = m.end()
            key, raw = m.group(1).strip(), m.group(2)
            if (props.get(key) or {}).get("type") == "string":
                args[key] = raw
                continue
            try:
                args[key] = json.loads(raw)
            except ValueError:
                if key in props:
                    raise _bad(f"argument {key!r} of {name!r} is not JSON", raw) from None
                args[key] = raw  # an undeclared parameter: kept as the text it is
        return args, args_text[pos:]

    def partial_call(self, text: str) -> ToolCall | None:
        """The unfinished last call of an output cut by the token limit (`text` begins at a start marker) -> the
        call with its name and the argument text written so far, or None when its name is not complete yet."""
        if self.family == "kimi":
            rest = text[len(KIMI_SECTION_BEGIN):].lstrip()
            head, sep, args = rest[len(KIMI_CALL_BEGIN):].partition(KIMI_ARGS_BEGIN)
            m = _KIMI_ID.fullmatch(head)
            if not rest.startswith(KIMI_CALL_BEGIN) or not sep or m is None:
                return None
            return self._call(m.group(1), m.group(2), args)
        body = text[len(GLM_CALL_BEGIN):]
        cut = body.find(GLM_KEY_BEGIN)
        if cut < 0 and not _GLM_NAME_DONE.match(body):
            return None  # the name may go on
        name = (body if cut < 0 else body[:cut]).strip()
        args, rest = self._glm_values(name, "" if cut < 0 else body[cut:])
        props = (self.schema(name) or {}).get("properties") or {}
        return self._call(f"call_{uuid.uuid4().hex[:24]}", name, _glm_partial_json(args, rest, props))

    def _call(self, call_id: str, name: str, arguments: str) -> ToolCall:
        if self.schema(name) is None:
            raise _bad(f"{name!r} is not one of the request's tools", name)
        return ToolCall(call_id, name, arguments)

    # ---- forcing -----------------------------------------------------------------------------------------------
    def _lit(self, marker: str) -> str:
        """A marker in the grammar: its special token, or its text."""
        tid = self.special.get(marker)
        return f"<[{tid}]>" if tid is not None else json.dumps(marker)

    def grammar(self) -> StructuredOutput:
        """The grammar a "required" or named tool_choice imposes on the output."""
        names = [t["function"]["name"] for t in self.tools]
        if self.choice not in ("auto", "required", "none"):
            names = [self.choice]
        rules = []
        for i, name in enumerate(names):
            schema = dict(self.schema(name) or {"type": "object"})
            schema["x-guidance"] = JSON_OPTIONS
            if self.family == "kimi":
                rules.append(f"call{i}: {self._lit(KIMI_CALL_BEGIN)} {json.dumps('functions.' + name + ':')} IDX "
                             f"{self._lit(KIMI_ARGS_BEGIN)} args{i} {self._lit(KIMI_CALL_END)}")
                rules.append(f"args{i}: %json {json.dumps(schema)}")
            else:
                rules.append(f"call{i}: {self._lit(GLM_CALL_BEGIN)} {json.dumps(name + chr(10))} "
                             f"{self._glm_args(i, schema)}{self._lit(GLM_CALL_END)}")
                rules += self._glm_arg_rules(i, schema)
        one = " | ".join(f"call{i}" for i in range(len(names)))
        many = "+" if self.parallel and self.choice == "required" else ""
        if self.family == "kimi":
            start = f"start: {self._lit(KIMI_SECTION_BEGIN)} ({one}){many} {self._lit(KIMI_SECTION_END)}"
        else:
            start = f"start: ({one}){many}"
        lark = "\n".join([start, *rules, "IDX: /[0-9]/"])
        return StructuredOutput("lark", lark, param="tool_choice")

    def _glm_args(self, i: int, schema: dict[str, Any]) -> str:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        return "".join(f"arg{i}_{j}{'' if k in required else '?'} " for j, k in enumerate(props))

    def _glm_arg_rules(self, i: int, schema: dict[str, Any]) -> list[str]:
        rules = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            sub = dict(sub) if isinstance(sub, dict) else {}
            if sub.get("type") == "string":
                value = r"/[^<]*/"
            else:
                sub["x-guidance"] = JSON_OPTIONS
                value = f"%json {json.dumps(sub)}"
            rules.append(f"arg{i}_{j}: {self._lit(GLM_KEY_BEGIN)} {json.dumps(key)} {self._lit(GLM_KEY_END)} "
                         f"\"\\n\" {self._lit(GLM_VALUE_BEGIN)} val{i}_{j} {self._lit(GLM_VALUE_END)} \"\\n\"")
            rules.append(f"val{i}_{j}: {value}")
        return rules


def _json_object(text: str, name: str) -> str:
    try:
        value = json.loads(text)
    except ValueError:
        raise _bad(f"the arguments of {name!r} are not JSON", text) from None
    if not isinstance(value, dict):
        raise _bad(f"the arguments of {name!r} are not a JSON object", text)
    return json.dumps(value, ensure_ascii=False)


def _glm_partial_json(args: dict[str, Any], rest: str, props: dict[str, Any]) -> str:
    """The arguments of a GLM call cut inside its markup as the JSON text they had begun to be: the complete pairs,
    then the cut key and the value text written so far (a string parameter's value opens a JSON string)."""
    text = json.dumps(args, ensure_ascii=False)[:-1]
    m = _GLM_PARTIAL_ARG.fullmatch(rest.lstrip())
    if m is None or m.group(2) is None:
        return text
    key, value = m.group(1).strip(), m.group(2)
    if (props.get(key) or {}).get("type") == "string":
        value = json.dumps(value, ensure_ascii=False)[:-1]
    return f"{text}{', ' if args else ''}{json.dumps(key, ensure_ascii=False)}: {value}"


class ToolCallParser:
    """One choice's output, read as it streams: text before the first call marker is content (a possible marker
    prefix is held back), each complete call becomes one `delta.tool_calls` entry (id, name, whole arguments)."""

    def __init__(self, setup: ToolSetup) -> None:
        self.setup = setup
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_calls = False

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """New output text -> (content to send, tool-call deltas to send)."""
        self._buf += text
        return self._drain(final=False)

    def finish(self, truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """End of output -> what is left. truncated: the output stopped at the token limit (finish_reason
        "length"). Raises ToolCallParseError for an unfinished call, unless truncated."""
        content, deltas = self._drain(final=True)
        if self._in_calls and self._buf.strip() == KIMI_SECTION_BEGIN and self.calls:
            self._buf = ""  # complete calls whose section end never came: the calls stand
        if self._in_calls and self._buf.strip():
            if not truncated:
                raise _bad("the output ended inside a tool call", self._buf)
            # out of tokens, not invalid markup (OpenAI answers "length" with what was written): the complete
            # calls stand and the unfinished one comes back with its partial arguments, once its name is known
            partial = self.setup.partial_call(self._buf)
            if partial is not None:
                partial = self._unique(partial)
                deltas.append({"index": len(self.calls), **partial.openai()})
                self.calls.append(partial)
            self._buf = ""
        return content, deltas

    def parse_all(self, text: str, truncated: bool = False) -> Parsed:
        """A whole output -> content and calls. truncated: as in `finish`."""
        content, _ = self.push(text)
        rest, _ = self.finish(truncated)
        return Parsed(content + rest, list(self.calls))

    def _unique(self, call: ToolCall) -> ToolCall:
        """`call`, with an id no earlier call of this output has: a repeated "functions.NAME:IDX" (the model writes
        Kimi ids itself, and may repeat one) gets IDX = the call's position, or the next index not yet taken."""
        taken = {c.id for c in self.calls}
        if call.id not in taken:
            return call
        stem = call.id.rpartition(":")[0] or call.id
        idx = len(self.calls)
        while f"{stem}:{idx}" in taken:
            idx += 1
        return replace(call, id=f"{stem}:{idx}")

    def _drain(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        marker = self.setup.start_marker()
        while True:
            if not self._in_calls:
                at = self._buf.find(marker)
                if at < 0:
                    keep = 0 if final else partial_suffix(self._buf, marker)
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:at])
                self._buf = self._buf[at:]
                self._in_calls = True
            calls, used = self.setup.parse_section(self._buf)
            for c in calls:
                c = self._unique(c)  # clients key tool results by id
                deltas.append({"index": len(self.calls), **c.openai()})
                self.calls.append(c)
            if used == 0 or (self.setup.family == "kimi" and not self._buf[:used].rstrip().endswith(
                    KIMI_SECTION_END)):
                if used:
                    self._buf = KIMI_SECTION_BEGIN + self._buf[used:]  # calls consumed; the section is still open
                break
            self._buf = self._buf[used:]
            self._in_calls = False
        text = "".join(content)
        if self.calls and not text.strip():
            text = ""  # whitespace between or after calls is not content
        return text, deltas


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (held back while streaming)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
