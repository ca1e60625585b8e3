"""README's real-size target table (markdown rows) from `make plan-targets`' bench/results/plan_<target>_<model>.json
(and, where present, the DP-attention plan plan_<target>_<model>_dp.json: `--attention dp`).

    .venv/bin/python bench/plan_table.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
COLUMNS = ("h200_kimi_k26", "h200_glm_52", "h100_kimi_k26", "v5p_kimi_k26", "v5p_glm_52", "v6e_kimi_k26", "v6e_glm_52")


def _handoff(m: dict, part: str) -> str:
    """One hand-off program's memory (arguments / temporaries / aliased) and pool copies, or "-" (not compiled)."""
    h = (m.get("handoff") or {}).get(part)
    if h is None:
        return "-"
    mem, gb = h["memory"], lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    copies = sum(x["count"] for x in h["moves"] if x["of"].startswith("pool") and x["op"] == "copy")
    coll = sum(c["count"] for c in h["collectives"])
    return (f"{gb(mem['argument'])} / {gb(mem['temp'])} / {gb(mem['alias'])} GB, {copies} pool copies, "
            f"{coll} collectives")


def _need(p: dict, ph: dict) -> str:
    """A compiled phase's footprint on one device (plan_fit.Fit.need) and whether it fits, or "-" (planned before)."""
    if ph.get("need_bytes") is None:
        return "-"
    budget = p["spec"]["memory_bytes"] - p["spec"]["reserve_bytes"]
    return f"{ph['need_bytes'] / 1e9:.2f} GB {'fits' if ph['fits'] else f'> {budget / 1e9:.0f}: does not fit'}"


def _run(p: dict, m: dict) -> str:
    """The plan's wall time and the host's mean 1-minute load while it ran, or "-" (run before they were recorded)."""
    r = p.get("run")
    return "-" if r is None else f"{r['wall_s']:.0f} s / {r['load_1m_mean']:.1f}"


def _dp(dp: dict | None) -> str:
    """The compiled DP-attention decode: temporaries and its collectives per step, or "-" (not compiled)."""
    if dp is None:
        return "-"
    ph = dp["modes"]["dp"]["phases"]["decode"]
    return f"{ph['memory']['temp'] / 1e9:.2f} GB; " + ", ".join(
        f"{c['count']} {c['kind']} {c['dtype']}{c['shape']}" for c in ph["collectives"] if c["bytes"] > 4096)


def rows(plans: list[dict], dps: list[dict | None] | None = None) -> list[str]:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    tp = [p["modes"]["tp"] for p in plans]
    dps = dps or [None] * len(plans)
    ph = lambda m, phase: m["phases"][phase]  # noqa: E731
    pool_copies = lambda m: sum(x["count"] for p in ("decode", "prefill") for x in ph(m, p)["moves"]  # noqa: E731
                                if x["of"].startswith("pool") and x["op"] in ("copy", "fusion"))
    table = [
        ("device (compiler's name), memory", lambda p, m: f"{p['device_kind']}, {p['spec']['memory_bytes'] / 1e9:.0f} GB"),
        ("decode: arguments (weights + pool: the plan's where its need is given) / temporaries / code",
         lambda p, m: " / ".join(gb(ph(m, "decode")["memory"][k]) for k in ("argument", "temp", "generated_code"))),
        ("prefill: arguments / temporaries / code",
         lambda p, m: " / ".join(gb(ph(m, "prefill")["memory"][k]) for k in ("argument", "temp", "generated_code"))),
        ("compiled layers (scaled to all) / compile s", lambda p, m: f"{ph(m, 'decode')['compiled_layers']} / "
         f"{ph(m, 'decode')['compile_s'] + ph(m, 'prefill')['compile_s']:.0f}"),
        ("decode collectives per step", lambda p, m: ", ".join(
            f"{c['count']} {c['kind']} {c['dtype']}{c['shape']}" for c in ph(m, "decode")["collectives"] if c["bytes"] > 4096)),
        ("pool copies per step (decode + prefill), weight / pool all-gathers", lambda p, m: f"{pool_copies(m)}, " + str(
            sum(x["count"] for q in ("decode", "prefill") for x in ph(m, q)["moves"] if x["op"] == "all-gather"))),
        ("hand-off import of one 8k request into the plan's pool: arguments / temp / aliased",
         lambda p, m: _handoff(m, "import")),
        ("hand-off export (128 BF16 pages -> FP8 chunk): arguments / temp / aliased",
         lambda p, m: _handoff(m, "export")),
        ("a chip's need, decode at the plan's pool / prefill (of memory less the 6 GB reserve)",
         lambda p, m: " / ".join(_need(p, ph(m, q)) for q in ("decode", "prefill"))),
        ("FP8 KV tokens, TP attention (6 GB reserve) / a token's bytes as laid out",
         lambda p, m: f"{m['kv_tokens']:,} / {m.get('kv_bytes_per_token_as_laid_out', '-')}"),
        ("plan wall time here (2 cores, niced) / host load: its `run` record (bench/plan_timed.py)", _run),
    ]
    dp_rows = [  # from the DP-attention plan where there is one (its compiled temporaries counted)
        ("FP8 KV tokens, DP attention", lambda p, d: f"{(d or p)['modes']['dp']['kv_tokens']:,}"),
        ("DP attention decode compiled (`--attention dp`): temporaries; collectives per step", lambda p, d: _dp(d)),
    ]
    out = []
    for name, f in [*table, *dp_rows]:
        cells = [f(p, d) for p, d in zip(plans, dps)] if (name, f) in dp_rows else [f(p, m) for p, m in zip(plans, tp)]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def _load(name: str) -> dict | None:
    path = RESULTS / f"plan_{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


if __name__ == "__main__":
    present = [c for c in COLUMNS if (RESULTS / f"plan_{c}.json").exists()]  # a v6e column once its plan compiled
    print("columns: " + ", ".join(present), file=sys.stderr)
    print("\n".join(rows([_load(c) for c in present], [_load(f"{c}_dp") for c in present])))
