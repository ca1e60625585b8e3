"""A server's answer relayed as the router's: status and headers as the server sent them, the body whole or
Server-Sent Event by event, and a stream the server breaks off ended by the router with an error event.

Events pass through whole (the bytes of an event split across reads wait for its end), so a stream cut mid-event
never shows the client half an event: it ends `data: {"error": {"type": "backend_error", ...}}` then
`data: [DONE]`. A prefill server's final answer (the first token already ended it) becomes the stream the client
asked for (`whole_as_events`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from flask import Response

from jaxserve.errors import BackendError
from jaxserve.server.pd_fleet import Fleet
from jaxserve.server.pd_metrics import BROKEN, RouterMetrics
from jaxserve.server.pd_upstream import Answer
from jaxserve.server.responses import DONE, error_body, sse

log = logging.getLogger("jaxserve.router")
EVENT_END = b"\n\n"


class Relay:
    """Relays answers, counting the exchanges that break in the router's metrics."""

    def __init__(self, fleet: Fleet, metrics: RouterMetrics) -> None:
        self.fleet, self.metrics = fleet, metrics

    def broken(self, answer: Answer, err: BackendError) -> None:
        url = answer.upstream.url
        self.metrics.errors.labels(self.fleet.pool_of(url), url, BROKEN).inc()
        log.warning("answer from %s broke off: %s", url, err.message)

    def __call__(self, answer: Answer, routed: dict[str, str]) -> Response:
        """The server's answer as the client's; `routed` adds headers (which servers served it)."""
        headers = {**answer.headers, **routed}
        if not answer.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                return Response(answer.read(), status=answer.status, headers=headers)
            except BackendError as e:
                self.broken(answer, e)
                raise
        resp = Response(self.events(answer), status=answer.status, headers=headers)
        resp.call_on_close(answer.close)  # a client gone before the first event still frees the connection
        return resp

    def events(self, answer: Answer) -> Iterator[bytes]:
        """Complete SSE events as they arrive; if the server breaks off, its error and [DONE] instead."""
        pending = b""
        try:
            for chunk in answer.chunks():
                pending += chunk
                end = pending.rfind(EVENT_END) + len(EVENT_END)
                if end >= len(EVENT_END):
                    yield pending[:end]
                    pending = pending[end:]
            if pending:
                yield pending
        except BackendError as e:
            self.broken(answer, e)
            yield (sse(error_body(e)) + DONE).encode()


def whole_as_events(body: dict[str, Any], chat: bool, include_usage: bool) -> Iterator[str]:
    """A whole completion or chat completion answer as the stream of the same answer: per choice, chat's role
    chunk and one chunk with its content, or a completion's one chunk; the usage chunk if asked; [DONE]."""
    base = {"id": body.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body.get("created"), "model": body.get("model")}
    for c in body.get("choices", []):
        choice = {"index": c.get("index", 0), "logprobs": c.get("logprobs"), "finish_reason": c.get("finish_reason")}
        if chat:
            message = c.get("message") or {}
            yield sse({**base, "choices": [{**choice, "logprobs": None, "finish_reason": None,
                                            "delta": {"role": "assistant", "content": ""}}],
                       "system_fingerprint": None})
            delta = {k: message[k] for k in ("content", "reasoning_content", "tool_calls") if message.get(k)}
            yield sse({**base, "choices": [{**choice, "delta": delta}], "system_fingerprint": None})
        else:
            yield sse({**base, "choices": [{**choice, "text": c.get("text", "")}], "system_fingerprint": None})
    if include_usage:
        yield sse({**base, "choices": [], "usage": body.get("usage"), "system_fingerprint": None})
    yield DONE
