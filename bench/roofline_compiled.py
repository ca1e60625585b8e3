"""Decode roofline from the compiled step (issue 30 item 4): a model's real decode program compiled for a chip on
compile-only devices (as `jaxserve plan --target`: a few layers, scaled), at each concurrency, and per device and
step its minimum bytes, the bytes it moves outside the kernels, its collectives, and the predicted step time and
tokens/s at the chip's bandwidths (jaxserve/roofline.py), beside the seeds' measured decode tokens/s. A BOUND, NOT
A MEASUREMENT: no device ran anything.

    JAX_PLATFORMS=cpu .venv-aot/bin/python bench/roofline_compiled.py --preset kimi-k2.6 --target h200 \\
        --json bench/results/roofline_h200_kimi_k26.json    # and --preset glm-5.2 ... roofline_h200_glm_52.json
    .venv/bin/python bench/roofline_compiled.py --readme     # README's table from those two files
    .venv/bin/python bench/roofline_compiled.py --readme bench/results/roofline_v6e_*.json   # a TPU target's

The decode pool is compiled at the size `jaxserve plan` says fits (bench/results/plan_<target>_<model>.json, TP
attention), as a deployment holds it: a per-layer copy of the pool costs what it would there.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# FACTS.md: the seeds' measured decode tokens/s (H200, SGLang, disaggregated decode pool)
SEEDS: dict[str, dict] = {
    "kimi-k2.6": {"what": "Kimi K2.6, FP8 KV (weights' format and GPU count not stated)",
                  "tokens_per_s": {1: 125, 8: 689, 16: 1028, 32: None, 64: 2192}},
    "glm-5.2": {"what": "GLM-5.2, INT4 weights, 8-way tensor parallel",
                "tokens_per_s": {1: 92, 8: 513, 16: 825, 32: 1267, 64: 1933}},
}


def _pool_pages(model: str, target: str, page_size: int) -> int | None:
    f = RESULTS / f"plan_{target}_{model.replace('.', '').replace('-', '_')}.json"
    if not f.exists():
        return None
    return int(json.loads(f.read_text())["modes"]["tp"]["kv_tokens"]) // page_size


def run(model: str, target_name: str, devices: int, rows: tuple[int, ...], context: int, progress: bool) -> dict:
    from jaxserve.config import from_hf_config
    from jaxserve.models.build import shard_model
    from jaxserve.plan import PRESETS, PlanSpec, _abstract, _compile_target
    from jaxserve.plan_compile import decode_step_shape
    from jaxserve.roofline import Chip, roofline_row
    from jaxserve.sharding import Parallel, ShardingRules, make_mesh
    from jaxserve.targets import target, target_devices

    t = target(target_name)
    raw = PRESETS[model]
    cfg = from_hf_config(raw)
    par = Parallel(make_mesh(target_devices(t, devices), dp=1), ShardingRules.preset("tp"))
    spec = PlanSpec(devices=devices, memory_bytes=t.memory_bytes, target=target_name, decode_context=context)
    spec = replace(spec, pool_pages=_pool_pages(model, target_name, spec.page_size))
    shape = decode_step_shape(cfg, shard_model(_abstract(cfg, spec.decode_weights, spec), par), par)
    chip = Chip(t.name, t.hbm_bytes_per_s, t.link_bytes_per_s, t.bandwidth_source)
    machine = common.machine()  # its load at the start (taken after the compiles, it was the load at the end)
    out_rows = []
    for b in rows:
        t0 = time.perf_counter()
        r, layers = _compile_target(raw, cfg, spec.decode_weights, par, replace(spec, decode_rows=b), "decode")
        row = roofline_row(shape, b, context, r.traffic, r.collectives, chip, devices)
        row.update(compiled_layers=layers, compile_s=time.perf_counter() - t0, memory=r.memory,
                   seeds_tokens_per_s=SEEDS[model]["tokens_per_s"].get(b))
        out_rows.append(row)
        if progress:
            print(f"{model} {target_name} rows {b}: {row['predicted']['serial_tokens_per_s']:.0f} tok/s bound, "
                  f"outside/minimum {row['outside_over_minimum']:.2f} ({row['compile_s']:.0f} s)", file=sys.stderr)
    return {"bench": "roofline_compiled", "label": "bound, not a measurement", "model": model,
            "target": target_name, "devices": devices, "context": context, "machine": machine,
            "spec": asdict(spec), "step_shape": asdict(shape), "seeds": SEEDS[model]["what"], "rows": out_rows,
            "notes": "per device and step; minimum = weights read (routed experts touched under uniform routing) + "
                     "KV of the live context (FP8) + new KV rows + residual stream; outside = bytes the compiled "
                     "HLO moves outside the Pallas kernels and XLA matmuls (weight reads excluded: they are in the "
                     "minimum); serial = (minimum + outside + XLA matmuls' activation bytes) / HBM + collectives / "
                     "link; overlapped = max of the two; ideal = minimum / HBM, collectives overlapped"}


def table(r: dict) -> str:
    lines = [f"{r['model']} decode on {r['devices']} x {r['target']}, {r['context']} context, per device: "
             f"BOUND, NOT A MEASUREMENT (seeds: {r['seeds']})",
             f"{'rows':>4} {'min GB':>7} {'outside GB':>10} {'out/min':>7} {'coll MB':>8} {'ideal tok/s':>11} "
             f"{'serial tok/s':>12} {'seeds tok/s':>11}"]
    for w in r["rows"]:
        p, seed = w["predicted"], w["seeds_tokens_per_s"]
        lines.append(f"{w['rows']:>4} {w['minimum_bytes']['total'] / 1e9:>7.2f} "
                     f"{w['traffic_bytes']['outside'] / 1e9:>10.2f} {w['outside_over_minimum']:>7.2f} "
                     f"{p['collective_bytes'] / 1e6:>8.1f} {p['ideal_tokens_per_s']:>11.0f} "
                     f"{p['serial_tokens_per_s']:>12.0f} {seed if seed is not None else 'n/a':>11}")
    lines.append("largest outside-kernel traffic at the highest concurrency (op, what, result, count x MB):")
    for o in r["rows"][-1]["offenders"]:
        lines.append(f"  {o['op']:<14} {o['what']:<40} {o['result'][:44]:<44} {o['count']:>4} x "
                     f"{o['bytes_each'] / 1e6:9.2f} = {o['bytes'] / 1e9:6.2f} GB")
    return "\n".join(lines)


def readme_rows(results: list[dict]) -> list[str]:
    """README's markdown table: per model, the bounds as compiled and at the minimum, beside the seeds' measured."""
    head = results[0]
    lines = [f"| {head['devices']} x {head['target'].upper()}, {head['context'] // 1024}k context, decode tokens/s "
             "(BOUND, NOT A MEASUREMENT) | " + " | ".join(f"c = {w['rows']}" for w in head["rows"]) + " |",
             "|---|" + "---|" * len(head["rows"])]
    fmt = lambda x: "n/a" if x is None else f"{x:,.0f}"  # noqa: E731
    for r in results:
        name = {"kimi-k2.6": "Kimi K2.6", "glm-5.2": "GLM-5.2"}.get(r["model"], r["model"])
        table = [("seeds, measured", lambda w: fmt(w["seeds_tokens_per_s"])),
                 ("bound as compiled (serial)", lambda w: fmt(w["predicted"]["serial_tokens_per_s"])),
                 ("bound as compiled, less its largest offender", lambda w: fmt(w["rows"] / (
                     w["predicted"]["serial_s"] - w["offenders"][0]["bytes"] / w["chip"]["hbm_bytes_per_s"]))),
                 ("bound at the minimum bytes", lambda w: fmt(w["predicted"]["ideal_tokens_per_s"])),
                 ("minimum GB / step / device", lambda w: f"{w['minimum_bytes']['total'] / 1e9:.2f}"),
                 ("outside-kernel GB (/ minimum)", lambda w: f"{w['traffic_bytes']['outside'] / 1e9:.2f} "
                                                             f"({w['outside_over_minimum']:.2f})"),
                 ("weights read outside the kernels / dense weights", lambda w: f"{w['weights_read_over_dense']:.2f}")]
        lines += [f"| {name}: {label} | " + " | ".join(f(w) for w in r["rows"]) + " |" for label, f in table]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2.6", choices=sorted(SEEDS))
    ap.add_argument("--target", default="h200")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64], help="concurrencies")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--json", dest="json_out", type=Path, help="where to write the result")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--readme", type=Path, nargs="*", help="print README's table from these result files (one "
                    "target; none: bench/results/roofline_h200_*)")
    args = ap.parse_args(argv)
    if args.readme is not None:
        files = args.readme or [RESULTS / f"roofline_h200_{m}.json" for m in ("kimi_k26", "glm_52")]
        print("\n".join(readme_rows([json.loads(f.read_text()) for f in files])))
        return 0
    if args.json_out is None:
        ap.error("--json is required")
    r = run(args.preset, args.target, args.devices, tuple(args.rows), args.context, not args.no_progress)
    r["command"] = "JAX_PLATFORMS=cpu .venv-aot/bin/python bench/roofline_compiled.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    return common.write_result(r, table(r), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
