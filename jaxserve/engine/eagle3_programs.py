"""The "eagle3:PATH:K" drafter's device side: the prefill and verify programs with an EAGLE-3 draft in them.

They are `engine.mtp_programs.MTPPrograms` with other bodies (same jitted signatures, compiles, runs, and the same
host side, `engine.mtp_draft.MTPDrafts`): each phase's program params are the target's leaves followed by the
draft's (`DraftPhase`: the draft replicated on the phase's mesh).
prefill: the target's chunk (`models.paged.prefill(aux_layers=...)`: the draft's three aux hidden states from the
    same forward), the first token sampled, then the draft rows of the chunk (`models.paged_eagle3.eagle3_extend`,
    next token = the prompt shifted by one; the final prompt position's = the sampled first token) so the draft's KV
    covers the prompt, and k drafts for the first decode step.
verify:  the target over k + 1 positions and `acceptance.verify_tokens`, then the draft rows of those positions
    (next token = the emitted tokens) and the next step's k drafts.
Drafts (`chain_drafts`): the draft's top-1 (mapped to target ids through d2t) at the last accepted position, then
k - 1 chained `eagle3_step`s fed the draft's own output h, as the references chain. Deterministic (q one-hot), so
verify_tokens keeps sampled rows exact; chained rows write draft KV only into pages the row holds (-1 elsewhere).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.cache import KVPages
from jaxserve.engine.acceptance import Verified, verify_tokens
from jaxserve.engine.config import EngineConfig, Speculative
from jaxserve.engine.layouts import PhaseLayouts
from jaxserve.engine.mtp_programs import MTPPrograms, PhaseLike, _at
from jaxserve.engine.sampling_forms import SamplingForms
from jaxserve.engine.sampling import Sampled, SamplingArrays, sample
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.build import dtype_of
from jaxserve.models.eagle3 import Eagle3Draft, load_eagle3
from jaxserve.models.paged import DecodeBatch, PrefillBatch, prefill
from jaxserve.models.paged_eagle3 import eagle3_extend, eagle3_step, pool_layers
from jaxserve.models.transformer import CausalLM


def load_draft(spec: Speculative | None, model: CausalLM) -> Eagle3Draft | None:
    """The "eagle3:PATH:K" draft for `model` (its activation dtype), None for other methods."""
    if spec is None or spec.method != "eagle3":
        return None
    return load_eagle3(spec.path, model.cfg, dtype_of(model))


def draft_layouts(layouts: PhaseLayouts, draft: Eagle3Draft | None) -> PhaseLayouts:
    """Both pools with the draft's packed K/V layers after the target's (`models.paged_eagle3`)."""
    if draft is None:
        return layouts
    grow = lambda lay: dataclasses.replace(lay, num_layers=lay.num_layers + pool_layers(draft.cfg, lay))  # noqa: E731
    return PhaseLayouts(prefill=grow(layouts.prefill), decode=grow(layouts.decode))


class DraftPhase:
    """A `programs.Phase` whose program params are its target leaves then the draft's, replicated on its mesh
    (`PhaseLike` for `MTPPrograms`; the pool stays the phase's own)."""

    def __init__(self, phase: PhaseLike, draft: Eagle3Draft) -> None:
        self.phase, self.graphdef, self.pages_sharding = phase, phase.graphdef, phase.pages_sharding
        self.draft_graphdef, state = nnx.split(draft)
        rep = NamedSharding(phase.mesh, P())
        leaves, self.draft_tree = jax.tree.flatten(state)
        self.n = len(phase.params)
        self.params = [*phase.params, *jax.device_put(leaves, rep)]
        self.state_sharding = [*jax.tree.leaves(phase.state_sharding), *[rep] * len(leaves)]

    @property
    def pages(self) -> KVPages:
        return self.phase.pages

    @pages.setter
    def pages(self, pages: KVPages) -> None:
        self.phase.pages = pages

    def params_of(self, leaves: list[jax.Array]) -> nnx.State:
        return self.phase.params_of(leaves[: self.n])

    def models(self, leaves: list[jax.Array]) -> tuple[CausalLM, Eagle3Draft]:
        """(target, draft) rebuilt from `params`-shaped leaves (inside a traced program)."""
        draft = nnx.merge(self.draft_graphdef, jax.tree.unflatten(self.draft_tree, leaves[self.n:]))
        return nnx.merge(self.graphdef, self.params_of(leaves)), draft


def chain_drafts(model: CausalLM, draft: Eagle3Draft, pages: KVPages, h: jax.Array, pos: jax.Array,
                 batch: PrefillBatch, ok: jax.Array, k: int, *, integrity: bool) -> tuple[jax.Array, KVPages]:
    """k drafts per row from the draft row at position pos [B] int32 whose output is h [B, H] (its top-1 is the
    token at pos + 2). Step i (1..k-1) is the draft row at pos + i from the previous h and draft, written only into
    pages the row holds (batch.block_tables up to batch.num_pages; -1 elsewhere and for rows not ok).
    -> (drafts [B, k] int32 target ids, pages)."""
    ps, m = pages.layout.page_size, batch.block_tables.shape[1]
    tok = draft.top1(h)
    out = [tok]
    for i in range(1, k):
        p = pos + i
        held = ok & (p // ps < batch.num_pages)
        table = jnp.take_along_axis(batch.block_tables, jnp.minimum(p // ps, m - 1)[:, None], 1)[:, 0]
        step = DecodeBatch(tok, p, jnp.where(held, table * ps + p % ps, -1), batch.block_tables,
                           jnp.where(ok, p + 1, 0), batch.expected_tags, batch.num_pages)
        h, pages = eagle3_step(model, draft, pages, step, h, integrity=integrity)
        tok = draft.top1(h)
        out.append(tok)
    return jnp.stack(out, 1), pages


def eagle3_prefill_step(model: CausalLM, draft: Eagle3Draft, pages: KVPages, batch: PrefillBatch,
                        samp: SamplingArrays, next_tokens: jax.Array, *, k: int, attention: AttentionBackend,
                        integrity: bool
                        ) -> tuple[Sampled, jax.Array, KVPages, jax.Array]:
    """The prefill program with the draft: next_tokens [B, T] int32 (the token after each chunk position; -1 at a
    row's final prompt position: the sampled first token goes there).
    -> (Sampled, ok [B] bool, pages, drafts [B, k] int32: meaningful for rows whose prompt ends in this chunk)."""
    logits, pages, ok, aux = prefill(model, pages, batch, attention=attention, integrity=integrity,
                                     aux_layers=draft.cfg.aux_layers)
    sampled = sample(logits, samp)
    nxt = jnp.where(next_tokens < 0, sampled.tokens[:, None], next_tokens)
    h, pages = eagle3_extend(model, draft, pages, batch, aux, nxt, integrity=integrity)
    last = batch.chunk_lens - 1
    drafts, pages = chain_drafts(model, draft, pages, _at(h, last), _at(batch.positions, last), batch, ok, k,
                                 integrity=integrity)
    return sampled, ok, pages, drafts


def eagle3_verify_step(model: CausalLM, draft: Eagle3Draft, pages: KVPages, batch: PrefillBatch,
                       drafts: jax.Array, samp: SamplingArrays, *, attention: AttentionBackend,
                       integrity: bool
                       ) -> tuple[Verified, jax.Array, KVPages, jax.Array]:
    """The verify (`verify.verify_step`) then the draft rows of the k + 1 positions and the next step's drafts.
    batch: [B, k + 1] positions per row; drafts [B, k] int32 (-1: none).
    -> (Verified, ok [B] bool, pages, next drafts [B, k] int32)."""
    logits, pages, ok, aux = prefill(model, pages, batch, all_logits=True, attention=attention,
                                     integrity=integrity, aux_layers=draft.cfg.aux_layers)
    out = verify_tokens(logits, drafts, None, samp, None)
    h, pages = eagle3_extend(model, draft, pages, batch, aux, out.tokens, integrity=integrity)
    last = out.count - 1  # the draft row of the last emitted token's input position n + count - 1
    nxt, pages = chain_drafts(model, draft, pages, _at(h, last), batch.positions[:, 0] + last, batch, ok,
                              drafts.shape[1], integrity=integrity)
    return out, ok, pages, nxt


class Eagle3Programs(MTPPrograms):
    """The jitted EAGLE-3 prefill and verify programs over `Programs`' phases (the MTP programs' shapes)."""

    def __init__(self, cfg: EngineConfig, prefill_phase: PhaseLike, decode_phase: PhaseLike,
                 rows_p: jax.sharding.Sharding, rows_d: jax.sharding.Sharding, compiles: dict[str, int],
                 forms: SamplingForms, draft: Eagle3Draft) -> None:
        super().__init__(cfg, DraftPhase(prefill_phase, draft), DraftPhase(decode_phase, draft), rows_p, rows_d,
                         compiles, forms)

    def _prefill_fn(self, params: list[jax.Array], pages: KVPages, batch: PrefillBatch, samp: SamplingArrays,
                    next_tokens: jax.Array):
        self.compiles["prefill_eagle3"] += 1
        model, draft = self.prefill_phase.models(params)
        return eagle3_prefill_step(model, draft, pages, batch, samp, next_tokens, k=self.k,
                                   attention=self.cfg.attention_backend, integrity=self.cfg.integrity)

    def _verify_fn(self, params: list[jax.Array], pages: KVPages, batch: PrefillBatch, drafts: jax.Array,
                   samp: SamplingArrays):
        self.compiles["verify"] += 1
        model, draft = self.decode_phase.models(params)
        return eagle3_verify_step(model, draft, pages, batch, drafts, samp, attention=self.cfg.attention_backend,
                                  integrity=self.cfg.integrity)


def drafter_programs(cfg: EngineConfig, prefill_phase: PhaseLike, decode_phase: PhaseLike,
                     rows: tuple[jax.sharding.Sharding, jax.sharding.Sharding], compiles: dict[str, int],
                     forms: SamplingForms, draft: Eagle3Draft | None) -> MTPPrograms | None:
    """The drafting prefill and verify programs `cfg.speculative` asks for: EAGLE-3 (a loaded draft), MTP, or None
    (n-gram drafts and no speculation use the plain programs)."""
    if draft is not None:
        return Eagle3Programs(cfg, prefill_phase, decode_phase, *rows, compiles, forms, draft)
    if cfg.speculative and cfg.speculative.method == "mtp":
        return MTPPrograms(cfg, prefill_phase, decode_phase, *rows, compiles, forms)
    return None
