"""README's real-size target table (markdown rows) from `make plan-targets`' bench/results/plan_<target>_<model>.json.

    .venv/bin/python bench/plan_table.py
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
COLUMNS = ("h200_kimi_k26", "h200_glm_52", "v5p_kimi_k26", "v5p_glm_52")


def rows(plans: list[dict]) -> list[str]:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    tp = [p["modes"]["tp"] for p in plans]
    ph = lambda m, phase: m["phases"][phase]  # noqa: E731
    pool_copies = lambda m: sum(x["count"] for p in ("decode", "prefill") for x in ph(m, p)["moves"]  # noqa: E731
                                if x["of"].startswith("pool") and x["op"] in ("copy", "fusion"))
    table = [
        ("device (compiler's name), memory", lambda p, m: f"{p['device_kind']}, {p['spec']['memory_bytes'] / 1e9:.0f} GB"),
        ("decode: arguments (weights + pool) / temporaries / code",
         lambda p, m: " / ".join(gb(ph(m, "decode")["memory"][k]) for k in ("argument", "temp", "generated_code"))),
        ("prefill: arguments / temporaries / code",
         lambda p, m: " / ".join(gb(ph(m, "prefill")["memory"][k]) for k in ("argument", "temp", "generated_code"))),
        ("compiled layers (scaled to all) / compile s", lambda p, m: f"{ph(m, 'decode')['compiled_layers']} / "
         f"{ph(m, 'decode')['compile_s'] + ph(m, 'prefill')['compile_s']:.0f}"),
        ("decode collectives per step", lambda p, m: ", ".join(
            f"{c['count']} {c['kind']} {c['dtype']}{c['shape']}" for c in ph(m, "decode")["collectives"] if c["bytes"] > 4096)),
        ("pool copies per step (decode + prefill), weight / pool all-gathers", lambda p, m: f"{pool_copies(m)}, " + str(
            sum(x["count"] for q in ("decode", "prefill") for x in ph(m, q)["moves"] if x["op"] == "all-gather"))),
        ("FP8 KV tokens, TP attention (6 GB reserve)", lambda p, m: f"{m['kv_tokens']:,}"),
        ("FP8 KV tokens, DP attention", lambda p, m: f"{p['modes']['dp']['kv_tokens']:,}"),
    ]
    return [f"| {name} | " + " | ".join(f(p, m) for p, m in zip(plans, tp)) + " |" for name, f in table]


if __name__ == "__main__":
    print("\n".join(rows([json.loads((RESULTS / f"plan_{c}.json").read_text()) for c in COLUMNS])))
