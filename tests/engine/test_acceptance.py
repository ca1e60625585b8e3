"""verify_tokens: greedy rows keep the longest draft prefix that matches the target's argmax (computed here from the
logits), sampled rows emit exactly the target's distribution (chi-square over 20,000 seeded runs per case), and
with no drafts it draws `sample`'s very tokens."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.acceptance import Verified, verify_tokens
from jaxserve.engine.sampling import LogitAdjust, SamplingArrays, sample, sampling_mode

VERIFY = jax.jit(verify_tokens)
SAMPLE = jax.jit(sample)


def arrays(rows: list[tuple[float, int, float]], seeds: np.ndarray | list[int], step: np.ndarray | int,
           mode: str | None = None, **extra) -> SamplingArrays:
    """SamplingArrays for rows of (temperature, top_k, top_p); extra: adjust / mask / top_n."""
    t, k, p = (np.array(c) for c in zip(*rows))
    return SamplingArrays(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32),
                          jnp.asarray(seeds, jnp.uint32), jnp.broadcast_to(jnp.asarray(step, jnp.int32), (len(rows),)),
                          mode=mode or sampling_mode(rows), **extra)


def longest_prefix(best: np.ndarray, drafts: np.ndarray) -> tuple[list[int], int]:
    """The greedy rule one row at a time: drafts while they equal the argmax, then the argmax."""
    out = []
    for j, d in enumerate(drafts):
        if d != best[j]:
            break
        out.append(int(d))
    out.append(int(best[len(out)]))
    return out, len(out)


def check_greedy(got: Verified, logits: np.ndarray, processed: np.ndarray, drafts: np.ndarray) -> list[int]:
    """Asserts got equals the longest-prefix rule on processed's argmax; returns the counts."""
    best = processed.argmax(-1)
    logprobs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    counts = []
    for b in range(drafts.shape[0]):
        want, n = longest_prefix(best[b], drafts[b])
        assert int(got.count[b]) == n, b
        np.testing.assert_array_equal(np.asarray(got.tokens[b, :n]), want)
        np.testing.assert_allclose(np.asarray(got.logprobs[b, :n]), logprobs[b, np.arange(n), want], rtol=1e-6)
        counts.append(n)
    return counts


def greedy_case(seed: int, B: int, K: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Random logits and drafts that follow the argmax for a row-dependent number of positions, then leave it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, K + 1, V)).astype(np.float32) * 3
    best = logits.argmax(-1)
    drafts = rng.integers(0, V, size=(B, K)).astype(np.int32)
    for b in range(B):
        m = b % (K + 1)  # rows cover every accepted length 0..K
        drafts[b, :m] = best[b, :m]
        if m < K:
            drafts[b, m] = (best[b, m] + 1) % V
    return logits, drafts


@pytest.mark.parametrize("mode", ["greedy", "full"])
def test_greedy_rows_keep_the_longest_matching_prefix(mode):
    B, K, V = 12, 4, 50
    logits, drafts = greedy_case(0, B, K, V)
    s = arrays([(0.0, 0, 1.0)] * B, np.arange(B), 5, mode=mode)
    got = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), None, s)
    assert got.tokens.shape == (B, K + 1) and got.tokens.dtype == jnp.int32 and got.count.dtype == jnp.int32
    counts = check_greedy(got, logits, logits, drafts)
    assert sorted(set(counts)) == list(range(1, K + 2))  # every outcome occurs
    # draft_probs do not matter to greedy rows
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (B, K, V)), axis=-1)
    again = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), probs, s)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(got.tokens))
    np.testing.assert_array_equal(np.asarray(again.count), np.asarray(got.count))


def test_greedy_follows_the_processed_logits():
    """Presence penalty over the history plus the drafts before each position, and a grammar mask per position."""
    B, K, V = 6, 3, 40
    logits, drafts = greedy_case(1, B, K, V)
    drafts[:, 0] = logits[:, 0].argmax(-1)  # position 1's penalty sees draft 0
    presence = 4.0
    history = np.full((B, 3), -1, np.int32)
    history[:, 0] = 7  # prompt token: no presence penalty
    history[:, 1] = logits[:, 1].argmax(-1)  # a generated token: penalized at every position
    adjust = LogitAdjust(jnp.asarray(history), jnp.ones(B, jnp.int32), jnp.ones(B, jnp.float32),
                         jnp.zeros(B, jnp.float32), jnp.full(B, presence, jnp.float32),
                         jnp.full((B, 1), -1, jnp.int32), jnp.zeros((B, 1), jnp.float32))
    allowed = np.ones((B, K + 1, V), bool)
    allowed[:, 2, logits[:, 2].argmax(-1)] = False  # position 2 bans its raw argmax
    mask = np.packbits(np.pad(allowed, ((0, 0), (0, 0), (0, 64 - V))), axis=-1, bitorder="little")
    mask = mask.reshape(B, K + 1, -1).view(np.int32)
    s = arrays([(0.0, 0, 1.0)] * B, np.arange(B), 0, adjust=adjust, mask=jnp.asarray(mask))
    got = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), None, s)
    processed = logits.copy()
    for b in range(B):
        for j in range(K + 1):
            generated = set(history[b, 1:2].tolist()) | set(drafts[b, :j].tolist())
            processed[b, j, list(generated)] -= presence
    processed[~allowed] = -np.inf
    assert (processed.argmax(-1) != logits.argmax(-1)).any()  # the adjustments matter
    check_greedy(got, logits, processed, drafts)


def test_no_drafts_is_sample():
    """K = 0: the bonus token is `sample`'s draw for the same seed and step, in every sampling program, with and
    without penalties, biases and a grammar mask."""
    V = 300  # > TOP_K_BOUND: the top-k path really drops candidates
    rows = [(0.0, 0, 1.0), (1.0, 50, 1.0), (0.7, 5, 0.9), (1.0, 0, 0.9), (0.8, 0, 1.0), (1.3, 64, 0.5)]
    B = len(rows)
    rng = np.random.default_rng(0)
    history = np.where(np.arange(8) < 5, rng.integers(0, V, (B, 8)), -1).astype(np.int32)
    adjust = LogitAdjust(jnp.asarray(history), jnp.full(B, 2, jnp.int32), jnp.full(B, 1.3, jnp.float32),
                         jnp.full(B, 0.4, jnp.float32), jnp.full(B, 0.6, jnp.float32),
                         jnp.asarray(rng.integers(0, V, (B, 3)), jnp.int32), jnp.full((B, 3), 2.0, jnp.float32))
    mask = rng.integers(-2**31, 2**31 - 1, (B, (V + 31) // 32)).astype(np.int32) | 1  # token 0 always allowed
    for trial in range(6):
        x = jax.random.normal(jax.random.key(trial), (B, V)) * (6.0 if trial % 2 else 1.0)
        for mode in {sampling_mode(rows), "full"} | ({"top_k"} if trial < 3 else set()):
            r = rows if mode != "top_k" else [(t, k if k else 64, p) for t, k, p in rows]
            extra = {} if trial % 2 else dict(adjust=adjust, mask=jnp.asarray(mask))
            s = arrays(r, [trial, 1, 2, 3, 4, 5], trial, mode=mode, top_n=3, **extra)
            want = SAMPLE(x, s)
            got = VERIFY(x[:, None, :], jnp.zeros((B, 0), jnp.int32), None, s)
            np.testing.assert_array_equal(np.asarray(got.count), 1)
            np.testing.assert_array_equal(np.asarray(got.tokens[:, 0]), np.asarray(want.tokens))
            np.testing.assert_array_equal(np.asarray(got.logprobs[:, 0]), np.asarray(want.logprobs))
            np.testing.assert_array_equal(np.asarray(got.top_ids[:, 0]), np.asarray(want.top_ids))


# ---- sampled rows: the emitted tokens are distributed exactly as the target's ----------------------------------
V_SMALL, K_SMALL, PER_CASE = 8, 2, 20_000
# (temperature, top_k, top_p) per batch program; temperature 0 rows ride along (their two tokens are fixed)
CASES = {"top_k": [(1.0, 3, 1.0), (0.6, 5, 0.8), (1.7, 8, 1.0), (0.0, 0, 1.0)],
         "full": [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.4, 0, 0.75), (0.9, 6, 0.9), (0.0, 0, 1.0)]}


def target_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The definition of the processed distribution [..., V], in numpy: argmax at temperature 0; else scale,
    keep the top_k most likely, then the smallest most-likely-first prefix whose mass before each token < top_p."""
    if temperature == 0:
        return np.eye(logits.shape[-1])[logits.argmax(-1)]
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, axis=-1, kind="stable")
    ranked = np.take_along_axis(scaled, order, axis=-1)
    keep = np.arange(logits.shape[-1]) < (top_k or logits.shape[-1])
    p = np.where(keep, np.exp(ranked - ranked[..., :1]), 0.0)
    p /= p.sum(-1, keepdims=True)
    keep = keep & (np.cumsum(p, -1) - p < top_p)
    p = np.where(keep, p, 0.0)
    out = np.zeros_like(p)
    np.put_along_axis(out, order, p / p.sum(-1, keepdims=True), axis=-1)
    return out


def draw(rng: np.random.Generator, q: np.ndarray) -> np.ndarray:
    """One token per row of q [N, V] (inverse CDF)."""
    return np.minimum((np.cumsum(q, -1) < rng.random(len(q))[:, None]).sum(-1), q.shape[-1] - 1).astype(np.int32)


class Target:
    """A toy target model over V_SMALL tokens after a fixed prefix: logits of token 1, of token 2 given token 1,
    of token 3 given tokens 1 and 2; P0, P1, P2 the processed distributions per case."""

    def __init__(self, cases: list[tuple[float, int, float]]):
        rng = np.random.default_rng(2024)
        V = V_SMALL
        self.L0 = rng.normal(size=V).astype(np.float32) * 1.5
        self.L1 = rng.normal(size=(V, V)).astype(np.float32) * 1.5
        self.L2 = rng.normal(size=(V, V, V)).astype(np.float32) * 1.5
        self.P = [[target_probs(L, *c) for L in (self.L0, self.L1, self.L2)] for c in cases]

    def exact(self, case: int) -> np.ndarray:
        """[V, V]: P(token 1 = a, token 2 = b)."""
        P0, P1, _ = self.P[case]
        return P0[:, None] * P1


def drafts_for(kind: str, target: Target, case: np.ndarray, context: np.ndarray | None, rng: np.random.Generator
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """K_SMALL drafts per row after the prefix (context None) or after prefix + context [N] -> (drafts [N, 2],
    draft_probs [N, 2, V] or None). random: uniform tokens, deterministic (q one-hot); far: drawn from a q far
    from p (the target's logits negated); good: drawn from q = p."""
    N, V = len(case), V_SMALL
    if kind == "random":
        return rng.integers(0, V, size=(N, K_SMALL)).astype(np.int32), None

    def q_after(level: int, prev: tuple[np.ndarray, ...]) -> np.ndarray:
        L = (target.L0, target.L1, target.L2)[level]
        if kind == "far":
            x = -L[prev] if prev else np.broadcast_to(-L, (N, V))
            return np.exp(x) / np.exp(x).sum(-1, keepdims=True)
        P = np.stack([target.P[c][level] for c in range(len(target.P))])  # [cases, ...]
        return P[(case, *prev)]

    prev: tuple[np.ndarray, ...] = () if context is None else (context,)
    q0 = q_after(len(prev), prev)
    d0 = draw(rng, q0)
    q1 = q_after(len(prev) + 1, (*prev, d0))
    return np.stack([d0, draw(rng, q1)], 1), np.stack([q0, q1], 1).astype(np.float32)


def run_two_tokens(kind: str, mode: str) -> tuple[Target, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """PER_CASE rows per case, distinct seeds: verify once after the prefix and, where only one token came out,
    once more after it (step 1). -> (target, case [N], token 1 [N], token 2 [N], the first verify's count [N])."""
    cases = CASES[mode]
    target = Target(cases)
    case = np.repeat(np.arange(len(cases)), PER_CASE)
    N = len(case)
    rows = [cases[c] for c in case]
    rng = np.random.default_rng({"random": 1, "far": 2, "good": 3}[kind])
    seeds = np.arange(N) + 100_000 * len(kind)
    d, q = drafts_for(kind, target, case, None, rng)
    logits = np.stack([np.broadcast_to(target.L0, (N, V_SMALL)), target.L1[d[:, 0]], target.L2[d[:, 0], d[:, 1]]], 1)
    first = VERIFY(jnp.asarray(logits), jnp.asarray(d), None if q is None else jnp.asarray(q),
                   arrays(rows, seeds, 0, mode=mode))
    tokens, count = np.asarray(first.tokens), np.asarray(first.count)
    t0 = tokens[:, 0]
    d, q = drafts_for(kind, target, case, t0, rng)
    logits = np.stack([target.L1[t0], target.L2[t0, d[:, 0]], np.zeros((N, V_SMALL), np.float32)], 1)
    second = VERIFY(jnp.asarray(logits), jnp.asarray(d), None if q is None else jnp.asarray(q),
                    arrays(rows, seeds, 1, mode=mode))
    t1 = np.where(count >= 2, tokens[:, 1], np.asarray(second.tokens)[:, 0])
    return target, case, t0, t1, count


def chi_square_p(observed: list[np.ndarray], expected: list[np.ndarray]) -> float:
    """Joint goodness of fit over independent multinomials (one per case): observed counts and expected
    probabilities [cells] each; cells expected under 5 are pooled, zero-probability cells must be empty."""
    from scipy.stats import chi2

    stat, dof = 0.0, 0
    for o, p in zip(observed, expected):
        assert o[p == 0].sum() == 0, "a token the target cannot emit was emitted"
        e = p * o.sum()
        small = (e > 0) & (e < 5)
        o = np.append(o[e >= 5], o[small].sum())
        e = np.append(e[e >= 5], e[small].sum())
        o, e = o[e > 0], e[e > 0]
        stat += float(((o - e) ** 2 / e).sum())
        dof += len(e) - 1
    return float(chi2.sf(stat, dof)) if dof else 1.0


@pytest.mark.parametrize("mode", ["top_k", "full"])
@pytest.mark.parametrize("kind", ["random", "far", "good"])
def test_two_sampled_tokens_follow_the_target_distribution(kind, mode):
    target, case, t0, t1, count = run_two_tokens(kind, mode)
    V = V_SMALL
    observed = [np.bincount(t0[case == c] * V + t1[case == c], minlength=V * V) for c in range(len(CASES[mode]))]
    p = chi_square_p(observed, [target.exact(c).ravel() for c in range(len(CASES[mode]))])
    # negative control, same samples: against the unprocessed target (temperature 1, no filters) the fit fails
    changed = [c for c, row in enumerate(CASES[mode]) if row != (1.0, 0, 1.0)]
    raw = (target_probs(target.L0, 1.0, 0, 1.0)[:, None] * target_probs(target.L1, 1.0, 0, 1.0)).ravel()
    o_raw = [observed[c] for c in changed]
    p_raw = chi_square_p(o_raw, [raw] * len(changed))
    sampled = np.isin(case, [c for c, row in enumerate(CASES[mode]) if row[0] > 0])
    rate = np.bincount(count[sampled], minlength=K_SMALL + 2)[1:] / sampled.sum()
    print(f"\n{kind} drafts, {mode} program: chi-square p = {p:.4f} (against the unprocessed target: {p_raw:.2g}); "
          f"first verify's count 1/2/3: {np.round(rate, 4)}")
    assert p > 0.01
    assert p_raw < 1e-6
    if kind == "good":
        assert rate[-1] == 1.0  # q = p: every draft is accepted (min(1, p / q) = 1)
    else:
        assert rate[0] > 0.5  # the drafts are bad: most first drafts are rejected


def test_out_of_vocabulary_drafts_are_never_accepted():
    """Padding drafts outside [0, V) are rejected by every rule (greedy, one-hot q, dense q), even at p ~ 1."""
    B, K, V = 6, 2, 16
    logits = np.zeros((B, K + 1, V), np.float32)
    logits[..., 3] = 50.0  # token 3 is certain
    drafts = np.array([[-1, 3], [V, 3], [3, -1], [3, V], [-1, -1], [3, 3]], np.int32)
    rows = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.9)]
    probs = jnp.full((B, K, V), 1.0 / V, jnp.float32)
    for t, k, p in rows:
        s = arrays([(t, k, p)] * B, np.arange(B), 0, mode="full")
        for q in (None, probs):
            got = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), q, s)
            np.testing.assert_array_equal(np.asarray(got.count), [1, 1, 2, 2, 1, 3])
            np.testing.assert_array_equal(np.asarray(got.tokens), 3)


def test_a_rows_tokens_follow_its_seed_not_its_batch():
    """The same rows permuted give the same tokens per row; a salt key changes them and is itself reproducible."""
    B, K, V = 16, 3, 40
    logits = jax.random.normal(jax.random.key(5), (B, K + 1, V))
    drafts = jax.random.randint(jax.random.key(6), (B, K), 0, V, jnp.int32)
    rows = [(1.0, 20, 0.95), (0.8, 0, 1.0), (0.0, 0, 1.0), (1.2, 0, 0.9)] * (B // 4)
    s = arrays(rows, np.arange(B) * 7, 3, mode="full")
    got = VERIFY(logits, drafts, None, s)
    perm = np.random.default_rng(0).permutation(B)
    s_perm = arrays([rows[i] for i in perm], (np.arange(B) * 7)[perm], 3, mode="full")
    again = VERIFY(logits[perm], drafts[perm], None, s_perm)
    for a, b in ((got.tokens, again.tokens), (got.count, again.count)):
        np.testing.assert_array_equal(np.asarray(a)[perm], np.asarray(b))
    salted = [VERIFY(logits, drafts, None, s, jax.random.key(11)) for _ in range(2)]
    np.testing.assert_array_equal(np.asarray(salted[0].tokens), np.asarray(salted[1].tokens))
    emitted = [[tuple(np.asarray(v.tokens[b, :int(v.count[b])])) for b in range(B)] for v in (got, salted[0])]
    assert emitted[0] != emitted[1]


def test_greedy_verify_has_no_sort_and_no_random_numbers():
    B, K, V = 4, 3, 300
    args = (jnp.zeros((B, K + 1, V)), jnp.zeros((B, K), jnp.int32), None)
    text = {m: VERIFY.lower(*args, arrays([(0.0 if m == "greedy" else 1.0, 0, 1.0)] * B, np.arange(B), 0, mode=m)
                            ).compile().as_text() for m in ("greedy", "full")}
    assert " sort(" in text["full"] and "threefry" in text["full"]  # negative control
    assert " sort(" not in text["greedy"] and "threefry" not in text["greedy"]
