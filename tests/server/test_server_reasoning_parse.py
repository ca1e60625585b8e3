"""The reasoning split on strings, as Kimi K2.5 / GLM-5 write it (`<think>` opened by the template or by the model),
streamed in every split, with tool calls after and inside the thinking; and the grammar that puts a response_format
or forced tool call after the thinking and forces `</think>` at the budget, checked with llguidance on the tiny
tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxserve.engine.structured import GrammarCompiler, StructuredOutput, json_schema_output
from jaxserve.server.reasoning import ReasoningSetup
from jaxserve.server.responses import Choice, split_output
from jaxserve.server.toolcalls import ToolSetup
from jaxserve.tokenizer import Tokenizer

TOKENIZER = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi-tokenizer"
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},)
KIMI = ToolSetup("kimi", TOOLS)
CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        "{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>")

# (template opened <think>, raw output, tools, expected (reasoning, content, call names))
CASES = [
    (True, "Let me think.\nOK.</think>\n\nThe answer is 4.", None, ("Let me think.\nOK.", "\n\nThe answer is 4.", [])),
    (True, "still thinking when the output ended", None, ("still thinking when the output ended", "", [])),
    (False, "  <think>plan</think>Answer.", None, ("plan", "Answer.", [])),
    (False, "Answer without thinking.", None, ("", "Answer without thinking.", [])),
    (False, "<thinking is not the marker", None, ("", "<thinking is not the marker", [])),
    (True, "I should call it.</think>" + CALL, KIMI, ("I should call it.", "", ["get_weather"])),
    (True, "I will call it now" + CALL, KIMI, ("I will call it now", "", ["get_weather"])),  # inside the thinking
    (True, "no call</think>Sunny.", KIMI, ("no call", "Sunny.", [])),
]


def feed(opened: bool, text: str, tools: ToolSetup | None, cuts: list[int]) -> tuple[str, str, list[str]]:
    """Stream `text` in pieces cut at `cuts` through one choice's parsers -> (reasoning, content, call names)."""
    marker = tools.start_marker() if tools is not None else ""
    c = Choice(tools.parser() if tools is not None else None, ReasoningSetup(opened, tool_marker=marker).parser())
    reasoning, content, names, prev = [], [], [], 0
    for cut in [*cuts, len(text)]:
        r, t, calls = c.read(text[prev:cut])
        reasoning.append(r)
        content.append(t)
        names += [d["function"]["name"] for d in calls]
        prev = cut
    r, t, calls = c.read_end(truncated=False)
    names += [d["function"]["name"] for d in calls]
    return "".join(reasoning) + r, "".join(content) + t, names


@pytest.mark.parametrize("opened,text,tools,want", CASES)
def test_split_is_the_same_whole_and_streamed_at_every_position(opened, text, tools, want):
    marker = tools.start_marker() if tools is not None else ""
    setup = ReasoningSetup(opened, tool_marker=marker)
    reasoning, content, calls = split_output(Choice(tools.parser() if tools else None, setup.parser()), text, False)
    assert (reasoning, content, [c.name for c in calls]) == want
    for i in range(len(text) + 1):  # cut once at every position, then one character at a time
        assert feed(opened, text, tools, [i]) == want
    assert feed(opened, text, tools, list(range(1, len(text)))) == want


@pytest.mark.parametrize("tail,want", [
    ("<|im_assistant|>assistant<|im_middle|><think>", True), ("<|assistant|><think>\n", True),
    ("<|im_assistant|>assistant<|im_middle|>", False), ("<|assistant|>", False),
    ("<|im_assistant|>assistant<|im_middle|><think></think>", None), ("<|assistant|></think>", None),
])
def test_the_rendered_prompt_tail_says_whether_thinking_is_open(tail, want):
    setup = ReasoningSetup.of("<|im_user|>user<|im_middle|>hi<|im_end|>" + tail)
    assert (setup.opened if setup is not None else None) == want


# ---- the grammar -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = Tokenizer(TOKENIZER)
    return GrammarCompiler(tok, tok.vocab_size, (4090,))


def walk(compiler: GrammarCompiler, so: StructuredOutput, text: str) -> tuple[int, list[str]]:
    """Feed `text`'s tokens to a matcher while it allows them -> (tokens accepted, the tokens allowed next)."""
    tok = compiler._tokenizer
    m = compiler.matcher(so)
    ids = tok.encode(text, special_tokens=False)
    for n, t in enumerate(ids):
        words = np.frombuffer(compiler.bitmask(m).tobytes(), np.uint32)
        if not (words[t // 32] >> (t % 32)) & 1:
            allowed = [i for i in range(tok.vocab_size) if (words[i // 32] >> (i % 32)) & 1]
            return n, [tok.decode([a]) for a in allowed]
        m.consume_token(t)
    return len(ids), []


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_json_schema_applies_only_after_the_thinking(compiler):
    so = ReasoningSetup(opened=True).grammar(json_schema_output(SCHEMA))
    text = "free {not json} thinking</think>{\"n\": 3}"
    assert walk(compiler, so, text)[0] == len(compiler._tokenizer.encode(text, special_tokens=False))
    ids = compiler._tokenizer.encode("thinking</think> plain text", special_tokens=False)
    n, allowed = walk(compiler, so, "thinking</think> plain text")
    assert compiler._tokenizer.decode(ids[:n]) == "thinking</think>" and "{" in allowed and " plain" not in allowed


def test_a_model_opened_block_is_optional(compiler):
    so = ReasoningSetup(opened=False).grammar(json_schema_output(SCHEMA))
    for text in ("<think>hmm</think>{\"n\": 1}", "{\"n\": 1}"):
        assert walk(compiler, so, text)[0] == len(compiler._tokenizer.encode(text, special_tokens=False))


def test_a_special_token_end_of_thinking(compiler):
    """A tokenizer whose `</think>` is a special token (the real Kimi one): the grammar writes it as that token
    (here <|im_end|>, a special token of the tiny tokenizer, stands in for it)."""
    tok = compiler._tokenizer
    so = ReasoningSetup(opened=True, special={"</think>": 4095}).grammar(json_schema_output(SCHEMA))
    m = compiler.matcher(so)
    ids = tok.encode("some thought", special_tokens=False) + [4095] + tok.encode("{\"n\": 5}", special_tokens=False)
    for t in ids:
        assert (np.frombuffer(compiler.bitmask(m).tobytes(), np.uint32)[t // 32] >> (t % 32)) & 1, tok.decode([t])
        m.consume_token(t)
    assert m.is_accepting()


def test_forced_tool_call_grammar_follows_the_thinking(compiler):
    forced = ToolSetup("kimi", TOOLS, choice="get_weather").grammar()
    so = ReasoningSetup(opened=True).grammar(forced)
    text = "call it</think>" + CALL
    assert walk(compiler, so, text)[0] == len(compiler._tokenizer.encode(text, special_tokens=False))
    ids = compiler._tokenizer.encode("call it</think> Sunny", special_tokens=False)
    n, allowed = walk(compiler, so, "call it</think> Sunny")  # after the thinking only the call's markup
    assert compiler._tokenizer.decode(ids[:n]) == "call it</think>" and " Sunny" not in allowed


def test_no_grammar_without_a_constraint():
    assert ReasoningSetup(opened=True).grammar(None) is None
