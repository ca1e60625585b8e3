"""KV capacity: tokens per GiB of page pool, BF16 vs FP8 (e4m3 + one f32 scale per token, or per token and head).

GLM-5.2's pool also holds the DSA indexer keys (128 per token in each of its 21 full-indexer layers and its MTP
layer; IndexShare layers store none), FP8 + one f32 scale in an FP8 pool (or BF16 with the `index_kv_dtype="bf16"` option); its
layout comes from its config.json through the engine's own `kv_layout`.

Usage: python bench/kv_capacity.py [--quick] --json OUT.json

The numbers are computed from the layout (KVLayout.bytes_per_token) and cross-checked against the byte size of an
actual page pool's array shapes (jax.eval_shape of init_pages: no memory is allocated; --quick uses fewer pages).
This is pool capacity only: weights, activations and allocator headroom are not counted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxserve.cache import KVLayout, init_pages  # noqa: E402
from jaxserve.config import from_hf_config  # noqa: E402
from jaxserve.engine.layouts import kv_layout  # noqa: E402
from jaxserve.plan import PRESETS  # noqa: E402

GLM52 = from_hf_config(PRESETS["glm-5.2"])


@dataclass(frozen=True)
class ModelKV:
    name: str
    layout: KVLayout  # bf16 layout; fp8 derived


MODELS = (
    ModelKV("kimi-k2.6", KVLayout.mla(num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)),
    ModelKV("tiny-mla", KVLayout.mla(num_layers=4, kv_lora_rank=64, qk_rope_head_dim=16)),
    ModelKV("glm-4.5", KVLayout.gqa(num_layers=92, kv_heads=8, head_dim=128)),
    ModelKV("glm-5.2", kv_layout(GLM52, 16, "bf16")),  # latent rows + FP8 (in an FP8 pool) indexer keys
    ModelKV("glm-5.2-bf16idx", kv_layout(GLM52, 16, "fp8", "bf16")),  # indexer keys kept BF16 in an FP8 pool
)


def pool_bytes_per_token(layout: KVLayout, num_pages: int) -> float:
    """KV bytes per token measured from the shapes of a real pool of num_pages pages (its integrity tags, one
    uint32 per page, are not per-token KV and are left out)."""
    shapes = jax.eval_shape(lambda: init_pages(layout, num_pages))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(dataclasses.replace(shapes, tags=None)))
    return total / (num_pages * layout.page_size)


def measure(model: ModelKV, num_pages: int) -> dict[str, float | int | str]:
    row: dict[str, float | int | str] = {"model": model.name, "kind": model.layout.kind,
                                         "num_layers": model.layout.num_layers,
                                         "index_layers": model.layout.index_layers}
    for dtype in ("bf16", "fp8"):
        lay = model.layout.with_dtype(dtype)
        bpt = lay.bytes_per_token()
        measured = pool_bytes_per_token(lay, num_pages)
        if measured != bpt:
            raise AssertionError(f"{model.name} {dtype}: layout says {bpt} B/token, pool shapes give {measured}")
        row[f"{dtype}_bytes_per_token"] = bpt
        row[f"{dtype}_index_bytes_per_token"] = lay.index_bytes_per_token()
        row[f"{dtype}_tokens_per_gib"] = lay.tokens_per_gib()
    row["ratio"] = float(row["fp8_tokens_per_gib"]) / float(row["bf16_tokens_per_gib"])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="cross-check with 4-page pools instead of 256")
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = ap.parse_args(argv)
    rows = [measure(m, 4 if args.quick else 256) for m in MODELS]
    kimi = rows[0]
    result = {
        "model": kimi["model"],
        "bf16_tokens_per_gib": kimi["bf16_tokens_per_gib"],
        "fp8_tokens_per_gib": kimi["fp8_tokens_per_gib"],
        "ratio": kimi["ratio"],
        "note": "FP8 includes one float32 scale per token (MLA) or per token and kv head (GQA); "
                "Kimi MLA ratio = 1152 / (576 + 4) bytes per token per layer; GLM-5.2 adds its DSA indexer keys "
                "(22 layers (21 + the MTP layer) x (128 + 4) B in FP8, x 256 B in BF16)",
        "models": rows,
    }
    print(f"{'model':<16} {'kind':<4} {'B/tok bf16':>11} {'B/tok fp8':>10} {'(index fp8)':>11} {'tok/GiB bf16':>13} "
          f"{'tok/GiB fp8':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:<16} {r['kind']:<4} {r['bf16_bytes_per_token']:>11} {r['fp8_bytes_per_token']:>10} "
              f"{r['fp8_index_bytes_per_token']:>11} {r['bf16_tokens_per_gib']:>13.0f} "
              f"{r['fp8_tokens_per_gib']:>12.0f} {r['ratio']:>6.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
