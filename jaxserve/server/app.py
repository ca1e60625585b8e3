"""The OpenAI-compatible HTTP API over one Engine: `create_app(engine, model_name) -> Flask`, its routes and handlers.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
Server-Sent Events ending in `data: [DONE]`), POST /v1/responses and GET /v1/responses/{id} (`server.responses_api`:
a chat request underneath), GET /health (live), GET /ready (warmed up, not draining), GET /metrics,
GET /openapi.json, GET /internal/status and POST /internal/prefix_match (`server.disagg`, for a router; with
`kv_transfer_params` a request is one step of prefill and decode as separate servers). While the server drains (`server.limits.Lifecycle`), generation requests get 503 + Retry-After.

A generation request's body is read as strict JSON (`server.body`: 415 unless declared JSON) and validated into a
`Generation` (`server.protocol`: a 400 naming the field) before anything reaches the engine; then it is admitted
(`server.limits`: past `AppConfig.max_inflight` requests in flight it is answered 429 + Retry-After at once),
submitted, and answered whole or streamed (`server.responses`). A non-streaming request whose client disconnects
is aborted in the engine.

Every error leaves as an OpenAI-shaped body `{"error": {"message", "type", "param", "code"}}` with the status from
`jaxserve.errors.http_status` (the one place that maps exception types to codes). The app owns its handler objects
and metrics: no global state.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from flask import Flask, Response, request

from jaxserve.engine import Engine, TokenEvent
from jaxserve.errors import ModelNotFoundError, ShuttingDownError
from jaxserve.server.body import parse_json, require_json
from jaxserve.server.limits import RETRY_AFTER_S, AppConfig, DisconnectWatcher, Lifecycle, once
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openapi import openapi_spec
from jaxserve.server.chat_request import parse_chat
from jaxserve.server.disagg import add_internal_routes, kv_transfer
from jaxserve.server.protocol import Generation, parse_completion
from jaxserve.server.responses_api import ResponsesApi
from jaxserve.server.responses import (CHAT, COMPLETION, Reply, Shape, TokenText, add_error_handlers,
                                       complete, single_choice, stream)

log = logging.getLogger("jaxserve.server")

Parse = Callable[[Any, Engine, str, AppConfig], Generation]
IGNORED_HEADER = "x-jaxserve-ignored-fields"


def _request_json() -> Any:
    """The current request's body as validated JSON; its Content-Type is checked before the body is read."""
    require_json(request.mimetype or None, request.mimetype_params, request.content_type)
    return parse_json(request.get_data(cache=False))


class GenerationHandler:
    """The generation endpoints' handler: validate the body, admit, submit to the engine, answer whole or streamed.
    Holds the admission gate and the disconnect watcher of one app."""

    def __init__(self, engine: Engine, model_name: str, cfg: AppConfig, metrics: ServerMetrics,
                 lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.model_name = model_name
        self.cfg = cfg
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.admission = lifecycle.admission
        self.watcher = DisconnectWatcher(engine.abort)
        self.tokens = TokenText(engine.tokenizer)

    def __call__(self, parse: Parse, shape: Shape) -> Response:
        t0 = time.monotonic()
        self.check_open()
        raw = _request_json()
        gen = kv_transfer(parse(raw, self.engine, self.model_name, self.cfg), raw, self.engine)
        reply, ids, events = self.start(gen, shape)
        resp = self.streamed(reply, ids, events, t0) if gen.stream else self.whole(reply, ids, events, t0)
        return name_ignored(resp, gen.ignored)

    def check_open(self) -> None:
        """Raises ShuttingDownError (503) while the server drains."""
        if self.lifecycle.draining:
            raise ShuttingDownError("the server is shutting down: retry on another replica", value="draining")

    def start(self, gen: Generation, shape: Shape) -> tuple[Reply, list[str], Iterator[tuple[int, TokenEvent]]]:
        """Admit a validated request and submit it -> (its reply, engine request ids, events); a drain's timeout
        aborts it."""
        self.admission.enter()  # after validation: a bad request is a 400 even when the server is full
        try:
            rid, ids, events = self.submit(gen, shape)
        except BaseException:
            self.admission.leave()
            raise
        self.lifecycle.track(rid, functools.partial(self.abort_all(ids), rid))
        reply = Reply(gen, shape, rid, self.model_name, self.tokens, self.metrics,
                      aborted_why=lambda: self.lifecycle.abort_reason)
        return reply, ids, events

    def whole(self, reply: Reply, ids: list[str], events: Iterator[tuple[int, TokenEvent]], t0: float) -> Response:
        """The non-streamed answer; the request leaves admission and the drain's tracking when it is built."""
        try:
            disconnected = request.environ.get("waitress.client_disconnected")  # needs channel_request_lookahead
            return complete(reply, events, t0, self.watcher, disconnected, self.abort_all(ids))
        finally:
            self.lifecycle.untrack(reply.rid)
            self.admission.leave()

    def submit(self, gen: Generation, shape: Shape) -> tuple[str, list[str], Iterator[tuple[int, TokenEvent]]]:
        """-> (response id, engine request ids, events as (choice index, event))."""
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        reqs = gen.requests(rid, request.headers.get("x-session-affinity"))
        # raises InvalidRequestError (400) or QueueFullError (429)
        if len(reqs) == 1:
            one = self.engine.submit(reqs[0])
            return rid, [rid], single_choice(one)
        return rid, [r.request_id for r in reqs], self.engine.submit_group(reqs)

    def abort_all(self, ids: list[str]) -> Callable[[str], None]:
        return lambda _rid: [self.engine.abort(i) for i in ids]

    def streamed(self, reply: Reply, ids: list[str], events: Iterator[tuple[int, TokenEvent]],
                 t0: float) -> Response:
        """The SSE response; admission is left when the server closes it, however the stream ended, or as soon
        as the watcher sees its client hang up (not at the next write: a queued stream writes nothing)."""
        ended = threading.Event()
        # counted once, by the watcher (before its abort) or by the stream's close, whichever sees it first
        hung_up = once(functools.partial(self.metrics.disconnect, reply.shape.endpoint))
        resp = Response(stream(reply, events, t0, ended, hung_up), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        leave = self.admission.once()
        disconnected = request.environ.get("waitress.client_disconnected")
        if disconnected is not None:
            abort = self.abort_all(ids)
            self.watcher.watch(reply.rid, disconnected, lambda rid: (hung_up(), abort(rid), leave()))

        def closed() -> None:
            self.watcher.unwatch(reply.rid)
            self.lifecycle.untrack(reply.rid)
            if not ended.is_set():
                for i in ids:
                    self.engine.abort(i)  # a stream closed before its first chunk never ran the generator's cleanup
            leave()

        resp.call_on_close(closed)
        return resp


def name_ignored(resp: Response, ignored: tuple[str, ...]) -> Response:
    """Name the request's unknown fields in the answer and the log (as vLLM warns), so a typo is visible."""
    if ignored:
        # JSON string escapes keep a header (latin-1, one line) and a log line safe from any name a client sends
        names = ", ".join(json.dumps(name)[1:-1] for name in ignored)[:1000]
        log.warning("%s: ignored unknown request fields: %s", request.path, names)
        resp.headers[IGNORED_HEADER] = names
    return resp


def create_app(engine: Engine, model_name: str, cfg: AppConfig | None = None,
               lifecycle: Lifecycle | None = None) -> Flask:
    """A Flask app serving `engine` under `model_name` (what clients pass as `model`). lifecycle: its readiness,
    draining and admission (default: ready at once, admitting cfg.max_inflight)."""
    cfg = cfg if cfg is not None else AppConfig(max_inflight=engine.cfg.max_queue)
    lifecycle = lifecycle if lifecycle is not None else Lifecycle(cfg.max_inflight)
    app = Flask("jaxserve")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes  # waitress refuses larger bodies first (main.py)
    metrics = ServerMetrics(engine)
    generate = GenerationHandler(engine, model_name, cfg, metrics, lifecycle)

    @app.post("/v1/completions")
    def completions() -> Response:
        return generate(parse_completion, COMPLETION)

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        return generate(parse_chat, CHAT)

    responses = ResponsesApi(generate)

    @app.post("/v1/responses")
    def create_response() -> Response:
        return name_ignored(*responses.create(_request_json()))

    @app.get("/v1/responses/<response_id>")
    def get_response(response_id: str) -> Response:
        return responses.get(response_id)

    _add_info_routes(app, engine, model_name, metrics, lifecycle)
    add_internal_routes(app, engine, lifecycle)
    add_error_handlers(app, metrics.request, cfg.retry_after_s)
    return app


def _add_info_routes(app: Flask, engine: Engine, model_name: str, metrics: ServerMetrics,
                     lifecycle: Lifecycle) -> None:
    """The read-only endpoints: the model cards, /health (live: 200 while the process answers; with ?ready=1 as
    /ready), /ready (503 until warm-up is done and from the start of a drain on), /metrics and /openapi.json."""
    created = int(time.time())
    spec = openapi_spec(model_name)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "jaxserve",
                "max_model_len": engine.cfg.max_model_len}

    @app.get("/v1/models")
    def models() -> Response:
        return Response(json.dumps({"object": "list", "data": [model_card()]}), mimetype="application/json")

    @app.get("/v1/models/<path:name>")
    def model(name: str) -> Response:
        if name != model_name:
            raise ModelNotFoundError(f"the model '{name[:100]}' does not exist", value=name[:100], param="model")
        return Response(json.dumps(model_card()), mimetype="application/json")

    @app.get("/health")
    def health() -> Response:
        if request.args.get("ready") in ("1", "true"):
            return ready()
        s = engine.stats()
        return Response(json.dumps({"status": "ok", "model": model_name, "ready": lifecycle.ready,
                                    "state": lifecycle.state(), "running": s["running"], "waiting": s["waiting"]}),
                        mimetype="application/json")

    @app.get("/ready")
    def ready() -> Response:
        resp = Response(json.dumps({"status": lifecycle.state(), "model": model_name}),
                        status=200 if lifecycle.ready else 503, mimetype="application/json")
        if not lifecycle.ready:
            resp.headers["Retry-After"] = str(RETRY_AFTER_S)
        return resp

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    @app.get("/openapi.json")
    def openapi() -> Response:
        return Response(json.dumps(spec), mimetype="application/json")
