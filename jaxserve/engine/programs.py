"""The separately jitted prefill and decode programs, each with its own weight format, KV dtype and mesh.

prefill: BF16 page pool, prefill weights (FP8 by default), plain MLA, chunked; samples the first token.
decode:  FP8 (or BF16) page pool, decode weights (INT4 by default), tag check, absorbed MLA attention, sampling.
handoff: BF16 prefill pages -> decode pool pages (FP8 conversion on the prefill side, then a device transfer);
         the source pages' device tags travel with them and are verified on the decode side.
export / import: the two halves of the hand-off when the phases are separate servers (`EngineConfig.role`
         "prefill" / "decode": each builds, loads and compiles only its own phase; engine.kv_transfer moves the chunk,
         with per-page checksums computed on the device on both sides, `cache.checksum`).
Each pool carries its device tags (`KVPages.tags`); `sync_tags` sends the host allocator's changes before a
program reads them. Shapes are bucketed (rows, chunk tokens, pages per row) to powers of two so steady state never
recompiles; the model programs are one jit per shape (`engine.resident`: the mapping bound drops the oldest).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jaxserve.cache import KVLayout, KVPages, PageAllocator, compile_tag_sync, init_pages, pages_to_fp8
from jaxserve.cache.checksum import page_checksums
from jaxserve.engine.batch import dummy_decode, dummy_prefill
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.layouts import PhaseLayouts, phase_weights, weight_layout
from jaxserve.engine.eagle3_programs import draft_layouts, drafter_programs, load_draft
from jaxserve.engine.sampling import TOP_LOGPROBS_MAX, Sampled, SamplingArrays, SamplingMode, sample
from jaxserve.engine.invariant import decode_program, prefill_program
from jaxserve.engine.sampling_forms import SamplingForms, host_outputs, without_tops
from jaxserve.engine.resident import Resident, ShapeJit
from jaxserve.engine.scoring import PromptScores, prompt_scores
from jaxserve.engine.verify import Verified, dummy_verify, verify_step
from jaxserve.errors import ConfigError
from jaxserve.models import CausalLM
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.paged import DecodeBatch, PrefillBatch, decode, prefill
from jaxserve.models.build import shard_model
from jaxserve.models.sharded import import_fn
from jaxserve.sharding import POOL_AXES, Parallel, ShardingRules, make_mesh, pool_format, state_formats
from jaxserve.quant.weight_format import WeightFormat


def bucket(n: int, cap: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor), capped at `cap`."""
    b = max(floor, 1)
    while b < n:
        b *= 2
    return min(b, cap)


POOL_FIELDS = tuple(POOL_AXES)
FIRST_TAG_SYNCS = (1, 2, 4, 8)  # changed-page counts (padded to powers of two) a first short request syncs


@dataclass
class Phase:
    """One phase's model (graph + sharded state), mesh and page pool, with their layouts.

    params: the state's arrays as a flat list (`jax.tree.leaves(state)`, the same arrays), which is what the
    programs take: an nnx.State is flattened in Python on every call (~0.2 ms of each decode step's dispatch)."""

    graphdef: nnx.GraphDef
    state: nnx.State
    mesh: jax.sharding.Mesh
    pages: KVPages
    pages_sharding: KVPages
    state_sharding: nnx.State

    @functools.cached_property
    def params(self) -> list[jax.Array]:
        return jax.tree.leaves(self.state)  # once: the weights never change

    def params_of(self, leaves: list[jax.Array]) -> nnx.State:
        """The state rebuilt from `params`-shaped leaves (inside a traced program)."""
        return jax.tree.unflatten(jax.tree.structure(self.state), leaves)


def phase_devices(cfg: EngineConfig) -> tuple[list[jax.Device], list[jax.Device]]:
    """(prefill devices, decode devices): cfg.devices devices from cfg.first_device; split in two halves when
    disaggregated, the same list otherwise."""
    devices = jax.devices()
    end = cfg.first_device + cfg.devices
    if end > len(devices):
        raise ConfigError(f"EngineConfig asks for devices [{cfg.first_device}, {end}) but only {len(devices)} "
                          "devices exist", value=cfg.devices, param="devices")
    devices, half = devices[cfg.first_device: end], cfg.devices // 2
    return (devices[:half], devices[half:]) if cfg.disaggregate else (devices, devices)


def phase_parallel(cfg: EngineConfig, devices: list[jax.Device]) -> Parallel:
    """The mesh and sharding rules of one phase: a ("dp", "tp") mesh over its devices."""
    rules = ShardingRules.preset(cfg.sharding)
    dp = len(devices) if cfg.sharding == "dp_attention" else 1
    return Parallel(make_mesh(devices, dp=dp), rules)


def _pool_shardings(shape: KVPages, par: Parallel) -> KVPages:
    """A KVPages-shaped tree of NamedShardings (Formats with a pinned layout on TPU: `pool_format`), field by
    field from the pool table."""
    fields = {f: pool_format(par, f, getattr(shape, f).shape) for f in POOL_FIELDS if getattr(shape, f) is not None}
    return KVPages(shape.layout, **fields)


def _take_pages(src: KVPages, page_ids: jax.Array) -> KVPages:
    """Same-dtype hand-off: the selected pages of every layer, as a compact pool."""
    take = lambda x: None if x is None else x[:, page_ids]  # noqa: E731
    return KVPages(src.layout, latent=take(src.latent), latent_scale=take(src.latent_scale), k=take(src.k),
                   v=take(src.v), k_scale=take(src.k_scale), v_scale=take(src.v_scale),
                   tags=None if src.tags is None else src.tags[page_ids], index_k=take(src.index_k),
                   index_k_scale=take(src.index_k_scale))


def prefill_step(graphdef: nnx.GraphDef, state: nnx.State, pages: KVPages, batch: PrefillBatch,
                 samp: SamplingArrays, *, attention: AttentionBackend = AttentionBackend(), integrity: bool = True
                 ) -> tuple[Sampled, jax.Array, KVPages]:
    """The prefill program's body: tag check, one chunk per row written and attended, first tokens sampled.
    -> (Sampled: tokens [B] int32, logprobs [B] f32, top alternatives; ok [B] bool; pages)."""
    model = nnx.merge(graphdef, state)
    logits, pages, ok = prefill(model, pages, batch, attention=attention, integrity=integrity)
    return sample(logits, samp), ok, pages


def prefill_scored_step(graphdef: nnx.GraphDef, state: nnx.State, pages: KVPages, batch: PrefillBatch,
                        samp: SamplingArrays, targets: jax.Array, top: int, *,
                        attention: AttentionBackend = AttentionBackend(), integrity: bool = True
                        ) -> tuple[Sampled, jax.Array, KVPages, PromptScores]:
    """`prefill_step` with the last layer's tail and the head at every chunk position (its own program: rows
    without prompt logprobs never run it), also returning the prompt logprobs of targets [B, T] int32 (-1: none)
    with `top` (static) alternatives. -> (Sampled, ok [B] bool, pages, PromptScores)."""
    model = nnx.merge(graphdef, state)
    logits, pages, ok = prefill(model, pages, batch, all_logits=True, attention=attention, integrity=integrity)
    last = jnp.clip(batch.chunk_lens - 1, 0, logits.shape[1] - 1)
    at_last = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    return sample(at_last, samp), ok, pages, prompt_scores(logits, targets, top)


def decode_step(graphdef: nnx.GraphDef, state: nnx.State, pages: KVPages, batch: DecodeBatch,
                samp: SamplingArrays, *, integrity: bool, attention: AttentionBackend
                ) -> tuple[Sampled, jax.Array, KVPages]:
    """The decode program's body: tag check, one token per row. -> (Sampled, ok [B] bool, pages)."""
    model = nnx.merge(graphdef, state)
    logits, pages, ok = decode(model, pages, batch, integrity=integrity, attention=attention)
    return sample(logits, samp), ok, pages


class Programs:
    """Owns both phases and their compiled programs. `compiles` counts traces per program (recompile check)."""

    def __init__(self, model: CausalLM, cfg: EngineConfig, decode_model: CausalLM | None = None) -> None:
        """model: the prefill phase's weights (and decode's, unless `decode_model` is given); each is put in its
        phase's format (a model already stored in that format, e.g. from `jaxserve quantize`, is used as is)."""
        self.cfg = cfg
        self.model_cfg = model.cfg
        p_dev, d_dev = phase_devices(cfg)
        self.prefill_parallel = phase_parallel(cfg, p_dev)
        self.decode_parallel = phase_parallel(cfg, d_dev)
        interpret = cfg.attention_backend.interpret
        backend = cfg.attention_backend.tiling  # the matmul kernels' tiling

        def fmt(name: str) -> WeightFormat:
            return WeightFormat(name, cfg.int4_group_size, cfg.quantize_attention, cfg.use_kernels, interpret,
                                backend, cfg.int4_scope)

        draft = load_draft(cfg.speculative, model)  # "eagle3:PATH:K": its K/V take extra pool layers
        self.layouts = draft_layouts(PhaseLayouts.of(model.cfg, cfg), draft)  # the prefix-cache salt reads its dtype
        self.weight_layout = {"prefill": weight_layout(cfg, p_dev), "decode": weight_layout(cfg, d_dev)}

        def phase_model(m: CausalLM, name: str, weights: str) -> CausalLM:
            return phase_weights(m, fmt(weights), self.weight_layout[name], p_dev if name == "prefill" else d_dev)

        has = cfg.phases
        self.prefill_phase = self._phase(phase_model(model, "prefill", cfg.prefill_weights), self.prefill_parallel,
                                         self.layouts.prefill, cfg.num_prefill_pages) if "prefill" in has else None
        self.decode_phase = self._phase(phase_model(decode_model or model, "decode", cfg.decode_weights),
                                        self.decode_parallel, self.layouts.decode,
                                        cfg.num_decode_pages) if "decode" in has else None
        self.compiles: collections.Counter[str] = collections.Counter()
        self.resident = Resident()  # the model programs, one jit per signature: the mapping bound drops the oldest
        # where decode batch arrays live: the scheduler uploads there, so batches built from the host and ones merged
        # on the device with a running decode's tokens are placed alike and share one compiled program
        self.decode_rows = self.decode_parallel.sharding(("batch",))
        self.prefill_rows = self.prefill_parallel.sharding(("batch",))
        self.forms = SamplingForms(model.cfg.vocab_size, cfg.max_model_len)  # two sampling programs per shape
        if self.prefill_phase is not None:
            self._jit_prefill()
        if self.decode_phase is not None:
            self._jit_decode()
        # "mtp:K" / "eagle3:PATH:K": the prefill and verify programs with the drafter; role both only
        self.mtp = drafter_programs(cfg, self.prefill_phase, self.decode_phase, (self.prefill_rows, self.decode_rows),
                                    self.compiles, self.forms, draft)

    def _jit_prefill(self) -> None:
        """The prefill phase's programs (and the export of its pages in the decode format)."""
        # explicit layouts for every input: weights and pools as the rules say, batch arrays split by row (DP
        # attention) or replicated, so nothing is placed on a default device and resharded per call
        ph, rows_p = self.prefill_phase, self.prefill_rows
        self._prefill = ShapeJit(self.resident, "prefill", self._prefill_fn, functools.partial(jax.jit, donate_argnums=(
            1,), in_shardings=(jax.tree.leaves(ph.state_sharding), ph.pages_sharding, rows_p, rows_p),
            out_shardings=(rows_p, rows_p, ph.pages_sharding)))
        self._prefill_scored = ShapeJit(self.resident, "prefill_scored", self._prefill_scored_fn, functools.partial(
            jax.jit, donate_argnums=(1,), static_argnums=(5,), in_shardings=(jax.tree.leaves(ph.state_sharding),
            ph.pages_sharding, rows_p, rows_p, rows_p), out_shardings=(rows_p, rows_p, ph.pages_sharding, rows_p)))
        self._export = jax.jit(self._export_fn)

    def _jit_decode(self) -> None:
        """The decode phase's programs (and the import of pages into its pool)."""
        dh, rows_d = self.decode_phase, self.decode_rows
        self._decode = ShapeJit(self.resident, "decode", self._decode_fn, functools.partial(jax.jit, donate_argnums=(
            1,), in_shardings=(jax.tree.leaves(dh.state_sharding), dh.pages_sharding, rows_d, rows_d),
            out_shardings=(rows_d, rows_d, dh.pages_sharding)))
        # speculative decoding's verify: the decode phase's model and pool, k + 1 positions per row (engine.verify)
        self._verify = ShapeJit(self.resident, "verify", self._verify_fn, functools.partial(jax.jit, donate_argnums=(
            1,), in_shardings=(jax.tree.leaves(dh.state_sharding), dh.pages_sharding, rows_d, rows_d, rows_d),
            out_shardings=(rows_d, rows_d, dh.pages_sharding)))
        self._import = jax.jit(import_fn(self.decode_parallel), donate_argnums=(0,), out_shardings=dh.pages_sharding)

    def _phase(self, model: CausalLM, par: Parallel, layout: KVLayout, num_pages: int) -> Phase:
        """Put a phase's model on its mesh (already-placed arrays stay where they are) and create its pool."""
        model = shard_model(model, par if par.mesh.devices.size > 1 else None)
        state_sharding = state_formats(par, nnx.state(model))
        graphdef, state = nnx.split(model)
        state = jax.device_put(state, state_sharding)
        shape = jax.eval_shape(lambda: init_pages(layout, num_pages))
        shard = _pool_shardings(shape, par)
        pages = jax.jit(lambda: init_pages(layout, num_pages), out_shardings=shard)()
        return Phase(graphdef, state, par.mesh, pages, shard, state_sharding)

    # ---- traced bodies (the Counter increments only while tracing) ----------------------------------------
    def _prefill_fn(self, params: list[jax.Array], pages: KVPages, batch: PrefillBatch, samp: SamplingArrays):
        self.compiles["prefill"] += 1
        ph = self.prefill_phase
        return prefill_program(self.cfg, prefill_step)(ph.graphdef, ph.params_of(params), pages, batch, samp,
                                                       attention=self.cfg.attention_backend, integrity=self.cfg.integrity)

    def _prefill_scored_fn(self, params: list[jax.Array], pages: KVPages, batch: PrefillBatch,
                           samp: SamplingArrays, targets: jax.Array, top: int):
        self.compiles["prefill_scored"] += 1
        ph = self.prefill_phase
        return prefill_scored_step(ph.graphdef, ph.params_of(params), pages, batch, samp, targets, top,
                                   attention=self.cfg.attention_backend, integrity=self.cfg.integrity)

    def _decode_fn(self, params: list[jax.Array], pages: KVPages, batch: DecodeBatch, samp: SamplingArrays):
        self.compiles["decode"] += 1
        ph = self.decode_phase  # deterministic: invariant.decode_program runs the rows in tiles of one shape
        return decode_program(self.cfg, decode_step)(ph.graphdef, ph.params_of(params), pages, batch, samp,
                                                     integrity=self.cfg.integrity, attention=self.cfg.attention_backend)

    def _verify_fn(self, params: list[jax.Array], pages: KVPages, batch: PrefillBatch, drafts: jax.Array,
                   samp: SamplingArrays):
        self.compiles["verify"] += 1
        ph = self.decode_phase
        return verify_step(ph.graphdef, ph.params_of(params), pages, batch, drafts, samp,
                           attention=self.cfg.attention_backend, integrity=self.cfg.integrity)

    def _export_fn(self, pages: KVPages, page_ids: jax.Array) -> KVPages:
        self.compiles["handoff"] += 1
        if self.cfg.kv_dtype == "fp8":
            return pages_to_fp8(pages, page_ids, self.layouts.decode.index_dtype)
        return _take_pages(pages, page_ids)

    # ---- host entry points -----------------------------------------------------------------------------------
    def run_prefill(self, batch: PrefillBatch, samp: SamplingArrays, targets: np.ndarray | None = None,
                    top: int = 0) -> tuple[Sampled, np.ndarray, PromptScores | None]:
        """-> (Sampled with numpy fields, ok [B] bool: the row's pages passed the tag check, the prompt logprobs
        of `targets` [B, T] int32 (`scoring.score_targets`) with `top` alternatives: None without targets)."""
        ph = self.prefill_phase
        s = (self.forms.form if targets is None else self.forms.general)(samp, self.prefill_rows)  # SCORING_MODE
        if targets is None:
            sampled, ok, ph.pages = self._prefill(ph.params, ph.pages, batch, s)
            return host_outputs(sampled, samp), np.asarray(ok), None
        sampled, ok, ph.pages, scores = self._prefill_scored(ph.params, ph.pages, batch, s, targets, top)
        return host_outputs(sampled, samp), np.asarray(ok), jax.tree.map(np.asarray, scores)

    def run_decode(self, batch: DecodeBatch, samp: SamplingArrays) -> tuple[Sampled, np.ndarray]:
        """-> (Sampled with numpy fields, ok [B] bool)."""
        return self.read_decode(self.dispatch_decode(batch, samp))

    def dispatch_decode(self, batch: DecodeBatch, samp: SamplingArrays) -> tuple[Sampled, jax.Array]:
        """Enqueue one decode program and return at once: (Sampled, ok [B] bool) as device arrays, their copies to
        the host already started. The pool is threaded through (donated in, the output kept), so every later
        program on it (tag sync, hand-off, the next decode) runs after this one, in dispatch order."""
        ph = self.decode_phase
        sampled, ok, ph.pages = self._decode(ph.params, ph.pages, batch, self.forms.form(samp, self.decode_rows))
        sampled = without_tops(sampled, samp)  # a batch without top logprobs never copies them
        for x in (sampled.tokens, sampled.logprobs, ok):
            x.copy_to_host_async()
        return sampled, ok

    def read_decode(self, pending: tuple[Sampled, jax.Array]) -> tuple[Sampled, np.ndarray]:
        """Wait for a dispatched decode: -> (Sampled with numpy fields, ok [B] bool)."""
        sampled, ok = pending
        return jax.tree.map(np.asarray, sampled), np.asarray(ok)

    def run_verify(self, batch: PrefillBatch, drafts: jax.Array, samp: SamplingArrays, read: bool = True
                   ) -> tuple[Verified, np.ndarray]:
        """One verify program over the decode pool (`verify.upload_verify`'s batch and drafts, placed where decode
        batches live) -> (Verified with numpy fields, ok [B] bool); read False: the device arrays, not waited for."""
        ph = self.decode_phase
        s = self.forms.form(samp, self.decode_rows, drafts.shape[1] + 1)  # a grammar mask per position
        # everything on the decode rows' sharding, as `_compile` lowers it: another placement is another program
        batch, drafts, s = jax.device_put((batch, drafts, s), self.decode_rows)
        out, ok, ph.pages = self._verify(ph.params, ph.pages, batch, drafts, s)
        return (host_outputs(out, samp), np.asarray(ok)) if read else (out, ok)

    def sync_tags(self, prefill_alloc: PageAllocator, decode_alloc: PageAllocator) -> None:
        """Send each allocator's tag changes since the last call (allocations: the new tag; frees: 0) to its
        pool's device tags. Nothing is sent (or compiled) when nothing changed."""
        for phase, alloc in ((self.prefill_phase, prefill_alloc), (self.decode_phase, decode_alloc)):
            if phase is None:
                continue  # a phase this role does not run
            tags = alloc.sync_device_tags(phase.pages.tags)
            if tags is not phase.pages.tags:
                phase.pages = dataclasses.replace(phase.pages, tags=tags)

    def device_tags(self, phase: str) -> np.ndarray:
        """A host copy of one pool's device tags [pages] uint32 ("prefill" | "decode"); for failure handling."""
        return np.asarray((self.prefill_phase if phase == "prefill" else self.decode_phase).pages.tags)

    def handoff(self, src_pages: list[int], dst_pages: list[int], src_tags: list[int], dst_tags: list[int],
                groups: list[int] | None = None) -> None:
        """Copy prefill pages to decode pages (FP8 conversion when the decode pool is FP8). Padded to a power of
        two: padding reads the null page and writes nowhere. The source pages' device tags travel with the chunk
        and are compared with `src_tags` on the decode side (`insert_pages`): on a mismatch nothing of that
        request is written and its destination pages get tag 0, so the owner fails its first decode check.
        groups: the request (0, 1, ...) each page belongs to when one hand-off carries several (None: one request).
        Call `sync_tags` first."""
        chunk = self._export(self.prefill_phase.pages, jax.device_put(self._padded(src_pages, 0, np.int32)))
        # disaggregated: the compact chunk crosses from the prefill devices to the decode devices
        mesh = self.decode_phase.mesh
        self.import_chunk(jax.device_put(chunk, jax.tree.map(lambda x: _on_mesh(x, mesh), chunk)), dst_pages,
                          src_tags, dst_tags, groups)

    def _padded(self, values: Sequence[int], fill: int, dtype: type) -> np.ndarray:
        """values padded with `fill` to their hand-off bucket (`prefill_page_buckets`)."""
        out = np.full(self.cfg.pick(self.cfg.prefill_page_buckets, len(values)), fill, dtype)
        out[: len(values)] = values
        return out

    def export_chunk(self, src_pages: list[int]) -> tuple[KVPages, jax.Array]:
        """Prefill pages -> (a compact chunk of them in the decode pool's format, FP8 + scales when it is FP8, on
        the prefill devices; their checksums [n, F] uint32, `cache.checksum`), both on the device, padded to a
        hand-off bucket (padding reads the null page). The chunk carries the source pages' device tags."""
        chunk = self._export(self.prefill_phase.pages, jax.device_put(self._padded(src_pages, 0, np.int32)))
        return chunk, page_checksums(chunk, jnp.arange(chunk.tags.shape[0], dtype=jnp.int32))

    def import_chunk(self, chunk: KVPages, dst_pages: list[int], src_tags: list[int], dst_tags: list[int],
                     groups: list[int] | None = None) -> None:
        """Write a chunk (on the decode devices, padded to its bucket) into decode pages: see `handoff`."""
        dst, s_tags, d_tags = (self._padded(dst_pages, -1, np.int32), self._padded(src_tags, 0, np.uint32),
                               self._padded(dst_tags, 0, np.uint32))
        group = np.zeros(dst.shape[0], np.int32)
        group[: len(groups or [])] = groups or []
        self.decode_phase.pages = self._import(self.decode_phase.pages, chunk,
                                               *jax.device_put((dst, s_tags, d_tags, group)))

    def chunk_sharding(self) -> NamedSharding:
        """Where a chunk pulled from a prefill server is placed before its import: replicated on the decode mesh."""
        return NamedSharding(self.decode_phase.mesh, P())

    def decode_checksums(self, pages: list[int]) -> np.ndarray:
        """The checksums [n, F] uint32 of decode pool pages (after an import: what the exporter computed)."""
        ids = jax.device_put(self._padded(pages, 0, np.int32))
        return np.asarray(page_checksums(self.decode_phase.pages, ids))[: len(pages)]

    def warmup(self, progress: bool = True, *, background: bool = False) -> threading.Thread | None:
        """Compile every bucketed program ahead of traffic (decode rows x pages, prefill (rows, chunk) x pages, hand-off
        sizes, verify rows x pages when speculative; `EngineConfig.program_count`), smallest shapes first, with a
        progress bar. Afterwards no plain greedy request compiles anything (the general sampling form compiles on
        first use; `warmup.full_plan` has both).

        Nothing runs: each program is lowered and compiled against the pools' shapes, so the pools are never
        touched and warm-up may run beside live traffic. `background=True` does it in a daemon thread (returned);
        requests meanwhile compile the shapes they need themselves (a shape both want compiles twice at worst).
        With the persistent compilation cache (`jaxserve.engine.compile_cache`) a warm start only loads them.
        """
        if background:
            t = threading.Thread(target=self.warmup, args=(False,), name="jaxserve-warmup", daemon=True)
            t.start()
            return t
        combos = self.program_shapes()
        for combo in tqdm(combos, desc="warm-up compiles", disable=not progress):
            self._compile(*combo)
        return None

    def compile_first(self, extra: Sequence[Callable[[], None]] = ()) -> None:
        """Compile the programs a first short greedy request runs (one row in the smallest prefill, hand-off, decode
        and, when speculative, verify buckets), each in its own thread: XLA compiles with the GIL released, so on a
        multi-core host the first request waits for the slowest of them instead of their sum. Later calls with these
        shapes reuse them (an ahead-of-time compile fills the jit cache). `compile_first_sampled` does the same shapes
        with sampling. Also in the pool: the tag syncs of the first requests (`FIRST_TAG_SYNCS`) and `extra` (the
        scheduler's own small jits), so that request compiles nothing at all."""
        jobs = [functools.partial(self._compile, *combo) for combo in self._first_shapes()]
        jobs += [functools.partial(compile_tag_sync, ph.pages.tags, FIRST_TAG_SYNCS) for ph in self.phases()]
        jobs += list(extra)
        with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="jaxserve-compile") as pool:
            for f in [pool.submit(job) for job in jobs]:
                f.result()

    def compile_first_sampled(self) -> None:
        """The prefill and decode of `compile_first`'s shapes in the general sampling form: what any request that
        is not plain greedy runs (the OpenAI defaults, temperature 1 and top_p 1, included)."""
        for kind, b, m, t in self._first_shapes():
            if kind in ("prefill", "decode"):
                self._compile(kind, b, m, t, mode="any")

    def _first_shapes(self) -> list[tuple[str, int, int, int]]:
        c = self.cfg
        return [x for x in [("prefill", 1, c.prefill_page_buckets[0], c.chunk_buckets[0]),
                            ("decode", 1, c.page_buckets[0], 0), (self.move_kind, 0, c.prefill_page_buckets[0], 0),
                            ("verify", 1, c.page_buckets[0], 0)]
                if x[0] in self.kinds]

    @property
    def move_kind(self) -> str:
        """How pages leave prefill or reach decode in this role: "handoff" (both phases here), "export" (prefill
        role: to the KV transfer service), "import" (decode role: from a prefill server)."""
        return {"both": "handoff", "prefill": "export", "decode": "import"}[self.cfg.role]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The program kinds this role compiles (`_compile`)."""
        spec = ("verify",) if self.cfg.speculative is not None and "decode" in self.cfg.phases else ()
        return (*self.cfg.phases, self.move_kind, *spec)

    def phases(self) -> list[Phase]:
        """The phases this role built."""
        return [ph for ph in (self.prefill_phase, self.decode_phase) if ph is not None]

    def program_shapes(self) -> list[tuple[str, int, int, int]]:
        """Every bucketed (kind, rows, pages, chunk tokens) this role can run, small (common) shapes first."""
        c = self.cfg
        combos = [("decode", b, m, 0) for b in c.row_buckets for m in c.page_buckets]
        combos += [("prefill", b, m, t) for b, t in c.prefill_shapes for m in c.prefill_page_buckets]
        combos += [(self.move_kind, 0, m, 0) for m in c.prefill_page_buckets]
        combos += [("verify", b, m, 0) for b in c.row_buckets for m in c.page_buckets]
        combos.sort(key=lambda x: (max(x[1], 1) * max(x[3], 1) * x[2], x[0]))
        return [x for x in combos if x[0] in self.kinds]

    def _compile(self, kind: str, b: int, m: int, t: int, mode: SamplingMode = "greedy") -> None:
        """Lower and compile one bucketed program against the pools' shapes (nothing runs, no pool is touched);
        mode: the sampling form of the prefill / decode / verify program (`sampling_forms.SERVING_MODES`)."""
        if self.mtp is not None and kind in ("prefill", "verify"):
            return self.mtp.compile(kind, b, m, t, mode)
        spec = lambda tree: jax.tree.map(  # noqa: E731 - shapes only: the live pools may be donated meanwhile
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        p_ph, d_ph = self.prefill_phase, self.decode_phase
        if kind == "decode":
            batch, samp = jax.device_put(dummy_decode(b, m), self.decode_rows)
            self._decode.lower(d_ph.params, spec(d_ph.pages), batch, self.forms.compiled(samp, mode, self.decode_rows)
                               ).compile()
        elif kind == "verify":
            batch, drafts, samp = jax.device_put(dummy_verify(b, self.cfg.speculative.k, m), self.decode_rows)
            self._verify.lower(d_ph.params, spec(d_ph.pages), batch, drafts,
                               self.forms.compiled(samp, mode, self.decode_rows, drafts.shape[1] + 1)).compile()
        elif kind in ("prefill", "prefill_scored"):  # scored: prompt logprobs, in SCORING_MODE (scoring.py)
            batch, samp = dummy_prefill(b, t, m)
            args = (p_ph.params, spec(p_ph.pages), batch, self.forms.compiled(samp, mode, self.prefill_rows))
            scored = (np.full((b, t), -1, np.int32), TOP_LOGPROBS_MAX) if kind == "prefill_scored" else ()
            (self._prefill_scored if scored else self._prefill).lower(*args, *scored).compile()
        else:
            self._compile_move(kind, m, spec)

    def _compile_move(self, kind: str, m: int, spec: Callable) -> None:
        """Compile the export, import or hand-off of m pages (`move_kind`) with its checksums."""
        ids = jnp.zeros((m,), jnp.int32)
        d_ph = self.decode_phase
        if kind in ("export", "handoff"):
            lowered = self._export.lower(spec(self.prefill_phase.pages), ids)
            out = lowered.compile().output_shardings
            mesh = d_ph.mesh if d_ph is not None else self.prefill_phase.mesh
            chunk = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=NamedSharding(
                mesh, sh.spec if isinstance(sh, NamedSharding) else P())), lowered.out_info, out)
        else:
            chunk = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.chunk_sharding()),
                                 jax.eval_shape(lambda: init_pages(self.layouts.decode, m)))
        if kind == "export":
            page_checksums.lower(chunk, ids).compile()
            return
        tags = jnp.zeros((m,), jnp.uint32)
        self._import.lower(spec(d_ph.pages), chunk, ids, tags, tags, ids).compile()
        if kind == "import":
            page_checksums.lower(spec(d_ph.pages), ids).compile()


def _on_mesh(x: jax.Array, mesh: jax.sharding.Mesh) -> NamedSharding:
    """The same partitioning as x, on another mesh (prefill -> decode transfer)."""
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
    return NamedSharding(mesh, spec)
