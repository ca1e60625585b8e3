"""Batched token sampling inside the jitted programs: greedy, temperature, top-k, top-p, per-row seeds.

Four programs (`SamplingArrays.mode`, static, so each is its own compile); the engine runs "greedy" and "any"
(`engine.sampling_forms`), "top_k" and "full" serve callers that pick per batch (`sampling_mode`):
  * "greedy": every row has temperature 0: one argmax, no sort, no random numbers.
  * "top_k": every sampled row has 1 <= top_k <= TOP_K_BOUND: `lax.top_k(TOP_K_BOUND)` instead of sorting the
    vocabulary.
  * "full": anything else. At run time, if every row's candidates lie within the top TOP_K_BOUND (a top_k within
    the bound, or a top-p nucleus whose mass the top TOP_K_BOUND reach with margin) the top-k branch runs;
    otherwise the whole vocabulary is sorted (`lax.cond`: only one branch executes).
  * "any": any rows: "full" under a `lax.cond` on whether any row samples (an all-greedy batch runs the argmax
    only). The engine's general program (`engine.sampling_forms`): one compile serves every row kind.

Every path draws the same token as sorting the whole vocabulary would: the Gumbel noise is indexed by rank, and
with partitionable threefry (JAX's default) the first K noise values of a V-long draw equal a K-long draw, so
the top-k path needs only K of them. Rounding can differ in the last ulp of a probability (a shorter sum), which
only matters where a cumulative probability equals top_p to float precision.

Logit adjustments run before any of the programs, in batches that carry them (`SamplingArrays.adjust` / `mask`
not None; the engine's general form always carries them, neutral for rows that need none), each under a
`lax.cond` on whether any row's data asks for it (neutral data leaves the logits bit for bit as they are):
  * `SamplingArrays.adjust` (a `LogitAdjust`): repetition penalty (prompt and output tokens; positive logits are
    divided by it, negative ones multiplied, as HF transformers and vLLM do), frequency and presence penalties
    (output tokens only, OpenAI's definition: `logit - count * frequency - (count > 0) * presence`), then a sparse
    additive bias (OpenAI `logit_bias`).
  * `SamplingArrays.mask` [B, ceil(V / 32)] int32: an allowed-token bitmask (bit t % 32 of word t // 32): a
    grammar's, or every token but the end tokens while `min_tokens` is not reached; all ones for unconstrained
    rows; disallowed tokens get -inf.
Returned logprobs are the model's own (before adjustments), as OpenAI and vLLM report them; `top_n` > 0 (static)
also returns the top_n most likely tokens per row and their logprobs (with `top_rows` [B] bool set: computed only
when some row asks, zeros otherwise).

Seeds and batches. A row's key is fold_in(key(seed), tokens generated so far); the seed is the request's own or
one derived from its request id by SHA-256 (`request.request_seed`, the same in every process). What is
guaranteed: for fixed program shapes, a row's logits and token do not depend on the other rows (every op is
row-wise; the MoE's sort and scatter add each token's experts in expert order). What is not: the shapes
themselves follow the batch - decode rows (1, 2, 4, ...) and block-table width follow how many requests and how
long a context share the step, prefill chunks follow the step's token budget - and a different shape is a
different program: other GEMM blocking (a 1-row decode is a matrix-vector product), another MoE algorithm
(gathered experts below `n * k <= experts`, grouped matmul above), a longer attention reduction. Those move the
last bits of the logits, bf16 activations make that an ulp of bf16, and at temperature > 0 over a flat
distribution a sampled token flips within a few tokens (random tiny model, bf16 / FP8 KV / INT4, one request
alone vs among 15: at the second token; pinning the row bucket alone removed it there, pinning block table and
chunk alone did not). Pinning every bucket to one shape (`batch_invariant_buckets`) makes a seeded request's
tokens independent of its batch, at the price of running the largest program every step (tests/test_seeds.py
checks exactly this); `EngineConfig(deterministic=True)` gets the same with the normal buckets by computing rows in
fixed-shape tiles (`engine.invariant`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp

from jaxserve.engine.config import EngineConfig

# Candidates the top-k path keeps per row: requests with top_k in [1, 64] (or a nucleus within the top 64) never
# sort the vocabulary; 64 costs one lax.top_k over the vocabulary and 64 random draws per row.
TOP_K_BOUND = 64
# A top-p-only row takes the top-k path when the top TOP_K_BOUND tokens hold at least top_p + this much mass: the
# margin covers the rounding difference between the two paths' probability sums.
NUCLEUS_MARGIN = 1e-4

SamplingMode = Literal["greedy", "top_k", "full", "any"]
# OpenAI's bound on top_logprobs; a batch that wants any computes this many (one compile, sliced on the host)
TOP_LOGPROBS_MAX = 20


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitAdjust:
    """Penalties and biases of a batch. history [B, L] int32: each row's prompt then generated tokens, -1 padding;
    prompt_len [B] int32 (history[:, :prompt_len] is the prompt); repetition/frequency/presence [B] f32 (1, 0, 0 are
    neutral); bias_ids [B, K] int32 (-1 padding) with bias [B, K] f32 added to those tokens' logits."""

    history: jax.Array
    prompt_len: jax.Array
    repetition: jax.Array
    frequency: jax.Array
    presence: jax.Array
    bias_ids: jax.Array
    bias: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters. temperature [B] f32 (0 = greedy); top_k [B] int32 (0 = off); top_p [B] f32;
    seed [B] uint32; step [B] int32 (tokens generated so far: the key is fold_in(key(seed), step), so a seed gives
    the same tokens whatever else shares the batch). mode (static): which sampling program runs, see the module
    docstring; `sampling_mode` picks it from the rows' parameters. adjust / mask: None unless some row of the
    batch needs them (see the module docstring). top_n (static): top alternatives to return (0 or
    TOP_LOGPROBS_MAX); top_rows [B] bool or None: which rows want them (None: compute them whenever top_n > 0;
    else only when some row does, zeros otherwise)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    step: jax.Array
    adjust: LogitAdjust | None = None
    mask: jax.Array | None = None
    top_rows: jax.Array | None = None
    mode: SamplingMode = field(default="full", metadata=dict(static=True))
    top_n: int = field(default=0, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Sampled:
    """What a program's sampling returns: tokens [B] int32, logprobs [B] f32 (the chosen tokens' model logprobs),
    top_ids [B, top_n] int32 and top_logprobs [B, top_n] f32 (most likely first)."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def batch_invariant_buckets(cfg: EngineConfig) -> dict[str, int]:
    """EngineConfig overrides that give every program one shape (rows = max_batch, block table = the longest
    sequence, chunk = prefill_chunk), so a seeded request samples the same tokens whatever shares its batch
    (see the module docstring). Use: `EngineConfig(**base, **batch_invariant_buckets(EngineConfig(**base)))`, or
    `EngineConfig(deterministic=True)`, which sets the same."""
    return {"min_rows_bucket": cfg.max_batch, "min_pages_bucket": cfg.max_pages_per_seq,
            "min_chunk_bucket": cfg.prefill_chunk}


def sampling_mode(rows: Iterable[tuple[float, int, float]]) -> SamplingMode:
    """Host side: the cheapest program that samples every row exactly. rows: (temperature, top_k, top_p) each."""
    sampled = [(k, p) for t, k, p in rows if t > 0]
    if not sampled:
        return "greedy"
    if all(1 <= k <= TOP_K_BOUND for k, _ in sampled):
        return "top_k"
    return "full"


def sample(logits: jax.Array, s: SamplingArrays) -> Sampled:
    """logits [B, V] f32 -> Sampled (tokens [B] int32, the model's logprobs of them, top_n alternatives)."""
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = top_alternatives(logprobs_all, s)
    logits = processed_logits(logits, s)
    tokens = first_argmax(logits)
    if s.mode == "any":
        tokens = jax.lax.cond(jnp.any(s.temperature > 0), lambda: _draw(logits, s, tokens), lambda: tokens)
    elif s.mode != "greedy":
        tokens = _draw(logits, s, tokens)
    # a masked sum, not a gather: over vocab-split logits a local sum + an all-reduce of [B] (for one prefill row
    # XLA:GPU all-gathered the whole [V] row to gather from it)
    vocab = jnp.arange(logprobs_all.shape[-1], dtype=jnp.int32)[None, :]
    chosen = jnp.sum(jnp.where(vocab == tokens[:, None], logprobs_all, 0.0), axis=-1)
    return Sampled(tokens, chosen, top_ids, top_lp)


def _draw(logits: jax.Array, s: SamplingArrays, greedy: jax.Array) -> jax.Array:
    """Processed logits [B, V] f32 -> [B] int32: sampled rows' draws, greedy [B] elsewhere (mode != "greedy")."""
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    keys = row_keys(s.seed, s.step)
    k = min(TOP_K_BOUND, logits.shape[-1])
    if s.mode == "top_k":
        sampled = _sample_top_k(scaled, s, keys, k)
    else:
        sampled = jax.lax.cond(jnp.all(fits_top_k(scaled, s, k)), lambda: _sample_top_k(scaled, s, keys, k),
                               lambda: _sample_sorted(scaled, s, keys))
    return jnp.where(s.temperature > 0, sampled, greedy)


def top_alternatives(logprobs_all: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """logprobs_all [..., V] f32 -> (top_logprobs [..., top_n] f32, top_ids [..., top_n] int32), most likely first;
    with s.top_rows set, computed only when some row wants them (zeros otherwise)."""
    shape = logprobs_all.shape[:-1] + (s.top_n,)

    def top() -> tuple[jax.Array, jax.Array]:
        vals, ids = jax.lax.top_k(logprobs_all, s.top_n)
        return vals, ids.astype(jnp.int32)

    def none() -> tuple[jax.Array, jax.Array]:
        return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32)

    if not s.top_n:
        return none()
    return top() if s.top_rows is None else jax.lax.cond(jnp.any(s.top_rows), top, none)


def processed_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [B, V] f32 -> [B, V] f32 after the batch's penalties, biases and mask (those that are set, each
    under a cond on its data): the greedy token is their first argmax; sampled rows scale them by 1 / temperature
    and filter (candidates)."""
    if s.adjust is not None:
        logits = gated(adjusting(s.adjust), lambda x: adjust_logits(x, s.adjust), logits)
    if s.mask is not None:
        logits = gated(masking(s.mask), lambda x: masked(x, s.mask), logits)
    return logits


def gated(on: jax.Array, fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """fn(x) where on (a bool scalar on the device) holds, x itself otherwise: one branch runs (`lax.cond`)."""
    return jax.lax.cond(on, fn, lambda y: y, x)


def adjusting(a: LogitAdjust) -> jax.Array:
    """Bool scalar: some row has a token history or a bias (without either, `adjust_logits` is the identity)."""
    return jnp.any(a.history >= 0) | jnp.any(a.bias_ids >= 0)


def masking(mask: jax.Array) -> jax.Array:
    """Bool scalar: some bit of the bitmask [..., W] int32 is clear (some token is disallowed)."""
    return jnp.any(mask != -1)


def masked(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [B, V] f32 with the tokens the bitmask [B, W] int32 disallows at -inf."""
    return jnp.where(allowed(mask, logits.shape[-1]), logits, -jnp.inf)


def row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    """seed [B] uint32, step [B] int32 -> [B] keys: fold_in(key(seed), step), a row's stream for one token."""
    return jax.vmap(lambda sd, st: jax.random.fold_in(jax.random.key(sd), st))(seed, step)


def first_argmax(x: jax.Array) -> jax.Array:
    """x [B, V] f32 -> [B] int32: jnp.argmax's answer (the first maximum; the first NaN if any), as a max and a
    min over indices. XLA:CPU lowers argmax's (value, index) reduce as a scalar loop: 300 us at [16, 4096] on one
    core, against 80 us for these two vectorized reductions."""
    m = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == m) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def adjust_logits(logits: jax.Array, a: LogitAdjust) -> jax.Array:
    """logits [B, V] f32 -> [B, V] f32 with penalties and biases applied (see LogitAdjust)."""
    B, V = logits.shape
    L = a.history.shape[1]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, L))
    valid = a.history >= 0
    ids = jnp.where(valid, a.history, V)  # padding lands in an extra column that is dropped
    is_out = valid & (jnp.arange(L)[None, :] >= a.prompt_len[:, None])
    seen = jnp.zeros((B, V + 1), jnp.bool_).at[rows, ids].set(True)[:, :V]
    counts = jnp.zeros((B, V + 1), jnp.float32).at[rows, ids].add(is_out.astype(jnp.float32))[:, :V]
    r = a.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - counts * a.frequency[:, None] - (counts > 0) * a.presence[:, None]
    K = a.bias_ids.shape[1]
    brows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, K))
    bias = jnp.zeros((B, V + 1), jnp.float32).at[brows, jnp.where(a.bias_ids >= 0, a.bias_ids, V)].add(a.bias)
    return logits + bias[:, :V]


def allowed(mask: jax.Array, vocab: int) -> jax.Array:
    """Bitmask [B, W] int32 -> [B, vocab] bool (token t is allowed iff bit t % 32 of word t // 32 is set)."""
    t = jnp.arange(vocab)
    words = mask[:, t // 32]
    return ((words >> (t % 32)) & 1).astype(jnp.bool_)


def fits_top_k(scaled: jax.Array, s: SamplingArrays, k: int) -> jax.Array:
    """[B] bool: the row's candidates lie within its top k (greedy rows trivially do)."""
    vals, _ = jax.lax.top_k(scaled, k)
    m = jnp.max(vals, axis=-1, keepdims=True)  # (see _sample_top_k)
    mass = jnp.sum(jnp.exp(vals - m), axis=-1) / jnp.sum(jnp.exp(scaled - m), axis=-1)
    nucleus_fits = (s.top_k == 0) & (mass >= s.top_p + NUCLEUS_MARGIN)
    return (s.temperature <= 0) | ((s.top_k >= 1) & (s.top_k <= k)) | nucleus_fits


def _sample_top_k(scaled: jax.Array, s: SamplingArrays, keys: jax.Array, k: int) -> jax.Array:
    """scaled [B, V] -> [B] int32, over the top k candidates only (valid for rows `fits_top_k` accepts)."""
    idx, filtered = top_k_candidates(scaled, s, k)
    pick = pick_top_k(keys, filtered)
    return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _sample_sorted(scaled: jax.Array, s: SamplingArrays, keys: jax.Array) -> jax.Array:
    """scaled [B, V] -> [B] int32 by sorting the whole vocabulary (any top_k / top_p)."""
    order, filtered = sorted_candidates(scaled, s)
    pick = pick_sorted(keys, filtered)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def top_k_candidates(scaled: jax.Array, s: SamplingArrays, k: int) -> tuple[jax.Array, jax.Array]:
    """scaled [B, V] f32 -> (ids [B, k] int32, filtered [B, k] f32): the top k tokens, most likely first, and their
    scaled logits with top_k / top_p's dropped candidates at -inf. softmax(filtered) is the distribution a sampled
    row draws from (valid for rows `fits_top_k` accepts)."""
    vals, idx = jax.lax.top_k(scaled, k)  # [B, k], ties: lower index first, as the stable sort orders them
    rank = jnp.arange(k)[None, :]
    has_k = s.top_k[:, None] > 0
    keep = jnp.where(has_k, rank < s.top_k[:, None], True)
    masked = jnp.where(keep, vals, -jnp.inf)
    # the max, not vals[:, :1]: a second slice of top_k's sort defeats XLA's rewrite of it into a TopK call
    top = jnp.max(vals, axis=-1, keepdims=True)
    # a top-k row normalizes over its kept candidates; a top-p-only row over the whole vocabulary, as the sort does
    denom = jnp.where(has_k, jnp.sum(jnp.exp(masked - top), axis=-1, keepdims=True),
                      jnp.sum(jnp.exp(scaled - top), axis=-1, keepdims=True))
    probs = jnp.exp(masked - top) / denom
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (before < s.top_p[:, None])  # the top token always survives
    return idx, jnp.where(keep, vals, -jnp.inf)


def sorted_candidates(scaled: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """scaled [B, V] f32 -> (order [B, V] int32, filtered [B, V] f32): the whole vocabulary sorted (stable, most
    likely first) and the scaled logits in that order with top_k / top_p's dropped candidates at -inf."""
    V = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = jnp.where(s.top_k[:, None] > 0, rank < s.top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (before < s.top_p[:, None])  # the top token always survives
    return order, jnp.where(keep, sorted_logits, -jnp.inf)


def pick_top_k(keys: jax.Array, x: jax.Array) -> jax.Array:
    """keys [B], x [B, k] f32 logits over top_k_candidates -> [B] index into them, distributed as softmax(x)."""
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (x.shape[-1],), x.dtype))(keys)  # = ranks [0, k) of a V draw
    return jnp.argmax(x + noise, axis=-1)


def pick_sorted(keys: jax.Array, x: jax.Array) -> jax.Array:
    """keys [B], x [B, V] f32 logits over sorted_candidates -> [B] index into them, distributed as softmax(x)."""
    return jax.vmap(jax.random.categorical)(keys, x)
