"""`jaxserve router` in front of two `jaxserve serve` processes (role both, no decode pool): whole requests routed,
answers equal a direct request's (whole and streamed), sessions pinned, backend errors relayed with their status,
/metrics counting per server, and a killed backend: its stream ends with a clear error, later requests go to
the other server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_procs import MODEL, ROOT, start_jaxserve, start_router, start_serve

TIMEOUT = 120.0
PREFILL_HEADER = "x-jaxserve-prefill-server"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla")
    a = start_serve(cache, "--max-model-len", str(MAX_MODEL_LEN))
    b = start_serve(cache, "--max-model-len", str(MAX_MODEL_LEN))
    router = start_router([a.base, b.base], [])
    yield router, a, b
    router.close()
    a.kill()
    b.kill()


def completion(prompt: str | list[int], max_tokens: int = 8, **extra: object) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def chat(text: str, max_tokens: int = 8, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def post(base: str, path: str, body: dict, session: str | None = None) -> httpx.Response:
    headers = {"x-session-affinity": session} if session else {}
    return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=TIMEOUT)


def streamed_text(base: str, path: str, body: dict) -> tuple[str, list[str]]:
    """(the text of a streamed answer, its raw data payloads)."""
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    text = ""
    for d in data[:-1]:
        c = json.loads(d)["choices"][0]
        text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, data


def router_metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_whole_requests_answer_as_a_direct_request(fleet):
    router, a, _ = fleet
    for path, body in (("/v1/completions", completion("def main():")), ("/v1/chat/completions", chat("hello"))):
        direct = post(a.base, path, body).json()["choices"][0]
        routed = post(router.base, path, body)
        assert routed.status_code == 200 and routed.headers[PREFILL_HEADER]
        assert routed.json()["choices"][0] == direct
        text, data = streamed_text(router.base, path, body)
        assert text == (direct.get("text") or direct.get("message", {}).get("content"))
        assert data[-1] == "[DONE]"


def test_a_session_sticks_to_one_server(fleet):
    router, _, _ = fleet
    for session in ("s-a", "s-b", "s-c"):
        served = {post(router.base, "/v1/completions", completion(f"{session} x"), session).headers[PREFILL_HEADER]
                  for _ in range(3)}
        assert len(served) == 1
    by_key = {post(router.base, "/v1/completions", completion("k", prompt_cache_key="key-1")).headers[PREFILL_HEADER]
              for _ in range(3)}
    assert len(by_key) == 1  # the body's prompt_cache_key pins as the header does


def test_a_prompt_goes_to_the_server_holding_its_prefix(fleet):
    router, a, b = fleet
    shared = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(20))
    holder = post(router.base, "/v1/completions", completion(shared + "first"), "p1").headers[PREFILL_HEADER]
    other = b.base if holder == a.base else a.base

    def totals() -> dict[str, int]:
        return {v.url: v.total for v in router.fleet.views("prefill")}

    while totals()[holder] <= totals()[other]:  # idle servers take turns: make it the other's turn
        assert post(router.base, "/v1/completions", completion("x"), "p1").headers[PREFILL_HEADER] == holder
    before = router_metric(router.base, "jaxserve_router_cached_prompt_tokens_total", server=holder)
    again = post(router.base, "/v1/completions", completion(shared + "second"))
    assert again.headers[PREFILL_HEADER] == holder
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after = router_metric(router.base, "jaxserve_router_cached_prompt_tokens_total", server=holder)
    assert after - before == again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_backend_errors_pass_through_with_their_status(fleet):
    router, _, _ = fleet
    missing = httpx.get(f"{router.base}/v1/models/nope", timeout=TIMEOUT)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    long_prompt = list(range(100, 100 + MAX_MODEL_LEN - 10))
    over = post(router.base, "/v1/completions", completion(long_prompt, max_tokens=100))
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    wrong_model = post(router.base, "/v1/completions", {**completion("x"), "model": "other"})
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    models = httpx.get(f"{router.base}/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_metrics_count_requests_per_server(fleet):
    router, a, b = fleet
    before = {s: router_metric(router.base, "jaxserve_router_requests_total", pool="prefill", server=s)
              for s in (a.base, b.base)}
    served = Counter(post(router.base, "/v1/completions", completion(f"count {i}"), f"m{i}").headers[PREFILL_HEADER]
                     for i in range(6))
    for s in (a.base, b.base):
        after = router_metric(router.base, "jaxserve_router_requests_total", pool="prefill", server=s)
        assert after - before[s] == served[s]
        assert router_metric(router.base, "jaxserve_router_server_up", pool="prefill", server=s) == 1.0
    assert router_metric(router.base, "jaxserve_router_in_flight") == 0.0


def test_the_router_command(fleet):
    _, a, b = fleet
    router = start_jaxserve("router", "--prefill", a.base, b.base, "--port", "0", "--health-interval", "0.2")
    try:
        body = completion("def main():")
        r = post(router.base, "/v1/completions", body)
        assert r.status_code == 200 and r.headers[PREFILL_HEADER] in (a.base, b.base)
        assert r.json()["choices"][0] == post(a.base, "/v1/completions", body).json()["choices"][0]
        assert httpx.get(f"{router.base}/ready", timeout=TIMEOUT).status_code == 200
    finally:
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=30) == 0, router.text()
    bad = subprocess.run([sys.executable, "-m", "jaxserve.cli", "router", "--prefill", "ftp://x:1"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert bad.returncode == 2 and "http://host:port" in bad.stderr


def pinned_to(router_base: str, server: str) -> str:
    """A session pinned to `server` (idle servers take turns, so one of a few new sessions lands there)."""
    return next(f"to-{server}-{i}" for i in range(100) if post(router_base, "/v1/completions", completion("pin"),
                                                               f"to-{server}-{i}").headers[PREFILL_HEADER] == server)


def wait_alive(base: str, server: str, alive: bool) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = {s["url"]: s["alive"] for s in httpx.get(f"{base}/health", timeout=TIMEOUT).json()["servers"]}
        if states[server] == alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"{server} never became {'alive' if alive else 'dead'} in the router's /health")


def test_a_hung_backend_is_cut_and_its_request_served_by_the_other(fleet):
    router, a, b = fleet
    session = pinned_to(router.base, b.base)
    body = completion("hung")
    want = post(a.base, "/v1/completions", body).json()["choices"][0]
    b.proc.send_signal(signal.SIGSTOP)
    try:
        r = post(router.base, "/v1/completions", body, session)  # sent to b, cut once b is declared dead
        assert r.status_code == 200 and r.headers[PREFILL_HEADER] == a.base and r.json()["choices"][0] == want
    finally:
        b.proc.send_signal(signal.SIGCONT)
    wait_alive(router.base, b.base, alive=True)


def test_killing_a_backend_ends_its_stream_with_an_error_and_routes_around_it(fleet):
    router, a, b = fleet
    session = pinned_to(router.base, b.base)
    body = completion("def main():", max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{router.base}/v1/completions", json=body, headers={"x-session-affinity": session},
                      timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in first
        b.kill()
        rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "backend_error" and b.base in error["message"]
    wait_alive(router.base, b.base, alive=False)
    for i in range(4):  # the pinned session too: its server is dead
        r = post(router.base, "/v1/completions", completion(f"after {i}"), session if i == 0 else None)
        assert r.status_code == 200 and r.headers[PREFILL_HEADER] == a.base
    assert router_metric(router.base, "jaxserve_router_server_up", pool="prefill", server=b.base) == 0.0
    assert router_metric(router.base, "jaxserve_router_errors_total", server=b.base, status="broken") >= 1
