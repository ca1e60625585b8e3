"""Host-side page allocator (`PageAllocator`): free lists per page shard, refcounts, and each page's generation
tag, sent to the pool's device tag array as changes (`sync_device_tags`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from jaxserve.cache.layout import NULL_PAGE
from jaxserve.cache.pool import scatter_tags
from jaxserve.errors import ConfigError, OutOfPagesError, PageAllocatorError


@dataclass
class PageAllocator:
    """Host-side page allocator with refcounts and per-page generation tags.

    Page 0 (NULL_PAGE) is reserved when `reserve_null_page` (default): never handed out, so block tables can pad
    with it. Tags are uint32, bumped on every allocation (skipping 0 on wrap, so a tag never equals its previous
    value and 0 means "never allocated"). Freeing does not change the host tag; reallocating does. The device's
    copy (`live_tags`, sent by `sync_device_tags`) is 0 for a free page, so a reader still holding a freed page
    fails its check at once, before the page is even reallocated.

    `shards` > 1 splits the page ids into equal contiguous ranges, one per data-parallel attention rank (the pool's
    page axis is split the same way over the mesh): `allocate(n, shard=r)` takes pages of range r only, and the
    first page of every range is reserved as that device's null page (global page `r * pages_per_shard`).
    """

    num_pages: int
    reserve_null_page: bool = True
    shards: int = 1
    _tags: np.ndarray = field(init=False, repr=False)
    _refcount: np.ndarray = field(init=False, repr=False)
    _free: list[list[int]] = field(init=False, repr=False)  # per shard: a stack, pops lowest ids first
    _dirty: set[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        first = 1 if self.reserve_null_page else 0
        if self.shards < 1 or self.num_pages % self.shards:
            raise ConfigError(f"PageAllocator: {self.num_pages} pages do not split into {self.shards} equal shards",
                              value=self.shards, param="shards")
        if self.pages_per_shard <= first:
            raise ConfigError("PageAllocator needs at least one allocatable page per shard", value=self.num_pages,
                              param="num_pages")
        self._tags = np.zeros(self.num_pages, np.uint32)
        self._refcount = np.zeros(self.num_pages, np.int32)
        ps = self.pages_per_shard
        self._free = [list(range((s + 1) * ps - 1, s * ps + first - 1, -1)) for s in range(self.shards)]
        self._dirty = set()

    @property
    def pages_per_shard(self) -> int:
        return self.num_pages // self.shards

    @property
    def capacity(self) -> int:
        """Allocatable pages (the reserved null pages excluded)."""
        return self.num_pages - (self.shards if self.reserve_null_page else 0)

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._free)

    def num_free_in(self, shard: int) -> int:
        """Free pages of one shard."""
        return len(self._free[shard])

    def shard_of(self, page: int) -> int:
        return int(page) // self.pages_per_shard

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def tags(self) -> np.ndarray:
        """Copy of the host tag array [num_pages] uint32."""
        return self._tags.copy()

    @property
    def live_tags(self) -> np.ndarray:
        """What the device tag array should hold [num_pages] uint32: the tag of each allocated page, 0 if free."""
        return np.where(self._refcount > 0, self._tags, 0).astype(np.uint32)

    def refcount(self, page: int) -> int:
        self._check_page(page)
        return int(self._refcount[page])

    def tag(self, page: int) -> int:
        """The page's current host tag (its last allocation's)."""
        self._check_page(page)
        return int(self._tags[page])

    def allocate(self, n: int, shard: int = 0) -> list[tuple[int, int]]:
        """n fresh pages of `shard` as (page, tag), refcount 1 each. All or nothing: OutOfPagesError allocates
        nothing."""
        if n < 0:
            raise PageAllocatorError(f"cannot allocate a negative number of pages ({n})", value=n, param="n")
        if not 0 <= shard < self.shards:
            raise PageAllocatorError(f"unknown page shard {shard!r} (have {self.shards})", value=shard, param="shard")
        free = self._free[shard]
        if n > len(free):
            raise OutOfPagesError(f"need {n} pages, {len(free)} free", value=n, param="n")
        out = []
        for _ in range(n):
            page = free.pop()
            tag = int(self._tags[page]) + 1
            tag = 1 if tag > 0xFFFFFFFF else tag  # wrap skips 0
            self._tags[page] = tag
            self._refcount[page] = 1
            self._dirty.add(page)
            out.append((page, tag))
        return out

    def share(self, page: int, tag: int | None = None) -> None:
        """One more owner of an allocated page (prefix cache). With `tag`, a stale pair is refused."""
        self._check_owned(page, tag)
        self._refcount[page] += 1

    def free(self, page: int, tag: int) -> None:
        """Drop one reference; at refcount 0 the page returns to the free list.

        Raises PageAllocatorError for an unknown/reserved page, a free page (double free) or a stale tag.
        """
        self._check_owned(page, tag)
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._free[self.shard_of(page)].append(page)
            self._dirty.add(page)  # the device forgets the generation too

    def _check_page(self, page: int) -> None:
        if not (isinstance(page, (int, np.integer)) and 0 <= page < self.num_pages):
            raise PageAllocatorError(f"unknown page {page!r}", value=page, param="page")
        if self.reserve_null_page and page % self.pages_per_shard == NULL_PAGE:
            raise PageAllocatorError(f"page {page} is a reserved null page", value=page, param="page")

    def _check_owned(self, page: int, tag: int | None) -> None:
        self._check_page(page)
        if self._refcount[page] == 0:
            raise PageAllocatorError(f"page {page} is not allocated (double free or use after free)", value=page,
                                     param="page")
        if tag is not None and int(tag) != int(self._tags[page]):
            raise PageAllocatorError(f"stale tag {tag} for page {page} (current {int(self._tags[page])})",
                                     value=tag, param="tag")

    def device_tags(self) -> jax.Array:
        """Full upload of `live_tags` [num_pages] uint32 (once, at start-up); clears the dirty set."""
        self._dirty.clear()
        return jax.device_put(self.live_tags)

    def take_dirty(self) -> tuple[np.ndarray, np.ndarray]:
        """(pages [n] int32, live tags [n] uint32: 0 for a freed page) changed since the last sync; clears the set."""
        pages = np.fromiter(sorted(self._dirty), np.int32, len(self._dirty))
        self._dirty.clear()
        return pages, np.where(self._refcount[pages] > 0, self._tags[pages], 0).astype(np.uint32)

    def sync_device_tags(self, device_tags: jax.Array) -> jax.Array:
        """Scatter only the changed live tags into `device_tags` [num_pages] uint32 (donated); returns the new array.

        The update is padded to a power-of-two length (pad index out of bounds, dropped) to bound recompiles.
        """
        pages, tags = self.take_dirty()
        if pages.size == 0:
            return device_tags
        n = 1 << (int(pages.size) - 1).bit_length()
        pad = n - pages.size
        pages = np.concatenate([pages, np.full(pad, self.num_pages, np.int32)])
        tags = np.concatenate([tags, np.zeros(pad, np.uint32)])
        return scatter_tags(device_tags, jax.device_put(pages), jax.device_put(tags))
