"""Prefix cache keys and hits: salted chains, per-request cache_salt, token confirmation, stale entries dropped
(never raised), entries whose device tag was overwritten dropped."""
from __future__ import annotations

import numpy as np

from engine_util import tiny_model
from jaxserve.cache import PageAllocator
from jaxserve.engine.prefix_cache import Entry, PrefixCache, engine_salt, page_hashes

PS = 4
TOKENS = list(range(100, 117))  # 4 full pages + 1


def _cached(salt: bytes = b"s", cache_salt: str | None = None) -> tuple[PageAllocator, PrefixCache, list]:
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, PS, salt)
    pages = alloc.allocate(5)
    cache.insert(TOKENS, pages, cache_salt)
    for p, t in pages:  # the request finishes: only the cache holds the full pages
        alloc.free(p, t)
    return alloc, cache, pages


def test_hit_shares_pages_and_salts_separate():
    alloc, cache, pages = _cached()
    found = cache.lookup(TOKENS)
    assert found == pages[:4] and all(alloc.refcount(p) == 2 for p, _ in found)
    assert cache.lookup(TOKENS, cache_salt="tenant-a") == []  # another tenant never sees them
    other = PrefixCache(alloc, PS, b"other model")
    other.entries = cache.entries  # the same table under another engine salt: no key matches
    assert other.lookup(TOKENS) == []
    _, salted, _ = _cached(cache_salt="tenant-a")
    assert len(salted.lookup(TOKENS, cache_salt="tenant-a")) == 4 and salted.lookup(TOKENS) == []


def test_engine_salt_binds_model_weights_and_kv_dtype():
    cfg = tiny_model("deepseek_v3").cfg
    cfg2 = tiny_model("glm4_moe").cfg
    base = engine_salt(cfg, "fp8", "bf16", "bfloat16")
    assert base == engine_salt(cfg, "fp8", "bf16", "bfloat16")
    others = {engine_salt(cfg2, "fp8", "bf16", "bfloat16"), engine_salt(cfg, "int4", "bf16", "bfloat16"),
              engine_salt(cfg, "fp8", "fp8", "bfloat16"), engine_salt(cfg, "fp8", "bf16", "float32")}
    assert base not in others and len(others) == 4
    assert page_hashes(TOKENS, PS, base) != page_hashes(TOKENS, PS, engine_salt(cfg, "int4", "bf16", "bfloat16"))


def test_hit_is_confirmed_by_the_stored_tokens():
    alloc, cache, pages = _cached()
    h = page_hashes(TOKENS, PS, b"s")
    e = cache.entries[h[1]]
    cache.entries[h[1]] = Entry(e.page, e.tag, (0,) * PS)  # a colliding key whose page holds other tokens
    assert cache.lookup(TOKENS) == pages[:1]  # the run stops before the mismatching page
    assert alloc.refcount(pages[1][0]) == 1  # nothing shared for it


def test_stale_entry_is_dropped_not_raised():
    alloc, cache, pages = _cached()
    page, tag = pages[2]
    alloc.free(page, tag)  # a bookkeeping bug frees the cache's reference ...
    (p2, t2), = alloc.allocate(1)  # ... and the page is handed to someone else
    assert p2 == page and t2 != tag
    assert cache.lookup(TOKENS) == pages[:2]  # no PageAllocatorError; the run ends at the stale page
    assert all(e.page != page or e.tag == t2 for e in cache.entries.values())
    assert alloc.refcount(page) == 1  # the new owner's reference is untouched
    assert cache.evict(16) >= 0 and alloc.refcount(page) == 1


def test_entries_whose_device_tag_was_overwritten_are_dropped():
    alloc, cache, pages = _cached()
    device = alloc.live_tags
    device[pages[1][0]] = 12345  # a stale writer stamped its tag on the device
    assert cache.drop_mismatched(device) == 1
    assert alloc.refcount(pages[1][0]) == 0  # the cache's reference returned
    assert len(cache) == 3
    cache.clear()
    assert alloc.num_used == 0
