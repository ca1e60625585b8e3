"""`jaxserve plan`: will a model fit, and how many KV tokens, on N devices of a given memory size?

Nothing is allocated: the model is built abstractly (`nnx.eval_shape`) in each phase's weight format, laid out
by the sharding rules, and the real decode and prefill programs are lowered and compiled for an N-device CPU
mesh (`--xla_force_host_platform_device_count`). Per device it reports the weight bytes of each phase (from
each parameter's shard shape), the compiled temporaries (`compiled.memory_analysis()`), the KV pool that is
left, the tokens that pool holds under TP attention (the MLA latent replicated on every device) and under DP
attention (split by request), and the collectives of one step (kind, count, bytes) read from the compiled HLO.
Bytes per token include GLM-5.x's DSA indexer keys (FP8 + scale in an FP8 pool), which live in the same pages.
A config with an MTP head (`num_nextn_predict_layers`) counts its weights in both phases and its KV layer.

With `--target cpu` (the default) the programs compile on the XLA path (a CPU cannot compile Pallas kernels);
their temporaries are that path's, at the stated batch and context. With `--target h200|h100|v5p|v6e` the mesh is
built over the chip's compile-only topology devices (jaxserve/targets.py) and the programs compile with its
compiler and its Pallas kernels (attention "pallas" / "pallas_tpu", the quantized matmul kernels): the report is
that compiler's `memory_analysis()` (arguments, outputs, temporaries, code), its collectives, and every copy,
transpose or all-gather of a weight or pool shape in the compiled HLO (jaxserve/plan_compile.py). A target plan
compiles the leading dense layers + 1 MoE layer and + one more period of the layer pattern, and scales every
reported number linearly in the layer count to the model's (`--full-compile`: all layers). A target plan also
compiles the prefill -> decode hand-off at every layer into the pool it says fits (`handoff`, jaxserve/plan_handoff.py).

The KV pool is what the compiled decode program leaves (jaxserve/plan_fit.py): its arguments other than the pool
and the weights, temporaries and unaliased outputs are the compiler's, and a token costs the pool's bytes as the
compiler laid them out (the donated pool's aliased bytes: TPU tiles pad them). The decode program is then compiled
again at that pool (not the decode rows' pages, which need not fit) and its figures reported; KV tokens are 0
unless the program compiled at the pool fits. Each compiled phase says whether it fits (`need_bytes`, `fits`);
a disaggregated plan's prefill runs on its own devices, and its not fitting does not change the decode pool.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jaxserve.errors import ConfigError
from jaxserve.format_names import FORMATS, KV_DTYPES, canonical_format
from jaxserve.plan_compile import PhaseCompile, compile_phase, scaled
from jaxserve.plan_fit import Fit, kv_fit
from jaxserve.plan_handoff import compile_handoff
from jaxserve.targets import TARGETS, target, target_devices

# model configs as their config.json files give them (MODEL_FORMATS.md): only the keys the models read
PRESETS: dict[str, dict] = {
    "kimi-k2.6": {  # the text backbone of moonshotai/Kimi-K2.6 (kimi_k25 text_config), INT4 g32 routed experts
        "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 1,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rope_theta": 50000.0, "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": False,
    },
    "glm-5.2": {  # zai-org GLM-5.2: GLM-5.1 geometry, 1M context, IndexShare (21 full / 57 shared indexers:
        # 0, 1, 2, then every 4th), nested rope_parameters, a head_dim (192) that the MLA rope dim ignores, 1 MTP layer
        "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 78, "first_k_dense_replace": 3, "head_dim": 192,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "index_n_heads": 32,
        "index_head_dim": 128, "index_topk": 2048, "index_topk_freq": 4, "index_skip_topk_offset": 3,
        "indexer_rope_interleave": True, "index_share_for_mtp_iteration": True, "num_nextn_predict_layers": 1,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
        "rope_parameters": {"rope_type": "default", "rope_theta": 8000000},
        "eos_token_id": [154820, 154827, 154829], "tie_word_embeddings": False,
    },
    "glm-4.5": {  # zai-org GLM-4.5 (355B): GQA 96 q / 8 kv heads, 1 MTP layer
        "model_type": "glm4_moe", "num_nextn_predict_layers": 1, "vocab_size": 151552, "hidden_size": 5120, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_hidden_layers": 92, "first_k_dense_replace": 3,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
        "use_qk_norm": True, "attention_bias": True, "n_routed_experts": 160, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 1e6, "tie_word_embeddings": False,
    },
}
MEMORY: dict[str, float] = {"h200": 141e9, "h100": 80e9, "tpu-v5p": 95e9, "tpu-v6e": 32e9}
# what the seeds report for their deployments (FACTS.md), shown beside the plan
SEED_TOKENS: dict[str, float] = {"kimi-k2.6": 1.37e6, "glm-5.2": 1.18e6}


@dataclass(frozen=True)
class PlanSpec:
    """What to plan. memory_bytes: one device's memory; reserve_bytes: kept free for the runtime (CUDA context,
    communication buffers, fragmentation). colocated: prefill and decode share the devices (else the decode
    pool's devices are planned, as in a disaggregated deployment)."""

    devices: int = 8
    memory_bytes: float = MEMORY["h200"]
    decode_weights: str = "int4"
    prefill_weights: str = "fp8"
    kv_dtype: str = "fp8"
    group_size: int = 32
    attention: str = "tp"  # "tp" | "dp"
    sharding: str = "tp"  # experts: "tp" (FFN split) | "ep" (whole experts per device)
    colocated: bool = False
    page_size: int = 64
    decode_rows: int = 64
    decode_context: int = 8192
    prefill_chunk: int = 512
    prefill_context: int = 8192
    reserve_bytes: float = 6e9
    compile: bool = True
    target: str = "cpu"  # the compiler (jaxserve.targets): cpu | h200 | h100 | v5p | v6e
    scale_layers: bool = True  # targets: compile a few layers and scale (else every layer)
    pool_pages: int | None = None  # the compiled decode pool's pages (None: the decode rows' pages + null pages)

    def __post_init__(self) -> None:
        for p in ("decode_weights", "prefill_weights", "kv_dtype"):  # accept "bfloat16", "float8_e4m3fn", ...
            object.__setattr__(self, p, canonical_format(getattr(self, p)))
        for p, allowed in (("decode_weights", FORMATS), ("prefill_weights", FORMATS), ("kv_dtype", KV_DTYPES)):
            if getattr(self, p) not in allowed:
                raise ConfigError(f"--{p.replace('_', '-')} must be one of {allowed}, got {getattr(self, p)!r}",
                                  value=getattr(self, p), param=p)
        target(self.target)


@dataclass
class PhasePlan:
    fmt: str
    weight_bytes: int  # per device
    temp_bytes: int | None = None  # compiled temporaries per device
    compile_s: float | None = None
    collectives: list[dict] = field(default_factory=list)
    memory: dict[str, int] | None = None  # memory_analysis(): argument, output, temp, generated_code, alias bytes
    moves: list[dict] = field(default_factory=list)  # copies / transposes / all-gathers of a weight or pool
    compiled_layers: int | list[int] | None = None  # a list: compiled at these counts, scaled to the model's
    pool_pages: int | None = None  # the compiled program's pool (all page shards, null pages included)
    need_bytes: int | None = None  # the program's footprint at that pool on one device (plan_fit.Fit.need)
    fits: bool | None = None  # need_bytes within the device's memory less the reserve


def _rules_name(spec: PlanSpec, dp_attention: bool) -> str:
    return "dp_attention" if dp_attention else ("ep" if spec.sharding == "ep" else "tp")


def _abstract(cfg, fmt: str, spec: PlanSpec):  # noqa: ANN001, ANN202 - ModelConfig
    """The model in `fmt`, abstract (ShapeDtypeStructs)."""
    import jax.numpy as jnp

    from jaxserve.models import CausalLM
    from jaxserve.models.layers import abstract_build
    from jaxserve.quant.weight_format import WeightFormat, WeightPlan

    t = target(spec.target)  # on a chip, the quantized matmuls run the Pallas kernels of its tiling
    plan = WeightPlan(WeightFormat(fmt, spec.group_size, use_kernel=t.platform != "cpu",
                                   backend="tpu" if t.platform == "tpu" else "gpu"))
    return abstract_build(lambda rngs: CausalLM(cfg, dtype=jnp.bfloat16, rngs=rngs, weights=plan))


def _per_device_bytes(model, par) -> int:  # noqa: ANN001
    """Bytes one device holds of `model`'s parameters (each parameter's shard shape)."""
    import math

    import jax
    from flax import nnx

    from jaxserve.sharding import state_shardings

    _, state = nnx.split(model)
    total = 0
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(state_shardings(par, state))):
        total += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def _compile(cfg, model, par, spec: PlanSpec, phase: str):  # noqa: ANN001, ANN202
    """One phase's program on the CPU path (XLA attention) -> (temp bytes, seconds, collectives)."""
    r = compile_phase(cfg, model, par, spec, phase)
    return r.memory["temp"], r.seconds, r.collectives


def _layer_points(raw: dict, cfg) -> tuple[int, int] | None:  # noqa: ANN001
    """The two layer counts a target plan compiles: the leading dense layers + one MoE layer, and one period of the
    layer pattern more (GLM-5.x: a full DSA indexer every `index_topk_freq`-th layer); None: too few layers to
    scale, compile them all."""
    dense = next((i for i, t in enumerate(cfg.mlp_layer_types) if t != "dense"), cfg.num_layers)
    period = max(int(raw.get("index_topk_freq", 1) or 1), 1) if cfg.indexer_types else 1
    la = dense + 1
    return (la, la + period) if la + period < cfg.num_layers else None


def _compile_target(raw: dict, cfg, fmt: str, par, spec: PlanSpec, phase: str,  # noqa: ANN001, ANN202
                    pool_pages: int | None = None):
    """One phase compiled for spec.target: at two small layer counts, scaled to the model's (else all layers).
    pool_pages: the pool's pages exactly (plan_compile.compile_phase)."""
    from jaxserve.config import from_hf_config
    from jaxserve.models.build import shard_model

    t = target(spec.target)
    points = _layer_points(raw, cfg) if spec.scale_layers else None
    if points is None:
        return compile_phase(cfg, shard_model(_abstract(cfg, fmt, spec), par), par, spec, phase, t.attention,
                             in_mesh=True, pool_pages=pool_pages), cfg.num_layers
    runs = []
    for n in points:
        small = from_hf_config(dict(raw, num_hidden_layers=n))
        runs.append(compile_phase(small, shard_model(_abstract(small, fmt, spec), par), par, spec, phase,
                                  t.attention, in_mesh=True, pool_pages=pool_pages))
    return scaled(runs[0], points[0], runs[1], points[1], cfg.num_layers), list(points)


def _sized_decode(compile_at: Callable, first: PhaseCompile, fit_of: Callable, page_size: int, shards: int,
                  tries: int = 3) -> tuple[PhaseCompile, Fit]:
    """The decode program compiled at the pool that fits beside it: from `first` (compiled at the rows' pool),
    recompiled (`compile_at(pages)`) at the pages its fit leaves (a null page per shard included) until the
    compiled program fits and its pool is within 1% of what fits. fit_of(compile) -> its plan_fit.Fit. Nothing
    fits (under 2 pages a shard): `first`, whose fit says so."""
    r, f = first, fit_of(first)
    for _ in range(tries):
        want = f.tokens // page_size  # per page shard
        if want < 2 or (f.fits and r.pool_pages // shards >= 0.99 * want):
            break
        r = compile_at(want * shards)
        f = fit_of(r)
    return r, f


def _compile_one(raw: dict, cfg, model, fmt: str, par, spec: PlanSpec, phase: str,  # noqa: ANN001, ANN202
                 pool_pages: int | None = None):
    """One phase's program for spec.target -> (PhaseCompile, the layer counts compiled)."""
    if spec.target == "cpu":
        return compile_phase(cfg, model, par, spec, phase, pool_pages=pool_pages), cfg.num_layers
    return _compile_target(raw, cfg, fmt, par, spec, phase, pool_pages)


def _record(pp: PhasePlan, r: PhaseCompile, f: Fit) -> None:
    """A phase's compile and its fit on one device, into its plan."""
    pp.temp_bytes, pp.compile_s, pp.collectives, pp.memory, pp.moves = (r.memory["temp"], r.seconds,
                                                                        r.collectives, r.memory, r.moves)
    pp.pool_pages, pp.need_bytes, pp.fits = r.pool_pages, f.need, f.fits


def _per_token(cfg, spec: PlanSpec, kv_dtype: str, par, dp_attention: bool) -> int:  # noqa: ANN001
    """A token's nominal pool bytes on one device (GQA under TP: the device's kv heads)."""
    from jaxserve.engine.layouts import kv_layout

    layout = kv_layout(cfg, spec.page_size, kv_dtype)
    per_token = layout.bytes_per_token()
    return per_token // par.size("kv_heads") if layout.kind == "gqa" and not dp_attention else per_token


def _fit_mode(raw: dict, cfg, models: dict, phases: dict[str, PhasePlan], runs: dict[str, PhaseCompile],  # noqa: ANN001
              par, spec: PlanSpec, dp_attention: bool) -> dict:
    """One attention mode's KV pool on a decode device. Compiled: from the decode program recompiled at the pool
    that fits beside it (plan_fit.kv_fit: the pool as laid out, everything else the compiler reports), its tokens 0
    unless that program fits; else from the weights alone, at the layout's nominal bytes a token."""
    from jaxserve.engine.layouts import prefill_kv_dtype

    shards, ps, budget = par.size("pages"), spec.page_size, spec.memory_bytes - spec.reserve_bytes
    per_token = _per_token(cfg, spec, spec.kv_dtype, par, dp_attention)
    resident = phases["decode"].weight_bytes  # + the prefill format when colocated and different
    if spec.colocated and spec.prefill_weights != spec.decode_weights:
        resident += phases["prefill"].weight_bytes
    out = {"resident_weight_bytes": resident, "kv_bytes_per_token_per_device": per_token}
    if not runs:
        pool = budget - resident
        tokens = max(int(pool // per_token), 0)
        return dict(out, temp_bytes=0, kv_pool_bytes=max(int(pool), 0), kv_bytes_per_token_as_laid_out=per_token,
                    kv_tokens_per_device=tokens, decode_pool_pages=0)
    pre = runs["prefill"]
    other = pre.memory["temp"] if spec.colocated else 0  # colocated: the devices run the prefill's program too
    fit_of = lambda r: kv_fit(r.memory, r.pool_pages // shards * ps, per_token, resident,  # noqa: E731
                              phases["decode"].weight_bytes, budget, other)
    r, f = _sized_decode(lambda pages: _compile_one(raw, cfg, models["decode"], phases["decode"].fmt, par, spec,
                                                    "decode", pages)[0],
                         runs["decode"], fit_of, ps, shards)
    _record(phases["decode"], r, f)
    pre_token = _per_token(cfg, spec, prefill_kv_dtype(spec.kv_dtype), par, dp_attention)
    pre_weights = resident if spec.colocated else phases["prefill"].weight_bytes
    _record(phases["prefill"], pre, kv_fit(pre.memory, pre.pool_pages // shards * ps, pre_token, pre_weights,
                                           phases["prefill"].weight_bytes, budget))
    tokens = (r.pool_pages // shards - 1) * ps if f.fits and r.pool_pages // shards >= 2 else 0  # less null pages
    return dict(out, temp_bytes=max(r.memory["temp"], other), kv_pool_bytes=f.pool_bytes,
                kv_bytes_per_token_as_laid_out=round(f.bytes_per_token, 1), kv_tokens_per_device=tokens,
                decode_pool_pages=r.pool_pages if tokens else 0)


def plan(cfg_or_preset: str | dict, spec: PlanSpec = PlanSpec(), *, progress: bool = True) -> dict:
    """The plan as a dict (see the module docstring). Needs spec.devices JAX devices (CPU: forced host count)."""
    from tqdm import tqdm

    from jaxserve.config import from_hf_config
    from jaxserve.engine.layouts import kv_layout
    from jaxserve.models.build import shard_model
    from jaxserve.sharding import Parallel, ShardingRules, make_mesh

    raw = PRESETS[cfg_or_preset] if isinstance(cfg_or_preset, str) else cfg_or_preset
    cfg = from_hf_config(raw)
    devices = target_devices(target(spec.target), spec.devices)
    out: dict = {"model": cfg_or_preset if isinstance(cfg_or_preset, str) else raw.get("model_type"),
                 "target": spec.target, "device_kind": devices[0].device_kind,
                 "spec": asdict(spec), "modes": {}}
    steps = [("tp", "decode"), ("tp", "prefill"), ("dp", "decode"), ("dp", "prefill")]
    abstract: dict[str, object] = {}  # one abstract model per format, shared by both modes
    bar = tqdm(total=len(steps), desc="plan", disable=not progress)
    for mode in ("tp", "dp"):
        dp_attention = mode == "dp"
        rules = ShardingRules.preset(_rules_name(spec, dp_attention))
        par = Parallel(make_mesh(devices, dp=spec.devices if dp_attention else 1), rules)
        phases: dict[str, PhasePlan] = {}
        models, runs = {}, {}
        for phase, fmt in (("decode", spec.decode_weights), ("prefill", spec.prefill_weights)):
            if fmt not in abstract:
                abstract[fmt] = _abstract(cfg, fmt, spec)
            # the same abstract model, switched to this mode's mesh (one device: no shard_maps)
            models[phase] = shard_model(abstract[fmt], par if par.mesh.devices.size > 1 else None)
            phases[phase] = PhasePlan(fmt, _per_device_bytes(models[phase], par))
            if spec.compile and mode == spec.attention:
                runs[phase], phases[phase].compiled_layers = _compile_one(raw, cfg, models[phase], fmt, par, spec,
                                                                          phase)
            bar.update()
        fit = _fit_mode(raw, cfg, models, phases, runs, par, spec, dp_attention)
        per_device_tokens, pages = fit.pop("kv_tokens_per_device"), fit.pop("decode_pool_pages")
        layout = kv_layout(cfg, spec.page_size, spec.kv_dtype)
        out["modes"][mode] = {
            "phases": {k: asdict(v) for k, v in phases.items()}, **fit,
            # TP: every device holds (a kv-head slice of) the same tokens; DP: each device its own requests' tokens
            "kv_tokens": per_device_tokens * (spec.devices if dp_attention else 1),
            # GLM-5.x: the DSA indexer keys' share of per_token (in every device's copy, like the latent rows)
            "kv_index_bytes_per_token": layout.index_bytes_per_token(),
            "kv_tokens_per_device": per_device_tokens,
        }
        if runs and spec.target != "cpu":  # at the decode pool the plan compiled and says fits
            out["modes"][mode]["handoff"] = {
                k: {"memory": r.memory, "collectives": r.collectives, "moves": r.moves, "compile_s": r.seconds,
                    "pool_pages": pages} for k, r in compile_handoff(cfg, par, spec, pages, in_mesh=True).items()}
    bar.close()
    out["seed_tokens"] = SEED_TOKENS.get(cfg_or_preset) if isinstance(cfg_or_preset, str) else None
    return out


def table(p: dict) -> str:
    """A text table of a plan."""
    gb = lambda b: f"{b / 1e9:8.2f}" if b is not None else "       -"  # noqa: E731
    s = p["spec"]
    lines = [f"{p['model']} on {s['devices']} devices x {s['memory_bytes'] / 1e9:.0f} GB: decode {s['decode_weights']} "
             f"weights + {s['kv_dtype']} KV, prefill {s['prefill_weights']}; reserve {s['reserve_bytes'] / 1e9:.0f} GB"
             f"; {'colocated' if s['colocated'] else 'disaggregated (decode devices)'}",
             f"{'attention':<10}{'decode W GB':>12}{'prefill W GB':>13}{'temp GB':>9}{'KV pool GB':>11}"
             f"{'B/token':>9}{'KV tokens':>12}"]
    for mode, r in p["modes"].items():
        ph = r["phases"]
        lines.append(f"{mode:<10}{gb(ph['decode']['weight_bytes']):>12}{gb(ph['prefill']['weight_bytes']):>13}"
                     f"{gb(r['temp_bytes']):>9}{gb(r['kv_pool_bytes']):>11}{r['kv_bytes_per_token_per_device']:>9}"
                     f"{r['kv_tokens']:>12,}")
    if p.get("seed_tokens"):
        lines.append(f"seed deployment: ~{p['seed_tokens']:,.0f} FP8 KV tokens")
    for mode, r in p["modes"].items():
        for phase, ph in [*r["phases"].items(), *(r.get("handoff") or {}).items()]:
            if ph.get("memory"):
                m = ph["memory"]
                lines.append(f"{mode} {phase} on {p.get('target', 'cpu')} ({p.get('device_kind', '')}), layers "
                             f"{ph.get('compiled_layers', 'all')}: arguments {gb(m['argument'])} "
                             f"outputs {gb(m['output'])} "
                             f"temp {gb(m['temp'])} code {gb(m['generated_code'])} aliased {gb(m['alias'])} GB"
                             + (f"; with its {ph['pool_pages']}-page pool it needs {gb(ph['need_bytes'])} GB a device:"
                                f" {'fits' if ph['fits'] else 'DOES NOT FIT'}" if ph.get("fits") is not None else ""))
            for mv in ph.get("moves", []):
                lines.append(f"  {mv['count']:>4} x {mv['op']:<15} of {mv['of']} {mv['dtype']}{mv['shape']}"
                             f"{mv['layout']} ({mv['bytes'] / 1e6:.2f} MB each)")
            if ph["collectives"]:
                lines.append(f"{mode} {phase} collectives per step (compiled in {ph['compile_s']:.0f} s):")
                for c in ph["collectives"]:
                    lines.append(f"  {c['count']:>4} x {c['kind']:<15} {c['dtype']}{c['shape']} "
                                 f"({c['bytes'] / 1e6:.2f} MB each)")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), help="a real model's config")
    p.add_argument("--config", type=Path, help="an HF config.json instead of a preset")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--target", default="cpu", choices=sorted(TARGETS),
                   help="the compiler: cpu (XLA attention on host devices) or a chip's, on compile-only devices "
                        "(XLA:GPU + Triton / XLA:TPU + Mosaic, Pallas kernels in; needs `make install-aot`)")
    p.add_argument("--full-compile", action="store_true", help="targets: compile every layer (else a few, scaled)")
    p.add_argument("--memory", default=None, help=f"{', '.join(MEMORY)} or a size in GB (default: the target's)")
    p.add_argument("--decode-weights", default="int4")
    p.add_argument("--prefill-weights", default="fp8")
    p.add_argument("--kv-dtype", default="fp8")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--attention", choices=("tp", "dp"), default="tp", help="the mode whose programs compile")
    p.add_argument("--sharding", choices=("tp", "ep"), default="tp", help="experts: FFN split or whole")
    p.add_argument("--colocated", action="store_true", help="prefill and decode on the same devices")
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=8192)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--reserve-gb", type=float, default=6.0)
    p.add_argument("--no-compile", action="store_true", help="weights and KV only (seconds)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--no-progress", action="store_true")


def _spec(args: argparse.Namespace) -> PlanSpec:
    memory = (TARGETS[args.target].memory_bytes if args.memory is None
              else MEMORY[args.memory] if args.memory in MEMORY else float(args.memory) * 1e9)
    return PlanSpec(devices=args.devices, memory_bytes=memory, decode_weights=args.decode_weights,
                    prefill_weights=args.prefill_weights, kv_dtype=args.kv_dtype, group_size=args.group_size,
                    attention=args.attention, sharding=args.sharding, colocated=args.colocated,
                    decode_rows=args.decode_rows, decode_context=args.decode_context,
                    prefill_chunk=args.prefill_chunk, reserve_bytes=args.reserve_gb * 1e9,
                    compile=not args.no_compile, target=args.target, scale_layers=not args.full_compile)


def run(args: argparse.Namespace) -> int:
    if not args.preset and not args.config:
        raise SystemExit("jaxserve plan: give --preset or --config")
    if args.target != "cpu" and os.environ.get("JAX_PLATFORMS") != "cpu":
        # compile-only topology devices: the host runs on its CPU (a CUDA plugin would look for a driver)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        return subprocess.call([sys.executable, "-m", "jaxserve.cli", "plan", *sys.argv[2:]], env=env)
    import jax

    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if args.target == "cpu" and jax.default_backend() == "cpu" and len(jax.devices()) < args.devices:
        # the CPU backend's device count is fixed when it starts: run again with the forced count
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip(), JAX_PLATFORMS="cpu")
        return subprocess.call([sys.executable, "-m", "jaxserve.cli", "plan", *sys.argv[2:]], env=env)
    model = args.preset or json.loads(args.config.read_text())
    result = plan(model, _spec(args), progress=not args.no_progress)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0
