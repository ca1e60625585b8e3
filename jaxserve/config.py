"""Model configs built from Hugging Face `config.json` files (Kimi K2.x, GLM-4.5/4.6/4.7, GLM-5.x).

Multi-token-prediction (MTP): `num_hidden_layers` counts the main layers only; the MTP layer stored after them
(`num_nextn_predict_layers`, GLM-5.x layer 78, DeepSeek-V3 layer 61, GLM-4.5 layer 92) is `mtp_layers` (0 or 1: one
head is served, as every release ships one), kept by the converter when its tensors are present (else 0). The MTP
layer is a full decoder layer: its MLP kind follows the config's layer rule at index num_hidden_layers, and on
GLM-5.x it runs its own DSA indexer (`index_share_for_mtp_iteration` concerns chained MTP steps; not read).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jaxserve.errors import ConfigError

# model_type -> family; kimi_k2 / kimi_k25 are DeepSeek-V3-shaped text backbones.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "glm_moe_dsa": "glm_moe_dsa",
    "glm4_moe": "glm4_moe",
}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters; `rope_type` is "default" or "yarn"."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the models need, for the three families. MLA fields are 0 for GQA models and vice versa."""

    model_type: str  # family: deepseek_v3 | glm_moe_dsa | glm4_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer
    # MLA (deepseek_v3, glm_moe_dsa)
    q_lora_rank: int = 0  # 0: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # DSA indexer (glm_moe_dsa)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_types: tuple[str, ...] = ()  # "full" | "shared" per layer
    indexer_rope_interleave: bool = True
    # GQA (glm4_moe)
    head_dim: int = 0
    attention_bias: bool = False
    use_qk_norm: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    # MTP (multi-token prediction) head: 0 = none; its decoder layer is layer index num_layers
    mtp_layers: int = 0
    mtp_mlp_type: str = "sparse"  # "dense" | "sparse": the MTP decoder layer's MLP

    # ---- derived -------------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.model_type in ("deepseek_v3", "glm_moe_dsa")

    @property
    def has_indexer(self) -> bool:
        return self.model_type == "glm_moe_dsa"

    @property
    def index_layers(self) -> tuple[int, ...]:
        """The main layers that run their own DSA indexer ("full"), in order; IndexShare ("shared") layers reuse the
        selection of the last full layer before them. Entry j's keys are indexer key cache layer j."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def index_cache_layers(self) -> int:
        """Layers of the DSA indexer key cache: the main full indexer layers, then the MTP layer's (its own)."""
        return len(self.index_layers) + (self.mtp_layers if self.has_indexer else 0)

    def index_slot(self, layer: int) -> int:
        """The indexer key cache layer of full indexer layer `layer` (the MTP layer's comes after the main ones)."""
        if layer >= self.num_layers:
            return len(self.index_layers) + layer - self.num_layers
        return self.index_layers.index(layer)

    def mlp_type(self, layer: int) -> str:
        """"dense" or "sparse": layer `layer`'s MLP (layer num_layers is the MTP layer)."""
        return self.mlp_layer_types[layer] if layer < self.num_layers else self.mtp_mlp_type

    def full_indexer(self, layer: int) -> bool:
        """Whether layer `layer` runs its own DSA indexer (the MTP layer does)."""
        return self.has_indexer and (layer >= self.num_layers or self.indexer_types[layer] == "full")

    @property
    def kv_layers(self) -> int:
        """Layers of the paged KV pool: the main layers, then the MTP layer's (pool layer index num_layers)."""
        return self.num_layers + self.mtp_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Number of rotated dims per head (MLA: qk_rope_head_dim; GQA: head_dim * partial_rotary_factor)."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def latent_dim(self) -> int:
        """Per-token, per-layer MLA cache row: kv_lora_rank + qk_rope_head_dim (576 for Kimi)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for YaRN as the HF reference does."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if self.is_mla and r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        for k in ("mlp_layer_types", "indexer_types", "eos_token_ids"):
            d[k] = tuple(d.get(k) or ())
        return ModelConfig(**d)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_hf(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    # transformers 5.x nests RoPE in `rope_parameters`; older files use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    merged: dict[str, Any] = {**legacy, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}; supported: 'default', 'yarn'", value=rope_type,
                          param="rope_parameters.rope_type")
    factor = merged.get("factor")
    orig = merged.get("original_max_position_embeddings", max_pos)
    if rope_type == "yarn" and factor is None:
        factor = max_pos / orig
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor or 1.0),
        original_max_position_embeddings=int(orig),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=float(merged.get("mscale") or 0.0),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
        partial_rotary_factor=float(partial),
    )


def _as_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(v) for v in x) if isinstance(x, (list, tuple)) else (int(x),)


class _Required:
    """`req(key)`: a config.json key the model type cannot do without; ConfigError naming it if absent."""

    def __init__(self, raw: dict[str, Any], model_type: str) -> None:
        self.raw, self.model_type = raw, model_type

    def __call__(self, key: str) -> Any:
        if key not in self.raw:
            raise ConfigError(f"{self.model_type} config.json lacks required key {key!r}", value=None, param=key)
        return self.raw[key]


def _mlp_layer_types(raw: dict[str, Any], n_layers: int, n_experts: int) -> list[str]:
    """"sparse" / "dense" per layer from first_k_dense_replace and moe_layer_freq (configs without mlp_layer_types)."""
    first_dense = int(raw.get("first_k_dense_replace", 0))
    freq = int(raw.get("moe_layer_freq", 1) or 1)
    return ["sparse" if (n_experts and i >= first_dense and i % freq == 0) else "dense" for i in range(n_layers)]


def _mla_fields(raw: dict[str, Any], family: str, req: _Required) -> dict[str, Any]:
    """MLA's latent ranks and head dims (deepseek_v3, glm_moe_dsa)."""
    return dict(
        q_lora_rank=int(raw.get("q_lora_rank") or 0),
        kv_lora_rank=int(req("kv_lora_rank")),
        qk_nope_head_dim=int(req("qk_nope_head_dim")),
        qk_rope_head_dim=int(req("qk_rope_head_dim")),
        v_head_dim=int(req("v_head_dim")),
        # glm_moe_dsa always interleaves in transformers; deepseek_v3 reads the flag (default True).
        rope_interleave=bool(raw.get("rope_interleave", True)) if family == "deepseek_v3" else True,
    )


def _dsa_fields(raw: dict[str, Any], n_layers: int, req: _Required) -> dict[str, Any]:
    """GLM-5's DSA indexer: its heads, top-k and which layers compute their own top-k ("full") or reuse ("shared")."""
    indexer_types = raw.get("indexer_types")
    if not indexer_types:
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) \
                else list(pattern)
        else:
            f = max(int(raw.get("index_topk_freq", 1) or 1), 1)
            off = int(raw.get("index_skip_topk_offset", 2))
            indexer_types = ["full" if (max(i - off + 1, 0) % f) == 0 else "shared" for i in range(n_layers)]
    indexer_types = list(indexer_types)[:n_layers]  # entries past num_hidden_layers would be MTP layers
    if len(indexer_types) != n_layers or set(indexer_types) - {"full", "shared"}:
        raise ConfigError("indexer_types must give 'full' or 'shared' for each of the num_hidden_layers layers",
                          value=indexer_types, param="indexer_types")
    if indexer_types[0] != "full":
        raise ConfigError("the first DSA layer must be 'full'", value=indexer_types[0], param="indexer_types")
    return dict(
        index_n_heads=int(req("index_n_heads")),
        index_head_dim=int(req("index_head_dim")),
        index_topk=int(req("index_topk")),
        indexer_types=tuple(indexer_types),
        # transformers always interleaves the indexer's rope; the real GLM-5.x configs say true as well
        indexer_rope_interleave=bool(raw.get("indexer_rope_interleave", True)),
    )


def from_hf_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed HF config.json (the `text_config` of kimi_k25 is used)."""
    model_type = raw.get("model_type")
    if model_type == "kimi_k25":
        if "text_config" not in raw:
            raise ConfigError("kimi_k25 config has no text_config", value=sorted(raw), param="text_config")
        inner = dict(raw["text_config"])
        inner.setdefault("model_type", "kimi_k2")
        return from_hf_config(inner)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}",
            value=model_type,
            param="model_type",
        )
    family = SUPPORTED_MODEL_TYPES[model_type]
    req = _Required(raw, model_type)
    n_layers = int(req("num_hidden_layers"))
    max_pos = int(raw.get("max_position_embeddings", 4096))
    n_experts = int(raw.get("n_routed_experts") or raw.get("num_experts") or 0)
    # entries past num_hidden_layers (when a config lists them) are the MTP layer's
    mlp_types = list(raw.get("mlp_layer_types") or ()) or _mlp_layer_types(raw, n_layers, n_experts)
    mtp_mlp = mlp_types[n_layers] if len(mlp_types) > n_layers else _mlp_layer_types(raw, n_layers + 1,
                                                                                     n_experts)[n_layers]
    common: dict[str, Any] = dict(
        model_type=family,
        vocab_size=int(req("vocab_size")),
        hidden_size=int(req("hidden_size")),
        intermediate_size=int(req("intermediate_size")),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        num_layers=n_layers,
        num_heads=int(req("num_attention_heads")),
        num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(raw, max_pos),
        max_position_embeddings=max_pos,
        n_routed_experts=n_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        mlp_layer_types=tuple(mlp_types[:n_layers]),
        mtp_layers=min(int(raw.get("num_nextn_predict_layers") or 0), 1),
        mtp_mlp_type=mtp_mlp,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )
    if common["hidden_act"] != "silu":
        raise ConfigError(f"unsupported hidden_act {common['hidden_act']!r}; only 'silu'", value=common["hidden_act"],
                          param="hidden_act")
    if family in ("deepseek_v3", "glm_moe_dsa"):
        common.update(_mla_fields(raw, family, req))
    if family == "glm_moe_dsa":
        common.update(_dsa_fields(raw, n_layers, req))
    if family == "glm4_moe":
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
        common.update(head_dim=head_dim, use_qk_norm=bool(raw.get("use_qk_norm", False)))
    cfg = ModelConfig(**common)
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads",
                          value=(cfg.num_heads, cfg.num_kv_heads), param="num_key_value_heads")
    if cfg.n_routed_experts and cfg.n_routed_experts % cfg.n_group:
        raise ConfigError("n_routed_experts must be a multiple of n_group", value=(cfg.n_routed_experts, cfg.n_group),
                          param="n_group")
    if len(cfg.mlp_layer_types) != cfg.num_layers:
        raise ConfigError("mlp_layer_types must have one entry per layer", value=cfg.mlp_layer_types,
                          param="mlp_layer_types")
    if cfg.rope_dim % 2:
        raise ConfigError("the rotary dimension must be even", value=cfg.rope_dim, param="qk_rope_head_dim")


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from an HF folder (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"no config.json at {p}", value=str(p), param="config.json")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.json at {p} is not valid JSON: {e}", value=str(p), param="config.json") from e
    return from_hf_config(raw)
