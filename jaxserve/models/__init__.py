"""Flax NNX models for Kimi K2.x (deepseek_v3), GLM-5.x (glm_moe_dsa) and GLM-4.5 (glm4_moe)."""
from jaxserve.models.transformer import CausalLM, DecoderLayer, forward

__all__ = ["CausalLM", "DecoderLayer", "forward"]
