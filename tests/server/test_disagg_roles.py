"""Prefill and decode as separate servers (`--role`, PD_PROTOCOL.md): a prefill server and a decode server on
127.0.0.1, driven directly with the two-step protocol a router runs, against a `--role both` server; faults injected
by a TCP proxy in front of the prefill server's KV transfer port (a flipped byte, a cut connection)."""
from __future__ import annotations

import dataclasses
import functools
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest

from test_server import MODEL, TIMEOUT, Served, engine_config, serve, sse_events, tiny_model, tokenizer
from jaxserve.engine import Engine
from jaxserve.engine.kv_wire import FRAME

TRANSFER_TIMEOUT_S = 5.0  # an export nobody pulls is dropped after this (and a pull gives up after it)
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog and then some more words follow here",
           "import numpy as np\nx = np.arange(10)\n" * 3]


@functools.cache
def servers() -> dict[str, Served]:
    """One server per role (each builds only its phases), shared by the tests of this file."""
    cfg = dataclasses.replace(engine_config(), transfer_timeout_s=TRANSFER_TIMEOUT_S)
    return {role: serve(Engine(tiny_model(), dataclasses.replace(cfg, role=role), tokenizer()))
            for role in ("prefill", "decode", "both")}


@pytest.fixture(scope="module")
def srv() -> dict[str, Served]:
    yield servers()
    for s in servers().values():
        s.close()
    servers.cache_clear()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=TIMEOUT)


def prefill(srv: dict[str, Served], path: str, body: dict) -> dict:
    """Step 1: the prefill server's answer (first token + kv_transfer_params)."""
    r = post(srv["prefill"].base, path, {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()


def decode_text(srv: dict[str, Served], path: str, body: dict, kv: dict, stream: bool) -> str:
    """Step 2: the decode server's answer to the original body + the prefill's kv_transfer_params -> its text."""
    body = {**body, "kv_transfer_params": kv, "stream": stream}
    if not stream:
        r = post(srv["decode"].base, path, body)
        assert r.status_code == 200, r.text
        return _text(r.json()["choices"][0])
    parts = []
    with httpx.stream("POST", f"{srv['decode'].base}{path}", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for data in sse_events(r):
            if data != "[DONE]":
                choice = json.loads(data)["choices"][0]
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def completion(prompt: str, max_tokens: int = 12) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def status(served: Served) -> dict:
    return httpx.get(f"{served.base}/internal/status", timeout=TIMEOUT).json()


def wait_pages_back(srv: dict[str, Served], timeout: float = 30.0) -> None:
    """Until every page of the prefill and decode servers is free again (prefix-cache pages count as free)."""
    t0 = time.monotonic()
    while True:
        st = [status(srv[r]) for r in ("prefill", "decode")]
        if all(s["free_pages"] == s["total_pages"] and s["running"] == 0 for s in st):
            return
        assert time.monotonic() - t0 < timeout, st
        time.sleep(0.05)


class Proxy:
    """A one-connection TCP proxy to the prefill server's transfer port. flip_at: flip one byte at this offset of
    the page data (past the header frame); cut_at: close both sides after this many bytes of page data."""

    def __init__(self, host: str, port: int, flip_at: int | None = None, cut_at: int | None = None) -> None:
        self.upstream = (host, port)
        self.flip_at, self.cut_at = flip_at, cut_at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        up = socket.create_connection(self.upstream)
        with client, up, self.listener:
            n = FRAME.unpack(_recv(client, FRAME.size))[0]  # the pull request frame
            up.sendall(FRAME.pack(n) + _recv(client, n))
            head = _recv(up, FRAME.size)
            client.sendall(head + _recv(up, FRAME.unpack(head)[0]))
            sent = 0
            while (data := up.recv(65536)):
                buf = bytearray(data)
                if self.flip_at is not None and sent <= self.flip_at < sent + len(buf):
                    buf[self.flip_at - sent] ^= 0xFF
                if self.cut_at is not None and sent + len(buf) >= self.cut_at:
                    client.sendall(buf[: self.cut_at - sent])
                    return  # closing both sockets mid-stream
                client.sendall(buf)
                sent += len(buf)


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "proxy: connection closed early"
        out += chunk
    return out


def via_proxy(kv: dict, **faults: int) -> dict:
    return {**kv, "host": "127.0.0.1", "port": Proxy(kv["host"], kv["port"], **faults).port}


# ---- tests -----------------------------------------------------------------------------------------------------
def test_each_role_builds_only_its_phase(srv):
    kinds = {role: {k for k, *_ in srv[role].engine.programs.program_shapes()} for role in srv}
    assert kinds == {"prefill": {"prefill", "export"}, "decode": {"decode", "import"},
                     "both": {"prefill", "decode", "handoff"}}
    prefill, decode = srv["prefill"].engine.programs, srv["decode"].engine.programs
    assert decode.prefill_phase is None and prefill.decode_phase is None
    assert srv["both"].engine.transfers is None and prefill.cfg.role == "prefill"


def test_prefill_then_decode_equals_both(srv):
    for i, prompt in enumerate(PROMPTS):
        body = completion(prompt)
        want = post(srv["both"].base, "/v1/completions", body).json()["choices"][0]["text"]
        first = prefill(srv, "/v1/completions", body)
        kv = first["kv_transfer_params"]
        assert kv["num_tokens"] == len(tokenizer().encode(prompt)) and first["usage"]["completion_tokens"] == 1
        assert want.startswith(first["choices"][0]["text"])
        assert decode_text(srv, "/v1/completions", body, kv, stream=i % 2 == 1) == want
    wait_pages_back(srv)


def test_chat_prefill_then_decode_equals_both(srv):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "write a loop"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    want = _text(post(srv["both"].base, "/v1/chat/completions", body).json()["choices"][0])
    kv = prefill(srv, "/v1/chat/completions", {**body, "stream": True})["kv_transfer_params"]
    assert decode_text(srv, "/v1/chat/completions", body, kv, stream=True) == want


def test_decode_server_refuses_a_raw_prompt(srv):
    r = post(srv["decode"].base, "/v1/completions", completion("hello"))
    assert r.status_code == 400
    assert "kv_transfer_params missing" in r.json()["error"]["message"]


def test_prefill_server_never_decodes(srv):
    r = post(srv["prefill"].base, "/v1/completions", completion("hello", max_tokens=5))
    assert r.status_code == 400 and "--role prefill" in r.json()["error"]["message"]
    one = post(srv["prefill"].base, "/v1/completions", completion("hello", max_tokens=1))
    assert one.status_code == 200 and one.json()["usage"]["completion_tokens"] == 1
    assert "kv_transfer_params" not in one.json()


def test_decode_refuses_params_of_another_prompt(srv):
    kv = prefill(srv, "/v1/completions", completion(PROMPTS[0]))["kv_transfer_params"]
    r = post(srv["decode"].base, "/v1/completions", {**completion(PROMPTS[1]), "kv_transfer_params": kv})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.num_tokens"
    wait_pages_back(srv, timeout=TRANSFER_TIMEOUT_S + 30)  # its export times out


def test_a_page_corrupted_in_flight_fails_only_its_request(srv):
    bad_body, good_body = completion(PROMPTS[2]), completion(PROMPTS[1])
    want = post(srv["both"].base, "/v1/completions", good_body).json()["choices"][0]["text"]
    bad_kv = prefill(srv, "/v1/completions", bad_body)["kv_transfer_params"]
    good_kv = prefill(srv, "/v1/completions", good_body)["kv_transfer_params"]
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(post, srv["decode"].base, "/v1/completions",
                          {**bad_body, "kv_transfer_params": via_proxy(bad_kv, flip_at=100)})
        good = pool.submit(decode_text, srv, "/v1/completions", good_body, good_kv, False)
        r = bad.result()
        assert good.result() == want
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["type"] == "kv_transfer_error" and "checksum" in err["message"]
    wait_pages_back(srv)


def test_a_dropped_transfer_fails_its_request_and_returns_every_page(srv):
    body = completion(PROMPTS[2])
    kv = prefill(srv, "/v1/completions", body)["kv_transfer_params"]
    assert status(srv["prefill"])["free_pages"] < status(srv["prefill"])["total_pages"]  # held for the pull
    r = post(srv["decode"].base, "/v1/completions", {**body, "kv_transfer_params": via_proxy(kv, cut_at=150)})
    assert r.status_code == 502 and r.json()["error"]["type"] == "kv_transfer_error"
    wait_pages_back(srv)
    # the export was single-shot: pulling it again is refused, and the servers still serve
    again = post(srv["decode"].base, "/v1/completions", {**body, "kv_transfer_params": kv})
    assert again.status_code == 502 and "unknown or expired" in again.json()["error"]["message"]
    want = post(srv["both"].base, "/v1/completions", body).json()["choices"][0]["text"]
    kv = prefill(srv, "/v1/completions", body)["kv_transfer_params"]
    assert decode_text(srv, "/v1/completions", body, kv, stream=False) == want
    wait_pages_back(srv)


def test_a_stalled_transfer_times_out_and_fails_only_its_request(srv):
    body = completion(PROMPTS[0])
    kv = prefill(srv, "/v1/completions", body)["kv_transfer_params"]
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts the connection, never answers
        stalled = {**kv, "host": "127.0.0.1", "port": silent.getsockname()[1]}
        r = post(srv["decode"].base, "/v1/completions", {**body, "kv_transfer_params": stalled})
    assert r.status_code == 502 and "timed out" in r.json()["error"]["message"]
    wait_pages_back(srv, timeout=TRANSFER_TIMEOUT_S + 30)  # the export nobody pulled expires on the prefill side


def test_transfer_bytes_per_token_are_the_decode_layouts(srv):
    decode = srv["decode"].engine
    body = completion(PROMPTS[1], max_tokens=2)
    kv = prefill(srv, "/v1/completions", body)["kv_transfer_params"]
    before = decode.stats()
    decode_text(srv, "/v1/completions", body, kv, stream=False)
    after = decode.stats()
    sent = after["kv_transfer_bytes"] - before["kv_transfer_bytes"]
    tokens = after["kv_transfer_tokens"] - before["kv_transfer_tokens"]
    assert tokens == -(-kv["num_tokens"] // kv["page_size"]) * kv["page_size"]  # whole pages travel
    fp8 = decode.programs.layouts.decode
    assert kv["kv_format"] == fp8.dtype == "fp8" and sent == tokens * fp8.bytes_per_token()
    # FP8 values are half of BF16's; the per-token f32 scale (4 bytes a layer) is the rest
    bf16 = fp8.with_dtype("bf16").bytes_per_token()
    assert 2 * (sent // tokens - 4 * fp8.num_layers) == bf16


def test_internal_status_and_prefix_match(srv):
    for role in ("prefill", "decode", "both"):
        st = status(srv[role])
        assert st["role"] == role and st["ready"] is True and st["page_size"] == engine_config().page_size
        assert st["max_model_len"] == engine_config().max_model_len and st["total_pages"] > 0
    ids = tokenizer().encode(PROMPTS[2], special_tokens=False)
    prefill(srv, "/v1/completions", completion(PROMPTS[2]))
    got = post(srv["prefill"].base, "/internal/prefix_match", {"prompt_token_ids": ids}).json()
    ps = engine_config().page_size
    assert got == {"cached_tokens": (len(ids) - 1) // ps * ps}
    bad = post(srv["prefill"].base, "/internal/prefix_match", {"prompt_token_ids": "x"})
    assert bad.status_code == 400
    wait_pages_back(srv, timeout=TRANSFER_TIMEOUT_S + 30)
