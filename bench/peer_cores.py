"""jaxserve as `serve` runs it against llama.cpp on this CPU, side by side in one process (issue 33's peer goals).

Usage: python bench/peer_cores.py [--concurrency 1,16] [--new-tokens 128] [--reps 5] [--speculative ngram:3]
                                  [--pin] [--json bench/results/peer_cores.json]

Sides: "llama.cpp" (the embedded model exported to an f32 GGUF by the converter shipped with the pinned
llama-cpp-python, bench/peer_llamacpp.py: c sequences decoded in one batch per step, greedy), "jaxserve" (the engine
`jaxserve serve` builds with its default flags: `start_jax` picks the CPU layout and its XLA flags as serve does,
`engine_config` its EngineConfig; the prefix cache off, so every pass prefills), and "jaxserve+spec" (the same with
`--speculative`; above its max rows it decodes plainly, as serve does). Every side uses every core of the host
(llama.cpp: one thread per core; jaxserve: what `--cpu-layout auto` chooses); `--pin` pins the whole process to
one core instead (llama.cpp one thread, serve `--cpu-cores 1`). Workload: c requests at once, each a 64-token
window of held-out text (bench/speculative.py's prompts, the same for every side), `new_tokens` greedy tokens,
end of sequence ignored. Each side first runs the workload once untimed (its compiles), then the timed passes
alternate between the sides; a pass is timed from submit to the last token (prefill included). Reported per c:
tokens/s median (min..max) per side, the ratios of the medians, the speculative accept length, how many requests'
tokens equal plain jaxserve's and llama.cpp's, and the load average per repetition.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common, peer_llamacpp, speculative  # noqa: E402

OUT = ROOT / "bench" / "results" / "peer_cores.json"


def build_engines(cores: int, spec: str | None) -> dict:
    """{side: Engine} as `serve --cpu-cores cores [--speculative spec]` builds them (started as serve starts JAX)."""
    from jaxserve.cli import build_parser, default_checkpoint
    from jaxserve.engine import Engine
    from jaxserve.server.main import engine_config, start_jax

    def args(extra: list[str]) -> argparse.Namespace:
        return build_parser().parse_args(["serve", "--cpu-cores", str(cores), *extra])

    layout = start_jax(args([]))
    out = {"jaxserve": Engine.from_checkpoint(default_checkpoint(), replace(engine_config(args([]), layout),
                                                                            prefix_cache=False), start=False)}
    if spec:
        cfg = replace(engine_config(args(["--speculative", spec]), layout), prefix_cache=False)
        out["jaxserve+spec"] = Engine.from_checkpoint(default_checkpoint(), cfg, start=False)
    out["_layout"] = layout.name if layout is not None else None
    return out


def llama_side(td: Path, rows: list[int], context: int, threads: int) -> dict:
    """{c: LlamaCpp} on the embedded model's f32 HF export (one context per concurrency)."""
    import jax.numpy as jnp

    from jaxserve.checkpoint import load
    from jaxserve.cli import default_checkpoint
    from tools.train_tiny import ModelSize, export_hf, hf_config_dict

    export_hf(load(default_checkpoint(), dtype=jnp.float32)[1], hf_config_dict(ModelSize()), td / "hf")
    gguf = peer_llamacpp.export_gguf(td / "hf", td / "model-f32.gguf")
    return {c: peer_llamacpp.LlamaCpp(gguf, peer_llamacpp.LlamaCppConfig(rows=c, context=context, threads=threads))
            for c in rows}


def run(concurrency: list[int], new_tokens: int, reps: int, spec: str | None, pin: bool) -> dict:
    status = peer_llamacpp.status()
    if status != "ok":
        raise SystemExit(f"llama.cpp: {status}")
    if pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before any thread starts: they inherit it
    cores = len(os.sched_getaffinity(0))
    engines = build_engines(cores, spec)  # first: serve's CPU layout must be set before JAX's backend starts
    host = common.machine()
    layout = engines.pop("_layout")
    rows = []
    with tempfile.TemporaryDirectory() as td:
        llamas = llama_side(Path(td), concurrency, speculative.PROMPT_LEN + new_tokens, cores)
        for c in concurrency:
            prompts = speculative.prompts_for(engines["jaxserve"], c, seed=c)

            def call(side: str) -> tuple[float, list[list[int]], dict]:
                if side == "llama.cpp":
                    wall, toks = llamas[c].generate(np.array(prompts, np.int64), new_tokens)
                    return wall, toks.tolist(), {}
                return speculative.timed(engines[side], prompts, new_tokens)

            sides = ["llama.cpp", *engines]
            outs = {s: call(s)[1] for s in sides}  # untimed: compiles, and the tokens compared below
            walls: dict[str, list[float]] = {s: [] for s in sides}
            loads, acc = [], {"verify_rows": 0, "accepted_tokens": 0}
            for _ in range(reps):
                for s in sides:  # interleaved: the shared host's noise hits every side alike
                    wall, _, delta = call(s)
                    walls[s].append(wall)
                    if s == "jaxserve+spec":
                        acc = {k: acc[k] + delta[k] for k in acc}
                loads.append(os.getloadavg()[0])
            tps = {s: common.spread([c * new_tokens / w for w in ws]) for s, ws in walls.items()}
            med = {s: t["median"] for s, t in tps.items()}
            rows.append({"c": c, "new_tokens": new_tokens, "prompt_len": speculative.PROMPT_LEN,
                         "tokens_per_s": tps,
                         "over_llama_cpp": {s: med[s] / med["llama.cpp"] for s in engines},
                         "spec_over_plain": med["jaxserve+spec"] / med["jaxserve"] if spec else None,
                         "accept_length": (acc["accepted_tokens"] + acc["verify_rows"]) / acc["verify_rows"]
                         if acc["verify_rows"] else None,
                         "requests_equal_plain": {s: sum(a == b for a, b in zip(outs[s], outs["jaxserve"]))
                                                  for s in sides},
                         "requests": c, "loadavg_per_rep": loads})
        for m in llamas.values():
            m.close()
    return {"bench": "peer_cores", "machine": host, "cores": cores, "pinned": pin, "cpu_layout": layout,
            "speculative": spec, "reps": reps, "llama_cpp_version": peer_llamacpp.VERSION,
            "loadavg_at_end": os.getloadavg(), "rows": rows,
            "note": "tokens/s = c * new_tokens / wall of one pass (prefill included); medians (min..max) of "
                    "interleaved passes after an untimed one per side; llama.cpp f32 GGUF, jaxserve serve's "
                    "defaults (FP8 prefill / INT4 decode weights, FP8 KV, bf16) without the prefix cache"}


def table(r: dict) -> str:
    lines = [f"{r['cores']} core(s){' (pinned)' if r['pinned'] else ''}, jaxserve CPU layout {r['cpu_layout']}, "
             f"speculative {r['speculative']}  (tokens/s median (min..max))"]
    for row in r["rows"]:
        cells = ", ".join(f"{s} {t['median']:.0f} ({t['min']:.0f}..{t['max']:.0f})"
                          for s, t in row["tokens_per_s"].items())
        ratios = ", ".join(f"{s}/llama.cpp {v:.2f}x" for s, v in row["over_llama_cpp"].items())
        extra = f", spec/plain {row['spec_over_plain']:.2f}x" if row["spec_over_plain"] else ""
        extra += f", accept {row['accept_length']:.2f}" if row["accept_length"] else ""
        loads = row["loadavg_per_rep"]
        lines.append(f"  c = {row['c']}: {cells}; {ratios}{extra}; load {min(loads):.1f}-{max(loads):.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,16", help="comma-separated request counts")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--speculative", default="ngram:3", help="the third side's `serve --speculative` ('' for none)")
    ap.add_argument("--pin", action="store_true", help="pin the process to one core (every side one core)")
    ap.add_argument("--json", dest="json_out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    result = run([int(c) for c in args.concurrency.split(",")], args.new_tokens, args.reps,
                 args.speculative or None, args.pin)
    args.json_out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
