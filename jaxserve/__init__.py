"""jaxserve: a JAX/XLA inference server for Kimi K2.x and GLM MoE models."""
from jaxserve.checkpoint import load, load_config
from jaxserve.config import ModelConfig, from_hf_config, load_hf_config

__all__ = ["ModelConfig", "from_hf_config", "load", "load_config", "load_hf_config"]
