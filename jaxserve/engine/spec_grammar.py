"""Grammar rows under speculative decoding: a row's drafts cut to what its grammar allows (then extended by the
tokens the grammar forces), and the allowed-token bitmask of each of its verify positions.

A row with a grammar (engine.structured) speculates like any other: a copy of its llguidance matcher walks the
draft chain on the host, keeping drafts up to the first one its mask at that point rejects, then appends the
tokens the grammar forces there (`compute_ff_tokens`: e.g. a JSON schema's next key), up to the row's draft
limit, and gives each position's mask. The row's own matcher commits only the tokens the verify accepts (+ the
target's own), one by one through the scheduler's output path (`output.token_end`), as in the plain decode.

The verify samples position j of the row under the mask of the state after its drafts 0 .. j-1 (the [B, k + 1, W]
mask of the verify's general sampling form, `acceptance.verify_tokens`), so every token it emits is the one the
plain grammar decode would give: greedy the same tokens, sampled the target's masked distribution (drafts are
deterministic, q one-hot). The rule would be exact with any drafts; cutting at the first rejected one only saves
positions a grammar-masked target can never accept. Drafts made on the device (MTP / EAGLE-3 heads, chained in
the previous verify program) are not masked while drafted: their chain is cut here at its first rejected token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.engine.batch import SamplingExtras, top_width
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.structured import GrammarCompiler


@dataclass(frozen=True)
class GrammarDrafts:
    """A grammar row's drafts and its verify masks: tokens (each allowed after the ones before it); masks
    [len(tokens) + 1, W] int32, row j the allowed-token bitmask after tokens[:j] (its first row: the mask now)."""

    tokens: list[int]
    masks: np.ndarray


def allows(mask: np.ndarray, token: int) -> bool:
    """Bit `token` of a bitmask [W] int32 (engine.structured's layout)."""
    return 0 <= token < 32 * mask.shape[-1] and bool((int(mask[token // 32]) >> (token % 32)) & 1)


def grammar_drafts(matcher: object, grammar: GrammarCompiler, proposed: list[int], limit: int) -> GrammarDrafts:
    """The drafter's `proposed` chain cut at the first token the matcher rejects, then the tokens the grammar
    forces after the kept ones, at most `limit` in all; with each position's mask. The matcher is left as it was
    (a copy walks the chain)."""
    walker = matcher.deep_copy()  # a fork (microseconds): the row's own matcher is never advanced here
    masks, kept, forced = [grammar.bitmask(walker)], [], False
    chain = list(proposed[:max(limit, 0)])
    while len(kept) < limit:
        if not chain:
            if forced or walker.is_stopped():
                break
            chain, forced = list(walker.compute_ff_tokens()[:limit - len(kept)]), True
            if not chain:
                break
        token = chain.pop(0)
        if not allows(masks[-1], token):
            if forced:
                break
            chain = []  # the drafter's chain ends here: the forced tokens may go on from this state
            continue
        if not walker.consume_token(token):  # never for a token its mask allowed
            break
        kept.append(token)
        masks.append(grammar.bitmask(walker))
    return GrammarDrafts(kept, np.stack(masks[:len(kept) + 1]))


def verify_extras(rows: list[Sequence | None], grammar: dict[int, GrammarDrafts], drafts: list[list[int]],
                  place: list[int], k: int, vocab: int) -> SamplingExtras:
    """The verify's extras for its batch rows (None = padding): speculating rows have no penalties, biases or
    forced tokens (`speculative.speculates`), so only the masks (grammar rows' own per position, keyed by
    id(seq), cut to their final drafts; all ones elsewhere: [B, k + 1, W] int32, None without grammar rows) and
    the top-logprobs width."""
    live = [s for s in rows if s is not None]
    top_n = top_width(live, vocab)
    if not any(id(s) in grammar for s in live):
        return SamplingExtras(top_n=top_n)
    mask = np.full((len(rows), k + 1, (vocab + 31) // 32), -1, np.int32)
    for i, d in zip(place, drafts):
        g = grammar.get(id(rows[i]))
        if g is not None:
            mask[i, :len(d) + 1] = g.masks[:len(d) + 1]  # the drafts `_room` kept are a prefix of g.tokens
    return SamplingExtras(mask=mask, top_n=top_n)
