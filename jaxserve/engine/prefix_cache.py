"""Prefix cache over full prompt pages: a hash chain over token pages -> (page, tag), refcounted, LRU-evicted.

The cache holds one reference on each page it maps, so a cached page is never freed or reallocated while cached;
a request that reuses it takes its own reference (allocator.share). Eviction drops pages only the cache holds.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from jaxserve.cache import PageAllocator


def page_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Chained digests of each full page of `tokens`: h_i = sha256(h_{i-1} || tokens of page i)."""
    out, prev = [], b""
    for i in range(len(tokens) // page_size):
        chunk = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes()
        prev = hashlib.sha256(prev + chunk).digest()
        out.append(prev)
    return out


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # LRU order: oldest first
        self.hits = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """The longest cached run of full pages of `tokens` (leaving at least one token to compute), each shared
        for the caller (one more reference each)."""
        usable = (len(tokens) - 1) // self.page_size
        found: list[tuple[int, int]] = []
        for h in page_hashes(tokens, self.page_size)[:usable]:
            entry = self.entries.get(h)
            if entry is None:
                break
            self.entries.move_to_end(h)
            found.append(entry)
        for page, tag in found:
            self.allocator.share(page, tag)
        self.hits += len(found)
        return found

    def match(self, tokens: Sequence[int]) -> int:
        """How many full pages `lookup` would return, without taking references or touching the LRU order."""
        usable = (len(tokens) - 1) // self.page_size
        n = 0
        for h in page_hashes(tokens, self.page_size)[:usable]:
            if h not in self.entries:
                break
            n += 1
        return n

    def insert(self, tokens: Sequence[int], pages: Sequence[tuple[int, int]]) -> None:
        """Cache the full pages of `tokens`, held in `pages` (the request's own (page, tag) list)."""
        for h, (page, tag) in zip(page_hashes(tokens, self.page_size), pages):
            if h in self.entries:
                self.entries.move_to_end(h)
                continue
            self.allocator.share(page, tag)
            self.entries[h] = (page, tag)

    def evict(self, n_pages: int) -> int:
        """Free up to n_pages pages that only the cache references, least recently used first. -> pages freed."""
        freed = 0
        for h in list(self.entries):
            if freed >= n_pages:
                break
            page, tag = self.entries[h]
            if self.allocator.refcount(page) == 1:
                del self.entries[h]
                self.allocator.free(page, tag)
                freed += 1
        return freed

    def clear(self) -> None:
        for page, tag in self.entries.values():
            self.allocator.free(page, tag)
        self.entries.clear()
