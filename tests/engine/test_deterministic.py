"""`EngineConfig(deterministic=True)` (`serve --deterministic`): a row's decode logits are bitwise the same in every
row and page bucket (`engine.invariant`'s fixed-shape tiles), and 8 greedy and 8 seeded requests give the same tokens
alone and in a mixed batch of 16 under page pressure (where the default policy would preempt: this mode admits only
what the decode pool can finish, so it never recomputes), in the serving formats where drift showed (bf16 activations, FP8
KV, FP8 prefill / INT4 decode weights)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_tiny
from engine_util import prompts, small_config
from jaxserve.config import from_hf_config
from jaxserve.engine import Engine, SamplingParams, invariant
from jaxserve.engine.batch import sampling_arrays
from jaxserve.models import CausalLM
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.paged import DecodeBatch, PrefillBatch, decode, prefill
from jaxserve.models.paged_attention_xla import BLOCK_TOKENS


def test_deterministic_config_keeps_the_buckets_and_pins_them_only_where_tiles_do_not_apply():
    c, plain = small_config(deterministic=True), small_config(deterministic=False)
    assert c.invariant_tiles and c.row_buckets == plain.row_buckets and c.chunk_buckets == plain.chunk_buckets
    # decode attention's key block is the table width below one block: the smallest table holds a whole block
    assert c.page_buckets[0] * c.page_size >= min(BLOCK_TOKENS, c.max_model_len)
    s = small_config(deterministic=True, speculative="ngram:2")
    assert not s.invariant_tiles
    assert s.row_buckets == [s.max_batch] and s.page_buckets == [s.max_pages_per_seq]
    assert s.chunk_buckets == [s.prefill_chunk] and s.prefill_shapes == [(s.max_batch, s.prefill_chunk)]


def test_deterministic_none_is_on_where_tiles_apply_and_off_where_it_would_pin_every_shape():
    auto = small_config(deterministic=None)
    assert auto.deterministic and auto.invariant_tiles and not small_config().deterministic  # off by default
    assert auto.page_buckets == small_config(deterministic=True).page_buckets
    for off in (small_config(speculative="ngram:2", deterministic=None),
                small_config(devices=2, sharding="dp_attention", deterministic=None)):
        assert not off.deterministic and len(off.row_buckets) > 1 and len(off.page_buckets) > 1


def _filled_pool(e: Engine, lens: np.ndarray, pages_per_row: int):
    """Each row r's random context of lens[r] tokens prefilled into the decode pool on pages 1 + r * pages_per_row..
    -> (pages, block tables [R, pages_per_row] int32, the context tokens [R, T] int32)."""
    ph, ps = e.programs.decode_phase, e.cfg.page_size
    rows, t = len(lens), pages_per_row * ps
    tok = np.random.default_rng(3).integers(0, 256, (rows, t)).astype(np.int32)
    tables = (1 + np.arange(rows)[:, None] * pages_per_row + np.arange(pages_per_row)).astype(np.int32)
    pos = np.tile(np.arange(t, dtype=np.int32), (rows, 1))
    slots = np.where(pos < lens[:, None], tables[np.arange(rows)[:, None], pos // ps] * ps + pos % ps, -1)
    batch = PrefillBatch(*map(jnp.asarray, (tok, pos, slots.astype(np.int32), tables, lens, lens)))
    pages = jax.jit(lambda st, pg, b: prefill(nnx.merge(ph.graphdef, st), pg, b, integrity=False)[1])(
        ph.state, ph.pages, batch)
    return pages, tables, tok


@pytest.mark.slow  # three decode compiles and a prefill (~30 s CPU on the shared host); the token test below is in CI
def test_a_rows_decode_logits_are_bitwise_the_same_in_every_row_and_page_bucket():
    """The deterministic decode program's body (`invariant.tiled_decode_step`) over a bf16 / FP8 KV / INT4 model:
    the same row (context, token) alone and among 6 others (two tiles of 4; at the first and at the last row, with
    block tables of the smallest and of the largest page bucket) gives the same logits bit for bit."""
    e = _serving_engine(max_batch=4, num_decode_pages=64, max_model_len=256)
    small, large = e.cfg.page_buckets[0], e.cfg.page_buckets[-1]
    assert small < large
    ph, att = e.programs.decode_phase, AttentionBackend()
    lens = np.array([21, 9, 30, 5, 17, 26, 12, 3], np.int32)
    pages, tables, tok = _filled_pool(e, lens, 8)

    def logits_step(graphdef, state, pages, batch, samp, *, integrity, attention):  # noqa: ANN001, ANN202
        logits, pages, ok = decode(nnx.merge(graphdef, state), pages, batch, integrity=integrity, attention=attention)
        return logits, ok, pages

    run = jax.jit(lambda st, pg, b, s: invariant.tiled_decode_step(logits_step, ph.graphdef, st, pg, b, s, tile=4,
                                                                   integrity=False, attention=att)[0])

    def row0(n: int, m: int, at: int) -> np.ndarray:
        rows = [1 + i % 7 for i in range(n)]
        rows[at] = 0
        bt = np.zeros((n, m), np.int32)
        bt[:, :8] = tables[rows]
        p = lens[rows]
        slots = tables[rows, p // e.cfg.page_size] * e.cfg.page_size + p % e.cfg.page_size
        batch = DecodeBatch(*map(jnp.asarray, (tok[rows, 0], p, slots.astype(np.int32), bt, p + 1,
                                               np.zeros((n, m), np.uint32), np.full(n, 8, np.int32))))
        return np.asarray(run(ph.state, pages, batch, sampling_arrays([None] * n)))[at]

    alone = row0(1, small, 0)
    for n, m, at in ((7, small, 0), (7, large, 6)):
        np.testing.assert_array_equal(row0(n, m, at), alone, err_msg=f"{n} rows, {m} pages, at row {at}")


def _serving_engine(**overrides: object) -> Engine:
    cfg = from_hf_config(hf_tiny.CONFIGS["deepseek_v3"]().to_dict())
    model = CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    base = dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4", dtype="bfloat16", num_decode_pages=40,
                num_prefill_pages=128, max_batch=8, max_prefill_tokens=64, prefill_chunk=16, max_model_len=64,
                deterministic=True)
    return Engine(model, small_config(**{**base, **overrides}), start=False)


def test_greedy_and_seeded_tokens_do_not_depend_on_the_batch_or_preemption():
    e = _serving_engine()
    ps = prompts(16, seed=11, lengths=(5, 17, 9, 26, 3, 12, 21, 8))
    params = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in range(8)]
    params += [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=100 + i,
                              **({"top_k": 20} if i % 2 else {"top_p": 0.9})) for i in range(8)]
    alone = [e.generate([p], sp)[0].token_ids for p, sp in zip(ps, params)]
    order = [i for pair in zip(range(8), range(8, 16)) for i in pair]  # greedy and seeded interleaved
    together = e.generate([ps[i] for i in order], [params[i] for i in order])
    assert [t.token_ids for t in together] == [alone[i] for i in order]
    # under page pressure (any 8 of them need more decode pages than the pool holds: the default policy preempts
    # and recomputes, which changes tokens) the deterministic engine waits for pages instead
    most = sorted((-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(ps, params)), reverse=True)
    assert sum(most[-8:]) > e.cfg.num_decode_pages - 1
    assert e.stats()["preemptions"] == 0
