"""The servers behind `jaxserve router`, by pool: each one's `Upstream`, its health, its last status, and what
this router has sent it. The policy (`server.pd_policy`) reads them as `ServerView`s.

Health: a thread per server asks `GET /internal/status` every `interval_s` (a server without that route, a
`--role both` server from before roles, is read from `/health`). A server is alive from its first good answer;
it is dead after `fail_after` failed checks in a row (a timeout, an error status), or at once when its port
refuses connections (the process is gone), or when a request could not reach it. Declaring a server dead cuts
the connections of its requests in flight, so a server that hangs fails them at once instead of after the read
timeout. A dead server's checks go on, and one good answer brings it back.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxserve.errors import BackendError, BackendUnreachableError, ConfigError
from jaxserve.server.pd_policy import DECODE, PREFILL, ServerStatus, ServerView
from jaxserve.server.pd_upstream import Timeouts, Upstream

log = logging.getLogger("jaxserve.router")


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 1.0
    fail_after: int = 2  # failed checks in a row before a server is dead (a refused connection: at once)


def read_status(upstream: Upstream) -> ServerStatus:
    """One health check: the server's status. Raises BackendError (BackendUnreachableError: refused)."""
    code, body = upstream.probe("GET", "/internal/status")
    if code == 404:  # a server from before roles: its queue is in /health, its pages unknown
        code, body = upstream.probe("GET", "/health")
        if code == 200 and isinstance(body, dict):
            return ServerStatus(ready=bool(body.get("ready")), queued=_count(body, "waiting", upstream),
                                running=_count(body, "running", upstream))
    if code != 200 or not isinstance(body, dict):
        raise BackendError(f"server {upstream.url}: its status answered {code}", value=upstream.url)

    def known(key: str) -> int | None:
        return None if body.get(key) is None else _count(body, key, upstream)

    return ServerStatus(role=str(body.get("role", "both")), ready=bool(body.get("ready")),
                        queued=_count(body, "queued", upstream), running=_count(body, "running", upstream),
                        free_pages=known("free_pages"), total_pages=known("total_pages"),
                        page_size=known("page_size"), max_model_len=known("max_model_len"))


def _count(body: dict[str, Any], key: str, upstream: Upstream) -> int:
    v = body.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BackendError(f"server {upstream.url}: status field {key!r} is not a count: {v!r}", value=upstream.url)
    return v


class Member:
    """One server's state in its fleet (read and written under the fleet's lock)."""

    def __init__(self, upstream: Upstream, pool: str) -> None:
        self.upstream = upstream
        self.pool = pool
        self.alive = False
        self.status = ServerStatus()
        self.failures = 0
        self.sent = 0  # requests sent since the last status
        self.sent_pages = 0
        self.in_flight = 0
        self.total = 0  # requests ever sent
        self.checked = threading.Event()  # its first health check is done

    def view(self) -> ServerView:
        return ServerView(self.upstream.url, self.alive, self.status, self.sent, self.sent_pages, self.total)


class Fleet:
    """The prefill and decode pools: their members, health checks and bookkeeping. Thread-safe."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeouts: Timeouts = Timeouts(),
                 health: HealthConfig = HealthConfig()) -> None:
        if not prefill:
            raise ConfigError("a router needs at least one --prefill server", value=list(prefill), param="prefill")
        self.members: dict[str, Member] = {}
        for pool, urls in ((PREFILL, prefill), (DECODE, decode)):
            for url in urls:
                up = Upstream(url, timeouts)
                if up.url in self.members:
                    raise ConfigError(f"server {up.url} is listed twice", value=url, param=pool)
                self.members[up.url] = Member(up, pool)
        self.health = health
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def disaggregated(self) -> bool:
        """True with a decode pool (prefill then decode), False: whole requests to the prefill pool's servers."""
        return any(m.pool == DECODE for m in self.members.values())

    def views(self, pool: str) -> list[ServerView]:
        with self._lock:
            return [m.view() for m in self.members.values() if m.pool == pool]

    def upstream(self, url: str) -> Upstream:
        return self.members[url].upstream

    def pool_of(self, url: str) -> str:
        return self.members[url].pool

    def snapshot(self) -> list[tuple[str, str, bool, ServerStatus, int]]:
        """(pool, url, alive, status, in flight from this router) per server, for /metrics and /health."""
        with self._lock:
            return [(m.pool, url, m.alive, m.status, m.in_flight) for url, m in self.members.items()]

    def max_model_len(self) -> int | None:
        """The smallest context window a live server reports (None: none reports one)."""
        with self._lock:
            lens = [m.status.max_model_len for m in self.members.values() if m.status.max_model_len is not None]
        return min(lens) if lens else None

    def page_size(self, pool: str) -> int | None:
        with self._lock:
            sizes = [m.status.page_size for m in self.members.values() if m.pool == pool and m.status.page_size]
        return max(sizes) if sizes else None

    # ---- bookkeeping of the requests this router sends ---------------------------------------------------------
    def sent(self, url: str, pages: int) -> None:
        with self._lock:
            m = self.members[url]
            m.sent += 1
            m.sent_pages += pages
            m.in_flight += 1
            m.total += 1

    def done(self, url: str) -> None:
        with self._lock:
            self.members[url].in_flight -= 1

    def unreachable(self, url: str, err: BackendError) -> None:
        """A request could not connect to `url`: it is dead until a health check passes."""
        self._fail(self.members[url], err, at_once=True)

    # ---- health checks -----------------------------------------------------------------------------------------
    def check(self, url: str) -> bool:
        """One health check of `url` -> alive after it."""
        m = self.members[url]
        try:
            status = read_status(m.upstream)
        except BackendError as e:
            self._fail(m, e, at_once=isinstance(e, BackendUnreachableError))
        else:
            with self._lock:
                if not m.alive:
                    log.info("server %s (%s) is alive: %s", url, m.pool, status)
                m.alive, m.status, m.failures, m.sent, m.sent_pages = True, status, 0, 0, 0
                m.upstream.revived()
        m.checked.set()
        return m.alive

    def _fail(self, m: Member, err: BackendError, at_once: bool) -> None:
        with self._lock:
            m.failures += 1
            dies = m.alive and (at_once or m.failures >= self.health.fail_after)
            if dies:
                m.alive = False
        if dies:
            cut = m.upstream.cut(f"server {m.upstream.url} failed its health checks ({err.message})")
            log.warning("server %s (%s) is dead: %s; %d request(s) in flight cut", m.upstream.url, m.pool,
                        err.message, cut)

    def start(self, first_wait_s: float) -> None:
        """Start the health checks; return once every server was checked once (or after first_wait_s)."""
        for url in self.members:
            t = threading.Thread(target=self._watch, args=(url,), name=f"router-health-{url}", daemon=True)
            t.start()
            self._threads.append(t)
        for m in self.members.values():
            m.checked.wait(first_wait_s)

    def _watch(self, url: str) -> None:
        while not self._stop.is_set():
            self.check(url)
            self._stop.wait(self.health.interval_s)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
