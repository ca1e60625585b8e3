"""Small engines over random tiny models, for the engine tests."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hf_tiny
from jaxserve.config import from_hf_config
from jaxserve.engine import Engine, EngineConfig, Request, SamplingParams
from jaxserve.errors import KVIntegrityError
from jaxserve.models import CausalLM, forward


def tiny_model(arch: str = "deepseek_v3", seed: int = 0) -> CausalLM:
    cfg = from_hf_config(hf_tiny.CONFIGS[arch]().to_dict())
    return CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))


def small_config(**overrides: object) -> EngineConfig:
    base = dict(kv_dtype="bf16", prefill_weights="f32", decode_weights="f32", dtype="float32", page_size=4,
                num_decode_pages=96, num_prefill_pages=96, max_batch=8, max_prefill_tokens=32, prefill_chunk=16,
                max_model_len=64)
    base.update(overrides)
    return EngineConfig(**base)


def engine(model: CausalLM, **overrides: object) -> Engine:
    return Engine(model, small_config(**overrides), start=False)


def prompts(n: int, seed: int = 0, lengths: tuple[int, ...] = (5, 17, 9, 30, 3, 12)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 256, lengths[i % len(lengths)]))) for i in range(n)]


def greedy_reference(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by the full-sequence (un-paged) forward: the engine's ground truth."""
    width = 64  # one padded shape: one compile for every call
    seq, out = list(prompt), []
    for _ in range(n):
        row = np.zeros((1, width), np.int32)
        row[0, : len(seq)] = seq
        logits = forward(model, jnp.asarray(row), lengths=jnp.asarray([len(seq)], jnp.int32))
        tok = int(np.asarray(logits)[0, len(seq) - 1].argmax())
        out.append(tok)
        seq.append(tok)
    return out


def pool_is_full(e: Engine) -> bool:
    s = e.stats()
    return s["decode_pages_used"] == 0 and s["prefill_pages_used"] == s["prefix_cache_pages"]


def stale_page_fails_only_its_request(spec: Engine, ps: list[list[int]], sp: SamplingParams) -> None:
    """Three prompts decode speculatively; the second's last page (where its drafts go) is handed to someone else
    mid-run: only its request fails (KVIntegrityError), the others' tokens are those of a clean run, every page
    returns."""
    clean = [o.token_ids for o in spec.generate(ps, sp)]
    spec.scheduler.prefix_cache.clear()
    reqs = [Request(p, sp) for p in ps]
    streams = [spec.submit(r) for r in reqs]
    sched = spec.scheduler
    while sched.stats.verify_rows == 0 or sum(s.status.value == "decoding" for s in sched.running) < 3:
        spec.step()
    victim = next(s for s in sched.running if s.req.request_id == reqs[1].request_id)
    page, tag = victim.decode_pages[-1]  # the page its drafts are written into
    sched.decode_alloc.free(page, tag)  # a stale mapping: the page is handed to someone else
    [(new_page, new_tag)] = sched.decode_alloc.allocate(1)
    assert new_page == page and new_tag != tag
    ends = [list(st) for st in streams]
    assert ends[1][-1].finish_reason == "error" and isinstance(ends[1][-1].error, KVIntegrityError)
    for i in (0, 2):
        assert [ev.token_id for ev in ends[i] if ev.token_id is not None] == clean[i]
    sched.decode_alloc.free(new_page, new_tag)
    assert pool_is_full(spec)


class Progress:
    """A count that one thread raises (`add`) and others wait on (`wait_for`, `wait_more`), with a bounded wait."""

    def __init__(self, timeout: float) -> None:
        self.count = 0
        self.timeout = timeout
        self._cond = threading.Condition()

    def add(self, n: int = 1) -> None:
        with self._cond:
            self.count += n
            self._cond.notify_all()

    def wait_for(self, n: int) -> bool:
        """Wait until the count reaches n -> False if `timeout` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self.count >= n, self.timeout)

    def wait_more(self, n: int) -> bool:
        with self._cond:
            target = self.count + n
        return self.wait_for(target)


def record_decoder_threads(monkeypatch: object) -> list[str]:
    """Patch tokenizer.StreamDecoder.push to log the name of each thread that detokenizes -> that log."""
    from jaxserve.tokenizer import StreamDecoder

    names: list[str] = []
    push = StreamDecoder.push

    def recording_push(self: StreamDecoder, token_id: int) -> str:
        names.append(threading.current_thread().name)
        return push(self, token_id)

    monkeypatch.setattr(StreamDecoder, "push", recording_push)
    return names


def engine_advances(e: Engine, n: int, timeout: float) -> bool:
    """Wait until the engine has generated n more tokens (polled) -> False if `timeout` seconds passed first. A
    thread that the engine loop waits on can never see this: no backlog of streamed tokens can fake it."""
    target = e.stats()["generated_tokens"] + n
    deadline = time.monotonic() + timeout
    while e.stats()["generated_tokens"] < target:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@contextlib.contextmanager
def backend_compiles() -> Iterator[list[str]]:
    """The XLA backend compiles (or compile-cache loads) of every thread while the block runs: their threads' names."""
    names: list[str] = []

    def listener(event: str, seconds: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
