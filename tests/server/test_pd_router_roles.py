"""`jaxserve router` over 1 prefill + 2 decode servers (`jaxserve serve --role prefill|decode` processes), against a
`--role both` server: 32 concurrent greedy requests with shared prefixes answer as the both server does (prefix
hits counted on the prefill server, sessions pinned to one decode server each); killing a decode server mid-stream
ends its streams with a `backend_error` event and `data: [DONE]`, the other server's streams finish, and later
requests go to the survivor."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest

from serve_procs import MODEL, start_router, start_serve
from test_pd_router import PREFILL_HEADER, TIMEOUT, router_metric

DECODE_HEADER = "x-jaxserve-decode-server"
SESSIONS = 4
REQUESTS = 32
# every server batch-invariant: a greedy request's tokens do not depend on what shares its batch
FLAGS = ("--deterministic", "--max-model-len", "512", "--max-queue", str(REQUESTS + 8))


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla")
    procs = {"prefill": start_serve(cache, "--role", "prefill", *FLAGS),
             "decode0": start_serve(cache, "--role", "decode", *FLAGS),
             "decode1": start_serve(cache, "--role", "decode", *FLAGS),
             "both": start_serve(cache, *FLAGS)}
    router = start_router([procs["prefill"].base], [procs["decode0"].base, procs["decode1"].base])
    yield router, procs
    router.close()
    for p in procs.values():
        p.kill()


def body_of(i: int) -> tuple[str, dict]:
    """Request i: its session, and a completion or chat (streamed or not) whose prompt shares its session's
    prefix."""
    session = f"sess-{i % SESSIONS}"
    shared = f"Session {i % SESSIONS} notes: " + "the router keeps each prefix on one server. " * 6
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": i % 3 == 0}
    if i % 2:
        return session, {**body, "messages": [{"role": "system", "content": shared},
                                              {"role": "user", "content": f"question {i}"}]}
    return session, {**body, "prompt": f"{shared}\nitem {i}:"}


def answer(base: str, body: dict, session: str | None = None) -> tuple[str, dict[str, str]]:
    """(the answer's text, whole or streamed, and the response headers)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    headers = {"x-session-affinity": session} if session else {}
    if not body.get("stream"):
        r = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return (c["text"] if "text" in c else c["message"]["content"]), dict(r.headers)
    text = ""
    with httpx.stream("POST", f"{base}{path}", json=body, headers=headers, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    for d in data[:-1]:
        for c in json.loads(d)["choices"]:  # none in the usage chunk
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, dict(r.headers)


def server_metric(base: str, name: str) -> float:
    return router_metric(base, name)


def sessions_on(router_base: str, decodes: list[str], per_server: int) -> dict[str, list[str]]:
    """Sessions pinned to each decode server (`per_server` each), by short requests until each has its share."""
    pinned: dict[str, list[str]] = {d: [] for d in decodes}
    for k in range(100):
        if all(len(v) == per_server for v in pinned.values()):
            return pinned
        session = f"long-{k}"
        url = answer(router_base, {"model": MODEL, "prompt": "pin", "max_tokens": 1, "temperature": 0}, session)[1]
        if len(pinned[url[DECODE_HEADER]]) < per_server:
            pinned[url[DECODE_HEADER]].append(session)
    raise AssertionError(f"sessions did not spread over the decode servers: {pinned}")


def test_concurrent_requests_equal_a_both_server_and_sessions_stick(pd):
    router, procs = pd
    requests = [body_of(i) for i in range(REQUESTS)]
    cached_before = server_metric(procs["prefill"].base, "jaxserve_cached_prompt_tokens_total")
    with ThreadPoolExecutor(REQUESTS) as pool:
        want = [text for text, _ in pool.map(lambda r: answer(procs["both"].base, r[1]), requests)]
        got = list(pool.map(lambda r: answer(router.base, r[1], r[0]), requests))
    assert [text for text, _ in got] == want
    assert all(headers[PREFILL_HEADER] == procs["prefill"].base for _, headers in got)
    # a session's first request pins it; the rest of its requests (sent at once) may race that first answer
    again = [answer(router.base, body_of(i)[1], f"sess-{i}")[1][DECODE_HEADER] for i in range(SESSIONS)]
    for i, url in enumerate(again):
        assert answer(router.base, body_of(i + SESSIONS)[1], f"sess-{i}")[1][DECODE_HEADER] == url
    assert server_metric(procs["prefill"].base, "jaxserve_cached_prompt_tokens_total") > cached_before
    assert router_metric(router.base, "jaxserve_router_in_flight") == 0.0
    for d in ("decode0", "decode1"):
        assert router_metric(router.base, "jaxserve_router_requests_total", pool="decode",
                             server=procs[d].base) > 0


def test_a_request_the_first_token_ends_is_answered_by_the_prefill_server(pd):
    router, procs = pd
    body = body_of(0)[1]
    first = answer(procs["both"].base, {**body, "max_tokens": 1, "stream": False})[0]
    assert first  # its first token's text, made a stop string: the prefill ends the request
    for stream in (False, True):
        stopped = {**body, "stop": [first], "stream": stream}
        if stream:
            stopped["stream_options"] = {"include_usage": True}
        text, headers = answer(router.base, stopped)
        assert text == answer(procs["both"].base, stopped)[0]
        assert headers[PREFILL_HEADER] == procs["prefill"].base and DECODE_HEADER not in headers


def health_of(router_base: str, url: str) -> bool:
    return next(s["alive"] for s in httpx.get(f"{router_base}/health", timeout=TIMEOUT).json()["servers"]
                if s["url"] == url)


def wait_health(router_base: str, url: str, alive: bool) -> None:
    deadline = time.monotonic() + 60
    while health_of(router_base, url) != alive:
        assert time.monotonic() < deadline, f"{url} never became {'alive' if alive else 'dead'}"
        time.sleep(0.1)


def test_a_hung_decode_server_is_cut_and_its_request_decoded_elsewhere(pd):
    router, procs = pd
    hung, other = procs["decode0"], procs["decode1"]
    session = sessions_on(router.base, [hung.base, other.base], 1)[hung.base][0]
    body = body_of(2)[1]
    want = answer(procs["both"].base, body)[0]
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        text, headers = answer(router.base, body, session)  # pinned to the hung server until it is declared dead
        assert text == want and headers[DECODE_HEADER] == other.base
        assert not health_of(router.base, hung.base)
        assert router_metric(router.base, "jaxserve_router_errors_total", server=hung.base, status="broken") >= 1
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    wait_health(router.base, hung.base, alive=True)  # one good health check brings it back


def long_stream(base: str, session: str, out: dict, started: threading.Event) -> None:
    # near the 512-token window: no stream ends before the kill, which comes once all four have started
    body = {"model": MODEL, "prompt": f"{session}: def main():", "max_tokens": 480, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={"x-session-affinity": session},
                      timeout=TIMEOUT) as r:
        out["decode"] = r.headers.get(DECODE_HEADER)
        out["status"] = r.status_code
        out["data"] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["data"].append(line[len("data: "):])
                started.set()
    started.set()


def test_killing_a_decode_server_mid_stream_fails_only_its_streams(pd):
    router, procs = pd
    decodes = [procs["decode0"].base, procs["decode1"].base]
    sessions = [s for group in sessions_on(router.base, decodes, 2).values() for s in group]
    outs = [{} for _ in sessions]
    starts = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=long_stream, args=(router.base, session, o, s))
               for session, o, s in zip(sessions, outs, starts)]
    for t in threads:
        t.start()
    assert all(s.wait(TIMEOUT) for s in starts)
    assert sorted(o["decode"] for o in outs) == sorted(decodes * 2)  # the sessions' pins hold
    victim = procs["decode0"]
    victim.kill()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()  # no hang
    for o in outs:
        assert o["status"] == 200 and o["data"][-1] == "[DONE]"
        last = json.loads(o["data"][-2])
        if o["decode"] == victim.base:
            assert last["error"]["type"] == "backend_error" and victim.base in last["error"]["message"]
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    text, headers = answer(router.base, body_of(0)[1])
    assert text and headers[DECODE_HEADER] == procs["decode1"].base
