"""Requests, sampling parameters and the events a request's stream yields."""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from enum import Enum

from jaxserve.engine.structured import StructuredOutput
from jaxserve.errors import InvalidRequestError, JaxserveError

_ids = itertools.count()
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.

    Penalties (neutral values: 0, 0, 1): presence_penalty / frequency_penalty in [-2, 2] lower the logits of tokens
    already generated (once / per occurrence); repetition_penalty in (0, 2] divides positive and multiplies negative
    logits of tokens in the prompt or output. logit_bias: (token id, bias in [-100, 100]) pairs added to the logits.
    top_logprobs: alternatives (0..20) returned with each token. min_tokens: end tokens (eos, stop_token_ids) are
    banned until this many tokens exist. structured: a grammar the output must match (engine.structured).
    prompt_logprobs: None (off), 0 (each prompt token's logprob), k in 1..20 (also its top k alternatives), computed
    by the prefill program (`PromptLogprobs`); with them max_tokens may be 0: the prompt scored, nothing generated.
    thinking_budget: (N, end_ids): the output starts inside a thinking block; if its first N tokens do not close it
    with end_ids, end_ids are forced right after them (engine.budget).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int = 0
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None
    thinking_budget: tuple[int, tuple[int, ...]] | None = None

    @property
    def adjusts_logits(self) -> bool:
        """True if any penalty or bias applies (the batch then runs the adjusting program)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        least = 0 if self.prompt_logprobs is not None else 1
        checks = [
            ("max_tokens", is_int(self.max_tokens) and self.max_tokens >= least,
             "an integer >= 1 (0 only with prompt_logprobs: the prompt scored, nothing generated)"),
            ("temperature", is_num(self.temperature) and 0 <= self.temperature <= 100,
             "a number in [0, 100]"),
            ("top_k", is_int(self.top_k) and 0 <= self.top_k <= vocab_size, f"an integer in [0, {vocab_size}]"),
            ("top_p", is_num(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**32),
             "an integer in [0, 2^32)"),
            ("stop_token_ids", all(is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
             f"token ids in [0, {vocab_size})"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("presence_penalty", is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "a number in [-2, 2]"),
            ("frequency_penalty", is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "a number in [-2, 2]"),
            ("repetition_penalty", is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
             "a number in (0, 2]"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
                is_int(t) and 0 <= t < vocab_size and is_num(b) and -100 <= b <= 100 for t, b in self.logit_bias),
             f"at most {MAX_LOGIT_BIAS} (token id in [0, {vocab_size}), bias in [-100, 100]) pairs"),
            ("top_logprobs", is_int(self.top_logprobs) and 0 <= self.top_logprobs <= 20, "an integer in [0, 20]"),
            ("min_tokens", is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "an integer in [0, max_tokens]"),
            ("prompt_logprobs", self.prompt_logprobs is None or is_int(self.prompt_logprobs)
             and 0 <= self.prompt_logprobs <= 20, "null or an integer in [0, 20]"),
            ("thinking_budget", self.thinking_budget is None or _budget_ok(self.thinking_budget, vocab_size),
             f"null or (a non-negative integer, non-empty token ids in [0, {vocab_size}))"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise InvalidRequestError(f"{name} must be {want}", value=getattr(self, name), param=name)


def _budget_ok(budget: object, vocab_size: int) -> bool:
    if not isinstance(budget, tuple) or len(budget) != 2:
        return False
    n, end = budget
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0 and isinstance(end, tuple) and bool(end) \
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in end)


class Status(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    PULLING = "pulling"  # decode role: its pages are on their way from a prefill server
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(frozen=True)
class PullSpec:
    """Where a decode server pulls a request's KV pages from: the prefill server's answer (its kv_transfer_params),
    and the first token that prefill sampled (the decode server emits it first, then decodes)."""

    transfer_id: str
    host: str
    port: int
    first_token: int
    first_logprob: float


@dataclass
class Request:
    """One generation request. `prompt` is token ids; `session_id` routes to a decode worker (affinity);
    `cache_salt` (optional, non-empty) keeps its prefix-cache pages apart from requests with another salt."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    session_id: str | None = None
    cache_salt: str | None = None
    export_kv: bool = False  # prefill role: keep the prompt's pages for a decode server to pull (PD_PROTOCOL.md)
    pull: PullSpec | None = None  # decode role: pull the prompt's pages instead of prefilling it


def request_seed(req: Request) -> int:
    """The request's sampling seed (uint32): its own `params.seed`, else derived from its request id by SHA-256,
    the same in every process (Python's `hash` of a str changes with PYTHONHASHSEED)."""
    if req.params.seed is not None:
        return int(req.params.seed)
    digest = hashlib.sha256(req.request_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:4], "little")


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's own logprobs (`SamplingParams.prompt_logprobs`): logprobs[t] = log p(prompt[t] | prompt[:t]), None
    for t = 0 (nothing precedes it); top[t]: the top k (token id, logprob) at position t, most likely first (empty
    for t = 0 or k = 0)."""

    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step of a request: a new token (token_id set), or its end (finish_reason set).

    finish_reason: "stop" (eos, stop token or stop string), "length" (max_tokens or context), "abort", "error".
    text: the newly completed text, when the engine has a tokenizer (made on the consumer's side: engine.text_stream).
    end: on the token with which the engine ends the request (its finish event follows): "eos" (an end token or one
    of stop_token_ids: its text is not output), "grammar" (the grammar completed), "length".
    prompt_logprobs: set on a request's first event (its first token, or its end when it generates none) when the
    request asked for them.
    """

    request_id: str
    token_id: int | None = None
    logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    error: JaxserveError | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer: dict | None = None  # prefill role, on the finish event: the kv_transfer_params to answer with
    end: str | None = None


@dataclass
class RequestOutput:
    """The whole result of a finished request (Engine.generate)."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    cached_tokens: int
    error: JaxserveError | None = None
    prompt_logprobs: PromptLogprobs | None = None
