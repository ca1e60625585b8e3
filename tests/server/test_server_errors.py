"""HTTP error paths: every refusal is OpenAI-shaped with the right status, nothing a bad request does disturbs
others, an integrity abort reaches the client (500, or an SSE error event then [DONE]) and the metrics, a client
that disconnects mid-stream frees its pages, and the page pool is full again afterwards."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import httpx2 as httpx  # the HTTP client the pinned openai package ships with
import openai
import pytest

from jaxserve.engine import Engine, Request, SamplingParams
from test_server_fields import strict_server
from test_server import (MAX_MODEL_LEN, MODEL, TIMEOUT, EmitHook, Served, engine_config, metric, pool_is_full,
                         serve, shared_server, sse_events, tiny_model, tokenizer, wait_idle)


@pytest.fixture(scope="module")
def srv() -> Served:
    return shared_server()


def raw_post(srv: Served, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict, dict]:
    """POST raw bytes with http.client -> (status, headers, parsed JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def assert_error(body: dict, type_: str, param: str | None = None) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type_
    if param is not None:  # the field itself, or a part of it ("messages[0].role")
        assert err["param"] == param or err["param"].startswith((param + "[", param + "."))
        assert err["param"] in err["message"]
    return err


GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body", [b"{not json", b"", b"\xff\xfe\x00", b'{"model": ', b"[" * 5000 + b"]" * 5000,
                                  b'{"model": "tiny-test", "prompt": "a", "max_tokens": 1' + b"9" * 5000 + b"}"])
def test_malformed_json_is_400(srv, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, _, resp = raw_post(srv, path, body)
        assert status == 400
        assert_error(resp, "invalid_request_error")


@pytest.mark.parametrize("body", [[1, 2], "text", 3, None, True])
def test_non_object_json_is_400(srv, body):
    status, _, resp = raw_post(srv, "/v1/completions", json.dumps(body).encode())
    assert status == 400 and assert_error(resp, "invalid_request_error")["code"] == "invalid_json"


COMPLETION_CASES = [
    ("max_tokens", "5"), ("max_tokens", 2.5), ("max_tokens", True), ("temperature", "hot"), ("temperature", -0.1),
    ("temperature", 3.0), ("top_p", 0), ("top_p", 1.5), ("seed", -1), ("seed", 2**64),
    ("stream", "yes"), ("stop", 5), ("stop", [""]), ("stop", ["a"] * 17), ("prompt", {"a": 1}), ("prompt", [True]),
    ("prompt", [-1]), ("prompt", [4096]), ("prompt", ""), ("prompt", None), ("model", None), ("model", 3),
    ("logprobs", "x"), ("logprobs", 6), ("n", 0), ("n", 17), ("n", 1.5), ("echo", "yes"), ("top_k", -1),
    ("stream_options", {"x": 1}), ("stream_options", {"include_usage": True}), ("ignore_eos", 1),
    ("stop_token_ids", [5000]), ("frequency_penalty", 2.5), ("presence_penalty", "x"), ("presence_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("logit_bias", [1]), ("logit_bias", {"4096": 1}),
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"5": "1"}), ("min_tokens", -1),
    ("min_tokens", 3), ("prompt", ["a", 5]), ("prompt", [[1], []]), ("prompt", ["a"] * 65),
]


@pytest.mark.parametrize("field,value", COMPLETION_CASES)
def test_completion_field_errors_name_the_field(srv, field, value):
    body = {**GOOD, field: value}
    if value is None:
        del body[field]
    r = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert_error(r.json(), "invalid_request_error", field)


CHAT_CASES = [
    ("messages", "hi"), ("messages", []), ("messages", [{"content": "x"}]), ("messages", [{"role": "robot"}]),
    ("messages", [{"role": "user", "content": 5}]), ("messages", [{"role": "user", "content": [{"type": "image"}]}]),
    ("messages", ["x"]),
    ("max_completion_tokens", 0), ("max_completion_tokens", "3"), ("logprobs", 1), ("top_logprobs", 3),
    ("top_logprobs", 21), ("tools", "x"), ("tool_choice", "required"),
    ("response_format", {"type": "xml"}), ("response_format", "json"), ("response_format", {"type": "json_schema"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
]


@pytest.mark.parametrize("field,value", CHAT_CASES)
def test_chat_field_errors_name_the_field(srv, field, value):
    r = httpx.post(f"{srv.base}/v1/chat/completions", json={**GOOD_CHAT, field: value}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert_error(r.json(), "invalid_request_error", field)


# unknown fields: refused only by a server run with strict_fields (by default they are named in a header)
STRICT_CASES = [("/v1/completions", GOOD, "banana", 1), ("/v1/chat/completions", GOOD_CHAT, "prompt", "x"),
                ("/v1/chat/completions", GOOD_CHAT, "messages", [{"role": "user", "content": "x", "extra": 1}])]


@pytest.mark.parametrize("path,good,field,value", STRICT_CASES)
def test_unknown_field_errors_name_the_field_when_strict(path, good, field, value):
    r = httpx.post(f"{strict_server().base}{path}", json={**good, field: value}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert_error(r.json(), "invalid_request_error", field)


def test_unknown_model_is_404_model_not_found(srv):
    client = srv.client()
    with pytest.raises(openai.NotFoundError) as e:  # 404, as OpenAI and vLLM answer
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    r = httpx.get(f"{srv.base}/v1/models/nope", timeout=TIMEOUT)
    assert r.status_code == 404 and assert_error(r.json(), "invalid_request_error", "model")


def test_prompt_over_the_context_window_is_400(srv):
    for prompt in ([1] * MAX_MODEL_LEN, [7] * (MAX_MODEL_LEN + 40), "word " * 400):
        r = httpx.post(f"{srv.base}/v1/completions", json={**GOOD, "prompt": prompt}, timeout=TIMEOUT)
        assert r.status_code == 400
        assert assert_error(r.json(), "invalid_request_error", "prompt")["code"] == "context_length_exceeded"
    long_chat = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(model=MODEL, messages=long_chat)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


@pytest.mark.parametrize("max_tokens", [0, -1, MAX_MODEL_LEN + 1, 10**6, 10**40])
def test_max_tokens_out_of_range_is_400(srv, max_tokens):
    r = httpx.post(f"{srv.base}/v1/completions", json={**GOOD, "max_tokens": max_tokens}, timeout=TIMEOUT)
    assert r.status_code == 400 and assert_error(r.json(), "invalid_request_error", "max_tokens")


def test_prompt_plus_max_tokens_over_the_window_is_400(srv):
    r = httpx.post(f"{srv.base}/v1/completions", timeout=TIMEOUT,
                   json={**GOOD, "prompt": [5] * 200, "max_tokens": MAX_MODEL_LEN - 199})
    assert r.status_code == 400
    assert assert_error(r.json(), "invalid_request_error", "max_tokens")["code"] == "context_length_exceeded"


def test_http_level_errors_are_openai_shaped(srv):
    r = httpx.get(f"{srv.base}/v1/nothing", timeout=TIMEOUT)
    # as OpenAI answers an unknown route
    assert r.status_code == 404 and assert_error(r.json(), "invalid_request_error")["code"] == "not_found"
    r = httpx.get(f"{srv.base}/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and assert_error(r.json(), "invalid_request_error")
    # over the body limit: refused from the headers alone, before a byte of the body is sent
    with socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(5 << 20).encode() + b"\r\n\r\n")
        reply = b""
        while b"}}" not in reply:
            reply += sock.recv(4096)
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"application/json" in head
    assert_error(json.loads(payload), "invalid_request_error")
    # a client that sends it all anyway (httpx, the openai client) reads the same 413
    r = httpx.post(f"{srv.base}/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 413 and assert_error(r.json(), "invalid_request_error")


def test_queue_full_is_429_with_retry_after():
    # an engine that is never stepped: its one queue slot stays taken for as long as the test holds it
    engine = Engine(tiny_model(), engine_config(max_queue=1), tokenizer(), start=False)
    full = serve(engine)
    held = engine.submit(Request([1, 2, 3], SamplingParams(max_tokens=1)))
    try:
        r = httpx.post(f"{full.base}/v1/completions", json=GOOD, timeout=TIMEOUT)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert_error(r.json(), "rate_limit_error")
        with pytest.raises(openai.RateLimitError):
            full.client().chat.completions.create(model=MODEL, messages=GOOD_CHAT["messages"], max_tokens=1)
        with httpx.stream("POST", f"{full.base}/v1/completions", json={**GOOD, "stream": True},
                          timeout=TIMEOUT) as resp:
            assert resp.status_code == 429  # refused before the stream starts, not in-band
        # validation comes first: a bad request is a 400 even when the queue is full
        assert httpx.post(f"{full.base}/v1/completions", json={**GOOD, "top_p": 9},
                          timeout=TIMEOUT).status_code == 400
        assert metric(full.base, "jaxserve_http_requests_total", endpoint="/v1/completions", status="429") == 2
    finally:
        held.close()
        full.close()


def _corrupt_first_decode_page(injected: list[tuple[int, int]]):
    """Fault injection on the engine thread: after a request's first token, free one of its decode pages with its
    tag and allocate it again (a new tag, as if another request got it); give the page back when it ends."""

    def hook(sched, ev):  # noqa: ANN001
        if ev.token_id is not None and not injected:
            seq = next(s for s in sched.running if s.req.request_id == ev.request_id)
            page, tag = seq.decode_pages[0]
            sched.decode_alloc.free(page, tag)
            (p2, t2), = sched.decode_alloc.allocate(1)
            assert p2 == page and t2 != tag
            injected.append((p2, t2))
        elif ev.finish_reason is not None and injected:
            sched.decode_alloc.free(*injected[0])  # the injected owner goes away too: the pool is whole again

    return hook


def test_integrity_abort_is_500_and_counted(srv):
    before = metric(srv.base, "jaxserve_request_failures_total", endpoint="/v1/completions",
                    error_type="kv_integrity_error")
    mismatches = srv.engine.stats()["tag_mismatches"]
    injected: list[tuple[int, int]] = []
    with EmitHook(srv.engine, "fault-500", _corrupt_first_decode_page(injected)):
        with pytest.raises(openai.InternalServerError) as e:
            srv.client().completions.create(model=MODEL, prompt="def broken():", max_tokens=20,
                                            extra_body={"ignore_eos": True},
                                            extra_headers={"x-session-affinity": "fault-500"})
    assert injected and e.value.status_code == 500
    assert_error(e.value.response.json(), "kv_integrity_error")
    assert srv.engine.stats()["tag_mismatches"] == mismatches + 1
    assert metric(srv.base, "jaxserve_request_failures_total", endpoint="/v1/completions",
                  error_type="kv_integrity_error") == before + 1
    assert metric(srv.base, "jaxserve_kv_tag_mismatches_total") == mismatches + 1
    wait_idle(srv.engine)


def test_integrity_abort_mid_stream_is_an_sse_error_then_done(srv):
    injected: list[tuple[int, int]] = []
    before = metric(srv.base, "jaxserve_request_failures_total", endpoint="/v1/chat/completions",
                    error_type="kv_integrity_error")
    with EmitHook(srv.engine, "fault-sse", _corrupt_first_decode_page(injected)):
        with httpx.stream("POST", f"{srv.base}/v1/chat/completions", headers={"x-session-affinity": "fault-sse"},
                          json={**GOOD_CHAT, "max_tokens": 20, "stream": True, "ignore_eos": True},
                          timeout=TIMEOUT) as resp:
            assert resp.status_code == 200
            payloads = list(sse_events(resp))
    assert injected and payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert "error" in events[-1] and assert_error(events[-1], "kv_integrity_error")
    assert all("choices" in ev for ev in events[:-1])  # tokens before the failure were streamed normally
    assert metric(srv.base, "jaxserve_request_failures_total", endpoint="/v1/chat/completions",
                  error_type="kv_integrity_error") == before + 1
    # the openai client surfaces the in-band error as an exception
    injected.clear()
    with EmitHook(srv.engine, "fault-sse2", _corrupt_first_decode_page(injected)):
        with pytest.raises(openai.APIError):
            for _ in srv.client().chat.completions.create(
                    model=MODEL, messages=GOOD_CHAT["messages"], max_tokens=20, stream=True,
                    extra_body={"ignore_eos": True}, extra_headers={"x-session-affinity": "fault-sse2"}):
                pass
    wait_idle(srv.engine)


def test_client_disconnect_mid_stream_aborts_and_frees_pages(srv):
    wait_idle(srv.engine)
    aborted = srv.engine.stats()["aborted"]
    disconnects = metric(srv.base, "jaxserve_client_disconnects_total", endpoint="/v1/completions")
    body = json.dumps({"model": MODEL, "prompt": "while True:", "max_tokens": 200, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:  # the first token chunk is on the wire: the request is decoding
        got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    assert srv.engine.stats()["decode_pages_used"] > 0
    sock.close()
    t0 = time.monotonic()
    freed = wait_idle(srv.engine, timeout=10.0)
    print(f"pages freed {time.monotonic() - t0:.3f}s after the client disconnected")
    assert freed < 10.0
    assert srv.engine.stats()["aborted"] == aborted + 1  # aborted, not run to its 200 tokens
    assert metric(srv.base, "jaxserve_client_disconnects_total", endpoint="/v1/completions") == disconnects + 1


def test_a_queued_stream_whose_client_hangs_up_counts_one_disconnect(srv):
    """The watcher aborts a stream that has written nothing (it waits in the engine's queue): the stream then ends
    on the abort event, not on a failed write, and the disconnect must still be counted, once."""
    wait_idle(srv.engine)
    aborted = srv.engine.stats()["aborted"]
    disconnects = metric(srv.base, "jaxserve_client_disconnects_total", endpoint="/v1/completions")
    entered, closed = threading.Event(), threading.Event()

    def hold(_sched: object, _ev: object) -> None:  # the engine thread: the victim stays queued until released
        if not entered.is_set():
            entered.set()
            closed.wait(TIMEOUT)
            time.sleep(0.5)  # ten watcher polls: it aborts the victim before the engine runs again

    blocker = {"model": MODEL, "prompt": "def f():", "max_tokens": 4, "ignore_eos": True}
    with EmitHook(srv.engine, "hold-engine", hold):
        t = threading.Thread(target=lambda: httpx.post(f"{srv.base}/v1/completions", json=blocker, timeout=TIMEOUT,
                                                       headers={"x-session-affinity": "hold-engine"}))
        t.start()
        assert entered.wait(TIMEOUT)
        body = json.dumps({"model": MODEL, "prompt": "while True:", "max_tokens": 200, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        t0 = time.monotonic()
        while srv.engine.stats()["waiting"] == 0:  # submitted: queued behind the held step, nothing written
            assert time.monotonic() - t0 < TIMEOUT
            time.sleep(0.01)
        sock.close()
        closed.set()
        t.join(TIMEOUT)
    wait_idle(srv.engine)
    assert srv.engine.stats()["aborted"] == aborted + 1
    assert metric(srv.base, "jaxserve_client_disconnects_total", endpoint="/v1/completions") == disconnects + 1


def test_bad_requests_do_not_disturb_a_running_stream(srv):
    body = {"model": MODEL, "prompt": "def keep_going(n):", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    ref = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["text"]
    out: list[str] = []

    def good() -> None:
        with httpx.stream("POST", f"{srv.base}/v1/completions", json={**body, "stream": True},
                          timeout=TIMEOUT) as resp:
            out.extend(json.loads(p)["choices"][0]["text"] for p in sse_events(resp) if p != "[DONE]")

    t = threading.Thread(target=good)
    t.start()
    bad = [b"{", b"[]", json.dumps({**GOOD, "max_tokens": -3}).encode(),
           json.dumps({**GOOD, "prompt": [99999]}).encode(), json.dumps({**GOOD, "model": "x"}).encode(),
           json.dumps({**GOOD, "prompt": [1] * 1000}).encode()]
    statuses = [raw_post(srv, "/v1/completions", b)[0] for _ in range(5) for b in bad]
    t.join(TIMEOUT)
    assert not t.is_alive() and set(statuses) == {400, 404}  # 404: the unknown model
    assert "".join(out) == ref


def test_page_pool_is_full_after_the_error_tests(srv):
    wait_idle(srv.engine)
    s = srv.engine.stats()
    assert pool_is_full(srv.engine)
    assert s["decode_pages_used"] == 0 and s["prefill_pages_used"] == s["prefix_cache_pages"]
    assert httpx.get(f"{srv.base}/health", timeout=TIMEOUT).status_code == 200
