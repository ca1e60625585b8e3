"""Reasoning: a thinking model's `<think>`...`</think>` block split out of its output as `reasoning_content`.

Both families write the same markup: Kimi K2-Thinking / K2.5 / K2.6 and GLM-4.5 / 4.7 / 5.x think in a
`<think>`...`</think>` block before the answer. Whether the block is already open when generation starts depends
on the template: K2.5's thinking mode and GLM-5's generation prompt end with `<think>` (the output starts inside
the block), K2-Thinking and GLM-4.5 leave it to the model, and a template rendered with thinking off ends with
`</think>` (or `<think></think>`): then the whole output is content. `ReasoningSetup.of` reads this from the
rendered prompt's tail, so it follows whatever the checkpoint's own template does.

The parser streams: text before the block's end is reasoning (a possible marker prefix is held back), the rest
is content (then read for tool calls). A tool call that begins inside the thinking ends it: the model did not
close the block but is calling a tool, and the call is parsed as one.

`ReasoningSetup.grammar` wraps a request's grammar (response_format, forced tool calls) so that it applies only
after `</think>`. A thinking budget (`max_thinking_tokens`) is not enforceable in a grammar (llguidance's rule
`max_tokens` ends the thinking lexeme but cannot then force `</think>`): the engine forces it
(`SamplingParams.thinking_budget`, engine.budget), and a grammar's matcher consumes the forced tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from jaxserve.engine.structured import JSON_OPTIONS, StructuredOutput
from jaxserve.server.toolcalls import partial_suffix

THINK_BEGIN, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSetup:
    """How one request's output is split. opened: the prompt ends inside an open `<think>` block;
    tool_marker: the text that starts a tool call ("" without tools);
    special: marker -> token id for the think markers that are special tokens of the tokenizer."""

    opened: bool
    tool_marker: str = ""
    special: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def of(prompt_text: str) -> ReasoningSetup | None:
        """From the rendered prompt: None when thinking is off (the template closed the block already)."""
        tail = prompt_text.rstrip()
        if tail.endswith(THINK_END):
            return None
        return ReasoningSetup(opened=tail.endswith(THINK_BEGIN))

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self)

    def _lit(self, marker: str) -> str:
        tid = self.special.get(marker)
        return f"<[{tid}]>" if tid is not None else json.dumps(marker)

    def grammar(self, answer: StructuredOutput | None) -> StructuredOutput | None:
        """The grammar of the whole output: an (optional, unless the prompt opened it) thinking block, then
        `answer`. None when nothing constrains the output. The thinking is one lazy lexeme that ends at the first
        `</think>`, so the answer's grammar never applies inside it."""
        if answer is None:
            return None
        end = THINK_END if THINK_END not in self.special else ""
        # a special-token end cannot occur in text: the text lexeme ends where the model writes it
        thought = f"thought[lazy]: /(.|\\n)*{_regex(end)}/" if end else "thought: /(.|\\n)*/"
        block = "thought" if end else f"thought {self._lit(THINK_END)}"
        head = block if self.opened else f"({self._lit(THINK_BEGIN)} {block})?"
        rules = [f"start: {head} answer", thought]
        if answer.kind == "lark":
            rules.append(answer.spec.replace("start:", "answer:", 1))
        else:
            schema = json.loads(answer.spec) if answer.kind == "json_schema" else {"type": "object"}
            rules.append(f"answer: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
        return StructuredOutput("lark", "\n".join(rules), param=answer.param)


def _regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join(f"\\{ch}" if ch in "\\.+*?()|[]{}^$/" else ch for ch in text)  # `\<` would be a word boundary


class ReasoningParser:
    """One choice's output as it streams -> (reasoning text, the rest). Before the block opens (a template that
    leaves `<think>` to the model), leading whitespace and a prefix of `<think>` are held back."""

    def __init__(self, setup: ReasoningSetup) -> None:
        self.setup = setup
        self._state = "thinking" if setup.opened else "start"
        self._buf = ""

    def push(self, text: str) -> tuple[str, str]:
        """New output text -> (reasoning, content)."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """End of output -> what was held back, as (reasoning, content)."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_BEGIN):
                self._buf = head[len(THINK_BEGIN):]
                self._state = "thinking"
            elif not final and THINK_BEGIN.startswith(head):
                return "", ""  # whitespace or a prefix of <think>: wait
            else:
                self._state = "content"
        if self._state == "thinking":
            ends = [(at, m) for m in (THINK_END, self.setup.tool_marker) if m and (at := self._buf.find(m)) >= 0]
            if not ends:
                keep = 0 if final else max(partial_suffix(self._buf, m) for m in (THINK_END, self.setup.tool_marker))
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            at, marker = min(ends)
            reasoning = self._buf[:at]
            # a tool call inside the thinking ends it and stays in the output for the tool-call parser
            self._buf = self._buf[at + len(marker):] if marker == THINK_END else self._buf[at:]
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

