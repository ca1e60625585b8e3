"""The MTP head (jaxserve.models.mtp, paged_mtp) against an independent reference and against itself paged.

transformers has no MTP forward, so the reference is DeepSeek-V3's formula in torch (`hf_tiny.MTPReference`):
transformers' own decoder layer class at layer_idx = num_hidden_layers loaded with the MTP layer's weights, torch
RMSNorms and Linear for enorm / hnorm / eh_proj / shared_head.norm, and the main model's embedding, rotary embedding,
final hidden states and lm_head; the MTP tensors go into the safetensors beside the model's and through the real
converter (DeepSeek-V3 / Kimi MLA, GLM-4.5 GQA, and GLM-5's MLA + DSA, whose MTP layer runs its own indexer: 12 rows
over an index_topk of 4, so its selection counts). The paged path (mtp_extend over prompt chunks, then chained mtp_step drafts) is checked against the
dense `mtp_forward` over the same sequence, in f32, BF16 and FP8 pools.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import hf_tiny
import jaxserve
from jaxserve.cache import init_pages
from jaxserve.config import from_hf_config
from jaxserve.convert.converter import convert
from jaxserve.engine.layouts import kv_layout
from jaxserve.models import CausalLM
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.mtp import mtp_forward
from jaxserve.models.paged import DecodeBatch, PrefillBatch, prefill
from jaxserve.models.paged_mtp import mtp_extend, mtp_step

PAGE = 4


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@nnx.jit
def _hidden(model: CausalLM, tokens, lengths):
    return model.hidden(tokens, lengths=lengths)


@functools.partial(nnx.jit, static_argnames=("absorbed",))
def _mtp(model: CausalLM, hidden, next_tokens, lengths, absorbed=False):
    return mtp_forward(model, hidden, next_tokens, lengths=lengths, absorbed=absorbed)


# ------------------------------------------------------------------------------------------- vs the torch formula


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe", "glm_moe_dsa"])
def converted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    hf = hf_tiny.build(request.param)
    ref = hf_tiny.save_with_mtp(hf, tmp / "hf")
    convert(tmp / "hf", tmp / "jx", dtype="float32", progress=False)
    cfg, model = jaxserve.load(tmp / "jx")
    return ref, cfg, model


def test_mtp_logits_match_the_reference_formula(converted):
    ref, cfg, model = converted
    assert cfg.mtp_layers == 1 and model.mtp is not None
    assert cfg.mtp_mlp_type == "sparse" and type(ref.layer.mlp).__name__.endswith("MoE")  # layer N >= first dense
    tokens = torch.randint(0, cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    want_hidden = ref.hidden(tokens)
    want_logits, want_h = (t.numpy() for t in ref(want_hidden[:, :-1], tokens[:, 1:]))
    toks = jnp.asarray(tokens.numpy(), jnp.int32)
    hidden = _hidden(model, toks, jnp.full((3,), 13, jnp.int32))
    assert _rel(np.asarray(hidden), want_hidden.numpy()) <= 1e-4
    lengths = jnp.full((3,), 12, jnp.int32)
    logits, h = _mtp(model, hidden[:, :-1], toks[:, 1:], lengths)
    assert logits.shape == want_logits.shape
    assert _rel(np.asarray(logits), want_logits) <= 1e-4
    assert _rel(np.asarray(h), want_h) <= 1e-4
    # the head alone, from the reference's own hidden states
    alone, _ = _mtp(model, jnp.asarray(want_hidden[:, :-1].numpy()), toks[:, 1:], lengths)
    assert _rel(np.asarray(alone), want_logits) <= 1e-4
    absorbed, _ = _mtp(model, hidden[:, :-1], toks[:, 1:], lengths, absorbed=True)
    assert _rel(np.asarray(absorbed), np.asarray(logits)) <= 1e-5


# ------------------------------------------------------------------------------------------- paged vs dense


ARCHS = ("deepseek_v3", "glm4_moe", "glm_moe_dsa")


@pytest.fixture(scope="module")
def models():
    out = {}
    for arch in ARCHS:
        cfg = from_hf_config(dict(hf_tiny.CONFIGS[arch]().to_dict(), num_nextn_predict_layers=1))
        out[arch] = CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    return out


@functools.partial(nnx.jit, static_argnames=("attention",))
def _paged_chunk(model, pages, batch, next_tokens, attention):
    """The target's prefill of a chunk (its hidden states), then the MTP rows of the same chunk."""
    backend = AttentionBackend.parse(attention)
    _, pages, _, hidden = prefill(model, pages, batch, attention=backend, return_hidden=True)
    logits, h, pages = mtp_extend(model, pages, batch, hidden, next_tokens, attention=backend)
    return logits, h, pages


@functools.partial(nnx.jit, static_argnames=("attention",))
def _paged_step(model, pages, batch, hidden, attention):
    return mtp_step(model, pages, batch, hidden, attention=AttentionBackend.parse(attention))


class Rows:
    """B rows' pages: row b owns pages 1 + b * M .. (b + 1) * M, each with its own tag (7 + page id)."""

    def __init__(self, B: int, M: int) -> None:
        self.B, self.M = B, M
        self.table = (1 + np.arange(B * M, dtype=np.int32)).reshape(B, M)
        self.tags = (7 + np.arange(1 + B * M)).astype(np.uint32)

    def slot(self, b: int, pos: np.ndarray) -> np.ndarray:
        return self.table[b, pos // PAGE] * PAGE + pos % PAGE

    def chunk(self, tokens: np.ndarray, start: int, n: np.ndarray, T: int) -> PrefillBatch:
        """Row b's positions start .. start + n[b] - 1 (n[b] 0: a padding row)."""
        t = np.arange(T)[None]
        live = t < n[:, None]
        pos = np.where(live, start + t, 0).astype(np.int32)
        slots = np.where(live, np.stack([self.slot(b, pos[b]) for b in range(self.B)]), -1).astype(np.int32)
        ctx = np.where(n > 0, start + n, 0).astype(np.int32)
        used = -(-ctx // PAGE)
        table = np.where(np.arange(self.M)[None] < used[:, None], self.table, 0).astype(np.int32)
        toks = np.take_along_axis(tokens, np.clip(pos, 0, tokens.shape[1] - 1), 1)
        return PrefillBatch(*(jnp.asarray(a) for a in (toks, pos, slots, table, ctx, n.astype(np.int32))),
                            expected_tags=jnp.asarray(self.tags[table]), num_pages=jnp.asarray(used, jnp.int32))

    def step(self, tokens: np.ndarray, pos: np.ndarray) -> DecodeBatch:
        slots = np.array([self.slot(b, pos[b]) for b in range(self.B)], np.int32)
        used = (pos // PAGE + 1).astype(np.int32)
        table = np.where(np.arange(self.M)[None] < used[:, None], self.table, 0).astype(np.int32)
        return DecodeBatch(jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(slots),
                           jnp.asarray(table), jnp.asarray(pos + 1, jnp.int32), jnp.asarray(self.tags[table]),
                           jnp.asarray(used))


def _dense_chain(model: CausalLM, seq: np.ndarray, lens: np.ndarray, steps: int) -> list[np.ndarray]:
    """The dense reference: MTP logits at every prompt position (its next token: seq's), then `steps` chained rows
    (hidden: the previous row's MTP output; next token: seq's). seq [B, W] holds prompt + sampled + drafts.
    -> [logits over the prompt [B, W, V], then each step's logits [B, V]]."""
    B, W = seq.shape
    toks = jnp.asarray(seq, jnp.int32)
    main = np.asarray(_hidden(model, toks, jnp.asarray(lens, jnp.int32)))
    hidden = main.copy()
    nxt = jnp.asarray(np.concatenate([seq[:, 1:], seq[:, -1:]], 1), jnp.int32)
    out = []
    for k in range(steps + 1):
        logits, h = (np.asarray(a) for a in _mtp(model, jnp.asarray(hidden), nxt, jnp.asarray(lens + k, jnp.int32)))
        out.append(logits if k == 0 else logits[np.arange(B), lens + k - 1])
        hidden[np.arange(B), lens + k] = h[np.arange(B), lens + k - 1]  # the chain: row p + 1 takes row p's output
    return out


# relative to the largest reference logit. f32 pool: f32 rounding only (measured <= 4e-7); bf16 / fp8 pools: the KV
# rounding of every layer read back (the main layers' and the MTP layer's; measured <= 1.6e-3 bf16, <= 0.08 fp8)
TOL = {"f32": 1e-5, "bf16": 5e-3, "fp8": 0.15}


CASES = [(a, d, "xla") for a in ARCHS for d in ("f32", "bf16", "fp8")] + [
    # the paged kernels (interpret mode) read the MTP layer's pool layer like any other
    ("deepseek_v3", "fp8", "pallas_interpret"), ("glm4_moe", "bf16", "pallas_interpret")]


# bf16 KV over the XLA path sits between f32 and fp8 (both kept): slow tier, for CI time
SLOW_CASES = {("glm4_moe", "bf16", "xla"), ("deepseek_v3", "bf16", "xla")}


@pytest.mark.parametrize("arch,kv_dtype,attention", [
    pytest.param(*c, id="-".join(c), marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in CASES])
def test_paged_extend_then_steps_equal_dense(models, arch, kv_dtype, attention):
    model = models[arch]
    cfg = model.cfg
    rng = np.random.default_rng(4)
    lens, chunk, steps = np.array([11, 6]), 8, 2
    B, W = 2, int(lens.max()) + steps + 1
    seq = rng.integers(0, cfg.vocab_size, (B, W)).astype(np.int32)  # prompt, the sampled token, then the drafts
    for b in range(B):
        seq[b, lens[b] + steps + 1:] = 0
    rows = Rows(B, -(-W // PAGE))
    pages = init_pages(kv_layout(cfg, PAGE, kv_dtype), 1 + B * rows.M)
    assert pages.layout.num_layers == cfg.num_layers + 1
    pages = replace(pages, tags=jnp.asarray(rows.tags))
    want = _dense_chain(model, seq, lens, steps)
    scale = float(np.abs(want[0]).max())
    got_prompt = np.zeros_like(want[0])
    h_last = np.zeros((B, cfg.hidden_size), np.float32)
    for s in range(0, int(lens.max()), chunk):
        n = np.clip(lens - s, 0, chunk)
        batch = rows.chunk(seq, s, n, chunk)
        nxt = np.take_along_axis(seq, np.clip(np.asarray(batch.positions) + 1, 0, W - 1), 1)
        logits, h, pages = _paged_chunk(model, pages, batch, jnp.asarray(nxt), attention)
        for b in range(B):
            got_prompt[b, s:s + n[b]] = np.asarray(logits)[b, :n[b]]
            if n[b]:
                h_last[b] = np.asarray(h)[b, n[b] - 1]
    for b in range(B):
        assert np.abs(got_prompt[b, :lens[b]] - want[0][b, :lens[b]]).max() <= TOL[kv_dtype] * scale, b
    hidden = jnp.asarray(h_last)
    for k in range(1, steps + 1):
        pos = lens + k - 1  # the MTP row after the sampled token, then after each draft
        logits, hidden, pages = _paged_step(model, pages, rows.step(seq[np.arange(B), pos + 1], pos), hidden,
                                            attention)
        assert np.abs(np.asarray(logits) - want[k]).max() <= TOL[kv_dtype] * scale, k


@pytest.mark.parametrize("rules", ["tp", "ep", "dp_attention"])
def test_paged_mtp_on_a_mesh_equals_one_device(models, rules):
    """The head placed like the rest of the model (TP over heads and expert FFN, EP, DP attention over rows and
    pages) gives one device's logits."""
    import jax

    from jaxserve.models.build import shard_model
    from jaxserve.sharding import Parallel, ShardingRules, make_mesh

    model = models["deepseek_v3"]
    cfg = model.cfg
    n = 2 if rules == "dp_attention" else 4
    par = Parallel(make_mesh(jax.devices()[:n], dp=n if rules == "dp_attention" else 1), ShardingRules.preset(rules))
    placed = shard_model(model, par)
    B, T = 2, 8
    seq = np.random.default_rng(5).integers(0, cfg.vocab_size, (B, T + 2)).astype(np.int32)
    rows = Rows(B, -(-(T + 2) // PAGE))
    n_pages = 1 + B * rows.M + (-(1 + B * rows.M)) % n  # a multiple of the page shards
    rows.tags = np.concatenate([rows.tags, np.full(n_pages - len(rows.tags), 1, np.uint32)])
    out = []
    for m in (model, placed):
        pages = replace(init_pages(kv_layout(cfg, PAGE, "bf16"), n_pages), tags=jnp.asarray(rows.tags))
        batch = rows.chunk(seq, 0, np.array([T, T - 3]), T)
        nxt = np.take_along_axis(seq, np.asarray(batch.positions) + 1, 1)
        logits, h, pages = _paged_chunk(m, pages, batch, jnp.asarray(nxt), "xla")
        pos = np.array([T, T - 3])
        step, _, _ = _paged_step(m, pages, rows.step(seq[np.arange(B), pos + 1], pos), h[np.arange(B), pos - 1], "xla")
        out.append((np.asarray(logits), np.asarray(step)))
    for got, want in zip(out[1], out[0]):
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_a_model_without_its_head_is_the_same_model(models):
    from jaxserve.models.build import drop_mtp

    model = models["glm4_moe"]
    plain = drop_mtp(model)
    assert plain.mtp is None and plain.cfg.mtp_layers == 0 and model.mtp is not None
    assert kv_layout(plain.cfg, PAGE, "fp8").num_layers == kv_layout(model.cfg, PAGE, "fp8").num_layers - 1
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, model.cfg.vocab_size, (2, 7)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(plain(tokens)))


def test_decode_returns_the_dense_hidden_state(models):
    """decode(..., return_hidden=True): the last decoder layer's output of the step's token, the MTP head's input."""
    from jaxserve.models.paged import decode

    model = models["glm4_moe"]
    cfg = model.cfg
    B, L = 2, 7
    seq = np.random.default_rng(7).integers(0, cfg.vocab_size, (B, L + 1)).astype(np.int32)
    rows = Rows(B, -(-(L + 1) // PAGE))
    pages = replace(init_pages(kv_layout(cfg, PAGE, "f32"), 1 + B * rows.M), tags=jnp.asarray(rows.tags))
    _, _, pages = _paged_chunk(model, pages, rows.chunk(seq, 0, np.array([L, L]), L), jnp.asarray(seq[:, 1:]), "xla")
    step = nnx.jit(lambda m, p, b: decode(m, p, b, integrity=True, attention=AttentionBackend(), return_hidden=True))
    logits, _, ok, hidden = step(model, pages, rows.step(seq[:, L], np.array([L, L])))
    want = np.asarray(_hidden(model, jnp.asarray(seq), jnp.full((B,), L + 1, jnp.int32)))[:, L]
    assert np.asarray(ok).all() and hidden.shape == (B, cfg.hidden_size)
    assert _rel(np.asarray(hidden), want) <= 1e-5
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model.logits(jnp.asarray(want))), rtol=0, atol=1e-5)
