"""Prometheus metrics of `jaxserve router`, per pool and server: requests sent, errors, requests in flight, and
each server's health and last status (read from the fleet at scrape time). A private registry per app."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.server.pd_fleet import Fleet

BROKEN = "broken"  # the error label of an exchange that failed without a status (refused, cut, timed out)


class FleetCollector(Collector):
    """Each server's state as gauges labelled by pool and server."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "server"]
        up = GaugeMetricFamily("jaxserve_router_server_up", "1 while the server passes its health checks", labels=labels)
        in_flight = GaugeMetricFamily("jaxserve_router_in_flight", "requests this router has open on the server",
                                      labels=labels)
        queued = GaugeMetricFamily("jaxserve_router_server_queued", "the server's queue at its last status",
                                   labels=labels)
        free = GaugeMetricFamily("jaxserve_router_server_free_pages", "the server's free KV pages at its last status",
                                 labels=labels)
        for pool, url, alive, status, n in self.fleet.snapshot():
            up.add_metric([pool, url], float(alive))
            in_flight.add_metric([pool, url], n)
            queued.add_metric([pool, url], status.queued)
            if status.free_pages is not None:
                free.add_metric([pool, url], status.free_pages)
        yield from (up, in_flight, queued, free)


class RouterMetrics:
    """What the router records; `render()` gives the Prometheus text exposition."""

    def __init__(self, fleet: Fleet) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.http = Counter("jaxserve_router_http_requests", "HTTP requests to the router by endpoint and status",
                            ["endpoint", "status"], registry=r)
        self.requests = Counter("jaxserve_router_requests", "requests sent to each server", ["pool", "server"],
                                registry=r)
        self.errors = Counter("jaxserve_router_errors", "requests a server answered with an error status (or "
                              f"'{BROKEN}': refused, cut or timed out)", ["pool", "server", "status"], registry=r)
        self.cached_tokens = Counter("jaxserve_router_cached_prompt_tokens", "prompt tokens the chosen prefill "
                                     "server held in its prefix cache when the request was routed", ["server"],
                                     registry=r)
        self.sessions = Counter("jaxserve_router_pinned_requests", "requests routed by their session's pin",
                                registry=r)
        r.register(FleetCollector(fleet))

    def request(self, endpoint: str, status: int) -> None:
        self.http.labels(endpoint, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
