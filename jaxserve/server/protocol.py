"""The OpenAI request protocol: a validated request is a `Generation`; this module has what every endpoint shares
(sampling parameters, the context-window checks) and /v1/completions (chat: `server.chat_request`).

Each body is validated field by field before anything reaches the engine, so a bad request is refused with a 400
naming the field and never touches the scheduler. The body must name the served model (404 `model_not_found`) and
fit the context window by its character count before it is tokenized, then by its token count (tokenization stops
at the window). User text is encoded with special tokens disabled: only the chat template writes control tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from jaxserve.engine import Engine, Request, SamplingParams
from jaxserve.engine.request import PullSpec
from jaxserve.engine.structured import StructuredOutput
from jaxserve.errors import ContextLengthError, ModelNotFoundError, UnsupportedParameterError
from jaxserve.server.body import Body, UnknownFields, field_error, json_kind
from jaxserve.server.fields import COMPLETION_FIELDS, STREAM_OPTIONS, Extras, read_extras
from jaxserve.server.limits import (DEFAULT_COMPLETION_MAX_TOKENS, MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_N,
                                   MAX_PROMPTS, AppConfig)
from jaxserve.server.reasoning import ReasoningParser, ReasoningSetup
from jaxserve.server.toolcalls import ToolCallParser, ToolSetup


@dataclass(frozen=True)
class Generation:
    """A validated generation request, what the handlers consume: the prompt's token ids, the sampling parameters,
    how to shape the answer (stream, usage chunk, logprobs, n choices, tool calls, reasoning), the prefix-cache
    salt, the known fields that route it (`extras`) and the unknown fields it carried (`ignored`, named in the
    answer's `x-jaxserve-ignored-fields` header). A batched completion's further prompts are `more_prompts`
    (n choices each, in prompt order); `echo`: a completion's per-prompt text to prepend (empty: no echo)."""

    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    n: int = 1
    tools: ToolSetup | None = None  # a chat whose output is parsed for tool calls
    cache_salt: str | None = None  # prefix-cache pages are shared only within one salt
    reasoning: ReasoningSetup | None = None  # a thinking model's output: reasoning_content split out
    extras: Extras = Extras()
    ignored: tuple[str, ...] = ()
    more_prompts: tuple[list[int], ...] = ()
    echo: tuple[str, ...] = ()
    export_kv: bool = False  # kv_transfer_params {"do_remote_decode": true} (server.disagg)
    pull: PullSpec | None = None  # a decode server's kv_transfer_params (server.disagg)

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt, *self.more_prompts]

    def tool_parser(self) -> ToolCallParser | None:
        """A fresh per-choice tool-call parser, None when the output is plain text."""
        return None if self.tools is None else self.tools.parser()

    def reasoning_parser(self) -> ReasoningParser | None:
        """A fresh per-choice reasoning parser, None when the output has no thinking block."""
        return None if self.reasoning is None else self.reasoning.parser()

    def requests(self, rid: str, session: str | None) -> list[Request]:
        """The engine requests of the n choices (choice i samples with seed + i when a seed is given). session:
        the x-session-affinity header, else the body's prompt_cache_key."""
        session = session if session is not None else self.extras.affinity
        if self.n == 1 and not self.more_prompts:
            return [Request(self.prompt, self.params, request_id=rid, session_id=session,
                            cache_salt=self.cache_salt, export_kv=self.export_kv, pull=self.pull)]
        p = self.params
        return [Request(prompt, p if p.seed is None else replace(p, seed=(p.seed + i) % 2**32),
                        request_id=f"{rid}-{k * self.n + i}", session_id=session, cache_salt=self.cache_salt)
                for k, prompt in enumerate(self.prompts) for i in range(self.n)]


def cache_salt(body: Body) -> str | None:
    """vLLM's `cache_salt`: a non-empty string; prefix-cache pages are shared only among requests with the same
    salt (or none)."""
    salt = body.string("cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise field_error("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                          len(salt))
    return salt


def stream_options(body: Body, stream: bool) -> bool:
    """`stream_options.include_usage` (include_obfuscation is accepted: these chunks carry no padding)."""
    raw = body.raw.get("stream_options")
    if raw is None:
        return False
    if not stream:
        raise field_error("stream_options", "is only allowed when 'stream' is true")
    opts = body.child(raw, STREAM_OPTIONS, "stream_options")
    opts.boolean("include_obfuscation", False)
    return opts.boolean("include_usage", False)


def common_params(body: Body, prompt: list[int], max_tokens: int | None, default_max: int, max_len: int,
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


def choices_n(body: Body) -> int:
    return body.integer("n", 1, MAX_N, 1)


def max_tokens_of(body: Body, max_len: int, *names: str, lo: int = 1) -> int | None:
    """The completion length (>= lo) from the first of `names` given; two given with different values is a 400."""
    given = [(name, v) for name in names if (v := body.integer(name, lo, max_len)) is not None]
    if len({v for _, v in given}) > 1:
        (a, va), (b, vb) = given[:2]
        raise field_error(b, f"conflicts with '{a}' ({vb} != {va}); send one of them", vb)
    return given[0][1] if given else None


def check_model(body: Body, model_name: str) -> None:
    name = body.string("model", required=True)
    if name != model_name:
        raise ModelNotFoundError(f"the model '{name[:100]}' does not exist; this server serves '{model_name}'",
                                 value=name[:100], param="model")


def tokenizer_of(engine: Engine, param: str) -> Any:
    if engine.tokenizer is None:
        raise UnsupportedParameterError("this model has no tokenizer: use /v1/completions with token ids",
                                        value=None, param=param)
    return engine.tokenizer


def check_chars(tokenizer: Any, chars: int, max_len: int, param: str) -> None:
    """Refuse text that cannot fit the window by its length alone, before any of it is tokenized."""
    per_token = tokenizer.max_token_chars
    if per_token is not None and chars > max_len * per_token:
        raise ContextLengthError(f"'{param}': {chars} characters cannot fit this model's context window of {max_len} "
                                 f"tokens (one token covers at most {per_token} characters)", value=chars, param=param)


def _encode_user_text(engine: Engine, text: str, max_len: int) -> list[int]:
    """A prompt string -> ids, special tokens disabled; encoding stops past the window (the caller refuses it)."""
    tok = tokenizer_of(engine, "prompt")
    check_chars(tok, len(text), max_len, "prompt")
    return tok.encode(text, special_tokens=False, limit=max_len)


def _completion_prompts(engine: Engine, p: Any, max_len: int) -> tuple[list[list[int]], list[str | None]]:
    """/v1/completions' `prompt`: a string, token ids, or an array of either -> (token ids per prompt, the text
    given per prompt: None for token ids)."""
    vocab = engine.model_cfg.vocab_size
    if p is None:
        raise field_error("prompt", "is required")
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(p, str) or is_ids(p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or (is_ids(x) and x) for x in p):
        items = p
    else:
        raise field_error("prompt", "must be a string, an array of token ids, or a non-empty array of either")
    if len(items) > MAX_PROMPTS:  # before any is encoded
        raise field_error("prompt", f"at most {MAX_PROMPTS} prompts per request", len(items))
    prompts: list[list[int]] = []
    for x in items:
        if isinstance(x, str):
            prompts.append(_encode_user_text(engine, x, max_len))
        elif not all(0 <= t < vocab for t in x):
            raise field_error("prompt", f"token ids must be in [0, {vocab})")
        else:
            prompts.append(list(x))
        if not prompts[-1]:
            raise field_error("prompt", "is empty")
    return prompts, [x if isinstance(x, str) else None for x in items]


def parse_completion(raw: Any, engine: Engine, model_name: str, cfg: AppConfig = AppConfig()) -> Generation:
    """Validate a /v1/completions body. `echo` (not streamed) prepends each prompt's text and, with `logprobs`, its
    tokens' logprobs (computed by the prefill: SamplingParams.prompt_logprobs); max_tokens 0 needs echo."""
    body = Body(raw, COMPLETION_FIELDS, unknown=UnknownFields(cfg.strict_fields))
    check_model(body, model_name)
    body.only("best_of", (1,), "only best_of=1 is supported")
    body.only("suffix", ("",), "suffix is not supported")
    extras = read_extras(body)
    vocab, max_len = engine.model_cfg.vocab_size, engine.cfg.max_model_len
    prompts, texts = _completion_prompts(engine, body.raw.get("prompt"), max_len)
    logprobs = body.integer("logprobs", 0, 5)
    stream = body.boolean("stream", False)
    echo = body.boolean("echo", False)
    if echo and stream:
        raise UnsupportedParameterError("echo is not supported with stream: send stream false", value=True,
                                        param="echo")
    max_tokens = max_tokens_of(body, max_len, "max_tokens", lo=0)
    if max_tokens == 0 and not echo:
        raise field_error("max_tokens", "may be 0 only with echo (the prompt scored, nothing generated)", 0)
    longest = max(prompts, key=len)
    params = common_params(body, longest, max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, max_len, vocab,
                           logprobs is not None, "prompt", top_logprobs=logprobs or 0)
    if echo and (logprobs is not None or max_tokens == 0):  # the engine generates nothing only for a scoring request
        params = replace(params, prompt_logprobs=logprobs or 0)
    tok = engine.tokenizer
    echoed = tuple(t if t is not None else tok.decode(ids) if tok is not None else ""
                   for t, ids in zip(texts, prompts)) if echo else ()
    n = choices_n(body)
    if len(prompts) * n > MAX_PROMPTS:
        raise field_error("prompt", f"at most {MAX_PROMPTS} choices (prompts x n) per request", len(prompts) * n)
    return Generation(prompts[0], params, stream, stream_options(body, stream), logprobs is not None,
                      n, cache_salt=cache_salt(body), extras=extras, ignored=tuple(body.unknown.names),
                      more_prompts=tuple(prompts[1:]), echo=echoed)
