"""Paged KV cache: page pools (BF16/FP8), host allocator with generation tags, integrity checks."""
from jaxserve.cache.integrity import check_tags, integrity_errors, mask_outputs
from jaxserve.cache.pages import (
    FP8_MAX,
    NULL_PAGE,
    KVLayout,
    KVPages,
    PageAllocator,
    convert_pages_to_fp8,
    dequantize_fp8,
    gather_tokens,
    init_pages,
    insert_pages,
    pages_to_fp8,
    quantize_fp8,
    write_tokens,
)

__all__ = [
    "FP8_MAX", "NULL_PAGE", "KVLayout", "KVPages", "PageAllocator", "check_tags", "convert_pages_to_fp8",
    "dequantize_fp8", "gather_tokens", "init_pages", "insert_pages", "integrity_errors", "mask_outputs",
    "pages_to_fp8", "quantize_fp8", "write_tokens",
]
