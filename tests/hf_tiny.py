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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.05)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
        for module in model.modules():
            if type(module).__name__.endswith("TopkRouter"):
                module.weight.mul_(4.0)
    return model.eval()


def save(model: transformers.PreTrainedModel, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def logits(model: transformers.PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits
