"""The "mtp:K" drafter's device side: the prefill and verify programs with the MTP head in them.

prefill: the target's chunk (`models.paged.prefill(return_hidden=True)`), the first token sampled, then the MTP
    rows of the chunk (`models.paged_mtp.mtp_extend`, next token = the prompt shifted by one; the final prompt
    position's = the sampled first token) so the MTP layer's KV covers the prompt (the hand-off copies every pool
    layer, the MTP one included), and k drafts for the first decode step.
verify:  the target over k + 1 positions and `acceptance.verify_tokens` (`engine.verify`), then the MTP rows of
    those positions (next token = the emitted tokens: emitted[j] is the token at position n + j + 1; rows past the
    accepted count are garbage and are overwritten by the next step's extend), and the next step's k drafts.
Drafts (`chain_drafts`): argmax of the MTP logits at the last accepted position, then k - 1 chained `mtp_step`s
(hidden = the previous MTP output, token = the previous draft). They are deterministic (q one-hot), so
verify_tokens keeps sampled rows exact too. The chained steps write MTP KV at later positions only where the row
already holds the page (no pages are taken for them); elsewhere the slot is -1: the next step's attention over
that row reads stale MTP KV, which costs draft quality only (exactness comes from the verify).
Both are one jitted program each: one dispatch per step.
"""
from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.cache import KVPages
from jaxserve.engine.acceptance import Verified, verify_tokens
from jaxserve.engine.batch import dummy_prefill
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.sampling import Sampled, SamplingArrays, SamplingMode, sample
from jaxserve.engine.sampling_forms import SamplingForms, host_outputs
from jaxserve.engine.verify import dummy_verify
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.paged import DecodeBatch, PrefillBatch, prefill
from jaxserve.models.paged_mtp import mtp_extend, mtp_step
from jaxserve.models.transformer import CausalLM


def chain_drafts(model: CausalLM, pages: KVPages, logits: jax.Array, hidden: jax.Array, pos: jax.Array,
                 batch: PrefillBatch, ok: jax.Array, k: int, *, attention: AttentionBackend, integrity: bool
                 ) -> tuple[jax.Array, KVPages]:
    """k drafts per row from the MTP row at position pos [B] int32: logits [B, V] f32 (its MTP logits: the first
    draft is their argmax, the token at pos + 2), hidden [B, H] (its MTP output). Step i (1..k-1) is the MTP row at
    pos + i from the previous output and draft, written only into pages the row holds (batch.block_tables up to
    batch.num_pages; -1 elsewhere and for rows not ok). -> (drafts [B, k] int32, pages)."""
    ps, m = pages.layout.page_size, batch.block_tables.shape[1]
    draft = jnp.argmax(logits, -1).astype(jnp.int32)
    out = [draft]
    for i in range(1, k):
        p = pos + i
        page = p // ps
        held = ok & (page < batch.num_pages)
        table = jnp.take_along_axis(batch.block_tables, jnp.minimum(page, m - 1)[:, None], 1)[:, 0]
        slot = jnp.where(held, table * ps + p % ps, -1)
        step = DecodeBatch(draft, p, slot, batch.block_tables, jnp.where(ok, p + 1, 0), batch.expected_tags,
                           batch.num_pages)
        logits, hidden, pages = mtp_step(model, pages, step, hidden, attention=attention, integrity=integrity)
        draft = jnp.argmax(logits, -1).astype(jnp.int32)
        out.append(draft)
    return jnp.stack(out, 1), pages


def _at(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...] at per-row index idx [B] -> [B, ...]."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def mtp_prefill_step(graphdef: nnx.GraphDef, state: nnx.State, pages: KVPages, batch: PrefillBatch,
                     samp: SamplingArrays, next_tokens: jax.Array, *, k: int, attention: AttentionBackend,
                     integrity: bool) -> tuple[Sampled, jax.Array, KVPages, jax.Array]:
    """The prefill program with the MTP head: next_tokens [B, T] int32 (the token after each chunk position; -1
    at a row's final prompt position: the sampled first token goes there).
    -> (Sampled, ok [B] bool, pages, drafts [B, k] int32: meaningful for rows whose prompt ends in this chunk)."""
    model = nnx.merge(graphdef, state)
    logits, pages, ok, hidden = prefill(model, pages, batch, attention=attention, integrity=integrity,
                                        return_hidden=True)
    sampled = sample(logits, samp)
    nxt = jnp.where(next_tokens < 0, sampled.tokens[:, None], next_tokens)
    mlogits, h_mtp, pages = mtp_extend(model, pages, batch, hidden, nxt, attention=attention, integrity=integrity)
    last = batch.chunk_lens - 1
    drafts, pages = chain_drafts(model, pages, _at(mlogits, last), _at(h_mtp, last), _at(batch.positions, last),
                                 batch, ok, k, attention=attention, integrity=integrity)
    return sampled, ok, pages, drafts


def mtp_verify_step(graphdef: nnx.GraphDef, state: nnx.State, pages: KVPages, batch: PrefillBatch,
                    drafts: jax.Array, samp: SamplingArrays, *, attention: AttentionBackend, integrity: bool
                    ) -> tuple[Verified, jax.Array, KVPages, jax.Array]:
    """`verify.verify_step` then the MTP rows of the k + 1 positions and the next step's drafts.
    batch: [B, k + 1] positions per row (`verify.verify_batch`); drafts [B, k] int32 (-1: none).
    -> (Verified, ok [B] bool, pages, next drafts [B, k] int32)."""
    model = nnx.merge(graphdef, state)
    logits, pages, ok, hidden = prefill(model, pages, batch, all_logits=True, attention=attention,
                                        integrity=integrity, return_hidden=True)
    out = verify_tokens(logits, drafts, None, samp, None)
    mlogits, h_mtp, pages = mtp_extend(model, pages, batch, hidden, out.tokens, attention=attention,
                                       integrity=integrity)
    last = out.count - 1  # the MTP row of the last emitted token's input position n + count - 1
    nxt, pages = chain_drafts(model, pages, _at(mlogits, last), _at(h_mtp, last), batch.positions[:, 0] + last,
                              batch, ok, drafts.shape[1], attention=attention, integrity=integrity)
    return out, ok, pages, nxt


class PhaseLike(Protocol):
    """What these programs use of a `programs.Phase` (not imported: programs imports this module)."""

    graphdef: nnx.GraphDef
    pages: KVPages
    pages_sharding: KVPages
    state_sharding: nnx.State
    params: list[jax.Array]

    def params_of(self, leaves: list[jax.Array]) -> nnx.State: ...


class MTPPrograms:
    """The jitted MTP prefill and verify programs over `Programs`' phases (same shardings as its own)."""

    def __init__(self, cfg: EngineConfig, prefill_phase: PhaseLike, decode_phase: PhaseLike,
                 rows_p: jax.sharding.Sharding, rows_d: jax.sharding.Sharding, compiles: dict[str, int],
                 forms: SamplingForms) -> None:
        self.cfg, self.k = cfg, cfg.speculative.k
        self.prefill_phase, self.decode_phase, self.rows_p, self.rows_d = prefill_phase, decode_phase, rows_p, rows_d
        self.compiles, self.forms = compiles, forms
        ph, dh = prefill_phase, decode_phase
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,),
                                in_shardings=(jax.tree.leaves(ph.state_sharding), ph.pages_sharding, rows_p, rows_p,
                                              rows_p), out_shardings=(rows_p, rows_p, ph.pages_sharding, rows_p))
        self._verify = jax.jit(self._verify_fn, donate_argnums=(1,),
                               in_shardings=(jax.tree.leaves(dh.state_sharding), dh.pages_sharding, rows_d, rows_d,
                                             rows_d), out_shardings=(rows_d, rows_d, dh.pages_sharding, rows_d))

    def _prefill_fn(self, params: list[jax.Array], pages: KVPages, batch: PrefillBatch, samp: SamplingArrays,
                    next_tokens: jax.Array):
        self.compiles["prefill_mtp"] += 1
        ph = self.prefill_phase
        return mtp_prefill_step(ph.graphdef, ph.params_of(params), pages, batch, samp, next_tokens, k=self.k,
                                attention=self.cfg.attention_backend, integrity=self.cfg.integrity)

    def _verify_fn(self, params: list[jax.Array], pages: KVPages, batch: PrefillBatch, drafts: jax.Array,
                   samp: SamplingArrays):
        self.compiles["verify"] += 1
        ph = self.decode_phase
        return mtp_verify_step(ph.graphdef, ph.params_of(params), pages, batch, drafts, samp,
                               attention=self.cfg.attention_backend, integrity=self.cfg.integrity)

    def run_prefill(self, batch: PrefillBatch, samp: SamplingArrays, next_tokens: np.ndarray
                    ) -> tuple[Sampled, np.ndarray, np.ndarray]:
        """-> (Sampled with numpy fields, ok [B] bool, drafts [B, k] int32)."""
        ph = self.prefill_phase
        sampled, ok, ph.pages, drafts = self._prefill(ph.params, ph.pages, batch, self.forms.form(samp, self.rows_p),
                                                      next_tokens)
        return host_outputs(sampled, samp), np.asarray(ok), np.asarray(drafts)

    def run_verify(self, batch: PrefillBatch, drafts: jax.Array, samp: SamplingArrays
                   ) -> tuple[Verified, np.ndarray, np.ndarray]:
        """-> (Verified with numpy fields, ok [B] bool, next drafts [B, k] int32)."""
        ph = self.decode_phase
        s = self.forms.form(samp, self.rows_d, drafts.shape[1] + 1)  # a mask per position
        batch, drafts, s = jax.device_put((batch, drafts, s), self.rows_d)
        out, ok, ph.pages, nxt = self._verify(ph.params, ph.pages, batch, drafts, s)
        return host_outputs(out, samp), np.asarray(ok), np.asarray(nxt)

    def compile(self, kind: str, b: int, m: int, t: int, mode: SamplingMode = "greedy") -> None:
        """Lower and compile one bucket of the MTP prefill ("prefill") or verify ("verify") against the pools'
        shapes (nothing runs); mode: the sampling form (`sampling_forms.SERVING_MODES`)."""
        spec = lambda tree: jax.tree.map(  # noqa: E731 - shapes only: the live pools may be donated meanwhile
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        if kind == "verify":
            batch, drafts, samp = jax.device_put(dummy_verify(b, self.k, m), self.rows_d)
            self._verify.lower(self.decode_phase.params, spec(self.decode_phase.pages), batch, drafts,
                               self.forms.compiled(samp, mode, self.rows_d, self.k + 1)).compile()
        else:
            batch, samp = dummy_prefill(b, t, m)
            nxt = jnp.zeros((b, t), jnp.int32)
            self._prefill.lower(self.prefill_phase.params, spec(self.prefill_phase.pages), batch,
                                self.forms.compiled(samp, mode, self.rows_p), nxt).compile()


def next_tokens(rows: list[tuple[list[int], int, int, int]], place: list[int], b: int, t: int) -> np.ndarray:
    """The MTP prefill's next_tokens [b, t] int32 for chunks rows[j] = (tokens, start, n, target) at batch rows
    place[j]: token start + i + 1 at chunk position i, -1 at the final prompt position (target - 1) and padding."""
    out = np.full((b, t), -1, np.int32)
    for i, (toks, start, n, target) in zip(place, rows):
        end = min(start + n + 1, target)
        out[i, : end - start - 1] = toks[start + 1: end]
    return out
