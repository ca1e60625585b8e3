"""The "mtp:K" drafter's host side: which weights serve (the MTP head kept only for mtp speculation), and the
drafts each row carries from one device program to the next (`engine.mtp_programs` makes them: the prefill
program gives a row's first drafts, each verify the next ones).

Drafts are kept per sequence object until it leaves the running set; a row without drafts (the first step after
a scored prefill, a plain decode step, a preemption) enters the verify with none, emits one token and gets k.
"""
from __future__ import annotations

import numpy as np

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.mtp_programs import MTPPrograms, next_tokens
from jaxserve.engine.sampling import Sampled, SamplingArrays
from jaxserve.engine.sequence import Sequence
from jaxserve.errors import ConfigError
from jaxserve.models import CausalLM
from jaxserve.models.build import drop_mtp
from jaxserve.models.paged import PrefillBatch


def uses_mtp(cfg: EngineConfig) -> bool:
    return cfg.speculative is not None and cfg.speculative.method == "mtp"


def serving_models(model: CausalLM, decode_model: CausalLM | None, cfg: EngineConfig, name: str = "this model"
                   ) -> tuple[CausalLM, CausalLM | None]:
    """(model, decode_model) as the engine serves them: with mtp speculation both must have an MTP head
    (ConfigError naming `name` otherwise); without it the head is dropped, so the KV pool has no MTP layer."""
    models = [m for m in (model, decode_model) if m is not None]
    if uses_mtp(cfg):
        if any(m.mtp is None for m in models):
            spec = f"mtp:{cfg.speculative.k}"
            raise ConfigError(f"speculative {spec} needs a checkpoint with an MTP head "
                              f"(num_nextn_predict_layers > 0); {name} has none", value=spec, param="speculative")
        return model, decode_model
    return drop_mtp(model), None if decode_model is None else drop_mtp(decode_model)


class MTPDrafts:
    """Each running sequence's drafts for its next verify (from the last MTP program it was in)."""

    def __init__(self, programs: MTPPrograms, k: int) -> None:
        self.programs, self.k = programs, k
        self._drafts: dict[int, tuple[Sequence, list[int]]] = {}

    def prefill(self, rows: list[tuple[Sequence, int, int]], place: list[int], batch: PrefillBatch,
                samp: SamplingArrays) -> tuple[Sampled, np.ndarray]:
        """Run the MTP prefill program over the chunk rows (seq, start, n) at batch rows `place`; rows whose prompt
        ends here keep their first drafts. -> (Sampled with numpy fields, ok [B] bool)."""
        b, t = batch.tokens.shape
        nxt = next_tokens([(s.tokens, start, n, s.target) for s, start, n in rows], place, b, t)
        out, ok, drafts = self.programs.run_prefill(batch, samp, nxt)
        for i, (seq, start, n) in zip(place, rows):
            if ok[i] and start + n == seq.target:
                self._drafts[id(seq)] = (seq, drafts[i].tolist())
        return out, ok

    def take(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` of seq's drafts (none if it has none)."""
        entry = self._drafts.pop(id(seq), None)
        return entry[1][:limit] if entry is not None and entry[0] is seq and limit > 0 else []

    def verified(self, seqs: list[Sequence], place: list[int], drafts: np.ndarray, ok: np.ndarray) -> None:
        """Keep the verify program's next drafts [B, k] of its rows."""
        for i, seq in zip(place, seqs):
            if ok[i]:
                self._drafts[id(seq)] = (seq, drafts[i].tolist())

    def prune(self, running: list[Sequence]) -> None:
        """Forget the drafts of sequences no longer running."""
        live = {id(s) for s in running}
        self._drafts = {key: v for key, v in self._drafts.items() if key in live}
