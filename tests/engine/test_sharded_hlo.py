"""The compiled 8-device decode and prefill programs move activations only: no all-gather of a weight or of a KV
page, one all-reduce of [tokens, hidden] per row-parallel matmul / MoE block / embedding, and sampling's small
per-shard candidate exchange; in prefill the last layer's two are over [rows, hidden] (its output projection and MLP
run at each row's last token only). GLM-5's DSA (indexer scoring, top-k, sparse attention) adds none, under TP and
DP attention. Parsed from `lower(...).compile().as_text()`."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from engine_util import engine
from jaxserve.engine.batch import dummy_decode, dummy_prefill
from jaxserve.hlo import collectives
from jaxserve.models import dsa
from test_engine_sharded import eight_head_model

ROWS, PAGES, CHUNK = 8, 8, 16
HIDDEN = 64  # the tiny models' hidden size


def _compiled(e, phase: str) -> str:
    p = e.programs
    if phase == "decode":
        ph = p.decode_phase
        return p._decode.lower(ph.params, ph.pages, *dummy_decode(ROWS, PAGES)).compile().as_text()
    ph = p.prefill_phase
    return p._prefill.lower(ph.params, ph.pages, *dummy_prefill(ROWS, CHUNK, PAGES)).compile().as_text()


def _check(text: str, tokens: int, n_layers: int, n_dense: int, n_moe: int, vocab: int) -> None:
    ops = collectives(text)
    kinds = {c.kind for c in ops}
    assert kinds <= {"all-reduce", "all-gather"}, kinds
    activation = [c for c in ops if c.kind == "all-reduce" and c.elements == tokens * HIDDEN]
    # embedding + attention output projection per layer + dense MLP down + one per MoE block (shared fused)
    expected = 1 + n_layers + n_dense + n_moe
    if tokens > ROWS:  # prefill: the last (MoE) layer's output projection and MoE block over one token a row
        last = [c for c in ops if c.kind == "all-reduce" and c.elements == ROWS * HIDDEN]
        assert len(last) == 2, [(c.kind, c.shape) for c in ops]
        expected -= 2
    assert len(activation) == expected, [(c.kind, c.shape) for c in ops]
    for c in ops:
        if c.kind == "all-gather":
            # sampling's per-shard candidates [rows, shards]; never logits [rows, vocab], a weight or a page
            assert c.elements <= ROWS * 8, (c.kind, c.shape)
        else:
            assert c.elements <= tokens * HIDDEN, (c.kind, c.shape)
    assert all(vocab not in c.shape for c in ops)  # logits stay split over vocab


@pytest.mark.parametrize("arch,sharding", [("deepseek_v3", "tp"), ("deepseek_v3", "ep"), ("glm4_moe", "tp"),
                                           ("glm_moe_dsa", "tp")])
def test_sharded_programs_move_only_activations(arch, sharding):
    m = eight_head_model(arch)
    cfg = m.cfg
    assert not cfg.has_indexer or dsa.is_sparse(PAGES * 4, cfg.index_topk)  # GLM-5: the sparse path (page size 4)
    n_dense = sum(t == "dense" for t in cfg.mlp_layer_types)
    e = engine(m, devices=8, sharding=sharding, kv_dtype="fp8")
    _check(_compiled(e, "decode"), ROWS, cfg.num_layers, n_dense, cfg.num_layers - n_dense, cfg.vocab_size)
    _check(_compiled(e, "prefill"), ROWS * CHUNK, cfg.num_layers, n_dense, cfg.num_layers - n_dense, cfg.vocab_size)


def test_kernels_per_shard_add_no_collective():
    """INT4 decode weights through the Pallas INT4 / grouped-matmul kernels and the Pallas paged attention
    (interpret mode: the kernel bodies compile to plain HLO on CPU) sit inside the shard_maps: same collectives."""
    m = eight_head_model("deepseek_v3")
    e = engine(m, devices=8, kv_dtype="fp8", decode_weights="int4", int4_group_size=4, use_kernels=True,
               attention="pallas_interpret")
    n_dense = sum(t == "dense" for t in m.cfg.mlp_layer_types)
    _check(_compiled(e, "decode"), ROWS, m.cfg.num_layers, n_dense, m.cfg.num_layers - n_dense, m.cfg.vocab_size)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_dp_attention_programs_move_no_page(arch):
    """DP attention (rows and pages split 8 ways): the MoE's token all-gather and psum_scatter move (the tag check and
    the new tokens' row writes run per page shard: no tags, rows or slots); never a page of the pool (a collective ending in [page_size, row width]) nor
    anything larger than the step's [tokens, hidden] activations. GLM-5's sparse path: its gathered index keys and
    latent rows (once all-gathered / all-reduced outside the shard_map) stay on their rank."""
    m = eight_head_model(arch)
    cfg = m.cfg
    e = engine(m, devices=8, sharding="dp_attention", kv_dtype="fp8", num_decode_pages=128, num_prefill_pages=128)
    lay = e.programs.decode_phase.pages.layout
    widths = {lay.latent_dim} | ({lay.index_head_dim} if cfg.has_indexer else set())
    assert not cfg.has_indexer or dsa.is_sparse(PAGES * lay.page_size, cfg.index_topk)
    for phase, tokens in (("decode", ROWS), ("prefill", ROWS * CHUNK)):
        ops = collectives(_compiled(e, phase))
        assert {c.kind for c in ops} <= {"all-reduce", "all-gather", "reduce-scatter"}, phase
        for c in ops:
            assert c.elements <= tokens * HIDDEN, (phase, c.kind, c.shape)
            assert not any(c.shape[i:i + 2] == (lay.page_size, w) for w in widths for i in range(len(c.shape) - 1)), \
                (phase, c.kind, c.shape)
            # the tag check and the row writes run per page shard: no tags and no new KV row cross ranks
            assert c.dtype != "u32" and c.shape[-1] not in widths, (phase, c.kind, c.dtype, c.shape)
