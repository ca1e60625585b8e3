"""Decode tokens/s vs concurrency, BF16 vs FP8 KV pages, under the SAME KV memory budget (bytes).

Usage: python bench/kv_dtype_concurrency.py [--quick | --smoke] [--checkpoint DIR] --json OUT.json

The seeds' table (FACTS.md): at equal concurrency FP8 KV is a few % slower (dequant on read), but in the same
memory it holds ~2x the tokens, so BF16 runs out of memory at 64 concurrent requests where FP8 does not, and FP8's
peak throughput is +41%. Here: one budget in bytes, sized so BF16 pages hold `budget_seqs` sequences of the
workload (prompt + new tokens), fewer than the largest concurrency; each dtype gets
num_decode_pages = budget // (page_size * KVLayout.bytes_per_token). "Admits c" means c sequences can decode to
their full length at once without preemption (pages: 1 null page + c * ceil((prompt + new) / page_size)); a cell
beyond that is "out of memory". That cell is still run once on the BF16 engine (it queues and preempts instead of
failing) and its tokens/s, peak concurrent decoders and preemptions are recorded beside it.
Timed runs alternate bf16, fp8, bf16, ... after a warm-up on the exact workload; tokens/s counts only steps after
every request finished prefill (pure decode steps, host scheduling included), median of the runs.
On CPU these are CPU figures (XLA, no Pallas kernels): the dequant cost and the memory-bound regime of an H200
are not reproduced; the capacity side (what each budget admits) is exact.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from jaxserve.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxserve.engine.layouts import kv_layout  # noqa: E402
from jaxserve.engine.request import Request, Status  # noqa: E402
from jaxserve.models import CausalLM  # noqa: E402

DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class BenchSpec:
    """concurrency: decode rows per run; prompt_len + new_tokens: each sequence's length; budget_seqs: how many
    such sequences the BF16 pages of the budget hold (the byte budget follows); reps: timed runs per dtype."""

    concurrency: tuple[int, ...] = (1, 8, 16, 32, 64)
    prompt_len: int = 48
    new_tokens: int = 32
    budget_seqs: int = 48
    page_size: int = 16
    reps: int = 3


QUICK = BenchSpec(concurrency=(1, 16, 32), prompt_len=32, new_tokens=16, budget_seqs=24, reps=2)
SMOKE = BenchSpec(concurrency=(1, 4), prompt_len=16, new_tokens=4, budget_seqs=3, reps=1)



def bench_model(checkpoint: Path | None) -> tuple[str, CausalLM]:
    """The checkpoint's model (default checkpoints/tiny-kimi), or, absent, a random model of its architecture."""
    from flax import nnx

    from jaxserve.checkpoint import load
    from jaxserve.cli import default_checkpoint

    ckpt = checkpoint or default_checkpoint()
    if (ckpt / "jaxserve.json").exists():
        return str(ckpt.name), load(ckpt)[1]
    if checkpoint is not None:
        load(checkpoint)  # raises the typed CheckpointError naming what is missing
    from tools.train_tiny import ModelSize, hf_config_dict
    from jaxserve.config import from_hf_config

    cfg = from_hf_config(hf_config_dict(ModelSize()))
    return "random tiny-kimi architecture (checkpoints/tiny-kimi absent)", CausalLM(cfg, rngs=nnx.Rngs(0))


def page_bytes(model: CausalLM, dtype: str, page_size: int) -> int:
    return page_size * kv_layout(model.cfg, page_size, dtype).bytes_per_token()


def pages_per_seq(spec: BenchSpec) -> int:
    return -(-(spec.prompt_len + spec.new_tokens) // spec.page_size)


def budget_bytes(model: CausalLM, spec: BenchSpec) -> int:
    """Bytes of BF16 pages for budget_seqs full sequences plus the reserved null page."""
    return (1 + spec.budget_seqs * pages_per_seq(spec)) * page_bytes(model, "bf16", spec.page_size)


def engine_config(dtype: str, num_pages: int, spec: BenchSpec) -> EngineConfig:
    """Same weights (FP8 prefill, INT4 decode: the serving default), only the KV dtype and page count differ."""
    on_gpu = jax.default_backend() != "cpu"
    rows = max(spec.concurrency)
    return EngineConfig(kv_dtype=dtype, prefill_weights="fp8", decode_weights="int4", page_size=spec.page_size,
                        num_decode_pages=num_pages, num_prefill_pages=rows * pages_per_seq(spec) + 8,
                        max_batch=rows, max_prefill_tokens=512, prefill_chunk=256, max_model_len=256,
                        prefix_cache=False, use_kernels=on_gpu, attention="pallas" if on_gpu else "xla")


def prompts_for(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Deterministic, distinct token-id prompts [rows][length]."""
    return np.random.default_rng(seed).integers(1, vocab, size=(rows, length)).tolist()


@dataclass(frozen=True)
class Run:
    """One run: pure-decode tokens/s, most sequences decoding at once, preemptions during the run."""

    tokens_per_s: float
    peak_decoding: int
    preemptions: int


def timed_decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> Run:
    """Step the engine by hand until all prompts finish. The clock runs from the first step at which nobody is
    waiting or prefilling (in an over-budget run that never happens before some finish: then it runs from the
    first decode step and includes the queued requests' prefills, as a server would)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    pre0 = engine.stats()["preemptions"]
    gen0 = engine.stats()["generated_tokens"]
    for p in prompts:
        engine.submit(Request(p, params))
    sched = engine.scheduler
    peak = 0
    while sched.has_work() and (sched.pending() or sched.waiting
                                or any(s.status is not Status.DECODING for s in sched.running)):
        engine.step()
        peak = max(peak, sum(s.status is Status.DECODING for s in sched.running))
        if sched.waiting and peak > 0 and all(s.status is Status.DECODING for s in sched.running):
            break  # over budget: the rest wait for pages; time from here
    before = engine.stats()["generated_tokens"]
    t0 = time.perf_counter()
    while sched.has_work():
        engine.step()
        peak = max(peak, sum(s.status is Status.DECODING for s in sched.running))
    dt = time.perf_counter() - t0
    made = engine.stats()["generated_tokens"] - before
    if engine.stats()["generated_tokens"] - gen0 < len(prompts) * new_tokens:
        raise RuntimeError("a request did not finish its tokens")
    return Run(made / dt, peak, engine.stats()["preemptions"] - pre0)


def run(spec: BenchSpec, checkpoint: Path | None, progress: bool = True) -> dict:
    name, model = bench_model(checkpoint)
    budget = budget_bytes(model, spec)
    per_seq = pages_per_seq(spec)
    pb = {d: page_bytes(model, d, spec.page_size) for d in DTYPES}
    num_pages = {d: budget // pb[d] for d in DTYPES}
    admits = {d: (num_pages[d] - 1) // per_seq for d in DTYPES}
    engines = {d: Engine(model, engine_config(d, num_pages[d], spec), start=False) for d in DTYPES}
    vocab = model.cfg.vocab_size
    rows = []
    for c in tqdm(spec.concurrency, desc="concurrency", disable=not progress):
        prompts = prompts_for(c, spec.prompt_len, vocab, seed=c)
        fits = {d: c <= admits[d] for d in DTYPES}
        live = [d for d in DTYPES if fits[d]]
        for d in live:
            timed_decode(engines[d], prompts, spec.new_tokens)  # warm-up: compiles this workload's buckets
        runs: dict[str, list[Run]] = {d: [] for d in live}
        for _ in range(spec.reps):
            for d in live:
                runs[d].append(timed_decode(engines[d], prompts, spec.new_tokens))
        row: dict = {"concurrency": c}
        for d in DTYPES:
            if fits[d]:
                rs = runs[d]
                row[d] = {"status": "ok", "tokens_per_s": statistics.median(r.tokens_per_s for r in rs),
                          "runs": [r.tokens_per_s for r in rs], "peak_decoding": max(r.peak_decoding for r in rs),
                          "preemptions": sum(r.preemptions for r in rs)}
            else:
                timed_decode(engines[d], prompts, spec.new_tokens)  # warm-up of the over-budget shapes
                r = timed_decode(engines[d], prompts, spec.new_tokens)
                row[d] = {"status": "out of memory", "tokens_per_s": None,
                          "over_budget_run": {"tokens_per_s": r.tokens_per_s, "peak_decoding": r.peak_decoding,
                                              "preemptions": r.preemptions}}
        if fits["bf16"] and fits["fp8"]:
            row["fp8_over_bf16"] = row["fp8"]["tokens_per_s"] / row["bf16"]["tokens_per_s"]
        rows.append(row)
    peak = {d: max((r[d]["tokens_per_s"] for r in rows if r[d]["status"] == "ok"), default=None) for d in DTYPES}
    return {
        "bench": "kv_dtype_concurrency", "model": name, "machine": common.machine(),
        "cpu_figures": jax.default_backend() == "cpu", "spec": asdict(spec),
        "budget": {"bytes": budget, "page_bytes": pb,
                   "bytes_per_token": {d: pb[d] // spec.page_size for d in DTYPES},
                   "num_decode_pages": num_pages, "pages_per_seq": per_seq, "max_concurrency_admitted": admits},
        "rows": rows,
        "peak_tokens_per_s": peak,
        "peak_ratio_fp8_over_bf16": peak["fp8"] / peak["bf16"] if peak["fp8"] and peak["bf16"] else None,
        "seeds": {"concurrency": [1, 8, 16, 32, 64], "bf16": [137, 731, 1106, 1558, None],
                  "fp8": [125, 689, 1028, None, 2192], "peak_ratio": 2192 / 1558},
        "notes": "medians of interleaved timed runs after warm-up; "
                 + ("CPU figures (XLA on shared host cores, no Pallas kernels): not GPU predictions"
                    if jax.default_backend() == "cpu" else "GPU figures with Pallas kernels"),
    }


def table(r: dict) -> str:
    b = r["budget"]
    lines = [f"model: {r['model']}",
             f"KV budget {b['bytes'] / 2**20:.3f} MiB: pages bf16 {b['num_decode_pages']['bf16']}, fp8 "
             f"{b['num_decode_pages']['fp8']} ({b['bytes_per_token']['bf16']} / {b['bytes_per_token']['fp8']} B/token);"
             f" admits bf16 {b['max_concurrency_admitted']['bf16']}, fp8 {b['max_concurrency_admitted']['fp8']} "
             f"sequences of {r['spec']['prompt_len'] + r['spec']['new_tokens']} tokens",
             f"decode tokens/s ({'CPU' if r['cpu_figures'] else r['machine']['backend']}):",
             f"  {'concurrency':>11} {'bf16':>14} {'fp8':>14} {'fp8/bf16':>9}"]

    def cell(x: dict) -> str:
        if x["status"] == "ok":
            return f"{x['tokens_per_s']:.1f}"
        o = x["over_budget_run"]
        return f"OOM ({o['tokens_per_s']:.0f}*)"

    for row in r["rows"]:
        ratio = f"{row['fp8_over_bf16']:.3f}" if "fp8_over_bf16" in row else "-"
        lines.append(f"  {row['concurrency']:>11} {cell(row['bf16']):>14} {cell(row['fp8']):>14} {ratio:>9}")
    p = r["peak_ratio_fp8_over_bf16"]
    lines.append(f"peak fp8/bf16: {p:.3f} (seeds 1.407)" if p else "peak fp8/bf16: n/a")
    lines.append("  * OOM: beyond what the budget admits; the number is that run anyway, queued and preempted")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="3 concurrencies, short sequences (1-2 minutes)")
    mode.add_argument("--smoke", action="store_true", help="2 tiny concurrencies (CI schema check)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="jaxserve checkpoint (default: checkpoints/tiny-kimi)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="override the concurrency set")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    spec = SMOKE if args.smoke else QUICK if args.quick else BenchSpec()
    if args.concurrency:
        spec = replace(spec, concurrency=tuple(args.concurrency))
    r = run(spec, args.checkpoint)
    return common.write_result(r, table(r), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
