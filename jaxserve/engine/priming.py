"""First executions ahead of traffic: each compiled program of a warm-up plan run once on all-padding data, through
the same host entry points and upload formats a scheduler step uses, so a live request never pays a program's
first run (XLA:CPU sets up an executable's thunks, buffers and code pages on its first run, and jit's C++ fast
path for a call signature is built only by a first call through it; bench/first_execution.py measures both).

Padding writes nothing: prefill and decode rows have slot -1 and the null page's block table, the hand-off copies
the null page to destination -1 (nowhere), so no page's contents or device tag changes; each pool is threaded
through (donated in, the output kept), as a step does. The caller holds the engine's step lock: the pools must not
be donated by a step meanwhile. Kinds it does not run (a prefill or decode server's export / import, the drafter
programs of MTP / EAGLE-3 speculation) stay compiled only and run first on their first use.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxserve.cache import NULL_PAGE
from jaxserve.engine.batch import DecodeRows, padding_prefill, sampling_arrays
from jaxserve.engine.sampling import TOP_LOGPROBS_MAX, SamplingArrays
from jaxserve.engine.verify import padding_verify
from jaxserve.engine.warmup import Key, WarmupReport

if TYPE_CHECKING:
    from jaxserve.engine.programs import Programs

RUNNABLE = ("prefill", "prefill_scored", "decode", "verify", "handoff")


def runnable(programs: Programs, key: Key) -> bool:
    """Whether `run_once` runs this plan key's program (see the module docstring for what it leaves)."""
    kind = key[0]
    role_kind = "prefill" if kind == "prefill_scored" else kind
    return kind in RUNNABLE and role_kind in programs.kinds and \
        not (programs.mtp is not None and kind in ("prefill", "verify"))


def _form(samp: SamplingArrays, mode: str) -> SamplingArrays:
    """samp as a batch of sampling form `mode` ("greedy" stays plain; any other mode takes the general form)."""
    return samp if mode in ("greedy", "") else dataclasses.replace(samp, mode="any")


def run_once(programs: Programs, key: Key, ranks: int = 1) -> bool:
    """Run the program of one plan key (`warmup.plan_keys`) once on all-padding data and wait for it; ranks: the
    DP attention ranks a decode batch is laid out over. -> whether it ran (False: `runnable` says no)."""
    if not runnable(programs, key):
        return False
    kind, b, m, t, mode = key
    if kind in ("prefill", "prefill_scored"):  # as `scheduler` builds one: a padded host batch, one upload
        batch, samp = jax.device_put(padding_prefill(b, t, m)), sampling_arrays([None] * b)
        targets = (np.full((b, t), -1, np.int32), TOP_LOGPROBS_MAX) if kind == "prefill_scored" else ()
        programs.run_prefill(batch, _form(samp, mode), *targets)
    elif kind == "decode":  # no rows picked: every row of the packed upload is padding
        rows = DecodeRows(1, m, programs.cfg.page_size)
        none = np.zeros(0, np.int64)
        batch, cols = rows.upload(none, none, ranks, b, m, programs.decode_rows)
        programs.run_decode(batch, _form(SamplingArrays(*cols, mode="greedy"), mode))
    elif kind == "verify":  # as `speculative` builds one: one packed upload, split on the device
        batch, drafts, cols = padding_verify(b, programs.cfg.speculative.k, m, programs.decode_rows)
        programs.run_verify(batch, drafts, _form(sampling_arrays([None] * b, columns=cols), mode))
    else:  # hand-off of m pages: the null page to nowhere
        programs.handoff([NULL_PAGE] * m, [-1] * m, [0] * m, [0] * m)
        jax.block_until_ready(programs.decode_phase.pages)
    return True


def run_all(programs: Programs, keys: Iterable[Key], ranks: int = 1) -> dict[str, int]:
    """`run_once` each key -> how many programs of each kind ran."""
    ran: dict[str, int] = {}
    for key in keys:
        if run_once(programs, key, ranks):
            ran[key[0]] = ran.get(key[0], 0) + 1
    return ran


def prime(programs: Programs, keys: Iterable[Key], ranks: int, lock: threading.Lock, report: WarmupReport) -> None:
    """`run_all` under the engine's step lock (no step donates the pools meanwhile), counted in `report`
    (`primed` by kind, `prime_seconds`)."""
    t0 = time.monotonic()
    with lock:
        report.primed = run_all(programs, sorted(keys), ranks)
    report.prime_seconds = time.monotonic() - t0
