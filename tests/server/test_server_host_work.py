"""A request's host work at the server (chat templating and tokenization, grammar compilation, detokenization)
never runs in the engine loop: while one stream is running, another request whose template or grammar is slow to
build delays only itself. Structural, not timed: the slow build is a hook that blocks until the running stream's
client has received more tokens, so a build run inside the engine step would deadlock; the bounded wait would time
out and the test fail."""
from __future__ import annotations

import json
import threading

import httpx2 as httpx
import pytest

from engine_util import Progress, engine_advances, record_decoder_threads
from jaxserve.engine import Engine
from test_server import MODEL, TIMEOUT, Served, shared_server, sse_events, wait_idle

MORE = 5  # chunks the running stream must receive while the other request's work is blocked


@pytest.fixture(scope="module")
def srv() -> Served:
    return shared_server()


class Streaming(Progress):
    """A streamed completion read on its own thread, counting its content chunks."""

    def __init__(self, srv: Served, max_tokens: int) -> None:
        super().__init__(TIMEOUT)
        self.finish: str | None = None
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(srv.base, body), name="client-a", daemon=True)
        self.thread.start()

    def _run(self, base: str, body: dict) -> None:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as resp:
            for data in sse_events(resp):
                if data == "[DONE]":
                    break
                choices = json.loads(data)["choices"]
                self.finish = (choices[0].get("finish_reason") if choices else None) or self.finish
                self.add(bool(choices))


def blocking(real, engine: Engine, running: Streaming, waited: list[bool]):  # noqa: ANN001, ANN201
    """`real`, delayed until the engine has generated MORE tokens and the running stream's client has received MORE
    chunks (whether both happened goes to `waited`)."""
    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        waited.append(engine_advances(engine, MORE, TIMEOUT) and running.wait_more(MORE))
        return real(*args, **kwargs)
    return slow


def check_delays_only_itself(srv: Served, monkeypatch, owner: object, attr: str, body: dict) -> dict:
    """Stream A runs; `owner.attr` (a build step of the request `body`) is made slow until A got MORE chunks; the
    request is sent -> its answer. A must have gone on meanwhile and finished."""
    a = Streaming(srv, max_tokens=150)
    assert a.wait_for(1)
    waited: list[bool] = []
    monkeypatch.setattr(owner, attr, blocking(getattr(owner, attr), srv.engine, a, waited))
    r = httpx.post(f"{srv.base}/v1/chat/completions", json=body, timeout=TIMEOUT)
    monkeypatch.undo()
    assert r.status_code == 200, r.text
    assert waited == [True]  # the stream went on while this request's build was blocked
    a.thread.join(TIMEOUT)
    assert a.finish == "length"
    wait_idle(srv.engine)
    return r.json()


def test_a_slow_chat_template_delays_only_its_own_request(srv, monkeypatch):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True}
    out = check_delays_only_itself(srv, monkeypatch, srv.engine.tokenizer, "encode_chat", body)
    assert out["usage"]["completion_tokens"] == 2


def test_a_slow_grammar_build_delays_only_its_own_request(srv, monkeypatch):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_object"}}
    out = check_delays_only_itself(srv, monkeypatch, srv.engine.grammar, "matcher", body)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_text_is_made_on_the_request_thread(srv, monkeypatch):
    names = record_decoder_threads(monkeypatch)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 6, "ignore_eos": True, "stop": ["\x00"],
                "stream": stream, "n": 2}
        r = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    assert len(names) == 24 and "jaxserve-engine" not in names
