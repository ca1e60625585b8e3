"""The OpenAPI 3.1 description of the HTTP API, served at /openapi.json."""
from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: str) -> dict[str, Any]:
    text = {"400": "invalid request: malformed JSON (NaN/Infinity literals included), a wrong type or range, text "
                   "that is not valid Unicode (a lone surrogate), an invalid tool name (the field is named in "
                   "`param`), conflicting max_tokens / max_completion_tokens, prompt + max_tokens over the context "
                   "window (`context_length_exceeded`)",
            "404": "the body's `model` is not the served model (`model_not_found`)",
            "413": "body over the server's limit (4 MiB by default), refused from Content-Length before it is read",
            "415": "the body is not declared `Content-Type: application/json` (UTF-8)",
            "429": "the server's admission limit is reached; retry after the `Retry-After` seconds",
            "500": "the engine failed the request (e.g. `kv_integrity_error`: a KV page tag mismatch, failed closed; "
                   "`invalid_tool_call`: the model wrote tool-call markup that does not parse; an output cut by "
                   "max_tokens inside a call is not one, see `tools`)"}
    return {c: _json(_ref("Error"), text[c]) for c in codes}


_SAMPLING: dict[str, Any] = {
    "model": {"type": "string", "description": "the served model's id (GET /v1/models)"},
    "max_tokens": {"type": "integer", "minimum": 1, "description": "prompt + max_tokens must fit the context window"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1, "description": "0 is greedy"},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": 0, "default": 0, "description": "extension; 0 disables"},
    "seed": {"type": "integer", "minimum": 0, "maximum": 4294967295},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "description": "extension"},
    "ignore_eos": {"type": "boolean", "default": False, "description": "extension: do not stop at end-of-sequence"},
    "stream": {"type": "boolean", "default": False, "description": "Server-Sent Events ending in `data: [DONE]`"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                       "additionalProperties": False},
    "n": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1,
          "description": "choices; the first is prefilled alone, the others reuse its prompt pages (prefix cache); "
                         "with a seed, choice i samples with seed + i"},
    "user": {"type": "string"},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0,
                         "description": "subtracted once from the logit of every token already generated"},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "default": 0,
                          "description": "subtracted per occurrence from the logit of every generated token"},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2, "default": 1,
                           "description": "extension: logits of prompt and generated tokens divided (positive) or "
                                          "multiplied (negative) by it"},
    "logit_bias": {"type": "object", "maxProperties": 300, "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id -> bias added to its logit"},
    "min_tokens": {"type": "integer", "minimum": 0, "default": 0,
                   "description": "extension: end-of-sequence and stop_token_ids are banned before this many tokens"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 1024, "description":
                   "as vLLM: prefix-cache pages are shared only among requests with the same salt (or none); use a "
                   "secret, unguessable value per tenant"},
}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {
        "type": "integer", "description": "prompt tokens served from the prefix cache (whole KV pages)"}}}}}

_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None]}

_COMPLETION_REQUEST = {
    "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
    "properties": {**_SAMPLING, "max_tokens": {**_SAMPLING["max_tokens"], "default": 16},
                   "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                        {"type": "array", "maxItems": 1}]},
                   "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5,
                                "description": "the sampled tokens' logprobs and this many top alternatives per token"},
                   "echo": {"type": "boolean", "enum": [False]},
                   "best_of": {"type": "integer", "enum": [1]}}}

_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}

_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
    "name": _NAME, "tool_calls": {"type": "array"},
    "tool_call_id": {"type": "string"}}}

_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _NAME, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}

_RESPONSE_FORMAT = {
    "oneOf": [{"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}},
              {"type": "object", "required": ["type", "json_schema"], "properties": {
                  "type": {"const": "json_schema"},
                  "json_schema": {"type": "object", "required": ["name"], "properties": {
                      "name": {"type": "string"}, "description": {"type": "string"},
                      "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}}],
    "description": "enforced by grammar-constrained decoding (llguidance)"}

_TOOL_CHOICE = {
    "oneOf": [{"enum": ["auto", "none", "required"]},
              {"type": "object", "required": ["type", "function"], "properties": {
                  "type": {"const": "function"},
                  "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}],
    "description": "auto: the output is parsed for the model's tool-call markup (Kimi K2 or GLM); required / named: "
                   "the markup is enforced by constrained decoding"}

_CHAT_REQUEST = {
    "type": "object", "required": ["model", "messages"], "additionalProperties": False,
    "properties": {**_SAMPLING, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                   "max_completion_tokens": {"type": "integer", "minimum": 1,
                                             "description": "or max_tokens (equal if both are sent); default 1024 "
                                                            "(`--default-max-tokens`), at most the rest of the "
                                                            "context window"},
                   "logprobs": {"type": "boolean"},
                   "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20,
                                    "description": "alternatives per token (needs logprobs: true)"},
                   "response_format": _RESPONSE_FORMAT,
                   "tools": {"type": "array", "items": _TOOL, "maxItems": 128,
                             "description": "passed to the chat template; calls come back as `message.tool_calls` / "
                                            "`delta.tool_calls` with finish_reason `tool_calls`; an output cut by "
                                            "max_tokens inside a call ends with finish_reason `length`, the complete "
                                            "calls kept and the unfinished one returned with its partial "
                                            "arguments text"},
                   "tool_choice": _TOOL_CHOICE,
                   "parallel_tool_calls": {"type": "boolean", "default": True}}}

_COMPLETION = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "items": {"type": "object", "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
        "logprobs": {"type": ["object", "null"], "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": {"type": "number"}},
            "text_offset": {"type": "array", "items": {"type": "integer"}}}}}}}}}

_TOOL_CALL = {"type": "object", "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}

_CHAT_COMPLETION = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "items": {"type": "object", "properties": {
        "index": {"type": "integer"}, "finish_reason": _FINISH,
        "message": {"type": "object", "properties": {"role": {"const": "assistant"},
                                                     "content": {"type": ["string", "null"]},
                                                     "tool_calls": {"type": "array", "items": _TOOL_CALL}}},
        "logprobs": {"type": ["object", "null"], "properties": {"content": {"type": "array", "items": {
            "type": "object", "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                                             "bytes": {"type": ["array", "null"]}}}}}}}}}}}

_RESPONSES_REQUEST = {"type": "object", "required": ["model"], "properties": {
    "model": {"type": "string"}, "input": {"type": ["string", "array"]}, "instructions": {"type": ["string", "null"]},
    "tools": {"type": "array"}, "tool_choice": {"type": ["string", "object"]}, "max_output_tokens": {"type": "integer"},
    "previous_response_id": {"type": ["string", "null"]}, "store": {"type": "boolean"}, "stream": {"type": "boolean"},
    "text": {"type": "object"}, "reasoning": {"type": "object"}, "metadata": {"type": "object"}}}
_RESPONSE = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
    "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]}, "model": {"type": "string"},
    "output": {"type": "array", "items": {"type": "object"}}, "usage": {"type": ["object", "null"]}}}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}

_SSE = {"text/event-stream": {"schema": {"type": "string", "description":
                                         "`data: <chunk JSON>` events, then `data: [DONE]`; an engine failure "
                                         "mid-stream is sent as `data: <Error JSON>` before `data: [DONE]`"}}}


def _generation(summary: str, req: str, resp: str) -> dict[str, Any]:
    """The path item of a generation endpoint: request `req`, JSON answer `resp` or its SSE stream."""
    return {"post": {
        "summary": summary,
        "parameters": [{"name": "x-session-affinity", "in": "header", "required": False,
                        "schema": {"type": "string"}, "description": "routes the request's session"}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(req)}}},
        "responses": {"200": {"description": "the completion, or its stream",
                              "content": {"application/json": {"schema": _ref(resp)}, **_SSE}},
                      **_errors("400", "404", "413", "415", "429", "500")}}}


def _paths() -> dict[str, Any]:
    return {
        "/v1/models": {"get": {"summary": "the served model", "responses": {"200": _json(
            {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array"}}},
            "one model card")}}},
        "/v1/completions": _generation("text completion", "CompletionRequest", "Completion"),
        "/v1/chat/completions": _generation("chat completion (the tokenizer's chat template)", "ChatRequest",
                                            "ChatCompletion"),
        "/v1/responses": _generation("OpenAI Responses API, run as a chat completion (typed SSE events when "
                                     "streamed)", "ResponsesRequest", "Response"),
        "/v1/responses/{response_id}": {"get": {
            "summary": "a stored response", "parameters": [{"name": "response_id", "in": "path", "required": True,
                                                            "schema": {"type": "string"}}],
            "responses": {"200": _json(_ref("Response"), "the response object"), **_errors("404")}}},
        "/health": {"get": {"summary": "liveness (?ready=1: as /ready)",
                            "responses": {"200": _json({"type": "object"}, "ok")}}},
        "/ready": {"get": {"summary": "readiness: warmed up and not draining",
                           "responses": {"200": _json({"type": "object"}, "ready"),
                                         "503": _json({"type": "object"}, "warming up or draining")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
            "description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "this document",
                                  "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")}}},
    }


def openapi_spec(model_name: str) -> dict[str, Any]:
    """The OpenAPI document; `model_name` is the only accepted `model`."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving `{model_name}`."},
        "paths": _paths(),
        "components": {"schemas": {"CompletionRequest": _COMPLETION_REQUEST, "ChatRequest": _CHAT_REQUEST,
                                   "Completion": _COMPLETION, "ChatCompletion": _CHAT_COMPLETION, "Error": _ERROR,
                                   "ResponsesRequest": _RESPONSES_REQUEST, "Response": _RESPONSE}},
    }
