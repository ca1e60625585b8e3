"""Property test: malformed bodies (random JSON, wrong types, missing fields, huge numbers, non-JSON bytes) sent to
the generation endpoints never produce a 5xx or a hung worker, and the server still answers afterwards."""
from __future__ import annotations

import json
import socket

import httpx2 as httpx  # the HTTP client the pinned openai package ships with
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from test_server import MODEL, TIMEOUT, Served, shared_server, sse_events, wait_idle

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# valid bodies with a tiny max_tokens, so the mutants that stay valid generate cheaply
BASES = {
    "/v1/completions": {"model": MODEL, "prompt": "def f(x):", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9,
                        "seed": 3, "stop": ["\n\n"], "stream": False},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             "temperature": 0.5, "top_p": 0.9, "seed": 3, "logprobs": False, "stream": False},
}
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")

huge = st.one_of(st.integers(min_value=2**31), st.integers(max_value=-(2**31)),
                 st.sampled_from([10**400, -(10**400), 1e308, -1e308, 5e-324]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=20), huge),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _cheap(field: str, value: object) -> bool:
    """Mutants may stay valid; keep a valid length small, so a fuzz run never decodes hundreds of tokens (null is
    the default length: 16 for completions, the rest of the context window for chat)."""
    if field not in LENGTH_FIELDS:
        return True
    return value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 4)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(ENDPOINTS))
    body = json.loads(json.dumps(BASES[path]))
    kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "nested", "whole", "bytes", "truncate"]))
    if kind == "replace":
        field = draw(st.sampled_from(sorted(body) + ["stream_options", "n", "logprobs", "max_completion_tokens"]))
        value = draw(json_values.filter(lambda v: _cheap(field, v)))
        body[field] = value
    elif kind == "delete":
        field = draw(st.sampled_from([k for k in body if k not in LENGTH_FIELDS]))
        del body[field]
    elif kind == "add":
        body[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
    elif kind == "nested":  # break something inside messages / stop / prompt
        if path == "/v1/chat/completions":
            msg = body["messages"][0]
            msg[draw(st.sampled_from(["role", "content", "name", "tool_calls", "x"]))] = draw(json_values)
        else:
            body[draw(st.sampled_from(["prompt", "stop"]))] = draw(st.lists(json_values, max_size=3))
    elif kind == "whole":
        return path, json.dumps(draw(json_values)).encode()
    elif kind == "bytes":
        return path, draw(st.binary(max_size=64))
    raw = json.dumps(body).encode()
    if kind == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    return path, raw


@pytest.fixture(scope="module")
def srv() -> Served:
    return shared_server()


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=mutated())
def test_malformed_bodies_never_500_or_hang(srv, case):
    path, raw = case
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", f"{srv.base}{path}", content=raw,
                           headers={"Content-Type": "application/json"}) as resp:
            assert resp.status_code < 500, resp.read()
            if resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream"):
                payloads = list(sse_events(resp))  # read to the end: a valid mutant streams to [DONE]
                assert payloads[-1] == "[DONE]"
                assert all("error" not in json.loads(p) for p in payloads[:-1])
                return
            body = json.loads(resp.read())
    if resp.status_code == 200:
        assert body["choices"] and body["usage"]["completion_tokens"] <= 16
    else:
        assert resp.status_code in (400, 413)
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def test_server_answers_after_fuzzing_and_garbage(srv):
    # non-HTTP bytes on a raw socket: waitress answers 400 or drops the connection, and keeps serving
    for junk in (b"\x00\x01\x02garbage\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\n"
                 b"Content-Length: 99999999999999999999\r\n\r\n{"):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT) as sock:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            reply = sock.recv(4096)
            assert not reply.startswith(b"HTTP/1.1 5") and not reply.startswith(b"HTTP/1.0 5")
    r = httpx.get(f"{srv.base}/health", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    ok = httpx.post(f"{srv.base}/v1/completions", timeout=TIMEOUT,
                    json={"model": MODEL, "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    wait_idle(srv.engine)
