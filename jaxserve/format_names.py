"""The names of jaxserve's number formats: runtime weight formats, KV pool dtypes, the dtype spellings users type
for them, and `canonical_format` that maps those spellings to the names.

A leaf: it imports nothing from jaxserve, so the cache, the quantizers, the configs and the planner all read the
same names without importing one another.
"""
from __future__ import annotations

from typing import Final, Literal

FORMATS: Final = ("bf16", "f32", "fp8", "int4")  # runtime weight formats (jaxserve.quant.formats)
KVDtype = Literal["bf16", "fp8", "f32"]  # f32: a reference-precision pool (tests, quality baselines)
KV_DTYPES: tuple[KVDtype, ...] = ("bf16", "fp8", "f32")  # KV page pool dtypes (jaxserve.cache.layout)
# dtype names users type for a format (numpy / ml_dtypes / torch spellings)
FORMAT_ALIASES: Final = {"bfloat16": "bf16", "float32": "f32", "fp32": "f32", "float8_e4m3fn": "fp8",
                         "float8_e4m3": "fp8", "fp8_e4m3": "fp8", "e4m3": "fp8", "uint4": "int4", "w4a16": "int4"}


def canonical_format(name: str) -> str:
    """A format name or a dtype alias ("bfloat16", "float8_e4m3fn", ...) -> the format name (others unchanged)."""
    return FORMAT_ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else name
