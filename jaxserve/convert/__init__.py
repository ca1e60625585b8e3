"""Hugging Face checkpoints -> jaxserve Orbax checkpoints: the safetensors reader and the converter."""
from jaxserve.convert.converter import add_arguments, convert, run

__all__ = ["add_arguments", "convert", "run"]
