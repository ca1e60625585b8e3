"""What fits beside a compiled decode program on one device: the KV pool and its tokens, from the program's
`memory_analysis()` (per device) at a known pool, the weights the device holds and its memory less the reserve.
Pure arithmetic, used by `jaxserve plan` (jaxserve/plan.py) to size the pool and to check the program it compiled
at that pool fits.

The donated pool comes back aliased (updated in place), so `alias` is the pool's bytes as the compiler laid it out
(a TPU pads FP8 latent rows and their scales to whole tiles: 648 B a layer-token for 576 + 4); its bytes per token
are what a token costs, not the layout's nominal ones. Everything else the program needs (its other arguments,
temporaries and the outputs not aliased) is fixed, as are weights the device holds that the program does not read.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    """Per device, in bytes. need: the compiled program's footprint at its pool (the weights the device holds, the
    program's other arguments, the pool as laid out, temporaries, outputs not aliased); fits: need <= budget
    (memory less the reserve); pool_bytes: the budget less everything but the pool (what a pool may take);
    bytes_per_token: a token's pool bytes as laid out; tokens: the tokens pool_bytes holds (0 if it is negative)."""

    need: int
    fits: bool
    pool_bytes: int
    bytes_per_token: float
    tokens: int


def kv_fit(memory: dict[str, int], pool_tokens: int, nominal_per_token: int, resident: int, read_weights: int,
           budget: float, temp: int | None = None) -> Fit:
    """The fit of one device beside a program compiled with a pool of `pool_tokens` tokens a device (> 0).

    memory: its memory_analysis() fields (argument, output, temp, alias; bytes per device); nominal_per_token: the
    pool layout's bytes a token (jaxserve.cache.KVLayout.bytes_per_token, per device); resident: the weight bytes
    the device holds; read_weights: those of them the program takes as arguments; budget: the device's memory less
    the reserve; temp: the temporaries to plan for (colocated: the largest phase's), default the program's."""
    nominal = pool_tokens * nominal_per_token
    aliased = memory["alias"] >= nominal  # else the pool was not updated in place: its new copy is an output
    pool = memory["alias"] if aliased else nominal
    others = max(memory["argument"] - pool - read_weights, 0)  # the batch, its page tables, sampling state
    fixed = resident + others + max(memory["temp"], temp or 0) + memory["output"] - memory["alias"]
    per_token = pool / pool_tokens if aliased else float(nominal_per_token)
    left = budget - fixed
    return Fit(need=int(fixed + pool), fits=fixed + pool <= budget, pool_bytes=max(int(left), 0),
               bytes_per_token=per_token, tokens=max(int(left // per_token), 0))
