"""`jaxserve router`'s HTTP app: an OpenAI-compatible front end over a pool of prefill servers and a pool of
decode servers (`jaxserve serve --role prefill|decode`), or over prefill-pool servers of `--role both` alone
(then each request goes whole to one of them: a data-parallel front end).

A generation request (/v1/completions, /v1/chat/completions) is parsed as the servers will parse it (the same
parsers, tokenizer and chat template: `ParseView`), which gives its prompt token ids and max_tokens. Then:
1. prefill server: the session's pin, else `pd_policy.pick_prefill` over the cached prefix each live server
   reports for the prompt (`POST /internal/prefix_match`, asked only when there is a choice) and queue depths;
2. without a decode pool the request goes there whole and its answer is relayed;
3. with one, the prefill server gets the body with `"kv_transfer_params": {"do_remote_decode": true}` (not
   streamed) and answers the first token plus the `kv_transfer_params` the decode side needs (none: the first
   token ended the request, and that answer is the client's, as a stream if it asked for one); the decode server
   (`pd_policy.pick_decode`: free pages vs the request's prompt + max_tokens pages, then load) gets the original
   body plus those `kv_transfer_params`, and its answer (streamed or not) is relayed (`server.pd_relay`).
A server's error status and body are relayed as they are. A request that cannot connect to its server goes to
another of the pool (nothing was sent). A decode leg that fails before its answer starts (the server went away,
502 kv_transfer_error, 503 out of pages) is run once more from the prefill, on another decode server; a whole
request whose server went away before answering, once more on another server. A server
that dies or is cut mid-answer fails that request with a 502 `backend_error` naming the server; mid-stream (the
status line is out) the stream's last events are that error and `data: [DONE]`.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, request

from jaxserve.config import ModelConfig
from jaxserve.engine import EngineConfig
from jaxserve.errors import BackendError, BackendUnreachableError
from jaxserve.server.body import parse_json, require_json
from jaxserve.server.chat_request import parse_chat
from jaxserve.server.limits import AppConfig
from jaxserve.server.pd_fleet import Fleet
from jaxserve.server.pd_metrics import BROKEN, RouterMetrics
from jaxserve.server.pd_relay import Relay, whole_as_events
from jaxserve.server.pd_policy import (DECODE, PREFILL, Pin, PolicyConfig, SessionTable, pages_for, pick_decode,
                                       pick_prefill)
from jaxserve.server.protocol import Generation, parse_completion
from jaxserve.server.pd_upstream import Answer
from jaxserve.server.responses import add_error_handlers
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger("jaxserve.router")
Parse = Callable[[Any, Any, str, AppConfig], Generation]
FORWARDED_HEADERS = ("x-session-affinity", "authorization")
RETRIES = 1  # a request whose server failed before its answer started runs again on another server, once
RETRIED_STATUSES = (502, 503)  # kv_transfer_error (the pull failed), out_of_pages / service_unavailable
PREFILL_HEADER, DECODE_HEADER = "x-jaxserve-prefill-server", "x-jaxserve-decode-server"


@dataclass(frozen=True)
class ParseView:
    """What the request parsers read of an Engine (its tokenizer, model config and context window), so the router
    turns a body into the same prompt token ids as the servers, without loading weights."""

    tokenizer: Tokenizer
    model_cfg: ModelConfig
    cfg: EngineConfig


@dataclass(frozen=True)
class RouterConfig:
    model_name: str
    app: AppConfig = AppConfig()
    policy: PolicyConfig = PolicyConfig()


class PdProxy:
    """The generation endpoints' handler: parse, route, forward, relay."""

    def __init__(self, fleet: Fleet, tokenizer: Tokenizer, model_cfg: ModelConfig, cfg: RouterConfig,
                 metrics: RouterMetrics) -> None:
        self.fleet, self.cfg, self.metrics = fleet, cfg, metrics
        self.tokenizer, self.model_cfg = tokenizer, model_cfg
        self.sessions = SessionTable()
        self.relay = Relay(fleet, metrics)
        self._views: dict[int, ParseView] = {}
        self._lock = threading.Lock()

    def view(self) -> ParseView:
        """The parse view at the servers' context window (the model's own before any server reported one)."""
        max_len = self.fleet.max_model_len() or self.model_cfg.max_position_embeddings
        with self._lock:
            if max_len not in self._views:
                self._views[max_len] = ParseView(self.tokenizer, self.model_cfg, EngineConfig(max_model_len=max_len))
            return self._views[max_len]

    def __call__(self, parse: Parse) -> Response:
        require_json(request.mimetype or None, request.mimetype_params, request.content_type)
        raw = request.get_data(cache=False)
        body = parse_json(raw)
        gen = parse(body, self.view(), self.cfg.model_name, self.cfg.app)
        session = request.headers.get("x-session-affinity") or gen.extras.affinity
        pin = self.sessions.get(session)
        if pin is not None:
            self.metrics.sessions.inc()
        headers = {"Content-Type": "application/json"}
        headers |= {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        if not self.fleet.disaggregated:
            return self.whole(raw, gen, session, pin, headers)
        return self.disaggregated(body, gen, session, pin, headers)

    def whole(self, raw: bytes, gen: Generation, session: str | None, pin: Pin | None,
              headers: dict[str, str]) -> Response:
        """The request, whole, to one prefill-pool server (role both); one that fails before its answer starts
        (it died or hung) is replaced by another, once."""
        tried: set[str] = set()
        for attempt in range(1 + RETRIES):
            try:
                url, answer = self.send(PREFILL, lambda: self.choose_prefill(gen, pin, tried), raw, headers, pages=0)
            except BackendError as e:
                if attempt == RETRIES:
                    raise
                tried.add(e.value)
                pin = None
                log.warning("%s; sending the request to another server", e.message)
                continue
            self.sessions.set(session, Pin(url))
            return self.relay(answer, {PREFILL_HEADER: url})
        raise AssertionError("unreachable: the last attempt returns or raises")

    def disaggregated(self, body: dict[str, Any], gen: Generation, session: str | None, pin: Pin | None,
                      headers: dict[str, str]) -> Response:
        """Prefill on one server (first token + kv_transfer_params), then decode on another. A decode leg that fails
        before its answer starts (its server went away, the KV transfer failed, its pool was full) is run once
        more from the prefill, on another decode server: nothing reached the client yet."""
        page_size = self.fleet.page_size(DECODE)
        pages = sum(pages_for(len(p), gen.params.max_tokens, page_size, gen.n) for p in gen.prompts) \
            if page_size else 0
        tried: set[str] = set()
        d_pin = pin.decode if pin is not None else None
        pick_decode(self.fleet.views(DECODE), pages, d_pin)  # no live decode server: refused before any prefill
        first = {k: v for k, v in body.items() if k != "stream_options"}
        first |= {"stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        for attempt in range(1 + RETRIES):
            p_url, answer = self.send(PREFILL, lambda: self.choose_prefill(gen, pin), json.dumps(first).encode(),
                                      headers, pages=0)
            routed = {PREFILL_HEADER: p_url}
            if answer.status != 200:
                return self.relay(answer, routed)
            prefilled = answer.json()
            params = prefilled.get("kv_transfer_params") if isinstance(prefilled, dict) else None
            if params is None:  # the first token ended the request: the prefill answer is final
                self.sessions.set(session, Pin(p_url, d_pin))
                return self.final(prefilled, gen, routed)

            def choose() -> str:
                views = self.fleet.views(DECODE)
                return pick_decode([v for v in views if v.url not in tried] or views, pages, d_pin)

            d_body = json.dumps({**body, "kv_transfer_params": params}).encode()
            try:
                d_url, answer = self.send(DECODE, choose, d_body, headers, pages)
            except BackendError as e:
                if attempt == RETRIES:
                    raise
                tried.add(e.value)
                log.warning("%s; prefilling again for another decode server", e.message)
                continue
            if answer.status in RETRIED_STATUSES and attempt < RETRIES:
                log.warning("decode server %s answered %d: %s; prefilling again for another decode server", d_url,
                            answer.status, answer.read()[:300])
                tried.add(d_url)
                d_pin = None
                continue
            self.sessions.set(session, Pin(p_url, d_url))
            return self.relay(answer, routed | {DECODE_HEADER: d_url})
        raise AssertionError("unreachable: the last attempt returns or raises")

    def final(self, prefilled: dict[str, Any], gen: Generation, routed: dict[str, str]) -> Response:
        """A prefill server's final answer, streamed if the client asked for a stream."""
        if not gen.stream:
            return Response(json.dumps(prefilled), mimetype="application/json", headers=routed)
        chat = request.path.endswith("/chat/completions")
        return Response(whole_as_events(prefilled, chat, gen.include_usage), mimetype="text/event-stream",
                        headers=routed | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def forward(self) -> Response:
        """A GET (the model cards) answered by a live prefill-pool server."""
        url, answer = self.send(PREFILL, lambda: pick_prefill(self.fleet.views(PREFILL), {}), None, {}, pages=0)
        return self.relay(answer, {PREFILL_HEADER: url})

    def choose_prefill(self, gen: Generation, pin: Pin | None, avoid: Collection[str] = ()) -> str:
        """The prefill server for `gen`, not one in `avoid` unless no other lives."""
        views = self.fleet.views(PREFILL)
        views = [v for v in views if v.url not in avoid and v.alive] or views
        live = [v.url for v in views if v.alive]
        pinned = pin.prefill if pin is not None else None
        cached = {} if pinned in live or len(live) < 2 else \
            {url: self.prefix_match(url, gen.prompt, gen.cache_salt) for url in live}
        url = pick_prefill(views, cached, pinned, self.cfg.policy)
        self.metrics.cached_tokens.labels(url).inc(cached.get(url, 0))
        return url

    def prefix_match(self, url: str, prompt: list[int], salt: str | None) -> int:
        """Tokens of `prompt` (under the request's cache_salt) the server's prefix cache holds (0: cannot say)."""
        query: dict[str, Any] = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt is not None else {})
        try:
            code, body = self.fleet.upstream(url).probe("POST", "/internal/prefix_match", query)
        except BackendError:
            return 0  # the health checks judge the server; routing goes on without its answer
        cached = body.get("cached_tokens") if code == 200 and isinstance(body, dict) else 0
        return cached if isinstance(cached, int) and not isinstance(cached, bool) else 0

    def send(self, pool: str, choose: Callable[[], str], body: bytes | None, headers: dict[str, str],
             pages: int) -> tuple[str, Answer]:
        """Send this request (method, path) with `body` to the server `choose()` picks -> (its URL, its answer); a server that cannot be
        reached is marked dead and the next pick tried. Raises NoBackendError when none is left."""
        while True:
            url = choose()
            self.metrics.requests.labels(pool, url).inc()
            self.fleet.sent(url, pages)
            try:
                answer = self.fleet.upstream(url).request(request.method, request.path, body, headers)
            except BackendError as e:
                self.fleet.done(url)
                self.metrics.errors.labels(pool, url, BROKEN).inc()
                if not isinstance(e, BackendUnreachableError):
                    raise
                log.warning("%s; sending the request to another %s server", e.message, pool)
                self.fleet.unreachable(url, e)
                continue
            if answer.status >= 400:
                self.metrics.errors.labels(pool, url, str(answer.status)).inc()
            answer.on_close(lambda: self.fleet.done(url))
            return url, answer

def create_router_app(fleet: Fleet, tokenizer: Tokenizer, model_cfg: ModelConfig, cfg: RouterConfig) -> Flask:
    """The router's Flask app over `fleet` (whose health checks the caller starts)."""
    app = Flask("jaxserve-router")
    app.config["MAX_CONTENT_LENGTH"] = cfg.app.max_body_bytes  # waitress refuses larger bodies first
    metrics = RouterMetrics(fleet)
    proxy = PdProxy(fleet, tokenizer, model_cfg, cfg, metrics)

    @app.post("/v1/completions")
    def completions() -> Response:
        return proxy(parse_completion)

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        return proxy(parse_chat)

    @app.get("/v1/models")
    @app.get("/v1/models/<path:name>")
    def models(name: str | None = None) -> Response:
        return proxy.forward()

    @app.get("/health")
    def health() -> Response:
        servers = [{"pool": pool, "url": url, "alive": alive, "ready": s.ready, "queued": s.queued,
                    "running": s.running, "free_pages": s.free_pages, "in_flight": n}
                   for pool, url, alive, s, n in fleet.snapshot()]
        return Response(json.dumps({"status": "ok", "model": cfg.model_name, "servers": servers}),
                        mimetype="application/json")

    @app.get("/ready")
    def ready() -> Response:
        pools = {PREFILL, DECODE} if fleet.disaggregated else {PREFILL}
        up = {pool for pool, _, alive, s, _ in fleet.snapshot() if alive and s.ready}
        ok = pools <= up
        return Response(json.dumps({"status": "ready" if ok else "not ready", "pools_ready": sorted(up)}),
                        status=200 if ok else 503, mimetype="application/json")

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    add_error_handlers(app, metrics.request)
    return app
