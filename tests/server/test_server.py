"""The HTTP API end to end: a real waitress server on a loopback port over a real (random, tiny) engine, driven by the
`openai` client and raw HTTP. Also the harness the other server test files share (one engine per test session:
its compiles are the cost)."""
from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx  # the HTTP client the pinned openai package ships with
import jax.numpy as jnp
import openai
import pytest
from flax import nnx
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.config import from_hf_config
from jaxserve.engine import Engine, EngineConfig, TokenEvent
from jaxserve.models import CausalLM
from jaxserve.server import create_app
from jaxserve.server.limits import AppConfig
from jaxserve.server.main import SPARE_THREADS, ServeConfig, make_server
from jaxserve.tokenizer import Tokenizer

TOKENIZER = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi-tokenizer"
MODEL = "tiny-test"
# a Kimi-shaped (deepseek_v3) model small enough to compile in seconds; the tokenizer's 4096 ids
TINY = {"model_type": "deepseek_v3", "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "max_position_embeddings": 512, "eos_token_id": 4090}
MAX_MODEL_LEN = 256
TIMEOUT = 60.0  # per HTTP request: a hung worker fails the test instead of hanging it


# ---- harness ---------------------------------------------------------------------------------------------------
@functools.cache
def tiny_model() -> CausalLM:
    return CausalLM(from_hf_config(TINY), dtype=jnp.float32, rngs=nnx.Rngs(0))


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer(TOKENIZER)


def engine_config(max_queue: int = 64) -> EngineConfig:
    return EngineConfig(kv_dtype="fp8", prefill_weights="bf16", decode_weights="bf16", dtype="float32", page_size=8,
                        num_decode_pages=128, num_prefill_pages=128, max_batch=8, max_prefill_tokens=64,
                        prefill_chunk=32, max_model_len=MAX_MODEL_LEN, max_queue=max_queue)


@dataclass
class Served:
    """A waitress server on 127.0.0.1:<free port> serving `engine`, run on a background thread."""

    engine: Engine
    port: int
    server: object
    thread: threading.Thread

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        # no retries: a 429/500 must reach the test as it was sent
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)

    def close(self) -> None:
        self.server.close()
        self.server.task_dispatcher.shutdown(timeout=5)
        self.engine.close()


def serve(engine: Engine, name: str = MODEL, max_inflight: int = 8, **app: object) -> Served:
    """Admission limit and thread count together, as `jaxserve serve` sets them."""
    app_cfg = AppConfig(max_inflight=max_inflight, **app)
    server = make_server(create_app(engine, name, app_cfg), ServeConfig("127.0.0.1", 0, max_inflight + SPARE_THREADS,
                                                                        app_cfg.max_body_bytes))
    thread = threading.Thread(target=server.run, name="waitress-test", daemon=True)
    thread.start()
    return Served(engine, server.effective_port, server, thread)


@functools.cache
def shared_server() -> Served:
    """One engine + server for the whole session (the server test files); closed when it ends (conftest.py)."""
    return serve(Engine(tiny_model(), engine_config(), tokenizer()))


def pool_is_full(engine: Engine) -> bool:
    s = engine.stats()
    return (s["running"] == 0 and s["waiting"] == 0 and s["decode_pages_used"] == 0
            and s["prefill_pages_used"] == s["prefix_cache_pages"])


def wait_idle(engine: Engine, timeout: float = 10.0) -> float:
    """Seconds until no request is in flight and every page not held by the prefix cache is free."""
    t0 = time.monotonic()
    while not pool_is_full(engine):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"engine not idle after {timeout}s: {engine.stats()}")
        time.sleep(0.01)
    return time.monotonic() - t0


def metric(base: str, name: str, **labels: str) -> float:
    """One sample of GET /metrics (0.0 when the labelled series does not exist yet)."""
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def sse_events(resp: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of an SSE response, in order."""
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


@dataclass
class EmitHook:
    """Runs `fn(scheduler, event)` on the engine thread for every event of requests with `session_id`, before the
    event is delivered: a safe place to inspect or corrupt engine state between steps."""

    engine: Engine
    session_id: str
    fn: Callable[[object, TokenEvent], None]
    _orig: Callable[[TokenEvent], None] | None = field(default=None, init=False)
    _mine: set[str] = field(default_factory=set, init=False)

    def __enter__(self) -> EmitHook:
        sched = self.engine.scheduler
        self._orig = orig = sched.emit

        def emit(ev: TokenEvent) -> None:
            if ev.request_id not in self._mine:
                if any(s.req.request_id == ev.request_id and s.req.session_id == self.session_id
                       for s in sched.running):
                    self._mine.add(ev.request_id)
            if ev.request_id in self._mine:
                self.fn(sched, ev)
            orig(ev)

        sched.emit = emit
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.scheduler.emit = self._orig


# ---- tests -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv() -> Served:
    return shared_server()


def test_models_lists_the_served_model(srv):
    client = srv.client()
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_with_openai_client(srv):
    r = srv.client().completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert isinstance(r.choices[0].text, str) and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer().encode("def add(a, b):"))
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_completion_with_openai_client(srv):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "hello"}]
    r = srv.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    want = tokenizer().encode(tokenizer().apply_chat_template(messages, add_generation_prompt=True))
    assert r.usage.prompt_tokens == len(want)
    # max_tokens (the older name) works too
    r2 = srv.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert r2.usage.completion_tokens == 3


def test_stream_equals_non_stream_and_ends_with_done(srv):
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=TIMEOUT).json()
    with httpx.stream("POST", f"{srv.base}/v1/completions", timeout=TIMEOUT,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        payloads = list(sse_events(resp))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    *token_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage_chunk["usage"][key] == whole["usage"][key]
    assert all(c["usage"] is None for c in token_chunks)
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == whole["choices"][0]["text"]
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["usage"]["completion_tokens"] == 6


def test_chat_stream_with_openai_client(srv):
    messages = [{"role": "user", "content": "print hello"}]
    chunks = list(srv.client().chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    whole = srv.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                                 temperature=0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content


def test_repeated_long_prompt_reports_cached_tokens(srv):
    prompt = "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n"
    n = len(tokenizer().encode(prompt))
    assert n >= 24  # three 8-token pages
    client = srv.client()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= n and cached % 8 == 0  # whole pages of the prompt
    assert second.usage.prompt_tokens == n


def test_completion_logprobs(srv):
    r = httpx.post(f"{srv.base}/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": "x = ", "max_tokens": 4, "temperature": 0, "logprobs": 0, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    none = httpx.post(f"{srv.base}/v1/completions", timeout=TIMEOUT, json={
        "model": MODEL, "prompt": "x = ", "max_tokens": 1}).json()
    assert none["choices"][0]["logprobs"] is None


def test_chat_logprobs_with_openai_client(srv):
    r = srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_completion_tokens=5, temperature=0, logprobs=True,
                                             extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(c.logprob <= 0 for c in content)
    # the tokens' bytes spell the message exactly (byte-level vocabulary)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == r.choices[0].message.content


def test_stop_strings(srv):
    client = srv.client()
    body = dict(model=MODEL, prompt="for i in range(10):\n", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    client.completions.create(**body)  # warms the prefix cache: the next two runs see the same cached prefill
    ref = client.completions.create(**body).choices[0].text
    assert len(ref) >= 6
    stop = ref[3:5]
    cut = ref.find(stop)
    got = client.completions.create(**body, stop=[stop, "\x00never"]).choices[0]
    assert got.finish_reason == "stop" and got.text == ref[:cut] and stop not in got.text
    # streaming holds back a possible stop-string prefix and never sends the stop string itself
    chunks = list(client.completions.create(**body, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(srv):
    client = srv.client()

    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="def f(", max_tokens=8, temperature=1.0, top_p=0.95,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    a = sample(7)
    assert sample(7) == a
    assert any(sample(s) != a for s in (8, 9))


def session_ids(engine: Engine, session: str, send: Callable[[], httpx.Response]) -> tuple[int, list[str | None]]:
    """Run `send` -> (its status, the session id the engine saw on its running request of `session`)."""
    seen: list[str | None] = []

    def record(sched, ev):  # noqa: ANN001
        if ev.token_id is not None and not seen:
            seen.extend(s.req.session_id for s in sched.running if s.req.request_id == ev.request_id)

    with EmitHook(engine, session, record):
        status = send().status_code
    return status, seen


def test_session_affinity_header_reaches_the_engine(srv):
    assert session_ids(srv.engine, "user-42", lambda: httpx.post(
        f"{srv.base}/v1/completions", headers={"x-session-affinity": "user-42"}, timeout=TIMEOUT,
        json={"model": MODEL, "prompt": "a", "max_tokens": 2, "ignore_eos": True})) == (200, ["user-42"])


def test_concurrent_requests_all_complete(srv):
    results: dict[int, dict] = {}

    def one(i: int) -> None:
        results[i] = httpx.post(f"{srv.base}/v1/completions", timeout=TIMEOUT, json={
            "model": MODEL, "prompt": f"value_{i} = ", "max_tokens": 3 + i % 3, "temperature": 0,
            "ignore_eos": True}).json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(results) == list(range(4))
    for i, r in results.items():
        assert r["usage"]["completion_tokens"] == 3 + i % 3
    wait_idle(srv.engine)


def test_metrics_health_and_openapi(srv):
    srv.client().completions.create(model=MODEL, prompt="m", max_tokens=3, extra_body={"ignore_eos": True})
    assert metric(srv.base, "jaxserve_http_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert metric(srv.base, "jaxserve_completion_tokens_total") >= 3
    assert metric(srv.base, "jaxserve_prompt_tokens_total") >= 1
    assert metric(srv.base, "jaxserve_time_to_first_token_seconds_count") >= 1
    assert metric(srv.base, "jaxserve_inter_token_latency_seconds_count") >= 2
    wait_idle(srv.engine)
    s = srv.engine.stats()
    assert metric(srv.base, "jaxserve_kv_pages_used", pool="decode") == 0
    assert metric(srv.base, "jaxserve_kv_pages_free", pool="decode") == s["decode_pages_free"]
    assert metric(srv.base, "jaxserve_kv_pages_used", pool="prefill") == s["prefill_pages_used"]
    assert metric(srv.base, "jaxserve_queue_depth") == 0
    text = httpx.get(f"{srv.base}/metrics", timeout=TIMEOUT).text
    for name in ("jaxserve_kv_tag_mismatches_total", "jaxserve_preemptions_total", "jaxserve_running_requests"):
        assert name in text
    evictions = "jaxserve_program_evictions_total"  # compiled programs dropped to the compile cache (engine.warmup)
    assert evictions in text and metric(srv.base, evictions) == s["evictions"]
    # --warmup fast's padding (idle: no step adds to it), and its background loads (they may go on meanwhile)
    assert metric(srv.base, "jaxserve_padded_steps_total") == s["padded_steps"]
    assert "jaxserve_program_reloads_total" in text and "jaxserve_programs_pending" in text
    assert httpx.get(f"{srv.base}/health", timeout=TIMEOUT).json()["status"] == "ok"
    spec = httpx.get(f"{srv.base}/openapi.json", timeout=TIMEOUT).json()
    assert spec["openapi"].startswith("3.") and {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                                 "/health", "/metrics"} <= set(spec["paths"])
