"""Tiny random transformers models for the three architectures (the numerical references), built from config classes."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 16,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def kimi_config(n_group: int = 1, topk_group: int = 1) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=n_group, topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.827,
        rms_norm_eps=1e-6, max_position_embeddings=512, rope_parameters=dict(YARN), num_nextn_predict_layers=0,
        tie_word_embeddings=False, attn_implementation="eager")


def glm5_config(index_topk: int = 4, indexer_types: tuple[str, ...] = ("full", "shared", "full"),
                index_n_heads: int = 4) -> transformers.GlmMoeDsaConfig:
    return transformers.GlmMoeDsaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=len(indexer_types), first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16,
        index_n_heads=index_n_heads, index_head_dim=16, index_topk=index_topk, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=512,
        indexer_types=list(indexer_types), attn_implementation="eager")


def glm4_config() -> transformers.Glm4MoeConfig:
    return transformers.Glm4MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}, rms_norm_eps=1e-5,
        num_nextn_predict_layers=0, max_position_embeddings=512, attn_implementation="eager")


CONFIGS = {"deepseek_v3": kimi_config, "glm_moe_dsa": glm5_config, "glm4_moe": glm4_config}


def build(arch: str, seed: int = 0, **config_args: int) -> transformers.PreTrainedModel:
    """A random float32 eager model; router weights enlarged and biases randomized so expert choice is decisive."""
    torch.manual_seed(seed)
    cfg = CONFIGS[arch](**config_args)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model)
    return model.eval()


def save(model: transformers.PreTrainedModel, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def logits(model: transformers.PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


class MTPReference(torch.nn.Module):
    """DeepSeek-V3's MTP module (transformers has no MTP forward), built from transformers' own decoder layer class
    at layer_idx = num_hidden_layers and RMSNorm class, plus a torch Linear for eh_proj; reuses the main model's
    embedding, rotary embedding and lm_head."""

    def __init__(self, model: transformers.PreTrainedModel, seed: int = 1) -> None:
        super().__init__()
        cfg, main = model.config, model.model
        H, n = cfg.hidden_size, cfg.num_hidden_layers
        norm_cls, layer_cls = type(main.norm), type(main.layers[0])
        torch.manual_seed(seed)
        self.enorm, self.hnorm = norm_cls(H, eps=cfg.rms_norm_eps), norm_cls(H, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.layer = layer_cls(_with_mtp_layer(cfg), layer_idx=n)
        self.shared_norm = norm_cls(H, eps=cfg.rms_norm_eps)
        _randomize(self)
        self.model = [model]  # a list: not a submodule (its weights are the main model's)
        self.prefix = f"model.layers.{n}"

    def state(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of the MTP layer (names as GLM / DeepSeek checkpoints store them), with the
        embed_tokens / shared_head.head copies some checkpoints carry (random here: a reader must ignore them)."""
        p = self.prefix
        out = {f"{p}.{k}": v for k, v in self.layer.state_dict().items()}
        out.update({f"{p}.enorm.weight": self.enorm.weight, f"{p}.hnorm.weight": self.hnorm.weight,
                    f"{p}.eh_proj.weight": self.eh_proj.weight, f"{p}.shared_head.norm.weight": self.shared_norm.weight})
        main = self.model[0]
        out[f"{p}.embed_tokens.weight"] = torch.randn_like(main.model.embed_tokens.weight)
        out[f"{p}.shared_head.head.weight"] = torch.randn_like(main.lm_head.weight)
        return {k: v.detach().contiguous().clone() for k, v in out.items()}

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The main model's last decoder layer output (before the final norm) [B, T, H]."""
        seen: list[torch.Tensor] = []
        main = self.model[0]
        handle = main.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            with torch.no_grad():
                main(input_ids=tokens)
        finally:
            handle.remove()
        return seen[0]

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, H] (positions 0..T-1), next_tokens [B, T] -> (logits [B, T, V], MTP layer output)."""
        main = self.model[0]
        B, T = next_tokens.shape
        with torch.no_grad():
            x = self.eh_proj(torch.cat([self.enorm(main.model.embed_tokens(next_tokens)), self.hnorm(hidden)], -1))
            pos = torch.arange(T)[None].expand(B, T)
            mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
            h = self.layer(x, attention_mask=mask, position_ids=pos,
                           position_embeddings=main.model.rotary_emb(x, pos))
            h = h[0] if isinstance(h, tuple) else h  # GLM-5's layer also returns its top-k selection
            return main.lm_head(self.shared_norm(h)), h


def _with_mtp_layer(cfg: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """cfg with per-layer lists (GLM-5's mlp_layer_types, indexer_types) one entry longer: the MTP layer is a MoE
    layer with its own indexer."""
    import copy

    out = copy.deepcopy(cfg)
    if getattr(cfg, "indexer_types", None):
        out.indexer_types = list(cfg.indexer_types) + ["full"]
    if getattr(cfg, "mlp_layer_types", None):
        out.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
    return out


def _randomize(module: torch.nn.Module) -> None:
    """The same random scheme as `build`."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.05)
        for name, buf in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
        for m in module.modules():
            if type(m).__name__.endswith("TopkRouter"):
                m.weight.mul_(4.0)


def save_with_mtp(model: transformers.PreTrainedModel, folder: Path, seed: int = 1) -> MTPReference:
    """Save `model` plus a random MTP layer (tensors in their own shard, config.json's num_nextn_predict_layers = 1)
    -> the MTP layer's torch reference."""
    import json

    from safetensors.torch import save_file

    save(model, folder)
    mtp = MTPReference(model, seed).eval()
    save_file(mtp.state(), str(folder / "model-mtp.safetensors"))
    cfg_path = folder / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(raw))
    return mtp
