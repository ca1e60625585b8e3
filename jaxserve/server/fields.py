"""The request fields each endpoint knows: every field of OpenAI's current request schemas (chat completions,
completions, responses) plus vLLM's extensions this server implements.

A known field is either honored (sampling, tools, `reasoning_effort`, `prompt_cache_key`, ...) or accepted and
ignored because it has no meaning for one self-hosted model (`store` on chat, `service_tier`, `safety_identifier`,
`verbosity`, `prediction`, `web_search_options`, `metadata` outside /v1/responses): those are still type-checked,
so a wrong type is a 400 like any other field's, and a value this server cannot honor (audio output) is refused.
A null is always "unset". Unknown fields go to the body's `UnknownFields` (named in a response header, or a 400
under `serve --strict-fields`).
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxserve.errors import UnsupportedParameterError
from jaxserve.server.body import Body, field_error, json_kind

MAX_METADATA = 16  # OpenAI's limits on `metadata`: 16 pairs, keys of 64 and values of 512 characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
MAX_AFFINITY_KEY_CHARS = 1024
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
NO_THINKING = frozenset({"none", "minimal"})  # efforts that turn a thinking model's reasoning off

IGNORED = frozenset({"store", "service_tier", "safety_identifier", "verbosity", "modalities", "audio", "prediction",
                     "web_search_options", "metadata", "user", "prompt_cache_key", "reasoning_effort"})
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                           "stream_options", "n", "user", "presence_penalty", "frequency_penalty",
                           "top_k", "ignore_eos", "stop_token_ids", "logit_bias", "repetition_penalty",
                           "min_tokens", "cache_salt", "kv_transfer_params"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"} | IGNORED
CHAT_FIELDS = COMMON_FIELDS | IGNORED | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "functions", "function_call", "chat_template_kwargs", "max_thinking_tokens"}
# an assistant message as the openai client dumps it back (refusal, annotations, audio, function_call: null)
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content",
                            "refusal", "annotations", "audio", "function_call"})
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
# vLLM's sampling extensions, which /v1/responses passes on to the chat path under the same names
RESPONSES_EXTENSIONS = ("top_k", "seed", "stop", "ignore_eos", "stop_token_ids", "repetition_penalty", "min_tokens",
                        "cache_salt", "presence_penalty", "frequency_penalty", "logit_bias", "chat_template_kwargs")
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "parallel_tool_calls",
    "previous_response_id", "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options",
    "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user", "include",
    "background", "conversation", "prompt", "prompt_cache_key", "prompt_cache_retention", "context_management",
    *RESPONSES_EXTENSIONS})


@dataclass(frozen=True)
class Extras:
    """The known fields a request carries besides its generation parameters. effort: `reasoning_effort` (None:
    unset); affinity: `prompt_cache_key`, a routing key (requests with the same key go to the same worker, so they
    share its prefix cache; unlike `cache_salt` it isolates nothing); metadata: echoed where OpenAI echoes it."""

    effort: str | None = None
    affinity: str | None = None
    metadata: dict[str, str] | None = None


def read_extras(body: Body) -> Extras:
    """Type-check the accepted fields and read those with meaning here. Raises InvalidRequestError naming the field,
    UnsupportedParameterError for audio output."""
    for name in ("user", "safety_identifier", "service_tier"):
        body.string(name)
    body.boolean("store", False)
    body.choice("verbosity", ("low", "medium", "high"))
    for name in ("prediction", "web_search_options"):
        body.obj(name)
    modalities = body.raw.get("modalities")
    if modalities is not None and (not isinstance(modalities, list)
                                   or not all(isinstance(m, str) for m in modalities)):
        raise field_error("modalities", "must be an array of strings", json_kind(modalities))
    for name, given in (("audio", body.has("audio")), ("modalities", any(m != "text" for m in modalities or []))):
        if given:
            raise UnsupportedParameterError(f"'{name}': this server writes text only (no audio output)",
                                            value=json_kind(body.raw.get(name)), param=name)
    key = body.string("prompt_cache_key")
    if key is not None and not 0 < len(key) <= MAX_AFFINITY_KEY_CHARS:
        raise field_error("prompt_cache_key", f"must be a non-empty string of at most {MAX_AFFINITY_KEY_CHARS} "
                          "characters", len(key))
    return Extras(body.choice("reasoning_effort", EFFORTS), key, metadata(body))


def metadata(body: Body) -> dict[str, str] | None:
    """OpenAI's `metadata`: at most 16 string pairs."""
    raw = body.obj("metadata")
    if raw is None:
        return None
    if len(raw) > MAX_METADATA:
        raise field_error("metadata", f"at most {MAX_METADATA} pairs", len(raw))
    for k, v in raw.items():
        if len(k) > MAX_METADATA_KEY or not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            raise field_error(f"metadata.{k[:64]}", f"keys of at most {MAX_METADATA_KEY} characters, string "
                              f"values of at most {MAX_METADATA_VALUE}", json_kind(v))
    return raw
