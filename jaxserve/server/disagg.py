"""Prefill and decode as separate servers (`jaxserve serve --role`, PD_PROTOCOL.md), the HTTP side: the
`kv_transfer_params` body field read into a `Generation`, the role rules (a decode server takes only requests a
prefill server prepared; a prefill server never decodes past the first token), and the routes a router polls:
GET /internal/status, POST /internal/prefix_match."""
from __future__ import annotations

import json
from typing import Any

from flask import Flask, Response, request

from jaxserve.engine import Engine
from jaxserve.server.body import field_error, parse_json
from jaxserve.server.limits import Lifecycle


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
