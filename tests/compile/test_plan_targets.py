"""`jaxserve plan --target`: Kimi K2.6's real decode program (INT4 g32 experts, FP8 latent pool, 64 rows x 8k context)
compiled for 8 x H200 (XLA:GPU, Pallas Triton kernels) and TPU v5p with 8 chips (XLA:TPU, Mosaic kernels) on
abstract weights, at 2 and 3 layers, scaled to 61 as the plan does. Asserted on what the compiler reported: it fits,
the temporaries are the target's, the only collectives are activation all-reduces, no weight or pool is gathered,
and it fits with no pool-sized copy on both. The DP-attention decode (rows and pages split 8 ways, attention
weights replicated, experts over all 8) compiled at 2 layers (the dense layer + one MoE layer) for both: only the
MoE's token all-gather and reduce-scatter cross devices, never a tag, a KV row, a page or a weight."""
from __future__ import annotations

import functools

import pytest

from jaxserve.config import from_hf_config
from jaxserve.models.build import shard_model
from jaxserve.plan import PRESETS, PlanSpec, _abstract, _per_device_bytes
from jaxserve.plan_compile import compile_phase, scaled
from jaxserve.plan_handoff import compile_handoff
from jaxserve.sharding import Parallel, ShardingRules, make_mesh
from jaxserve.targets import TARGETS, target_devices

LAYERS = 61
ROWS, HIDDEN = 64, 7168


@functools.cache
def _decode(target: str) -> dict:
    t = TARGETS[target]
    spec = PlanSpec(target=target, memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, 8), dp=1), ShardingRules.preset("tp"))
    runs = []
    for n in (2, 3):
        cfg = from_hf_config(dict(PRESETS["kimi-k2.6"], num_hidden_layers=n))
        model = shard_model(_abstract(cfg, "int4", spec), par)
        runs.append((compile_phase(cfg, model, par, spec, "decode", t.attention, in_mesh=True),
                     _per_device_bytes(model, par)))
    (a, wa), (b, wb) = runs
    return {"spec": spec, "plan": scaled(a, 2, b, 3, LAYERS), "weights": wb + (LAYERS - 3) * (wb - wa), "at3": b}


@pytest.mark.parametrize("target", ["h200", "v5p"])
def test_kimi_decode_fits_and_moves_only_activations(target):
    d = _decode(target)
    p = d["plan"]
    assert p.memory["temp"] > 0 and d["at3"].memory["temp"] > 0  # the target compiler's temporaries
    assert p.memory["argument"] >= d["weights"] > 70e9  # ~76.5 GB of INT4 weights per device + the pool
    assert {c["kind"] for c in p.collectives} == {"all-reduce"}
    # each MoE / attention output is reduced over the 8 devices: 64 rows x 7168, bf16 or f32, once per layer or so
    big = [c for c in p.collectives if c["bytes"] > 4096]
    assert big and all(c["bytes"] <= ROWS * HIDDEN * 4 and c["shape"][-1] == HIDDEN for c in big), big
    assert LAYERS <= sum(c["count"] for c in big) <= 3 * LAYERS
    assert not [m for m in p.moves if m["op"] == "all-gather"]  # no weight or pool gathered
    assert not [m for m in p.moves if m["of"] == "weight" and m["bytes"] > 16e6]  # no expert stack relaid out


def _fits(d: dict) -> bool:
    """The weights, the 64 x 8k pool and the temporaries within one device's memory less the reserve."""
    return d["plan"].memory["argument"] + d["plan"].memory["temp"] < d["spec"].memory_bytes - d["spec"].reserve_bytes


def test_h200_decode_fits_and_copies_no_pool():
    """No copy of the pool or a layer of it, by a `copy` op or by a fusion (plan_compile.fusion_copies): the Triton
    decode kernel reads the whole pool's bits at the layer. Handed `pages.layer(i)`, XLA:GPU copied each layer's
    slice (a `slice` fusion, 946 MB at the deployment's pool) into the kernel's own buffer."""
    d = _decode("h200")
    assert _fits(d)
    assert not [m for m in d["plan"].moves if m["of"].startswith("pool")]


def test_v5p_decode_copies_no_pool():
    """No copy of the latent pool or its scales, whole or one layer's: the pool is held row-major
    (`sharding.pool_format`), the Mosaic decode kernel reads the whole pool's bits at a scalar-prefetched layer,
    and new rows are written by dynamic_update_slices (a scatter wanted the 8-bit pool in (8, 128) tiles, the
    8-device entry keeps (32, 128)). Before, the copies made the temporaries scale with the pool (21 GB at 61
    layers); now they do not grow with the layers. (The 64 x 8k pool itself, 18.4 GB, 20.5 GB in row-major
    tiles, does not fit beside 76.5 GB of weights in 95 GB less the reserve: `jaxserve plan` sizes the pool.)"""
    d = _decode("v5p")
    moves = [m for m in d["plan"].moves if m["of"].startswith("pool.latent")]
    assert not moves, moves
    layer_slice = (ROWS * 8192 // 64 + 1) * 64 * 576  # one layer's latent pages (+ the null page): one old copy
    assert 0 < d["plan"].memory["temp"] < layer_slice  # at 61 layers: the temporaries do not scale with the pool


@pytest.mark.slow
@pytest.mark.parametrize("preset,phase", [("glm-4.5", "decode"), ("kimi-k2.6", "prefill")])
def test_h200_gqa_decode_and_mla_prefill_copy_no_pool_layer(preset, phase):
    """The other Triton attention kernels the engine hands a pool (GLM-4.5's GQA decode, the paged prefill) read the
    whole pool's bits at the layer too: 2 layers compiled for 8 x H200 copy no pool or layer of it (handed
    `pages.layer(i)`, each call's K / V or latent slice was copied by a `slice` fusion)."""
    t = TARGETS["h200"]
    spec = PlanSpec(target="h200", memory_bytes=t.memory_bytes, decode_rows=8)
    par = Parallel(make_mesh(target_devices(t, 8), dp=1), ShardingRules.preset("tp"))
    cfg = from_hf_config(dict(PRESETS[preset], num_hidden_layers=2))
    fmt = spec.decode_weights if phase == "decode" else spec.prefill_weights
    r = compile_phase(cfg, shard_model(_abstract(cfg, fmt, spec), par), par, spec, phase, t.attention, in_mesh=True)
    kernel = "paged_gqa_decode" if phase == "decode" else "paged_prefill_mla"
    assert [x for x in r.traffic if x["category"] == "kernel" and kernel in x["what"]]  # the Triton kernel runs
    assert not [m for m in r.moves if m["of"].startswith("pool")], r.moves


@functools.cache
def _dp_decode(target: str):  # noqa: ANN202
    """Kimi K2.6's DP-attention decode at 2 layers (layer 0 dense, layer 1 MoE) on 8 devices of `target`."""
    t = TARGETS[target]
    spec = PlanSpec(target=target, memory_bytes=t.memory_bytes, attention="dp")
    par = Parallel(make_mesh(target_devices(t, 8), dp=8), ShardingRules.preset("dp_attention"))
    cfg = from_hf_config(dict(PRESETS["kimi-k2.6"], num_hidden_layers=2))
    return compile_phase(cfg, shard_model(_abstract(cfg, "int4", spec), par), par, spec, "decode", t.attention,
                         in_mesh=True)


@pytest.mark.parametrize("target", ["h200", "v5p"])
def test_kimi_dp_attention_decode_gathers_no_page_and_copies_no_pool(target):
    """The tag check and the new rows' writes run per page shard (`sharded.check_tags_per_shard` /
    `write_per_shard`): the partitioner's version all-gathered the whole tag array (H200) and, on v5p, copied the
    device's latent pool in every row write. What crosses devices is the one MoE layer's tokens: an all-gather of
    the 64 rows' [64, 7168] bf16 in, and their sum back (a reduce-scatter to [8, 7168], or on TPU an all-reduce)."""
    r = _dp_decode(target)
    assert r.memory["temp"] > 0
    for c in r.collectives:
        assert c["kind"] in ("all-gather", "reduce-scatter", "all-reduce") and c["shape"][-1] == HIDDEN, c
        assert c["count"] == 1 and c["shape"][0] == (ROWS // 8 if c["kind"] == "reduce-scatter" else ROWS), c
    assert {c["kind"] for c in r.collectives} & {"reduce-scatter", "all-reduce"}
    assert [c["kind"] for c in r.collectives].count("all-gather") == 1
    assert not [m for m in r.moves if m["of"].startswith("pool") or m["op"] == "all-gather"], r.moves


# the decode pool's pages the plan's TP rows say fit (bench/results/plan_<target>_kimi_k26.json: KV tokens / 64)
HANDOFF_POOL = {"h200": 25780, "v5p": 4856}


@functools.cache
def _handoff(target: str) -> dict:
    t = TARGETS[target]
    spec = PlanSpec(target=target, memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, 8), dp=1), ShardingRules.preset("tp"))
    return compile_handoff(from_hf_config(PRESETS["kimi-k2.6"]), par, spec, HANDOFF_POOL[target], in_mesh=True)


@pytest.mark.parametrize("target", ["h200", "v5p"])
def test_kimi_handoff_updates_the_decode_pool_in_place(target):
    """The hand-off of one 8k-token request (128 pages, 61 layers) into Kimi K2.6's real FP8 decode pool: the import
    returns the donated pool aliased (written in place: no second pool), its temporaries within twice the chunk
    (v5p: the chunk relaid out; they do not grow with the pool), no collective (TP: the pool is replicated, every device writes its copy); the export quantizes the
    128 BF16 pages into a chunk of half their bytes, moving nothing between devices."""
    h = _handoff(target)
    pool = HANDOFF_POOL[target] * 64 * (576 + 4) * LAYERS  # FP8 latent rows + their f32 scales
    imp, exp = h["import"], h["export"]
    assert imp.memory["alias"] >= pool and imp.memory["output"] - imp.memory["alias"] < 1024  # (+ a tuple table)
    chunk = 128 * 64 * (576 + 4) * LAYERS
    assert imp.memory["temp"] < 2 * chunk and not imp.collectives  # at most the chunk relaid out: not the pool
    assert exp.memory["output"] >= chunk and not exp.collectives
    assert exp.memory["output"] < 0.6 * 128 * 64 * 576 * 2 * LAYERS  # FP8 + scales: about half the BF16 pages


def test_h200_handoff_copies_no_pool():
    assert not [m for m in _handoff("h200")["import"].moves if m["of"].startswith("pool")]


@pytest.mark.slow
def test_v5p_dp_attention_handoff_import_copies_no_pool():
    """Under DP attention (8 page shards, 2 layers) the import runs per device (`sharded.insert_per_shard`): each
    chip DMAs the chunk's pages it holds into its own pool shard, with no collective and no copy of the shard (the
    scatter relaid out the device's 8-bit shard in and out)."""
    t = TARGETS["v5p"]
    spec = PlanSpec(target="v5p", memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, 8), dp=8), ShardingRules.preset("dp_attention"))
    cfg = from_hf_config(dict(PRESETS["kimi-k2.6"], num_hidden_layers=2))
    imp = compile_handoff(cfg, par, spec, HANDOFF_POOL["v5p"], in_mesh=True)["import"]
    assert imp.memory["alias"] > 0 and not imp.collectives
    assert not [m for m in imp.moves if m["of"].startswith("pool")], imp.moves


def test_v5p_handoff_copies_no_pool():
    """The import's value pages are DMA'd into the donated pool in place (`sharded.import_fn`: the Mosaic kernel
    `copy_pages_tpu`): XLA:TPU's scatter (and a per-page dynamic_update_slice loop) relaid out the whole 8-bit pool,
    (32, 128) -> (8, 128) tiles and back, around the write (a copy of u8[61, 5426, 64, 576], 12.2 GB, per hand-off)."""
    assert not [m for m in _handoff("v5p")["import"].moves if m["of"].startswith("pool")]


@pytest.mark.slow
@pytest.mark.parametrize("target,phase", [("v5p", "decode"), ("v5p", "prefill"), ("v6e", "decode"),
                                          ("v6e", "prefill"), ("v5p", "verify"), ("v6e", "verify")])
def test_gqa_kernels_read_the_whole_pool_and_copy_no_pool(target, phase):
    """GLM-4.5's GQA decode and prefill on v5p and v6e (2 layers + the MTP layer's pool layer, TP 8: one kv head a
    chip): the Mosaic kernels read the whole pool's bits at a scalar-prefetched layer from a pool stored head-major
    (`sharding.pool_format`), so no layer of K / V is copied into the call (handed `pages.layer(i)`: a 67 MB
    copy of each layer's K and of its V per decode step) and the K / V scatter copies no pool (row-major, the
    write relaid out the whole K and V pools). Row-major also padded the one-head pool to whole (32, 128) tiles:
    4x the K / V bytes, 128x the scales'; the arguments are now the weights and the pool's own bytes. No pool
    array is copied at all, the FP8 scale pools included (counted with unit dims dropped: f32[3, 8193, 64]): held
    head-major ([L, P, 1, ps]) they were (1, 128)-tiled, and XLA:TPU's element scatter of new scales relaid both
    out per step and the kernel's read per layer (8 copies of 6.3 MB at 2 layers); now they are [L, Hkv, P, ps]
    and written as whole page rows (`cache.pool._store_page_rows`), in place. The speculative verify (3 drafts + 1
    positions a decode row, the prefill kernel over the FP8 decode pool) hands the prefill kernel the whole scale
    pools and the layer too: handed one layer's scales as [1, P, ps, 1] columns, XLA:TPU relaid both whole scale pools
    out and copied a column per layer for K and V (f32[1, 8193, 64, 1], its unit minor dim on the (8, 128) tile's
    lanes: 268 MB each), verify temporaries 570 -> 47 MB at 2 layers on v5p."""
    t = TARGETS[target]
    spec = PlanSpec(target=target, memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, 8), dp=1), ShardingRules.preset("tp"))
    cfg = from_hf_config(dict(PRESETS["glm-4.5"], num_hidden_layers=2))
    on_decode = phase != "prefill"  # decode and verify: the FP8 decode pool and the decode rows
    fmt = spec.decode_weights if on_decode else spec.prefill_weights
    model = shard_model(_abstract(cfg, fmt, spec), par)
    r = compile_phase(cfg, model, par, spec, phase, t.attention, in_mesh=True)
    kernel = f"paged_{'gqa_decode' if phase == 'decode' else 'prefill_gqa'}_tpu"
    assert [x for x in r.traffic if x["category"] == "kernel" and kernel in x["what"]]  # the Mosaic kernel runs
    assert not [m for m in r.moves if m["of"].startswith("pool")], r.moves
    pages = ROWS * 8192 // 64 + 1 if on_decode else 8192 // 64 + 1  # the rows' pages + the null page
    slot = 2 * (128 + 4) if on_decode else 2 * 128 * 2  # one kv head's K + V per token: FP8 + scale, BF16
    nominal = 3 * pages * 64 * slot + 4 * pages  # 3 pool layers (+ the MTP layer's), the tags
    pool = r.memory["alias"]  # the donated pool, returned in place
    assert nominal <= pool < 1.05 * nominal, (pool, nominal)  # row-major: 7.8x (decode), 2x (prefill)


@pytest.mark.slow
def test_v5p_gqa_handoff_import_copies_no_pool():
    """GLM-4.5's hand-off import into its FP8 decode pool on v5p (2 layers + the MTP layer, TP 8) DMAs K / V through
    their head-major rows and the scales through their [L * Hkv, P, ps] rows (`cache.pool._dma_head_major`,
    `_dma_scale_rows`), in place: handed the [L, P, ps, 1, D] pools, Mosaic wanted them row-major and XLA:TPU copied
    the whole K and V pools in and out (temporaries 806 MB at 8,192 pages: 2 x the pool; the plan's 92-layer
    import asked for 267 GB) and the scales' scatter relaid the scale pools out."""
    t = TARGETS["v5p"]
    spec = PlanSpec(target="v5p", memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, 8), dp=1), ShardingRules.preset("tp"))
    cfg = from_hf_config(dict(PRESETS["glm-4.5"], num_hidden_layers=2))
    imp = compile_handoff(cfg, par, spec, 8192, in_mesh=True)["import"]
    assert imp.memory["alias"] > 0 and not imp.collectives
    assert not [m for m in imp.moves if m["of"].startswith("pool")], imp.moves
    chunk = 3 * 128 * 64 * 2 * (128 + 4)  # 128 pages of one kv head's FP8 K + V and their scales, 3 pool layers
    assert imp.memory["temp"] < 2 * chunk, imp.memory
