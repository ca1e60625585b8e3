"""Prometheus metrics of one server: HTTP requests, tokens, latencies, and the engine's pools and counters.

Each app owns a private CollectorRegistry (no process-global state, so several apps can live in one process, as
in the tests). Engine gauges are read from `engine.stats()` at scrape time, so they are never stale.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine import Engine, TokenEvent

# seconds; CPU test engines sit at the top, accelerators at the bottom
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class EngineCollector(Collector):
    """Engine state as gauges and counters, read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        used = GaugeMetricFamily("jaxserve_kv_pages_used", "KV cache pages in use", labels=["pool"])
        free = GaugeMetricFamily("jaxserve_kv_pages_free", "KV cache pages free", labels=["pool"])
        for pool in ("prefill", "decode"):
            used.add_metric([pool], s[f"{pool}_pages_used"])
            free.add_metric([pool], s[f"{pool}_pages_free"])
        yield used
        yield free
        yield GaugeMetricFamily("jaxserve_prefix_cache_pages", "prefill pages held by the prefix cache",
                                value=s["prefix_cache_pages"])
        yield GaugeMetricFamily("jaxserve_queue_depth", "requests waiting for admission", value=s["waiting"])
        yield GaugeMetricFamily("jaxserve_running_requests", "requests prefilling or decoding", value=s["running"])
        yield CounterMetricFamily("jaxserve_kv_tag_mismatches", "decode rows failed closed on a KV page tag mismatch",
                                  value=s["tag_mismatches"])
        yield CounterMetricFamily("jaxserve_preemptions", "sequences preempted (recomputed) for decode pages",
                                  value=s["preemptions"])
        yield CounterMetricFamily("jaxserve_spec_draft_tokens", "speculative draft tokens proposed",
                                  value=s["draft_tokens"])
        yield CounterMetricFamily("jaxserve_spec_accepted_tokens", "speculative draft tokens the target accepted",
                                  value=s["accepted_tokens"])
        rows = s["verify_rows"]  # tokens a row emits per verify step: the accepted drafts + the target's own one
        yield GaugeMetricFamily("jaxserve_spec_mean_accept_length", "tokens emitted per row per verify step (0: none)",
                                value=(s["accepted_tokens"] + rows) / rows if rows else 0.0)
        yield CounterMetricFamily("jaxserve_program_evictions", "times compiled programs were dropped to the compile "
                                  "cache to stay under the memory-mapping budget (warm-up and serving)",
                                  value=s["evictions"])
        yield CounterMetricFamily("jaxserve_padded_steps", "steps run padded in a larger loaded program while their own "
                                  "shape was not loaded (--warmup fast)", value=s["padded_steps"])
        yield CounterMetricFamily("jaxserve_program_reloads", "evicted programs loaded again from the compile cache",
                                  value=s["program_reloads"])
        yield GaugeMetricFamily("jaxserve_programs_pending", "warm-up plan programs not loaded now (the background "
                                "thread loads them)", value=s["programs_pending"])
        yield CounterMetricFamily("jaxserve_engine_aborts", "requests aborted in the engine (disconnects included)",
                                  value=s["aborted"])


class RequestTimer:
    """Time to first token and inter-token latency of one request."""

    def __init__(self, ttft: Histogram, itl: Histogram, start: float) -> None:
        self._ttft, self._itl = ttft, itl
        self._last: float | None = None
        self._start = start

    def token(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._ttft.observe(now - self._start)
        else:
            self._itl.observe(now - self._last)
        self._last = now


class ServerMetrics:
    """The metrics one app records; `render()` gives the Prometheus text exposition."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("jaxserve_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("jaxserve_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("jaxserve_completion_tokens", "generated tokens of finished requests",
                                         registry=r)
        self.failures = Counter("jaxserve_request_failures", "requests the engine ended with an error, by type",
                                ["endpoint", "error_type"], registry=r)
        self.disconnects = Counter("jaxserve_client_disconnects", "requests whose client went away mid-generation",
                                   ["endpoint"], registry=r)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "request arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds", "time between consecutive tokens",
                             buckets=ITL_BUCKETS, registry=r)
        r.register(EngineCollector(engine))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def timer(self, start: float) -> RequestTimer:
        return RequestTimer(self.ttft, self.itl, start)

    def finished(self, endpoint: str, end: TokenEvent) -> None:
        self.prompt_tokens.inc(end.prompt_tokens)
        self.cached_tokens.inc(end.cached_tokens)
        self.completion_tokens.inc(end.completion_tokens)
        if end.finish_reason == "error":
            self.failures.labels(endpoint, end.error.error_type if end.error else "internal_error").inc()
        elif end.finish_reason == "abort":
            self.failures.labels(endpoint, "request_aborted").inc()

    def disconnect(self, endpoint: str) -> None:
        self.disconnects.labels(endpoint).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST  # prometheus_client metrics are thread-safe
