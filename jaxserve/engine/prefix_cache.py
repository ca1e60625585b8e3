"""Prefix cache over full prompt pages: a salted hash chain over token pages -> (page, tag, tokens), refcounted,
LRU-evicted.

Keys: h_0 = sha256(salt), h_i = sha256(h_{i-1} || tokens of page i). The salt binds entries to what produced
the KV (model config, weight format, KV dtype, activation dtype: `engine_salt`) and to a request's optional
`cache_salt` (as vLLM accepts), so requests with different salts never share pages. A hit is confirmed by
comparing the page's stored token ids with the request's before the page is reused (a digest collision, or a
bug in the chain, reads as a miss).

The cache holds one reference on each page it maps, so a cached page is never freed or reallocated while cached;
a request that reuses it takes its own reference (allocator.share). Eviction drops pages only the cache holds.
An entry whose page the allocator no longer backs with the same tag, or whose device tag was overwritten
(`drop_mismatched`), is dropped rather than served or raised.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.cache import PageAllocator
from jaxserve.config import ModelConfig
from jaxserve.errors import PageAllocatorError


def engine_salt(model_cfg: ModelConfig, weights: str, kv_dtype: str, dtype: str) -> bytes:
    """The salt every chain starts from: the model config (its identity here), the weight format, the KV pool's
    dtype and the activation dtype: pages written under any other combination never match."""
    return hashlib.sha256(repr((model_cfg, weights, kv_dtype, dtype)).encode()).digest()


def page_hashes(tokens: Sequence[int], page_size: int, salt: bytes = b"", cache_salt: str | None = None
                ) -> list[bytes]:
    """Chained digests of each full page of `tokens`: h_i = sha256(h_{i-1} || tokens of page i), with h_{-1}
    the digest of the engine salt and the request's cache_salt."""
    extra = b"" if cache_salt is None else b"\x00cache_salt\x00" + cache_salt.encode("utf-8", "surrogatepass")
    prev = hashlib.sha256(salt + extra).digest()
    out = []
    for i in range(len(tokens) // page_size):
        chunk = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes()
        prev = hashlib.sha256(prev + chunk).digest()
        out.append(prev)
    return out


@dataclass(frozen=True)
class Entry:
    """One cached page: its (page, tag) in the prefill pool and the token ids it holds."""

    page: int
    tag: int
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, salt: bytes = b"") -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.salt = salt
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()  # LRU order: oldest first
        self.hits = 0
        self.dropped = 0  # entries dropped as stale or overwritten

    def __len__(self) -> int:
        return len(self.entries)

    def _page_tokens(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(int(t) for t in tokens[i * self.page_size:(i + 1) * self.page_size])

    def lookup(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[tuple[int, int]]:
        """The longest cached run of full pages of `tokens` (leaving at least one token to compute), each shared
        for the caller (one more reference each). A page whose stored tokens differ ends the run; an entry the
        allocator refuses (stale tag) is dropped and ends the run. Never raises for a bad entry."""
        usable = (len(tokens) - 1) // self.page_size
        found: list[tuple[int, int]] = []
        for i, h in enumerate(page_hashes(tokens, self.page_size, self.salt, cache_salt)[:usable]):
            entry = self.entries.get(h)
            if entry is None or entry.tokens != self._page_tokens(tokens, i):
                break
            try:
                self.allocator.share(entry.page, entry.tag)
            except PageAllocatorError:
                self._drop(h, free=False)  # the page is no longer the cache's: forget it, free nothing
                break
            self.entries.move_to_end(h)
            found.append((entry.page, entry.tag))
        self.hits += len(found)
        return found

    def match(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """How many full pages `lookup` would return (by key and stored tokens), without taking references or
        touching the LRU order."""
        usable = (len(tokens) - 1) // self.page_size
        n = 0
        for i, h in enumerate(page_hashes(tokens, self.page_size, self.salt, cache_salt)[:usable]):
            entry = self.entries.get(h)
            if entry is None or entry.tokens != self._page_tokens(tokens, i):
                break
            n += 1
        return n

    def insert(self, tokens: Sequence[int], pages: Sequence[tuple[int, int]], cache_salt: str | None = None) -> None:
        """Cache the full pages of `tokens`, held in `pages` (the request's own (page, tag) list)."""
        for i, (h, (page, tag)) in enumerate(zip(page_hashes(tokens, self.page_size, self.salt, cache_salt), pages)):
            if h in self.entries:
                self.entries.move_to_end(h)
                continue
            try:
                self.allocator.share(page, tag)
            except PageAllocatorError:
                return  # the request's own page is stale: cache nothing from here on
            self.entries[h] = Entry(page, tag, self._page_tokens(tokens, i))

    def evict(self, n_pages: int) -> int:
        """Free up to n_pages pages that only the cache references, least recently used first. -> pages freed."""
        freed = 0
        for h in list(self.entries):
            if freed >= n_pages:
                break
            entry = self.entries[h]
            if not self._owned(entry):
                self._drop(h, free=False)  # stale: nothing of the cache's to free
            elif self.allocator.refcount(entry.page) == 1:
                self._drop(h, free=True)
                freed += 1
        return freed

    def drop_mismatched(self, device_tags: np.ndarray) -> int:
        """Drop every entry whose page's device tag (device_tags [pages] uint32) is not the entry's tag: its
        contents were overwritten or its page recycled. -> entries dropped."""
        bad = [h for h, e in self.entries.items() if int(device_tags[e.page]) != e.tag]
        for h in bad:
            self._drop(h, free=True)
        return len(bad)

    def clear(self) -> None:
        for h in list(self.entries):
            self._drop(h, free=True)

    def _owned(self, entry: Entry) -> bool:
        """The allocator still backs the entry: its page is allocated under the entry's tag."""
        return self.allocator.tag(entry.page) == entry.tag and self.allocator.refcount(entry.page) > 0

    def _drop(self, h: bytes, *, free: bool) -> None:
        """Forget entry h; with `free`, return the cache's reference if the allocator still backs it."""
        entry = self.entries.pop(h)
        self.dropped += 1
        if free and self._owned(entry):
            self.allocator.free(entry.page, entry.tag)
