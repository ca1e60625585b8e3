"""Structured outputs: grammar-constrained decoding with llguidance.

A request's `SamplingParams.structured` (a `StructuredOutput`: a JSON Schema, "any JSON object", or a Lark grammar)
becomes one `llguidance.LLMatcher` per sequence. Before each sampling of that row the scheduler asks the matcher for
its allowed-token bitmask ([ceil(V / 32)] int32 words, bit t % 32 of word t // 32) and the sampling step sets every
other logit to -inf (`sampling.allowed`); after the token is accepted the matcher consumes it. Rows without a grammar
pay nothing: a batch with none uploads no mask and runs the unmasked program (`SamplingArrays.mask` is None).

Why llguidance (1.9.1): its wheel has no Python dependencies (xgrammar pulls in torch and transformers at runtime;
outlines-core needs its own vocabulary index built per regex, and JSON Schema support lives in the heavier
`outlines` package); it builds its token trie straight from a HF `tokenizer.json` string or from any byte-level
vocabulary given as per-token bytes (our tiktoken backend, via `Tokenizer.token_bytes`), computes a mask in tens of
microseconds without precomputing per-grammar tables, and takes JSON Schema (strict), Lark (with `%json` islands,
which tool-call grammars use to embed each tool's parameter schema) and regexes through one interface. It is
maintained (guidance-ai; used by vLLM, SGLang and llama.cpp as a backend).

Where the work runs: a request's matcher is built by `GrammarCompiler.matcher` in `Engine.submit`, on the caller's
thread (the HTTP handler), never in the engine step; only the per-token mask and consume_token run in the loop.
The build does not stall the loop through the GIL either: llguidance's `LLMatcher` constructor drops the GIL while
it compiles (documented, and measured by bench/host_work.py on the shared 2-core host at load average ~7.5: beside
the compile of a 150-property JSON schema (~9.7k tokens of the tiny tokenizer; 13-23 ms) or of a 100-tool
forced-call grammar (46-72 ms), a thread waking every 1 ms saw largest gaps of 7-14 and 4-7 ms, as it does idle
(1-22 ms); a call that holds the GIL shows gap = work (at load ~20: json.loads of a 3.8 MB body, 49-59 ms of work,
49-59 ms gaps; the compiles then took up to 381 ms with gaps <= 48 ms). So no worker process is needed;
`grammar_from_json_schema` (Python, ~1 ms) and the mask (`compute_bitmask`, GIL dropped, < 2 ms for a fresh
matcher) are short.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from jaxserve.errors import InvalidRequestError

StructuredKind = Literal["json_object", "json_schema", "lark"]
# no free whitespace between JSON tokens: a weak model would otherwise fill max_tokens with blanks inside a
# valid document (the grammar allows it); separators as Python's json.dumps writes them
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. kind "json_object": any JSON object (spec ignored); "json_schema": spec is the
    schema as JSON text; "lark": spec is a Lark grammar (llguidance's dialect: `%json {schema}` embeds a schema).
    param names the request field it came from, for errors."""

    kind: StructuredKind
    spec: str = ""
    param: str = "response_format"

    def grammar(self) -> str:
        """-> llguidance's serialized grammar."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(self.spec, overrides=JSON_OPTIONS)
            except ValueError as e:
                raise InvalidRequestError(f"'{self.param}': the schema is not a JSON object: {e}",
                                          value=self.spec[:200], param=self.param) from e
        return llguidance.LLMatcher.grammar_from_lark(self.spec)


def json_schema_output(schema: dict[str, Any], param: str = "response_format") -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema), param)


class GrammarCompiler:
    """Builds matchers for one tokenizer. vocab: the model's vocabulary size (the logits' width; ids past the
    tokenizer's own vocabulary are never allowed). eos_ids: the tokens that end a finished grammar."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab = vocab
        self.words = (vocab + 31) // 32
        self.eos_ids = tuple(eos_ids)
        self._ll: Any = None
        self._ll_lock = threading.Lock()  # requests' threads build matchers concurrently: one trie build

    def prepare(self) -> None:
        """Build llguidance's tokenizer now (server start-up) rather than in the first structured request."""
        self._lltokenizer()

    def _lltokenizer(self) -> Any:
        """llguidance's tokenizer, built on first use (the trie build reads the whole vocabulary once)."""
        with self._ll_lock:
            return self._ll if self._ll is not None else self._build_lltokenizer()

    def _build_lltokenizer(self) -> Any:
        import llguidance

        tok = self._tokenizer
        json_file = tok.path / "tokenizer.json"
        eos = list(self.eos_ids) or None
        if tok.backend == "tokenizers" and json_file.is_file():
            self._ll = llguidance.LLTokenizer(json_file.read_text(encoding="utf-8"), n_vocab=self.vocab,
                                              eos_token=eos)
        else:
            self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tok, self.eos_ids)),
                                              n_vocab=self.vocab, eos_token=eos)
        return self._ll

    def matcher(self, so: StructuredOutput) -> Any:
        """A fresh llguidance.LLMatcher for `so`. Raises InvalidRequestError naming the field if it does not
        compile."""
        import llguidance

        m = llguidance.LLMatcher(self._lltokenizer(), so.grammar(), log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"'{so.param}': the grammar does not compile: {m.get_error()[:500]}",
                                      value=so.spec[:200], param=so.param)
        return m

    def bitmask(self, matcher: Any) -> np.ndarray:
        """The matcher's allowed tokens -> [words] int32 (a matcher in error allows only the end tokens)."""
        out = np.zeros(self.words, np.uint32)
        if matcher.is_error():
            for t in self.eos_ids:
                out[t // 32] |= np.uint32(1 << (t % 32))
            return out.view(np.int32)
        raw = np.frombuffer(matcher.compute_bitmask(), np.uint32)
        n = min(self.words, raw.size)
        out[:n] = raw[:n]
        return out.view(np.int32)


class _ByteVocab:
    """llguidance.TokenizerWrapper's view of a byte-level `jaxserve.tokenizer.Tokenizer` (e.g. tiktoken):
    each id's bytes, the special ids, and an encoder."""

    def __init__(self, tok: Any, eos_ids: tuple[int, ...]) -> None:
        self._tok = tok
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.bos_token_id = None
        special = tok.special_token_ids
        self.special_token_ids = sorted(special)
        self.tokens = [(tok.decode([i]).encode("utf-8") if i in special else tok.token_bytes(i))
                       for i in range(tok.vocab_size)]

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, special_tokens=False)
