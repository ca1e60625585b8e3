"""The prefill/decode router's policy (`jaxserve.server.pd_policy`) on hand-made server views: prefix preference,
queue tiebreak, free-page fit, affinity, dead servers skipped."""
from __future__ import annotations

import pytest

from jaxserve.errors import NoBackendError
from jaxserve.server.pd_policy import (Pin, PolicyConfig, ServerStatus, ServerView, SessionTable, pages_for,
                                       pick_decode, pick_prefill)

A, B, C = "http://a", "http://b", "http://c"


def view(url: str, queued: int = 0, running: int = 0, free: int | None = None, alive: bool = True,
         ready: bool = True, sent: int = 0, sent_pages: int = 0) -> ServerView:
    return ServerView(url, alive, ServerStatus(ready=ready, queued=queued, running=running, free_pages=free,
                                               total_pages=None if free is None else 100, page_size=8),
                      sent, sent_pages)


def test_prefill_prefers_the_longest_cached_prefix_over_a_shorter_queue():
    servers = [view(A, queued=0), view(B, queued=3), view(C, queued=1)]
    assert pick_prefill(servers, {A: 0, B: 32, C: 16}) == B


def test_prefill_without_cached_prefixes_takes_the_shortest_queue():
    servers = [view(A, queued=2, running=1), view(B, queued=0, running=2), view(C, queued=4)]
    assert pick_prefill(servers, {}) == B
    # requests sent since the status count as queued: a burst spreads over the servers
    assert pick_prefill([view(A, sent=3), view(B, running=1)], {}) == B


def test_equal_prefixes_tie_on_queue_depth_then_turns():
    assert pick_prefill([view(A, queued=2), view(B, queued=1)], {A: 16, B: 16}) == B
    assert pick_prefill([view(A), view(B)], {A: 16, B: 16}) == A
    # idle servers take turns: the one this router sent fewer requests in all
    assert pick_prefill([ServerView(A, True, ServerStatus(ready=True), total=3),
                         ServerView(B, True, ServerStatus(ready=True), total=2)], {}) == B
    assert pick_decode([ServerView(A, True, ServerStatus(ready=True), total=1),
                        ServerView(B, True, ServerStatus(ready=True))], 1) == B


def test_a_prefix_loses_its_pull_past_the_queue_gap():
    cfg = PolicyConfig(max_queue_gap=4)
    assert pick_prefill([view(A, queued=4), view(B)], {A: 64}, cfg=cfg) == A
    assert pick_prefill([view(A, queued=5), view(B)], {A: 64}, cfg=cfg) == B


def test_ready_servers_come_before_warming_ones():
    assert pick_prefill([view(A, ready=False), view(B, queued=5)], {A: 64}) == B
    assert pick_prefill([view(A, ready=False)], {}) == A  # alive but warming: still served


def test_dead_servers_are_skipped_and_none_alive_is_a_503():
    assert pick_prefill([view(A, alive=False), view(B, queued=9)], {A: 64}) == B
    assert pick_decode([view(A, free=100, alive=False), view(B, free=1)], 10) == B
    with pytest.raises(NoBackendError) as e:
        pick_decode([view(A, alive=False)], 1)
    assert e.value.http_status == 503 and e.value.value == [A]


def test_decode_prefers_a_server_whose_free_pages_hold_the_request():
    servers = [view(A, free=5), view(B, free=20, queued=3), view(C, free=12, running=2)]
    assert pick_decode(servers, 10) == C  # B and C fit; C is less loaded
    assert pick_decode(servers, 15) == B  # only B fits, though the most loaded
    assert pick_decode(servers, 30) == B  # none fits: the most free pages


def test_decode_free_pages_discount_what_was_sent_since_the_status():
    assert pick_decode([view(A, free=20, sent=1, sent_pages=15), view(B, free=10, queued=2)], 8) == B


def test_decode_equal_fit_ties_on_load_then_free_pages():
    assert pick_decode([view(A, free=10, running=1), view(B, free=10)], 4) == B
    assert pick_decode([view(A, free=10), view(B, free=30)], 4) == B
    assert pick_decode([view(A), view(B, free=2)], 4) == A  # a server reporting no pages counts as fitting


def test_pages_for_rounds_each_choice_up():
    assert pages_for(10, 6, 8) == 2
    assert pages_for(10, 7, 8) == 3
    assert pages_for(10, 6, 8, choices=3) == 6


def test_a_pinned_session_sticks_while_its_servers_live():
    prefill = [view(A, queued=9), view(B)]
    decode = [view(A, free=0, queued=9), view(B, free=100)]
    assert pick_prefill(prefill, {B: 64}, pinned=A) == A
    assert pick_decode(decode, 50, pinned=A) == A
    dead = [view(A, alive=False), view(B, queued=9)]
    assert pick_prefill(dead, {}, pinned=A) == B
    assert pick_decode(dead, 1, pinned=A) == B


def test_session_table_keeps_the_most_recent_sessions():
    table = SessionTable(max_sessions=2)
    table.set(None, Pin(A))  # no session: nothing pinned
    assert len(table) == 0 and table.get(None) is None
    table.set("s1", Pin(A, B))
    table.set("s2", Pin(B, C))
    assert table.get("s1") == Pin(A, B)  # s1 now the most recent
    table.set("s3", Pin(C))
    assert table.get("s2") is None and table.get("s1") == Pin(A, B) and table.get("s3") == Pin(C)
