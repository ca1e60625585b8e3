"""Where a new sequence goes: the DP attention rank with room for it (decode pages, rows) whose prefix cache holds
most of its prompt, then the least loaded; and, for deterministic serving, whether a rank's free decode pages cover
the most its running sequences and the new one may take, so that nothing is ever preempted."""
from __future__ import annotations

from dataclasses import dataclass

from jaxserve.cache import PageAllocator
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.prefix_cache import PrefixCache
from jaxserve.engine.sequence import Sequence


@dataclass(frozen=True)
class Placement:
    """Rank choice over the scheduler's own decode allocator, running list and prefix caches (shared, not copied)."""

    cfg: EngineConfig
    decode_alloc: PageAllocator
    running: list[Sequence]
    prefix_caches: list[PrefixCache]

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.cfg.page_size)

    def rank_for(self, tokens: list[int], cache_salt: str | None = None) -> int | None:
        """The rank for a new sequence; None: no rank has room."""
        need = self.pages_for(len(tokens) + 1)
        ranks = self.cfg.dp_ranks
        if ranks == 1:
            return 0 if self.decode_alloc.num_free >= need else None
        per_rank_rows = self.cfg.max_batch // ranks
        best, key = None, None
        for r in range(ranks):
            load = sum(1 for s in self.running if s.rank == r)
            if self.decode_alloc.num_free_in(r) < need or load >= per_rank_rows:
                continue
            hit = self.prefix_caches[r].match(tokens, cache_salt) if self.prefix_caches else 0
            k = (-hit, load, r)
            if key is None or k < key:
                best, key = r, k
        return best

    def fits_to_the_end(self, seq: Sequence, rank: int) -> bool:
        """Whether the rank's free decode pages cover what its running sequences may still take and all that seq
        may take (prompt + max_tokens): admitted so, no sequence ever needs a preemption."""
        def most(s: Sequence) -> int:
            return self.pages_for(min(len(s.req.prompt) + s.req.params.max_tokens, self.cfg.max_model_len))

        owed = sum(max(0, most(s) - len(s.decode_pages)) for s in self.running if s.rank == rank)
        return self.decode_alloc.num_free_in(rank) >= owed + most(seq)
