"""Paged KV cache: the pool's static layout, device page pools (BF16/FP8) and their programs, the host allocator
with generation tags, integrity checks."""
from jaxserve.cache.allocator import PageAllocator
from jaxserve.cache.integrity import check_tags, guard_tables, integrity_errors, mask_outputs, page_tags_at
from jaxserve.cache.layout import FP8_MAX, NULL_PAGE, KVLayout
from jaxserve.cache.pool import (
    KVPages,
    compile_tag_sync,
    convert_pages_to_fp8,
    dequantize_fp8,
    gather_index_keys,
    gather_latent_rows,
    gather_tokens,
    init_pages,
    insert_pages,
    pages_to_fp8,
    quantize_fp8,
    stamp_tags,
    write_index_keys,
    write_tokens,
)

__all__ = [
    "FP8_MAX", "NULL_PAGE", "KVLayout", "KVPages", "PageAllocator", "check_tags", "compile_tag_sync",
    "convert_pages_to_fp8",
    "dequantize_fp8", "gather_index_keys", "gather_latent_rows", "gather_tokens", "guard_tables", "init_pages",
    "insert_pages", "integrity_errors", "mask_outputs", "page_tags_at", "pages_to_fp8", "quantize_fp8", "stamp_tags",
    "write_index_keys", "write_tokens",
]
