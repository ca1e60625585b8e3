"""The /v1/responses store: bounded by count (oldest evicted first) and by age, safe to share between threads."""
from __future__ import annotations

import threading

import pytest

from jaxserve.server.response_store import ResponseStore, StoredResponse


class Clock:
    """A clock the test moves by hand (the store's age limit without sleeping)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(n: int) -> StoredResponse:
    return StoredResponse(({"role": "user", "content": str(n)},), (), {"id": f"resp_{n}", "output": []})


def test_the_oldest_is_evicted_beyond_the_count():
    store = ResponseStore(max_items=3, ttl_s=60.0)
    for n in range(5):
        store.put(f"resp_{n}", stored(n))
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_1") is None
    assert store.get("resp_4").messages[0]["content"] == "4"


def test_entries_older_than_the_ttl_are_gone():
    clock = Clock()
    store = ResponseStore(max_items=10, ttl_s=30.0, clock=clock)
    store.put("resp_a", stored(1))
    clock.now += 20
    store.put("resp_b", stored(2))
    clock.now += 15  # a is 35 s old, b 15 s
    assert store.get("resp_a") is None and store.get("resp_b") is not None
    clock.now += 16
    assert store.get("resp_b") is None and len(store) == 0


def test_zero_items_stores_nothing_and_bad_bounds_are_refused():
    store = ResponseStore(max_items=0, ttl_s=1.0)
    store.put("resp_x", stored(0))
    assert store.get("resp_x") is None
    with pytest.raises(ValueError):
        ResponseStore(max_items=1, ttl_s=0)


def test_threads_share_one_store_within_its_bound():
    store = ResponseStore(max_items=50, ttl_s=60.0)

    def put(t: int) -> None:
        for n in range(100):
            store.put(f"resp_{t}_{n}", stored(n))
            store.get(f"resp_{t}_{n // 2}")

    threads = [threading.Thread(target=put, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(store) == 50
