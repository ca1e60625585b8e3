"""The prefill/decode router's policy: which server of each pool a request goes to. Pure (no HTTP, no clock):
it sees each server as a `ServerView` (alive?, its last /internal/status, what this router sent it since) and
answers a URL, so every rule is unit-tested without a server.

Prefill: the live server with the longest cached prefix of the prompt (each server's /internal/prefix_match),
then the shortest queue; a prefix loses its pull when its server's queue is more than `max_queue_gap` requests
deeper than the shortest one (else one hot prefix would pile every request onto one server).
Decode: among live servers, those whose free KV pages hold the request (prompt + max_tokens, per choice) first,
then the least loaded; when none can hold it, the one with the most free pages (it queues the request).
Ready servers (warm-up done) come before live ones still warming up; full ties go to the server this router sent
fewer requests (idle servers take turns). A session (`x-session-affinity`) sticks to
the servers it was first given while they live (`SessionTable`); a dead server is never picked.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxserve.errors import NoBackendError

PREFILL, DECODE = "prefill", "decode"
MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class ServerStatus:
    """One server's last `GET /internal/status`. Page fields are None for a server that does not report them (a
    `--role both` server from before roles existed answers /health only)."""

    role: str = "both"
    ready: bool = False
    queued: int = 0
    running: int = 0
    free_pages: int | None = None
    total_pages: int | None = None
    page_size: int | None = None
    max_model_len: int | None = None


@dataclass(frozen=True)
class ServerView:
    """What the policy knows of one server: alive (its health checks pass), its last status, the requests and KV
    pages this router sent it since that status was taken (the status is polled, so these cover a burst), and all
    the requests this router ever sent it (the last tiebreak: idle servers take turns)."""

    url: str
    alive: bool
    status: ServerStatus = ServerStatus()
    sent: int = 0
    sent_pages: int = 0
    total: int = 0

    @property
    def load(self) -> int:
        """Requests queued or running on the server, counting those sent since its status."""
        return self.status.queued + self.status.running + self.sent

    @property
    def free_pages(self) -> int | None:
        """Free KV pages, less those the requests sent since the status will take (None: not reported)."""
        s = self.status
        return None if s.free_pages is None else s.free_pages - self.sent_pages


@dataclass(frozen=True)
class Pin:
    """The servers a session sticks to (decode None: whole requests, no decode pool)."""

    prefill: str
    decode: str | None = None


@dataclass(frozen=True)
class PolicyConfig:
    max_queue_gap: int = 8  # a cached prefix outweighs at most this many more queued requests


def pages_for(prompt_tokens: int, max_tokens: int, page_size: int, choices: int = 1) -> int:
    """KV pages a request holds at its last token: ceil((prompt + max_tokens) / page_size) per choice."""
    return choices * -(-(prompt_tokens + max_tokens) // page_size)


def _live(servers: Sequence[ServerView], pool: str) -> list[ServerView]:
    live = [s for s in servers if s.alive]
    if not live:
        raise NoBackendError(f"no live {pool} server: every one failed its health checks",
                             value=[s.url for s in servers], param=pool)
    return live


def _pinned(live: Sequence[ServerView], pinned: str | None) -> ServerView | None:
    return next((s for s in live if s.url == pinned), None)


def pick_prefill(servers: Sequence[ServerView], cached: Mapping[str, int], pinned: str | None = None,
                 cfg: PolicyConfig = PolicyConfig()) -> str:
    """The prefill server (URL) for a prompt. cached: URL -> tokens of the prompt that server's prefix cache holds
    (missing: 0); pinned: the session's server, kept while it lives. Raises NoBackendError if none lives."""
    live = _live(servers, PREFILL)
    if (pin := _pinned(live, pinned)) is not None:
        return pin.url
    shortest = min(s.load for s in live)

    def key(i: int) -> tuple[bool, int, int, int, int]:
        s = live[i]
        hit = cached.get(s.url, 0) if s.load - shortest <= cfg.max_queue_gap else 0
        return not s.status.ready, -hit, s.load, s.total, i

    return live[min(range(len(live)), key=key)].url


def pick_decode(servers: Sequence[ServerView], need_pages: int, pinned: str | None = None) -> str:
    """The decode server (URL) for a request needing `need_pages` KV pages. A server that does not report pages
    counts as fitting. Raises NoBackendError if none lives."""
    live = _live(servers, DECODE)
    if (pin := _pinned(live, pinned)) is not None:
        return pin.url

    def key(i: int) -> tuple[bool, bool, int, int, int, int]:
        s = live[i]
        free = s.free_pages
        if free is None or free >= need_pages:
            return not s.status.ready, False, s.load, -(free or 0), s.total, i
        return not s.status.ready, True, -free, s.load, s.total, i

    return live[min(range(len(live)), key=key)].url


class SessionTable:
    """Session id -> its `Pin`, least recently used dropped past `max_sessions`. Thread-safe."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self._pins: OrderedDict[str, Pin] = OrderedDict()
        self._max = max_sessions
        self._lock = threading.Lock()

    def get(self, session: str | None) -> Pin | None:
        if session is None:
            return None
        with self._lock:
            pin = self._pins.get(session)
            if pin is not None:
                self._pins.move_to_end(session)
            return pin

    def set(self, session: str | None, pin: Pin) -> None:
        if session is None:
            return
        with self._lock:
            self._pins[session] = pin
            self._pins.move_to_end(session)
            while len(self._pins) > self._max:
                self._pins.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pins)
