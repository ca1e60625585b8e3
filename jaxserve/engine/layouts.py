"""The KV page layouts of an engine's two phases, decided once from its EngineConfig and model config.

prefill: BF16 pages (f32 when `kv_dtype` is "f32": reference runs), the pool the prefill program writes and the
         prefix cache shares, so its dtype is part of the prefix-cache salt;
decode:  `kv_dtype` pages (FP8 by default), DSA indexer keys in `index_kv_dtype`.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxserve.cache import KVLayout
from jaxserve.config import ModelConfig
from jaxserve.engine.config import EngineConfig
from jaxserve.format_names import KVDtype


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
