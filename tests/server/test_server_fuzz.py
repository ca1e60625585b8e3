"""Property test: malformed requests (random JSON, wrong types, missing fields, huge numbers, non-JSON bytes, wrong
Content-Type, NaN/Infinity literals, lone surrogates, special-token text, bad tools) sent to the generation endpoints
never produce a 5xx or a hung worker; afterwards the server answers and the KV pages are back at their baseline."""
from __future__ import annotations

import json
import socket

import httpx2 as httpx  # the HTTP client the pinned openai package ships with
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from test_server import MODEL, TIMEOUT, Served, pool_is_full, shared_server, sse_events, wait_idle

N_EXAMPLES = 520  # issue 12: at least 500 malformed requests
CONTENT_TYPES = ["application/json", "text/plain", "", "application/json; charset=latin-1", "application/xml",
                 "application/json; charset=utf-8", "multipart/form-data; boundary=x", "application/vnd.api+json"]
SPECIAL_TEXT = ["<|im_end|>", "<|im_system|>system<|im_middle|>", "<|endoftext|>", "<|im_assistant|>"]

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
    the default length: 16 for completions, 1024 within the context window for chat)."""
    if field not in LENGTH_FIELDS:
        return True
    return value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 4)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(ENDPOINTS))
    body = json.loads(json.dumps(BASES[path]))
    kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "nested", "whole", "bytes", "truncate",
                                 "ctype", "literal", "surrogate", "special", "tools"]))
    content_type = "application/json"
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
        return path, json.dumps(draw(json_values)).encode(), content_type
    elif kind == "bytes":
        return path, draw(st.binary(max_size=64)), content_type
    elif kind == "ctype":
        content_type = draw(st.sampled_from(CONTENT_TYPES))
    elif kind == "special":  # valid: the text is encoded as ordinary tokens
        text = "".join(draw(st.lists(st.sampled_from(SPECIAL_TEXT + ["x", " ", "\n"]), min_size=1, max_size=6)))
        if path == "/v1/chat/completions":
            body["messages"][0]["content"] = text
            body["messages"].insert(0, {"role": draw(st.sampled_from(["system", "developer"])), "content": text})
        else:
            body["prompt"] = text
    elif kind == "tools" and path == "/v1/chat/completions":
        name = draw(st.one_of(st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True), st.text(max_size=70),
                              json_values))
        tool = {"type": draw(st.sampled_from(["function", "function", "code"])),
                "function": {"name": name, "parameters": draw(st.one_of(st.just({"type": "object"}), json_values))}}
        body["tools"] = draw(st.sampled_from([[tool], tool, [tool, tool]]))
    raw = json.dumps(body).encode()
    if kind == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif kind == "literal":  # NaN / Infinity where a number goes: not JSON, though Python's json reads it
        field = "temperature" if draw(st.booleans()) else "top_p"
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
        raw = raw[:-1] + f', "{field}": {literal}}}'.encode()
    elif kind == "surrogate":  # a lone UTF-16 surrogate escape inside a string
        target = b'"hi"' if path == "/v1/chat/completions" else b'"def f(x):"'
        escape = draw(st.sampled_from([b"\\ud800", b"\\udfff", b"\\udc00x", b"a\\ud83d"]))
        raw = raw.replace(target, b'"' + escape + b'"')
    return path, raw, content_type


@pytest.fixture(scope="module")
def srv() -> Served:
    return shared_server()


@pytest.fixture(scope="module")
def client() -> httpx.Client:
    with httpx.Client(timeout=TIMEOUT) as c:  # one keep-alive connection: the fuzz measures the server, not TCP setup
        yield c


@pytest.fixture(scope="module")
def baseline(srv: Served) -> dict[str, float]:
    """Engine stats before the fuzz, with nothing in flight; `sent` counts the fuzz's requests."""
    wait_idle(srv.engine)
    return {**srv.engine.stats(), "sent": 0}


@settings(max_examples=N_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=mutated())
def test_malformed_bodies_never_500_or_hang(srv, baseline, client, case):
    path, raw, content_type = case
    baseline["sent"] += 1
    headers = {"Content-Type": content_type} if content_type else {}
    with client.stream("POST", f"{srv.base}{path}", content=raw, headers=headers) as resp:
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
        assert resp.status_code in (400, 404, 413, 415)  # 404: an unknown model; 415: not declared JSON
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def test_server_answers_after_fuzzing_and_garbage(srv, baseline):
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
    assert baseline["sent"] >= 500
    s = srv.engine.stats()
    # KV pages back at baseline: no decode page held, prefill pages free or in the prefix cache as before
    assert pool_is_full(srv.engine) and s["running"] == 0 and s["waiting"] == 0
    assert s["decode_pages_free"] == baseline["decode_pages_free"]
    assert (s["prefill_pages_free"] + s["prefix_cache_pages"]
            == baseline["prefill_pages_free"] + baseline["prefix_cache_pages"])
