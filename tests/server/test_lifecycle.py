"""The server's lifecycle: live vs ready (`/health`, `/ready`, `/health?ready=1` around `--warmup`), and the drain
of a shutdown: nothing new admitted (503 + Retry-After), in-flight streams end with a final event and [DONE]
(in process here; `jaxserve serve` under SIGTERM in test_shutdown.py)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx2 as httpx
import pytest

from test_server import MODEL, TIMEOUT, Served, shared_server, wait_idle
from jaxserve.server import create_app
from jaxserve.server.limits import AppConfig, Lifecycle
from jaxserve.server.main import SPARE_THREADS, STARTUP_BODIES, ServeConfig, make_server, start_warmup


@pytest.fixture
def lifecycle_server():
    """A second app over the shared engine, with its own lifecycle (not ready until a warm-up says so)."""
    engine = shared_server().engine
    lc = Lifecycle(4, ready=False)
    server = make_server(create_app(engine, MODEL, AppConfig(max_inflight=4), lc),
                         ServeConfig("127.0.0.1", 0, 4 + SPARE_THREADS))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    served = Served(engine, server.effective_port, server, thread)
    yield served, lc
    server.close()
    server.task_dispatcher.shutdown(timeout=5)


def test_ready_is_503_until_the_warmup_is_done(lifecycle_server, monkeypatch):
    srv, lc = lifecycle_server
    health = httpx.get(f"{srv.base}/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["ready"] is False  # live, not ready
    for path in ("/ready", "/health?ready=1"):
        r = httpx.get(f"{srv.base}{path}", timeout=TIMEOUT)
        assert r.status_code == 503 and r.json()["status"] == "warming up" and r.headers["Retry-After"]
    finished = srv.engine.stats()["finished"]
    compiled: list[tuple[str, bool]] = []  # the start-up grammars (first_feature_request): kind, ready then
    build = srv.engine.grammar.matcher
    monkeypatch.setattr(srv.engine.grammar, "matcher", lambda so: compiled.append((so.kind, lc.ready)) or build(so))
    start_warmup(srv.engine, "fast", lc, progress=False).join()
    # the start-up requests ran before ready: first_request's and first_feature_request's bodies
    assert srv.engine.stats()["finished"] == finished + 1 + len(STARTUP_BODIES)
    assert compiled == [("json_schema", False), ("lark", False)]  # response_format, then the forced tool call
    for path in ("/ready", "/health?ready=1"):
        r = httpx.get(f"{srv.base}{path}", timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["status"] == "ready"


def test_drain_refuses_new_work_and_ends_streams_with_a_reason(lifecycle_server):
    srv, lc = lifecycle_server
    lc.set_ready()
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.base}/v1/completions", json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(TIMEOUT)
    drained: list[int] = []
    drain = threading.Thread(target=lambda: drained.append(lc.drain(timeout_s=0.0)))
    drain.start()
    drain.join(TIMEOUT)
    reader.join(TIMEOUT)
    assert drained == [1]  # the stream was still running at the (zero) timeout
    assert lines[-1] == "data: [DONE]"
    assert "shutting down" in lines[-2] and '"error"' in lines[-2]  # the final event says why
    r = httpx.post(f"{srv.base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                   timeout=TIMEOUT)
    assert r.status_code == 503 and r.headers["Retry-After"] and r.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(f"{srv.base}/ready", timeout=TIMEOUT).status_code == 503
    assert httpx.get(f"{srv.base}/health", timeout=TIMEOUT).status_code == 200
    assert lc.admission.in_flight == 0
    wait_idle(srv.engine)


def _until(cond, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_stream_whose_client_leaves_frees_its_slot_before_any_write(lifecycle_server):
    """With the engine held mid-step (a compile or a long prefill), a stream has written nothing; its client
    hanging up still frees its admission slot at once, not at the stream's next write."""
    srv, lc = lifecycle_server
    lc.set_ready()
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True}).encode()
    with srv.engine._step_lock:  # the engine cannot step: no token, no write
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert _until(lambda: lc.admission.in_flight == 1)
        s.close()
        assert _until(lambda: lc.admission.in_flight == 0)
    wait_idle(srv.engine)
