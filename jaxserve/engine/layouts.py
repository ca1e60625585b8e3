"""The KV page layouts of an engine's two phases, decided once from its EngineConfig and model config.

prefill: BF16 pages (f32 when `kv_dtype` is "f32": reference runs), the pool the prefill program writes and the
         prefix cache shares, so its dtype is part of the prefix-cache salt;
decode:  `kv_dtype` pages (FP8 by default), DSA indexer keys in `index_kv_dtype`.
Also each phase's weights: their layout on its devices (`weight_layout`) and format (`in_format`).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.cache import KVLayout
from jaxserve.config import ModelConfig
from jaxserve.engine.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.format_names import KVDtype
from jaxserve.models import CausalLM
from jaxserve.models.build import dtype_of, matmuls
from jaxserve.quant.apply import compute_layout, quantize_model
from jaxserve.quant.weight_format import WeightFormat


def kv_layout(cfg: ModelConfig, page_size: int, dtype: str, index_dtype: str | None = None) -> KVLayout:
    """The page pool of `cfg`: MLA latent rows (+ DSA indexer keys of its full indexer layers) or GQA K/V, for the
    main layers and then the MTP layer when the model has one (`cfg.kv_layers`).
    index_dtype: the indexer keys' dtype when it differs from `dtype` (only "bf16" in an FP8 pool is useful)."""
    if cfg.is_mla:
        return KVLayout.mla(cfg.kv_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, page_size=page_size, dtype=dtype,
                            index_layers=cfg.index_cache_layers, index_head_dim=cfg.index_head_dim if cfg.has_indexer
                            else 0, index_dtype=None if index_dtype in (None, dtype) else index_dtype)
    return KVLayout.gqa(cfg.kv_layers, cfg.num_kv_heads, cfg.head_dim, page_size=page_size, dtype=dtype)


def prefill_kv_dtype(kv_dtype: KVDtype) -> KVDtype:
    """The prefill pool's dtype for a decode pool of `kv_dtype`: BF16, or f32 beside an f32 (reference) pool."""
    return "f32" if kv_dtype == "f32" else "bf16"


@dataclass(frozen=True)
class PhaseLayouts:
    """The two pools' layouts of one engine: what the programs allocate and what the prefix-cache salt names."""

    prefill: KVLayout
    decode: KVLayout

    @classmethod
    def of(cls, model_cfg: ModelConfig, cfg: EngineConfig) -> PhaseLayouts:
        return cls(prefill=kv_layout(model_cfg, cfg.page_size, prefill_kv_dtype(cfg.kv_dtype)),
                   decode=kv_layout(model_cfg, cfg.page_size, cfg.kv_dtype, cfg.index_kv_dtype))


def weight_layout(cfg: EngineConfig, devices: list[jax.Device]) -> str:
    """The phase's weight layout: cfg.weight_layout, with "auto" resolved to "compute" when the phase runs on CPU
    devices without Pallas (XLA:CPU has no packed INT4/FP8 matmul: the packed path unpacks every used expert each
    step, 2-8x a dense step on the embedded model), "packed" otherwise."""
    if cfg.weight_layout != "auto":
        return cfg.weight_layout
    xla_only = not cfg.use_kernels and cfg.attention_backend.implementation == "xla"
    return "compute" if xla_only and all(d.platform == "cpu" for d in devices) else "packed"


def in_format(model: CausalLM, wf: WeightFormat) -> CausalLM:
    """`model` with its quantizable weights in wf.fmt; a weight already quantized differently is an error."""
    out = quantize_model(model, wf)
    for path, module in matmuls(out):
        if module.fmt in ("fp8", "int4") and module.fmt != wf.fmt:
            raise ConfigError(f"{path} is stored as {module.fmt}, but this phase runs {wf.fmt} weights",
                              value=module.fmt, param="weights")
    return out


def wide_weights(model: CausalLM, devices: list[jax.Device]) -> bool:
    """Whether a phase's compute layout also holds its bf16 Linear weights in f32 (`MatmulFormat.wide`): on CPU
    devices, where XLA converts a bf16 weight to f32 for every one-row (c = 1) product - the 4 MB head and each
    layer's Linear weights on each step - and runs bf16 natively from two rows on (bench/decode_profile.py). The
    routed experts hold none: their gathers convert only the gathered experts."""
    return dtype_of(model) == jnp.bfloat16 and all(d.platform == "cpu" for d in devices)


def gate_up_twin(devices: list[jax.Device]) -> bool:
    """Whether a phase's compute layout also holds its dense routed experts' gate and up as one row-major twin
    (`MatmulFormat.gate_up`): on CPU, where XLA:CPU's two-dimensional product of every expert beats the batched one
    per expert and the expert slots (bench/step_cuts.py "gateup"). A single-device block only (`Experts`)."""
    return all(d.platform == "cpu" for d in devices)


def phase_weights(model: CausalLM, wf: WeightFormat, layout: str, devices: list[jax.Device]) -> CausalLM:
    """`model` in a phase's format `wf` and weight layout ("packed" | "compute", `weight_layout`) on `devices`."""
    out = in_format(model, wf)
    return compute_layout(out, dtype_of(out), wide_weights(out, devices), gate_up_twin(devices)) \
        if layout == "compute" else out
