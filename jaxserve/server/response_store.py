"""The in-memory store of /v1/responses answers that `previous_response_id` and `GET /v1/responses/{id}` read.

A stored response keeps the conversation it answered (earlier turns included, as chat messages) and its own output
items, so a next turn renders `conversation + output + new input` without walking a chain. The store is bounded by
count (the oldest is evicted first) and by age (an entry older than `ttl_s` is gone); it lives in one process and is
lost on restart, as a self-hosted server's cache of recent turns should be.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """One stored answer. messages: the conversation it answered, as chat messages (earlier turns included;
    instructions excluded: they do not carry over to a next turn, as OpenAI's); output: its output items;
    body: the response object GET returns."""

    messages: tuple[dict[str, Any], ...]
    output: tuple[dict[str, Any], ...]
    body: dict[str, Any]


class ResponseStore:
    """Thread-safe map of response id -> StoredResponse holding at most `max_items`, none older than `ttl_s`."""

    def __init__(self, max_items: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 0 or ttl_s <= 0:
            raise ValueError(f"a response store needs max_items >= 0 and ttl_s > 0, got {max_items}, {ttl_s}")
        self.max_items = max_items
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = (self._clock(), stored)
            self._items.move_to_end(response_id)
            self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, None when it was never stored, was evicted or expired."""
        with self._lock:
            self._evict()
            entry = self._items.get(response_id)
            return entry[1] if entry is not None else None

    def __len__(self) -> int:
        with self._lock:
            self._evict()
            return len(self._items)

    def _evict(self) -> None:
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)
        oldest_allowed = self._clock() - self.ttl_s
        while self._items and next(iter(self._items.values()))[0] < oldest_allowed:
            self._items.popitem(last=False)
