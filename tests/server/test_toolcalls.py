"""Tool-call parsing on strings in the models' real markup (Kimi K2, GLM-4.5 and GLM-4.7/5), streamed in every
split, plus the forcing grammars checked against llguidance with the real tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve.engine.structured import GrammarCompiler
from jaxserve.server.toolcalls import ToolCallParseError, ToolSetup, family_of
from jaxserve.tokenizer import Tokenizer

TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search-web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}},
)
KIMI = ToolSetup("kimi", TOOLS)
GLM = ToolSetup("glm", TOOLS)

KIMI_TEXT = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             "<|tool_call_argument_begin|>{\"city\": \"Paris\", \"days\": 3}<|tool_call_end|>"
             "<|tool_call_begin|>functions.search-web:1<|tool_call_argument_begin|>{\"query\": \"café <b>\"}"
             "<|tool_call_end|><|tool_calls_section_end|>")
GLM45_TEXT = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>search-web\n"
              "<arg_key>query</arg_key>\n<arg_value>café 42</arg_value>\n<arg_key>filters</arg_key>\n"
              "<arg_value>{\"site\": \"x.org\"}</arg_value>\n</tool_call>")
GLM47_TEXT = ("Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
              "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")


def split_feed(setup: ToolSetup, text: str, cuts: list[int], truncated: bool = False) -> tuple[str, list[dict]]:
    p = setup.parser()
    content, deltas, prev = [], [], 0
    for c in [*cuts, len(text)]:
        t, d = p.push(text[prev:c])
        content.append(t)
        deltas += d
        prev = c
    t, d = p.finish(truncated)
    return "".join(content) + t, deltas + d


def test_kimi_calls_parse_with_their_ids():
    parsed = KIMI.parser().parse_all(KIMI_TEXT)
    assert parsed.content == "Let me check."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris", "days": 3}),
        ("functions.search-web:1", "search-web", {"query": "café <b>"})]


@pytest.mark.parametrize("text", [GLM45_TEXT, GLM47_TEXT])
def test_glm_calls_parse_with_typed_values(text):
    parsed = GLM.parser().parse_all(text)
    assert parsed.content.strip() == "Let me check."
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris", "days": 3}
    assert parsed.calls[0].name == "get_weather" and parsed.calls[0].id.startswith("call_")
    if len(parsed.calls) > 1:  # a string-typed value stays text; an object value is JSON
        assert json.loads(parsed.calls[1].arguments) == {"query": "café 42", "filters": {"site": "x.org"}}


@pytest.mark.parametrize("setup,text", [(KIMI, KIMI_TEXT), (GLM, GLM45_TEXT), (GLM, GLM47_TEXT)])
def test_streaming_in_any_split_equals_the_whole(setup, text):
    whole = setup.parser().parse_all(text)
    for step in (1, 2, 3, 7, 13):
        content, deltas = split_feed(setup, text, list(range(step, len(text), step)))
        assert content.strip() == whole.content.strip()
        assert [d["index"] for d in deltas] == list(range(len(whole.calls)))
        assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
            [(c.name, json.loads(c.arguments)) for c in whole.calls]
        assert all(d["type"] == "function" and d["id"] for d in deltas)


def test_plain_text_and_marker_lookalikes_stay_content():
    for setup in (KIMI, GLM):
        text = "a < b and <tool or <|tool_calls, no call here"
        content, deltas = split_feed(setup, text, list(range(1, len(text))))
        assert content == text and deltas == []


@pytest.mark.parametrize("setup,text", [
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0<|tool_call_argument_begin|>{}"
           "<|tool_call_end|><|tool_calls_section_end|>"),  # not a declared tool
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           "{\"city\": <|tool_call_end|><|tool_calls_section_end|>"),  # arguments are not JSON
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           "[1]<|tool_call_end|><|tool_calls_section_end|>"),  # not an object
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>get weather<|tool_call_argument_begin|>{}"
           "<|tool_call_end|><|tool_calls_section_end|>"),  # no NAME:INDEX id
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           "{\"city\": \"P\"}"),  # unterminated
    (KIMI, "<|tool_calls_section_begin|>hello<|tool_calls_section_end|>"),  # junk in the section
    (GLM, "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n</tool_call>"),
    (GLM, "<tool_call>nope\n</tool_call>"),
    (GLM, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"),  # unterminated
])
def test_invalid_markup_is_an_error_not_text(setup, text):
    with pytest.raises(ToolCallParseError) as e:
        setup.parser().parse_all(text)
    assert e.value.http_status == 500 and e.value.param == "tool_calls"


@pytest.mark.parametrize("setup,text,calls", [
    (KIMI, KIMI_TEXT[:KIMI_TEXT.index("{\"query")], [("get_weather", None), ("search-web", "")]),  # 2nd's args
    (KIMI, KIMI_TEXT[:KIMI_TEXT.index("\"}<|tool_call_end|><|tool_calls")],
     [("get_weather", None), ("search-web", '{"query": "café <b>')]),
    (KIMI, KIMI_TEXT[:KIMI_TEXT.index("functions.search")], [("get_weather", None)]),  # right after its begin marker
    (KIMI, "Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.get_wea", []),
    (GLM, GLM45_TEXT[:GLM45_TEXT.index("café")], [("get_weather", None), ("search-web", '{"query": "')]),
    (GLM, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris", [("get_weather", '{"city": "Paris')]),
    (GLM, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
          "<arg_value>1", [("get_weather", '{"city": "Paris", "days": 1')]),
    (GLM, "<tool_call>get_weath", []),
])
def test_output_cut_by_the_token_limit_returns_what_was_written(setup, text, calls):
    """finish_reason "length": not an error; the complete calls stand and the unfinished last one comes back with
    its name and the argument text written so far (None: a complete call, its arguments checked as JSON), as OpenAI
    does, once its name is complete; the same text ended by the model (not truncated) is still invalid markup."""
    whole = setup.parser().parse_all(text, truncated=True)
    assert [c.name for c in whole.calls] == [name for name, _ in calls]
    for c, (_, args) in zip(whole.calls, calls):
        assert c.arguments == args if args is not None else isinstance(json.loads(c.arguments), dict)
    assert whole.content.strip() == text[:text.index(setup.start_marker())].strip()
    for step in (1, 5, 11):  # streamed: the same calls, each once
        _, deltas = split_feed(setup, text, list(range(step, len(text), step)), truncated=True)
        assert [(d["index"], d["function"]["name"]) for d in deltas] == list(enumerate(c.name for c in whole.calls))
        assert [d["function"]["arguments"] for d in deltas][len(calls) - 1:] == [
            c.arguments for c in whole.calls][len(calls) - 1:]
        assert all(d["id"] for d in deltas)
    with pytest.raises(ToolCallParseError) as e:
        setup.parser().parse_all(text)
    assert "ended inside a tool call" in e.value.message


def test_invalid_complete_call_before_the_cut_is_still_an_error():
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"ci")
    with pytest.raises(ToolCallParseError) as e:
        KIMI.parser().parse_all(text, truncated=True)
    assert e.value.value == "nope"


def test_repeated_kimi_ids_become_unique_by_position():
    call = ("<|tool_call_begin|>functions.get_weather:{}<|tool_call_argument_begin|>{{\"city\": \"P\"}}"
            "<|tool_call_end|>")
    text = ("<|tool_calls_section_begin|>" + call.format(0) + call.format(0) + call.format(1)
            + "<|tool_call_begin|>functions.search-web:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
            + "<|tool_calls_section_end|>")
    want = ["functions.get_weather:0", "functions.get_weather:1", "functions.get_weather:2", "functions.search-web:0"]
    assert [c.id for c in KIMI.parser().parse_all(text).calls] == want
    for step in (1, 7):  # the same ids streamed, whatever the split
        _, deltas = split_feed(KIMI, text, list(range(step, len(text), step)))
        assert [d["id"] for d in deltas] == want


def test_family_from_template_or_architecture():
    tok = Tokenizer(Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi-tokenizer")
    assert family_of(tok.chat_template, "deepseek_v3") == "kimi"
    assert family_of("{{ '<arg_key>' }}", "deepseek_v3") == "glm"
    assert family_of(None, "glm4_moe") == "glm" and family_of(None, "glm_moe_dsa") == "glm"


@pytest.mark.parametrize("setup,text,ok", [
    (KIMI, KIMI_TEXT.removeprefix("Let me check."), True),
    (KIMI, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           "{\"days\": 3}<|tool_call_end|><|tool_calls_section_end|>", False),  # required "city" missing
    (KIMI, "plain text", False),
    (GLM, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
          "<arg_value>3</arg_value>\n</tool_call>", True),
    (GLM, "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", False),
])
def test_required_grammar_admits_exactly_valid_markup(setup, text, ok):
    from dataclasses import replace

    import llguidance

    tok = Tokenizer(Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi-tokenizer")
    compiler = GrammarCompiler(tok, tok.vocab_size, tuple(tok.eos_token_ids))
    m = compiler.matcher(replace(setup, choice="required").grammar())
    ll = llguidance.LLTokenizer((tok.path / "tokenizer.json").read_text(), n_vocab=tok.vocab_size)
    ids = ll.tokenize_str(text)
    accepted = m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
    assert accepted == ok
    if ok:  # and what the grammar admits parses
        assert setup.parser().parse_all(text).calls
