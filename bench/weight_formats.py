"""Weight formats: bytes of FP8 vs INT4 weights, decode tokens/s INT4 vs FP8, prefill tokens/s FP8 vs INT4.

Usage: python bench/weight_formats.py [--quick] [--checkpoint DIR] --json OUT.json

Bytes: measured from the model's runtime arrays after quantize_model (packed weights + scales), and for Kimi K2.6's
routed experts computed from the runtime layouts' shapes (jax.eval_shape of formats.quantize: nothing allocated).
Speed: two Engines on the same model, one with FP8 and one with INT4 weights in both phases (KV FP8 in decode,
prefix cache off so repeats recompute), fed the same held-out-style prompts. Per concurrency c: both engines are
warmed up on the exact workload (every bucketed program compiled), then timed runs alternate fp8, int4, fp8, ...
Decode tokens/s counts only the steps after every request finished prefill (pure decode steps, host scheduling
included); prefill tokens/s times max_tokens=1 requests (the first token comes from the prefill program).
On CPU these are CPU figures (no Pallas kernels; INT4 is unpacked by XLA ops), not GPU predictions. On a GPU the
engines use the Pallas kernels (use_kernels=True, attention="pallas").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxserve.checkpoint import load  # noqa: E402
from jaxserve.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxserve.engine.request import Request, Status  # noqa: E402
from jaxserve.models import CausalLM  # noqa: E402
from jaxserve.quant import formats  # noqa: E402
from jaxserve.quant.apply import quantize_model, weight_bytes  # noqa: E402
from jaxserve.quant.weight_format import WeightFormat  # noqa: E402


@dataclass(frozen=True)
class ExpertShapes:
    """Routed-expert tensor shapes of a model: gate/up [E, hidden, inter], down [E, inter, hidden] per MoE layer."""

    name: str
    moe_layers: int
    experts: int
    hidden: int
    inter: int


# Kimi K2.6 (the Kimi K2 / DeepSeek-V3 backbone): 61 layers, first dense, 384 routed experts of 7168 -> 2048
KIMI_K26 = ExpertShapes("kimi-k2.6", moe_layers=60, experts=384, hidden=7168, inter=2048)


@dataclass(frozen=True)
class BenchSpec:
    """concurrency: decode rows; prompt_len/new_tokens: the decode workload; reps: timed runs per format;
    prefill_rows x prefill_len: the prefill workload."""

    concurrency: tuple[int, ...] = (1, 8, 16, 32, 64)
    prompt_len: int = 32
    new_tokens: int = 32
    reps: int = 3
    prefill_rows: int = 8
    prefill_len: int = 128
    group_size: int = 32


QUICK = BenchSpec(concurrency=(1, 8), prompt_len=16, new_tokens=8, reps=2, prefill_rows=4, prefill_len=32)


# ---------------------------------------------------------------------------------------------------- bytes


def analytic_expert_bytes(shapes: ExpertShapes, fmt: str, group_size: int = 32) -> int:
    """Bytes of all routed-expert weights (packed + scales) in runtime format `fmt`, from the layout's shapes."""
    def one(k: int, n: int) -> int:
        sds = jax.ShapeDtypeStruct((shapes.experts, k, n), jax.numpy.bfloat16)
        w, s = jax.eval_shape(lambda x: formats.quantize(x, fmt, group_size), sds)
        return formats.weight_bytes(w, s)

    per_layer = 2 * one(shapes.hidden, shapes.inter) + one(shapes.inter, shapes.hidden)
    return shapes.moe_layers * per_layer


def model_bytes(model: CausalLM, group_size: int) -> dict[str, dict[str, int]]:
    """{fmt: {total, experts}} bytes of the model's parameters in bf16 (as given), fp8 and int4."""
    out = {"bf16": {"total": weight_bytes(model), "experts": weight_bytes(model, experts_only=True)}}
    for fmt in ("fp8", "int4"):
        q = quantize_model(model, WeightFormat(fmt, group_size))
        out[fmt] = {"total": weight_bytes(q), "experts": weight_bytes(q, experts_only=True)}
    return out


# ---------------------------------------------------------------------------------------------------- speed


def engine_config(weights: str, spec: BenchSpec) -> EngineConfig:
    """One format in both phases; sized for the largest workload; Pallas kernels off CPU."""
    rows = max(max(spec.concurrency), spec.prefill_rows)
    on_gpu = jax.default_backend() != "cpu"
    pages = 2 * rows * (-(-(max(spec.prompt_len + spec.new_tokens, spec.prefill_len) + 1) // 16)) + 8
    return EngineConfig(kv_dtype="fp8", prefill_weights=weights, decode_weights=weights,
                        int4_group_size=spec.group_size, use_kernels=on_gpu, attention="pallas" if on_gpu else "xla",
                        num_decode_pages=pages, num_prefill_pages=pages, max_batch=rows,
                        max_prefill_tokens=max(512, spec.prefill_len), prefill_chunk=max(256, spec.prefill_len),
                        max_model_len=max(256, spec.prefill_len + 8), prefix_cache=False)


def prompts_for(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Deterministic token-id prompts [rows][length] (distinct per row)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(rows, length)).tolist()


def timed_decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """Run the prompts to completion stepping the engine by hand -> (seconds of pure-decode steps, tokens made in
    them). Timing starts once no request is waiting or prefilling."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.submit(Request(p, params))
    sched = engine.scheduler
    while sched.pending() or sched.waiting or any(s.status != Status.DECODING for s in sched.running):
        engine.step()
    seqs = list(sched.running)
    before = sum(len(s.generated) for s in seqs)
    t0 = time.perf_counter()
    while sched.has_work():
        engine.step()
    return time.perf_counter() - t0, sum(len(s.generated) for s in seqs) - before


def timed_prefill(engine: Engine, prompts: list[list[int]]) -> tuple[float, int]:
    """max_tokens=1 requests through generate -> (seconds, prompt tokens)."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    dt = time.perf_counter() - t0
    if any(o.error is not None for o in outs):
        raise next(o.error for o in outs if o.error is not None)
    return dt, sum(len(p) for p in prompts)


def speed(model: CausalLM, spec: BenchSpec, progress: bool = True) -> dict:
    """Decode tokens/s per concurrency and prefill tokens/s, FP8 vs INT4 weights, interleaved."""
    fmts = ("fp8", "int4")
    engines = {f: Engine(model, engine_config(f, spec), start=False) for f in fmts}
    vocab = model.cfg.vocab_size
    decode_rows = []
    for c in tqdm(spec.concurrency, desc="decode concurrency", disable=not progress):
        prompts = prompts_for(c, spec.prompt_len, vocab, seed=c)
        for f in fmts:
            timed_decode(engines[f], prompts, spec.new_tokens)  # warm-up: compiles every bucket of this workload
        runs: dict[str, list[float]] = {f: [] for f in fmts}
        for _ in range(spec.reps):
            for f in fmts:
                dt, n = timed_decode(engines[f], prompts, spec.new_tokens)
                runs[f].append(n / dt)
        decode_rows.append({"concurrency": c, **{f"{f}_tokens_per_s": statistics.median(runs[f]) for f in fmts},
                            **{f"{f}_runs": runs[f] for f in fmts},
                            "int4_over_fp8": statistics.median(runs["int4"]) / statistics.median(runs["fp8"])})
    prompts = prompts_for(spec.prefill_rows, spec.prefill_len, vocab, seed=1000)
    for f in fmts:
        timed_prefill(engines[f], prompts)  # warm-up
    pruns: dict[str, list[float]] = {f: [] for f in fmts}
    for _ in range(spec.reps):
        for f in fmts:
            dt, n = timed_prefill(engines[f], prompts)
            pruns[f].append(n / dt)
    prefill = {"rows": spec.prefill_rows, "prompt_len": spec.prefill_len,
               **{f"{f}_tokens_per_s": statistics.median(pruns[f]) for f in fmts},
               **{f"{f}_runs": pruns[f] for f in fmts},
               "int4_over_fp8": statistics.median(pruns["int4"]) / statistics.median(pruns["fp8"])}
    return {"decode": decode_rows, "prefill": prefill}


# ------------------------------------------------------------------------------------------------------- main


def bench_model(checkpoint: Path | None) -> tuple[str, CausalLM]:
    """The checkpoint's model, or (none given and no embedded one) a random model of the tiny-kimi architecture."""
    from jaxserve.cli import default_checkpoint

    ckpt = checkpoint or default_checkpoint()
    if (ckpt / "jaxserve.json").exists():
        return str(ckpt), load(ckpt)[1]
    if checkpoint is not None:
        load(checkpoint)  # raises the typed CheckpointError naming what is missing
    from tools.train_tiny import ModelSize, hf_config_dict
    from jaxserve.config import from_hf_config

    cfg = from_hf_config(hf_config_dict(ModelSize()))
    return "random tiny-kimi architecture (checkpoints/tiny-kimi absent)", CausalLM(cfg, rngs=nnx.Rngs(0))


def run(spec: BenchSpec, checkpoint: Path | None, progress: bool = True) -> dict:
    load_start = os.getloadavg()  # the host is shared: record how busy it was around the timed runs
    name, model = bench_model(checkpoint)
    mb = model_bytes(model, spec.group_size)
    kimi = {f"int4_g{g}": analytic_expert_bytes(KIMI_K26, "int4", g) for g in (32, 64, 128)}
    kimi["fp8"] = analytic_expert_bytes(KIMI_K26, "fp8")
    kimi["bf16"] = analytic_expert_bytes(KIMI_K26, "bf16")
    bytes_ = {
        "model": {"name": name, **mb, "experts_int4_over_fp8": mb["int4"]["experts"] / mb["fp8"]["experts"],
                  "total_int4_over_fp8": mb["int4"]["total"] / mb["fp8"]["total"]},
        "kimi_k2.6_routed_experts": {"shapes": asdict(KIMI_K26), "bytes": kimi,
                                     **{f"int4_g{g}_over_fp8": kimi[f"int4_g{g}"] / kimi["fp8"] for g in (32, 64, 128)}},
        "goal_experts_int4_over_fp8": 0.53,
    }
    return {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()[:1]],
            "cpu_figures": jax.default_backend() == "cpu", "spec": asdict(spec), "bytes": bytes_,
            "speed": speed(model, spec, progress),
            "host_load_average_1_5_15min": {"start": list(load_start), "end": list(os.getloadavg()),
                                            "cpu_count": os.cpu_count()},
            "notes": "tokens/s are medians of the timed runs (all runs listed); "
                     + ("CPU figures: XLA on host cores, no Pallas kernels, not indicative of GPU speed"
                        if jax.default_backend() == "cpu" else "GPU figures with Pallas kernels")}


def table(r: dict) -> str:
    b = r["bytes"]
    m, k = b["model"], b["kimi_k2.6_routed_experts"]
    lines = [f"weights ({m['name']}): MiB total / experts",
             *[f"  {f:<5} {m[f]['total'] / 2**20:9.3f} / {m[f]['experts'] / 2**20:9.3f}" for f in ("bf16", "fp8", "int4")],
             f"  int4/fp8: total {m['total_int4_over_fp8']:.4f}, experts {m['experts_int4_over_fp8']:.4f} "
             f"(goal <= {b['goal_experts_int4_over_fp8']})",
             f"kimi-k2.6 routed experts GB: bf16 {k['bytes']['bf16'] / 1e9:.1f}, fp8 {k['bytes']['fp8'] / 1e9:.1f}, "
             + ", ".join(f"int4 g{g} {k['bytes'][f'int4_g{g}'] / 1e9:.1f} ({k[f'int4_g{g}_over_fp8']:.4f} of fp8)"
                         for g in (32, 64, 128)),
             f"decode tokens/s ({'CPU' if r['cpu_figures'] else r['backend']}):",
             f"  {'concurrency':>11} {'fp8':>10} {'int4':>10} {'int4/fp8':>9}"]
    for d in r["speed"]["decode"]:
        lines.append(f"  {d['concurrency']:>11} {d['fp8_tokens_per_s']:>10.1f} {d['int4_tokens_per_s']:>10.1f} "
                     f"{d['int4_over_fp8']:>9.3f}")
    p = r["speed"]["prefill"]
    lines.append(f"prefill tokens/s ({p['rows']} x {p['prompt_len']}): fp8 {p['fp8_tokens_per_s']:.1f}, "
                 f"int4 {p['int4_tokens_per_s']:.1f} (int4/fp8 {p['int4_over_fp8']:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 8, short prompts (about a minute)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="jaxserve checkpoint (default: checkpoints/tiny-kimi)")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="override the concurrency set")
    args = ap.parse_args(argv)
    spec = QUICK if args.quick else BenchSpec()
    if args.concurrency:
        spec = replace(spec, concurrency=tuple(args.concurrency))
    r = run(spec, args.checkpoint)
    print(table(r))
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(r, indent=1))
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
