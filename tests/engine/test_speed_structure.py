"""Structural facts behind the engine's speed, read off compiled HLO (never timings).

* KV pools are integer bit patterns: no `convert` / `bitcast-convert` whose operand is a page pool (a whole pool or
  one layer of it) in the prefill, decode or hand-off programs. A float8/bf16 pool made XLA:CPU convert the whole
  pool to f16/f32 and back around every scatter (and every gather).
* A greedy-only decode batch compiles a program with no sort (sampling fast path).
"""
from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_util import backend_compiles, small_config, tiny_model
from jaxserve.cache import KVLayout
from jaxserve.engine.programs import Programs
from jaxserve.engine.batch import dummy_decode, dummy_prefill

NUM_PAGES = 97  # odd, so that no weight or activation dim coincides with the pool's page count
_CONVERT = re.compile(r"= \w+\[([\d,]*)\]\S* (convert|bitcast-convert)\(")


def pool_sized_converts(hlo: str, num_pages: int, layer_elems: int) -> list[str]:
    """HLO lines converting an array with a `num_pages` dim and at least one layer's pool of elements.

    A convert's result has its operand's shape, so the result shape tells the operand's size."""
    out = []
    for line in hlo.splitlines():
        m = _CONVERT.search(line)
        if not m:
            continue
        dims = [int(d) for d in m.group(1).split(",") if d]
        if num_pages in dims and int(np.prod(dims)) >= layer_elems:
            out.append(line.strip()[:200])
    return out


def _layer_elems(lay: KVLayout, num_pages: int) -> int:
    per_token = lay.latent_dim if lay.kind == "mla" else lay.kv_heads * lay.head_dim
    return num_pages * lay.page_size * per_token


@pytest.fixture(scope="module")
def models():
    return {"deepseek_v3": tiny_model("deepseek_v3"), "glm4_moe": tiny_model("glm4_moe")}


def _programs(model, kv_dtype: str) -> Programs:
    return Programs(model, small_config(kv_dtype=kv_dtype, num_decode_pages=NUM_PAGES, num_prefill_pages=NUM_PAGES))


def test_negative_control_a_float8_pool_scatter_converts_the_pool():
    """The check can fail: scattering into a float8 array (the old pool layout) converts all of it on XLA:CPU."""
    pool = jnp.zeros((2, NUM_PAGES, 4, 24), jnp.float8_e4m3fn)

    def write(pool, rows, page):
        return pool.at[1, page, 0].set(rows.astype(pool.dtype), mode="drop")

    hlo = jax.jit(write).lower(pool, jnp.ones((3, 24)), jnp.arange(3)).compile().as_text()
    assert pool_sized_converts(hlo, NUM_PAGES, NUM_PAGES * 4 * 24)


@pytest.mark.parametrize("arch,kv_dtype", [("deepseek_v3", "fp8"), ("deepseek_v3", "bf16"), ("glm4_moe", "fp8")])
def test_prefill_and_handoff_convert_no_pool(models, arch, kv_dtype):
    pr = _programs(models[arch], kv_dtype)
    ph = pr.prefill_phase
    assert ph.pages.layout.storage_dtype == jnp.uint16
    elems = _layer_elems(ph.pages.layout, NUM_PAGES)
    batch, samp = dummy_prefill(4, 16, 8)
    hlo = pr._prefill.lower(ph.params, ph.pages, batch, samp).compile().as_text()
    assert pool_sized_converts(hlo, NUM_PAGES, elems) == []
    page_ids = jnp.zeros((8,), jnp.int32)
    hlo = pr._export.lower(ph.pages, page_ids).compile().as_text()
    assert pool_sized_converts(hlo, NUM_PAGES, elems) == []
    chunk = pr._export(ph.pages, page_ids)
    dst = pr.decode_phase.pages
    tags = jnp.zeros((8,), jnp.uint32)
    hlo = pr._import.lower(dst, chunk, page_ids, tags, tags).compile().as_text()
    assert pool_sized_converts(hlo, NUM_PAGES, _layer_elems(dst.layout, NUM_PAGES)) == []


def _decode_hlo(pr: Programs) -> str:
    ph = pr.decode_phase
    batch, samp = dummy_decode(4, 8)
    return pr._decode.lower(ph.params, ph.pages, batch, samp).compile().as_text()


@pytest.mark.parametrize("arch,kv_dtype", [("deepseek_v3", "fp8"), ("deepseek_v3", "bf16"), ("glm4_moe", "fp8")])
def test_decode_writes_convert_no_whole_pool(models, arch, kv_dtype):
    """The KV write path: no convert of the whole [layers, pages, ...] pool (it was 5 per FP8 step, 8 per BF16)."""
    pr = _programs(models[arch], kv_dtype)
    lay = pr.decode_phase.pages.layout
    assert lay.storage_dtype == (jnp.uint8 if kv_dtype == "fp8" else jnp.uint16)
    hlo = _decode_hlo(pr)
    assert pool_sized_converts(hlo, NUM_PAGES, lay.num_layers * _layer_elems(lay, NUM_PAGES)) == []


@pytest.mark.parametrize("arch,kv_dtype", [("deepseek_v3", "fp8"), ("glm4_moe", "bf16")])
def test_decode_reads_convert_no_layer_pool(models, arch, kv_dtype):
    """The XLA attention gathers pages as bits and views only the gathered block as values: not even one
    layer's pool is converted (it was, when attention read a value view of the layer)."""
    pr = _programs(models[arch], kv_dtype)
    lay = pr.decode_phase.pages.layout
    assert pool_sized_converts(_decode_hlo(pr), NUM_PAGES, _layer_elems(lay, NUM_PAGES)) == []


_RESULT = re.compile(r"= \(?\w+\[([\d,]*)\]")


def largest(hlo: str, op: str, suffix: tuple[int, ...] = ()) -> int:
    """Elements of the largest result of HLO ops of kind `op` (e.g. "gather") whose shape ends with `suffix`
    (e.g. a page's [page_size, latent_dim]: gathers of pages, not of MoE weights)."""
    sizes = []
    for line in hlo.splitlines():
        if f" {op}(" in line and (m := _RESULT.search(line)):
            dims = tuple(int(d) for d in m.group(1).split(",") if d)
            if dims[len(dims) - len(suffix):] == suffix:
                sizes.append(int(np.prod(dims)))
    return max(sizes, default=0)


@pytest.mark.parametrize("arch,kv_dtype", [("deepseek_v3", "fp8"), ("glm4_moe", "bf16")])
def test_decode_attention_reads_page_blocks_in_a_loop(models, arch, kv_dtype):
    """The XLA decode attention is a while loop over page blocks (trip count from the batch's live pages): no
    gather or convert of the whole padded context [B, M * ps, ...], only of one block (paged_attention_xla)."""
    from jaxserve.models.paged_attention_xla import block_pages_for

    b, m = 4, 96
    pr = Programs(models[arch], small_config(kv_dtype=kv_dtype, num_decode_pages=NUM_PAGES,
                                             num_prefill_pages=NUM_PAGES, max_model_len=400))
    lay = pr.decode_phase.pages.layout
    per_token = lay.latent_dim if lay.kind == "mla" else lay.kv_heads * lay.head_dim
    page = (lay.page_size, lay.latent_dim) if lay.kind == "mla" else (lay.page_size, lay.kv_heads, lay.head_dim)
    block = block_pages_for(lay.page_size, m)
    assert block < m  # the check needs more than one block
    ph = pr.decode_phase
    batch, samp = dummy_decode(b, m)
    hlo = pr._decode.lower(ph.params, ph.pages, batch, samp).compile().as_text()
    assert len(re.findall(r"= \(.*?\) while\(", hlo)) >= lay.num_layers  # one attention loop per layer at least
    one_block = b * block * lay.page_size * per_token
    assert 0 < largest(hlo, "gather", page) <= one_block and largest(hlo, "convert") < b * m * lay.page_size * per_token



_COPY = re.compile(r"= \w+\[([\d,]*)\]\S* copy\(")


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_decode_copies_no_pool(models, kv_dtype):
    """One block covering the table (a short context): the attention's page gathers stay in its loop, so XLA:CPU
    cannot fuse the layer's KV write into a hoisted gather and copy the pool (it copied the FP8 scale pool once per
    layer, bench/spec_profile.py --ops)."""
    pr = _programs(models["deepseek_v3"], kv_dtype)
    ph = pr.decode_phase
    batch, samp = dummy_decode(1, 8)  # c = 1: the engine's shape where XLA:CPU made the copies
    hlo = pr._decode.lower(ph.params, ph.pages, batch, samp).compile().as_text()
    pool_copies = [m.group(0) for m in _COPY.finditer(hlo)
                   if NUM_PAGES in [int(d) for d in m.group(1).split(",") if d]]
    assert pool_copies == []


def test_dense_all_copies_no_expert_weight():
    """Experts.dense_all (a few rows through every expert) reads the stacked [E, H, I] weights as they are: no
    transposed copy of a weight per call (XLA:CPU made one of each gate and up as an [N, H] x [H, E * I] product)."""
    from flax import nnx

    from jaxserve.models.layers import Experts

    e, h, inter = 4, 32, 48
    experts = Experts(e, h, inter, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.ones((3, h), jnp.bfloat16)
    weight = jnp.zeros((3, e), jnp.float32).at[:, 1].set(1.0)
    graph, state = nnx.split(experts)  # the weights as arguments (a closed-over constant could be folded)
    hlo = jax.jit(lambda st, x, w: nnx.merge(graph, st).dense_all(x, w)).lower(state, x, weight).compile().as_text()
    weight_copies = [m.group(0) for m in _COPY.finditer(hlo)
                     if int(np.prod([int(d) for d in m.group(1).split(",") if d] or [1])) >= e * h * inter]
    assert weight_copies == []


_SORT = re.compile(r"= \(?\w+\[([\d,]*)\]\S*(?:, \w+\[[\d,]*\]\S*)*\)? sort\(")


def vocab_sorts(hlo: str, vocab: int) -> list[str]:
    """HLO sort lines over an array with a vocabulary-sized dim (the MoE's small dispatch sorts do not count)."""
    return [line.strip()[:200] for line in hlo.splitlines()
            if (m := _SORT.search(line)) and vocab in [int(d) for d in m.group(1).split(",") if d]]


def test_greedy_decode_has_no_vocabulary_sort(models):
    pr = _programs(models["deepseek_v3"], "fp8")
    ph = pr.decode_phase
    batch, samp = dummy_decode(4, 8)
    assert samp.mode == "greedy"  # an all-greedy (here all-padding) batch picks the greedy program
    vocab = pr.model_cfg.vocab_size
    assert vocab_sorts(pr._decode.lower(ph.params, ph.pages, batch, samp).compile().as_text(), vocab) == []
    for mode, sorts in (("top_k", False), ("full", True)):  # the general program still sorts: the check can fail
        s = dataclasses.replace(samp, temperature=jnp.ones_like(samp.temperature), mode=mode)
        hlo = pr._decode.lower(ph.params, ph.pages, batch, s).compile().as_text()
        assert bool(vocab_sorts(hlo, vocab)) == sorts, mode


def test_bucket_grid_is_fine_and_bounded():
    """1-row bucket; decode page buckets pad at most 1.5x; the prefill grid only holds (rows, chunk) pairs within
    the step's token slots; the whole grid's size is the documented count."""
    from jaxserve.engine import EngineConfig

    c = EngineConfig()
    assert c.row_buckets[0] == 1
    pages = c.page_buckets
    assert pages == sorted(set(pages)) and pages[-1] == c.max_pages_per_seq
    assert all(b / a <= 1.5 for a, b in zip(pages, pages[1:]))
    assert all(b == 1 or b * t <= c.prefill_slots for b, t in c.prefill_shapes)
    assert c.program_count() == {"decode": 54, "prefill": 100, "handoff": 5}
    assert EngineConfig(page_bucket_steps=1).page_buckets == [8, 16, 32, 64, 128]
    assert c.pick(pages, 13) == 16 and c.pick(pages, 1) == 8 and c.pick(pages, 999) == 128


def test_warmup_compiles_the_grid_without_running_it(models):
    """warmup() lowers and compiles every bucket (no pool is touched), and a greedy request afterwards compiles
    nothing; the background form returns its thread."""
    from engine_util import engine, prompts
    from jaxserve.engine import SamplingParams

    e = engine(models["deepseek_v3"], kv_dtype="fp8", max_batch=2, max_model_len=32)
    pages_before = e.programs.decode_phase.pages
    e.programs.warmup(background=True).join()
    counts = e.programs.compiles
    n = e.cfg.program_count()
    assert counts["decode"] == n["decode"] and counts["prefill"] == n["prefill"] and counts["handoff"] == n["handoff"]
    assert e.programs.decode_phase.pages is pages_before  # nothing ran, nothing was donated
    before = dict(counts)
    e.generate(prompts(2, seed=3, lengths=(5, 20)), SamplingParams(max_tokens=6, ignore_eos=True))
    assert dict(e.programs.compiles) == before


def test_decode_batch_is_one_packed_upload_equal_to_the_per_row_build():
    """DecodeRows gathers the batch by numpy indexing; the packed array unpacks on device to exactly the batch
    the per-row loop built (tokens, positions, slots, tables, lengths, tags, pages, sampling columns).

    Everything here is local (a fresh DecodeRows, the test's own sequences, a pure jitted unpack): the IndexError
    once seen in a full run does not reproduce; each row's page list is checked to cover its position first, so
    a bad fixture fails with its values rather than an IndexError."""
    from jaxserve.engine.request import Request, SamplingParams
    from jaxserve.engine.batch import DecodeRows, unpack_decode
    from jaxserve.engine.sequence import Sequence

    ps, rows = 4, DecodeRows(4, 6, 4)
    seqs = []
    for i, (npages, length) in enumerate([(2, 5), (3, 11), (1, 4)]):
        seq = Sequence(Request([1, 2], SamplingParams(temperature=0.5 * i, top_k=i, top_p=0.9, seed=10 + i)), i)
        seq.decode_pages = [(10 * i + j + 1, 100 + j) for j in range(npages)]
        seq.decode_len, seq.generated = length, [7 + i]
        rows.assign(seq)
        rows.accepted(seq)
        seqs.append(seq)
    rows.add_page(seqs[2], 99, 5)
    seqs[2].decode_pages.append((99, 5))
    ready = [seqs[1], seqs[2]]  # not in slot order
    idx = np.array([s.slot for s in ready])
    batch, (temp, top_k, top_p, seed, step) = unpack_decode(jnp.asarray(rows.packed(idx, 4, 6)), 6)
    for i, seq in enumerate(ready):
        pos = seq.decode_len
        pages = [p for p, _ in seq.decode_pages]
        assert pos < len(pages) * ps, (pos, pages)  # the row owns the page its new token goes to
        assert int(batch.tokens[i]) == seq.generated[-1] and int(batch.positions[i]) == pos
        assert int(batch.slots[i]) == pages[pos // ps] * ps + pos % ps and int(batch.lengths[i]) == pos + 1
        assert list(np.asarray(batch.block_tables[i, :len(pages)])) == pages
        assert list(np.asarray(batch.expected_tags[i, :len(pages)])) == [t for _, t in seq.decode_pages]
        assert int(batch.num_pages[i]) == len(pages) and int(step[i]) == 1 and int(seed[i]) == seq.req.params.seed
        assert float(temp[i]) == seq.req.params.temperature and int(top_k[i]) == seq.req.params.top_k
        assert float(top_p[i]) == np.float32(0.9)
    assert batch.expected_tags.dtype == jnp.uint32 and temp.dtype == jnp.float32
    assert list(np.asarray(batch.slots[2:])) == [-1, -1] and not np.asarray(batch.lengths[2:]).any()  # padding
    assert list(np.asarray(top_p[2:])) == [1.0, 1.0] and not np.asarray(temp[2:]).any()
    rows.release(seqs[0])
    assert seqs[0].slot == -1


def test_compile_first_covers_a_first_short_request(models):
    """What `jaxserve serve` compiles before listening (greedy) and once idle (sampled, in the background) is
    exactly what its first short request runs: afterwards that request traces (compiles) no program of its own,
    and XLA compiles nothing else for it either (batch unpacking, tag syncs, host -> device copies)."""
    from jaxserve.engine import Engine, SamplingParams

    e = Engine(models["deepseek_v3"], small_config(kv_dtype="fp8"), start=False, warmup="first")
    assert dict(e.programs.compiles) == {"prefill": 1, "decode": 1, "handoff": 1}
    e.compile_deferred()  # what the loop runs when idle: the same prefill and decode shapes, sampled ("full" mode)
    assert dict(e.programs.compiles) == {"prefill": 2, "decode": 2, "handoff": 1}
    with backend_compiles() as compiled:
        out = e.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
        # what an OpenAI client sends by default: temperature 1, top_p 1
        out = e.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0,
                                                           seed=3))[0]
        assert len(out.token_ids) == 4
    assert dict(e.programs.compiles) == {"prefill": 2, "decode": 2, "handoff": 1}
    assert compiled == []


def test_deferred_compiles_start_when_the_engine_is_idle(models):
    """The running engine starts its deferred compiles in a background thread once idle (here a stand-in for
    `compile_first_sampled`, which the test above covers), after the request that arrived first."""
    from jaxserve.engine import Engine, SamplingParams

    e = Engine(models["deepseek_v3"], small_config(kv_dtype="fp8"))
    order = []
    e.deferred_compiles.append(lambda: order.append("compiled"))
    try:
        out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
        order.append("served")
        assert len(out.token_ids) == 2
        deadline = time.monotonic() + 60
        while e.background_compile is None and time.monotonic() < deadline:
            time.sleep(0.05)
        e.background_compile.join()
        assert order == ["served", "compiled"] and e.deferred_compiles == []
    finally:
        e.close()


def _read_params(hlo: str, shape: str) -> tuple[int, int]:
    """(ENTRY parameters of HLO type `shape`, e.g. "f32[8,64,32]"; how many of them an instruction reads)."""
    entry = hlo[hlo.index("\nENTRY "):]
    names = re.findall(rf"%?([\w.\-]+) = {re.escape(shape)}\S* parameter\(", entry)
    return len(names), sum(bool(re.search(rf"[(,] ?%?{re.escape(n)}[,)]", entry)) for n in names)


def test_the_c1_verify_moe_gathers_bf16_experts_which_hold_no_f32_twins():
    """The c = 1 verify's MoE (k + 1 = 4 tokens x top-2 = 8 pairs over 8 experts) gathers each pair's expert from
    the bf16 weights (XLA:CPU converts the gathered copy inside the gather, half the bytes a gather of f32 twins
    read: bench/results/step_cuts_gather_c1.json "gbf16"), so the CPU compute layout (WeightPlan(wide=True)) gives
    the routed experts no f32 twin: only the Linears hold one."""
    from flax import nnx

    from jaxserve.models.layers import MoE
    from jaxserve.quant.weight_format import WeightPlan

    cfg = tiny_model("deepseek_v3").cfg
    e, h, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert 4 * cfg.num_experts_per_tok == e  # the shape this pins: as many pairs as experts
    moe = MoE(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), path="layers.1.mlp", weights=WeightPlan(wide=True))

    def f32_arrays(m: nnx.Module) -> list[str]:
        return [".".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(m))
                if v.get_value().dtype == jnp.float32]

    assert f32_arrays(moe.experts) == []
    assert sorted(f32_arrays(moe.shared)) == ["down.wide", "gate.wide", "up.wide"]  # the same plan's Linear twins
    graph, state = nnx.split(moe)  # the weights as arguments
    x = jax.random.normal(jax.random.key(0), (1, 4, h), jnp.bfloat16)
    hlo = jax.jit(lambda st, x: nnx.merge(graph, st)(x)).lower(state, x).compile().as_text()
    assert largest(hlo, "gather", (h, inter)) == e * h * inter  # each pair's expert gathered (not dense_all)
    # gate and up, and down, each read as a bf16 argument (jit drops the arguments nothing reads)
    assert [_read_params(hlo, f"bf16[{s}]") for s in (f"{e},{h},{inter}", f"{e},{inter},{h}")] == [(2, 2), (1, 1)]
    # the check can fail: a program that gathers the gate weights alone keeps only them
    hlo = jax.jit(lambda st, i: nnx.merge(graph, st).experts.gate[...][i]).lower(
        state, jnp.arange(e)).compile().as_text()
    assert [_read_params(hlo, f"bf16[{s}]") for s in (f"{e},{h},{inter}", f"{e},{inter},{h}")] == [(1, 1), (0, 0)]
