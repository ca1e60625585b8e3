"""Prefill and decode as separate servers (`jaxserve serve --role`, PD_PROTOCOL.md), the HTTP side: the
`kv_transfer_params` body field read into a `Generation`, the role rules (a decode server takes only requests a
prefill server prepared; a prefill server never decodes past the first token), and the routes a router polls:
GET /internal/status, POST /internal/prefix_match."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from flask import Flask, Response, request

from jaxserve.engine import Engine
from jaxserve.engine.request import PullSpec
from jaxserve.errors import UnsupportedParameterError
from jaxserve.server.body import field_error, json_kind, parse_json
from jaxserve.server.limits import Lifecycle
from jaxserve.server.protocol import Generation


def add_internal_routes(app: Flask, engine: Engine, lifecycle: Lifecycle) -> None:
    """/internal/status (every role) and /internal/prefix_match (servers that prefill)."""

    @app.get("/internal/status")
    def status() -> Response:
        s = engine.stats()
        body = {"role": engine.cfg.role, "ready": lifecycle.ready, "queued": int(s["waiting"]),
                "running": int(s["running"]), **engine.pool_status(), "max_model_len": engine.cfg.max_model_len}
        return Response(json.dumps(body), mimetype="application/json")

    @app.post("/internal/prefix_match")
    def prefix_match() -> Response:
        raw = parse_json(request.get_data(cache=False))
        ids = raw.get("prompt_token_ids") if isinstance(raw, dict) else None
        vocab = engine.model_cfg.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise field_error("prompt_token_ids", f"must be an array of token ids in [0, {vocab})")
        salt = raw.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise field_error("cache_salt", "must be a string")
        return Response(json.dumps({"cached_tokens": engine.prefix_match(ids, salt)}), mimetype="application/json")


def kv_transfer(gen: Generation, raw: Any, engine: Engine) -> Generation:
    """The body's `kv_transfer_params` into `gen`: {"do_remote_decode": true} (to a prefill server: prefill, first
    token, export the pages; answered whole, whatever `stream` says) or a prefill answer's params (to a decode
    server: where to pull the pages, and the first token). Absent: `gen` as is (the engine's role rules apply)."""
    params = raw.get("kv_transfer_params") if isinstance(raw, dict) else None
    if params is None:
        return gen
    if not isinstance(params, dict):
        raise field_error("kv_transfer_params", "must be an object")
    if gen.n > 1 or gen.more_prompts:
        raise UnsupportedParameterError("kv_transfer_params takes one prompt and n = 1", value=gen.n,
                                        param="kv_transfer_params")
    if params.get("do_remote_decode") is True:
        p = gen.params
        one = replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
        return replace(gen, params=one, export_kv=True, stream=False, include_usage=False)
    return replace(gen, pull=_pull_spec(params, gen.prompt, engine))


def _pull_spec(params: dict[str, Any], prompt: list[int], engine: Engine) -> PullSpec:
    """A decode server's kv_transfer_params, checked against the request's own prompt and this server's pool."""
    def get(name: str, kind: type | tuple[type, ...]) -> Any:
        v = params.get(name)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise field_error(f"kv_transfer_params.{name}", f"is required ({getattr(kind, '__name__', 'number')})",
                              json_kind(v))
        return v

    tid, host, port = get("transfer_id", str), get("host", str), get("port", int)
    first, logprob, n = get("first_token", int), get("first_logprob", (int, float)), get("num_tokens", int)
    if n != len(prompt) or params.get("prompt_token_ids", prompt) != prompt:
        raise field_error("kv_transfer_params.num_tokens", f"the prefill server's prompt ({n} tokens) is not this "
                          f"request's ({len(prompt)} tokens): send the same body to both", n)
    if not 0 <= first < engine.model_cfg.vocab_size:
        raise field_error("kv_transfer_params.first_token", "is not a token id of this model", first)
    want = {"page_size": engine.cfg.page_size, "kv_format": engine.programs.layouts.decode.dtype}
    for name, value in want.items():
        if params.get(name, value) != value:
            raise field_error(f"kv_transfer_params.{name}", f"is {params.get(name)!r}; this decode server's pool "
                              f"has {value!r}", params.get(name))
    return PullSpec(tid, host, port, first, float(logprob))
