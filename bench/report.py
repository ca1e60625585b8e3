"""Gather bench/results/*.json into bench/results/REPORT.md, with the seeds' figures (FACTS.md) beside ours.

Usage: python bench/report.py [--results DIR] [--out REPORT.md]

Each known bench JSON gets a section (a missing one is listed as not run); unknown JSON files are listed by name.
The machine is described from the results themselves (each bench records CPU, cores and load average).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

SEEDS_KV = {"concurrency": [1, 8, 16, 32, 64], "bf16": [137, 731, 1106, 1558, None], "fp8": [125, 689, 1028, None, 2192]}
SEEDS_W = {"concurrency": [1, 8, 16, 32, 64], "fp8": [60, 425, 683, 994, 1672], "int4": [92, 513, 825, 1267, 1933]}


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _oom(x: float | None) -> str:
    return "out of memory" if x is None else f"{x:g}"


def machine_section(results: dict[str, dict]) -> list[str]:
    seen = {}
    for name, r in results.items():
        m = r.get("machine")
        if isinstance(m, dict):
            seen[name] = m
    lines = ["## Machine", ""]
    if not seen:
        return lines + ["(no bench recorded its machine)", ""]
    first = next(iter(seen.values()))
    lines.append(f"- CPU: {first.get('cpu', '?')}, {first.get('cores', '?')} cores visible, JAX backend "
                 f"{first.get('backend', 'cpu')}; no GPU was lent to this task.")
    lines.append("- The host may be shared with other sessions; load average at each bench's start: "
                 + ", ".join(f"{n} {m['loadavg_at_start'][0]:.1f}" for n, m in seen.items()
                             if m.get("loadavg_at_start")) + " (on 2 cores).")
    lines.append("- So every tokens/s below is a CPU figure with run-to-run noise of tens of percent; ratios were "
                 "measured side by side, interleaved, medians. They are not H200 predictions.")
    return lines + [""]


def kv_section(r: dict) -> list[str]:
    b = r["budget"]
    lines = ["## FP8 vs BF16 KV under one memory budget (`bench/kv_dtype_concurrency.py`)", "",
             f"Model: {r['model']}. Budget {b['bytes']} bytes of KV pages: BF16 {b['num_decode_pages']['bf16']} pages "
             f"({b['bytes_per_token']['bf16']} B/token), FP8 {b['num_decode_pages']['fp8']} pages "
             f"({b['bytes_per_token']['fp8']} B/token incl. the f32 scale). Sequences of "
             f"{r['spec']['prompt_len']} + {r['spec']['new_tokens']} tokens: BF16 admits "
             f"{b['max_concurrency_admitted']['bf16']}, FP8 admits {b['max_concurrency_admitted']['fp8']}.", "",
             "| concurrency | ours BF16 | ours FP8 | ours FP8/BF16 | seeds BF16 | seeds FP8 |", "|---|---|---|---|---|---|"]
    seeds = dict(zip(SEEDS_KV["concurrency"], zip(SEEDS_KV["bf16"], SEEDS_KV["fp8"])))
    for row in r["rows"]:
        c = row["concurrency"]

        def cell(x: dict) -> str:
            if x["status"] == "ok":
                return _f(x["tokens_per_s"])
            o = x["over_budget_run"]
            return (f"out of memory (run anyway: {o['tokens_per_s']:.0f} tok/s, {o['peak_decoding']} decoding at "
                    f"most, {o['preemptions']} preemptions)")

        sb, sf = seeds.get(c, (None, None))
        lines.append(f"| {c} | {cell(row['bf16'])} | {cell(row['fp8'])} | {_f(row.get('fp8_over_bf16'), 3)} | "
                     f"{_oom(sb) if c in seeds else '-'} | {('n/a' if sf is None else sf) if c in seeds else '-'} |")
    p = r["peak_ratio_fp8_over_bf16"]
    lines += ["", f"Peak throughput FP8/BF16 (best admitted cell each): ours {_f(p, 3)}, seeds {2192 / 1558:.3f}.",
              "What this says: the capacity side is exact (pages are bytes; FP8 holds "
              f"{b['num_decode_pages']['fp8'] / b['num_decode_pages']['bf16']:.2f}x the tokens). What it does not: "
              "on CPU a decode step is compute/overhead-bound, so tokens/s stops growing well before 64 rows and "
              "the extra admitted rows do not turn into the seeds' +41%; on an H200 decode is memory-bound and "
              "larger batches amortize the weight reads (see the roofline).", ""]
    return lines


def weights_section(r: dict) -> list[str]:
    lines = ["## INT4 vs FP8 weights (`bench/weight_formats.py`)", "",
             "| concurrency | ours FP8 | ours INT4 | ours INT4/FP8 | seeds FP8 | seeds INT4 | seeds INT4/FP8 |",
             "|---|---|---|---|---|---|---|"]
    seeds = dict(zip(SEEDS_W["concurrency"], zip(SEEDS_W["fp8"], SEEDS_W["int4"])))
    for d in r["speed"]["decode"]:
        c = d["concurrency"]
        sf, si = seeds.get(c, (None, None))
        lines.append(f"| {c} | {_f(d['fp8_tokens_per_s'])} | {_f(d['int4_tokens_per_s'])} | {_f(d['int4_over_fp8'], 3)} |"
                     f" {_f(sf, 0)} | {_f(si, 0)} | {_f(si / sf if sf else None, 3)} |")
    p = r["speed"]["prefill"]
    k = r["bytes"]["kimi_k2.6_routed_experts"]
    lines += ["", f"Prefill tokens/s: ours FP8 {_f(p['fp8_tokens_per_s'])}, INT4 {_f(p['int4_tokens_per_s'])} "
              f"(INT4/FP8 {_f(p['int4_over_fp8'], 3)}); seeds 10,160 vs 8,660 (0.852).",
              f"Kimi K2.6 routed experts INT4 g32 / FP8 bytes: {k['int4_g32_over_fp8']:.3f} (seeds' whole checkpoint: "
              "421/705 = 0.597).", ""]
    return lines


def integrity_section(r: dict) -> list[str]:
    lines = ["## KV page integrity cost (`bench/integrity_overhead.py`)", "",
             "| batch | tok/s on | tok/s off | on/off | cost % | check alone % of step |", "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['batch']} | {_f(row['tokens_per_s_on'])} | {_f(row['tokens_per_s_off'])} | "
                     f"{row['median_ratio']:.4f} | {row['cost_pct']:.2f} | {row['check_alone_pct_of_step']:.3f} |")
    return lines + ["", "Seeds: -0.38% to -0.79% throughput, p95 latency +0.42% to +0.80% (upper bound ~1%).", ""]


def capacity_section(r: dict) -> list[str]:
    lines = ["## KV capacity (`bench/kv_capacity.py`)", "",
             "| model | B/token BF16 | B/token FP8 | tokens/GiB FP8 / BF16 |", "|---|---|---|---|"]
    for m in r["models"]:
        lines.append(f"| {m['model']} | {m['bf16_bytes_per_token']} | {m['fp8_bytes_per_token']} | {m['ratio']:.3f} |")
    return lines + ["", "Seeds: ~686k -> ~1.37M tokens in the same deployment (2.00x).", ""]


def quality_section(r: dict) -> list[str]:
    lines = ["## Quality of the formats (`jaxserve eval-quality`, held-out stdlib text)", "",
             "| pair | ppl a | ppl b | mean KL | top-1 agreement |", "|---|---|---|---|---|"]
    for p in r["pairs"]:
        lines.append(f"| {p['label']} | {p['ppl_a']:.2f} | {p['ppl_b']:.2f} | {p['mean_kl']:.5f} | "
                     f"{p['top1_agreement']:.4f} |")
    lines += ["", "Greedy decoding through the engine, identical tokens vs all-BF16: " +
              ", ".join(f"{g['b']} {g['identical_fraction']:.3f} ({g['n_tokens']} tokens)" for g in r["greedy"]),
              "", "Seeds (FP8 vs BF16 KV; FP8 vs INT4 weights): benchmark scores within ~1 point (e.g. GSM8K "
              "94.24 / 94.09, MMLU 86.60 / 86.54).", ""]
    return lines


def flop_bounds_section(r: dict) -> list[str]:
    c1, c2 = r["decode_contexts"]
    t1, t2 = r["prefill_lengths"]
    f = r["matmul_flops_per_token"]
    lines = ["## What the context goals allow (`bench/flop_bounds.py`)", "",
             f"Per token the embedded model's matmuls do {f['all'] / 1e6:.2f} MFLOP ({f['lm_head'] / 1e6:.2f} of them "
             "lm_head); attention adds a fixed amount per (query, context token) pair. At equal FLOP rates:", "",
             f"| attention form | FLOP/pair | decode step {c2} / {c1} | attention rate the 1.5x goal needs | "
             f"prefill tok/s {t2} / {t1} | attention rate the 0.8x goal needs |", "|---|---|---|---|---|---|"]
    for form, b in r["bounds"].items():
        lines.append(f"| {form} | {b['attention_flops_per_pair']:,} | {b['decode_step_ratio']:.3f} | "
                     f"<= {b['decode_goal_needs_attention_rate_at_most']:.2f}x the matmuls' | "
                     f"{b['prefill_tok_s_ratio']:.3f} | >= {b['prefill_goal_needs_attention_rate_at_least']:.2f}x |")
    m = r.get("measured")
    if m:
        rate = r["bounds"]["absorbed"].get("measured_attention_rate", {})
        lines += ["", "Measured (" + m["source"] + "): decode program " +
                  ", ".join(f"batch {b} {v:.2f}" for b, v in m["decode_program_ratio"].items()) +
                  f"; prefill {m.get('prefill_tok_s_ratio', float('nan')):.2f}. The programs use the absorbed form; "
                  "read through it, attention runs at " +
                  ", ".join(f"{v:.2f}x (decode, batch {b})" for b, v in rate.get("decode", {}).items()) +
                  (f", {rate['prefill']:.2f}x (prefill)" if rate.get("prefill") else "") + " the matmuls' FLOP rate."]
        goals = r["goals"]
        dec = m["decode_program_ratio"]
        met = [b for b, v in dec.items() if v >= goals["decode_step_ratio"]]
        pre = m.get("prefill_tok_s_ratio")
        missed = [b for b in dec if b not in met]
        lines += ["", f"Against the goals: decode >= {goals['decode_step_ratio']} "
                      + "; ".join(([f"met at batch {', '.join(met)}"] if met else [])
                                  + ([f"not met at batch {', '.join(missed)}"] if missed else []))
                      + f"; prefill >= {goals['prefill_tok_s_ratio']} "
                      + ("not measured" if pre is None else ("met" if pre >= goals["prefill_tok_s_ratio"] else "not met"))
                      + ". A decode ratio above the equal-rate bound means attention runs slower per FLOP than the "
                        "matmuls: as the batch grows the weight matmuls amortize over more rows, while each row's "
                        "attention stays a matrix-vector product over its own pages."]
    return lines + [""]


def serving_section(r: dict) -> list[str]:
    s = r["summary"]
    lines = ["## HTTP serving (`bench/serving.py`)", "",
             f"{r['served_model']} behind `jaxserve serve` (waitress), {r['mode']}, prompt "
             f"{r['spec']['prompt_len']} / output {r['spec']['output_len']} tokens (uniform), source "
             f"{r['spec']['source']}, streaming. {s['completed']}/{s['planned']} completed, {s['errors']} errors, "
             f"{s['not_sent_by_deadline']} not sent by the deadline, {s['duration_s']:.1f} s.", "",
             f"Output {s['output_tokens_per_s']:.1f} tokens/s, {s['request_throughput_per_s']:.2f} requests/s.", "",
             "| ms | mean | p50 | p95 | p99 |", "|---|---|---|---|---|"]
    for k in ("ttft", "itl", "tpot", "e2e_latency"):
        d = s[k]
        lines.append(f"| {k.upper()} | {_f(d['mean_ms'])} | {_f(d['p50_ms'])} | {_f(d['p95_ms'])} | {_f(d['p99_ms'])} |")
    return lines + ["", "The load generator and the server share the same 2 busy cores, so latencies include "
                    "contention with the client itself.", ""]


def serving_pd_section(r: dict) -> list[str]:
    def cell(d: dict | None) -> str:
        return "-" if d is None else f"{d['median']:.0f} [{d['min']:.0f}..{d['max']:.0f}]"

    cols = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    lines = ["## Prefill and decode servers vs one `--role both` server (`bench/serving.py --pd`)", "",
             *[f"- {name}: {desc}" for name, desc in r["layouts"].items()],
             f"- {r['spec']['reps']} interleaved reps, median [min..max]; load {r['loadavg_start']} -> "
             f"{r['loadavg_end']} on {r['machine']['cores']} cores", "",
             "| layout | pass | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for lay, kinds in r["summary"].items():
        lines += [f"| {lay} | {kind} | " + " | ".join(cell(d[c]) for c in cols) + f" | {d['errors']} |"
                  for kind, d in kinds.items()]
    lines.append("")
    for lay, i in r["interference"].items():
        ratio = "-" if i["ratio"] is None else f"{i['ratio']:.2f}x"
        lines.append(f"- {lay}: short streams' ITL p99 beside {r['spec']['long_prompt_len']}-token prompts / "
                     f"without = {ratio} (goal <= {i['goal']}x: {'met' if i['goal_met'] else 'not met'})")
    return lines + ["", r["notes"] + ".", ""]


def peer_section(r: dict) -> list[str]:
    lines = ["## Peer: transformers generate() and llama.cpp vs jaxserve Engine (`bench/peer_transformers.py`)", "",
             f"Model: {r['model']}; prompt {r['spec']['prompt_len']}, {r['spec']['new_tokens']} new tokens, greedy.",
             "", "| concurrency | HF tok/s | llama.cpp | jaxserve f32 | jaxserve serving | f32/HF | serving/HF | "
                 "serving/llama.cpp | greedy agreement f32 (rows equal, token match) | serving | llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        t, q, a = row["tokens_per_s"], row["jaxserve_over_hf"], row["agreement_vs_hf"]
        ql = row.get("jaxserve_over_llama_cpp")
        ql = ql if isinstance(ql, dict) else {}  # a status string when llama.cpp did not run
        ag = lambda k: f"{a[k]['rows_equal']}/{a[k]['rows']}, {a[k]['token_match']:.2f}" if k in a else "-"  # noqa: E731
        lines.append(f"| {row['concurrency']} | {_f(t['hf'])} | {_f(t.get('llama.cpp'))} | {_f(t.get('f32'))} | "
                     f"{_f(t.get('serving'))} | {_f(q.get('f32'), 2)} | {_f(q.get('serving'), 2)} | "
                     f"{_f(ql.get('serving'), 2)} | {ag('f32')} | {ag('serving')} | {ag('llama.cpp')} |")
    lc = r.get("llama_cpp", {"status": "not in this result"})
    lines += ["", "Configs: " + "; ".join(f"{k}: {v}" for k, v in r["configs"].items()) + ".",
              f"llama.cpp: {lc['status']}" + (f", {lc['threads']} threads" if "threads" in lc else "") + ".", ""]
    if "context_rows" in r:
        ctx = sorted({row["context"] for row in r["context_rows"]})
        ms = {(row["batch"], row["context"]): row["decode_program_s"]["median"] * 1e3 for row in r["context_rows"]}
        lines += ["| decode program, " + r["context_config"] + " | batch | " +
                  " | ".join(f"ms at context {c}" for c in ctx) + f" | {ctx[-1]} / {ctx[0]} |",
                  "|---|---|" + "---|" * (len(ctx) + 1)]
        for b in sorted({row["batch"] for row in r["context_rows"]}):
            lines.append(f"| | {b} | " + " | ".join(_f(ms.get((b, c)), 2) for c in ctx) + " | " +
                         (_f(ms[b, ctx[-1]] / ms[b, ctx[0]], 2) if (b, ctx[0]) in ms and (b, ctx[-1]) in ms
                          else "-") + " |")
        lines.append("")
    if "prefill" in r:
        pf = r["prefill"]
        lines += [f"Prefill ({pf['config']}, one prompt, chunks of {pf['prefill_chunk']}): " + ", ".join(
            f"{row['prompt_len']} tokens {_f(row['tokens_per_s'])} tok/s" for row in pf["rows"])
            + f"; longest / shortest {_f(pf['longest_over_shortest'], 2)}.", ""]
    return lines


def roofline_section(r: dict) -> list[str]:
    bw = r["bandwidth_bytes_per_s"]
    lines = ["## Decode roofline (`bench/roofline.py`)", "",
             f"Measured bandwidth here: reduce {bw['reduce_read'] / 1e9:.1f} GB/s, copy {bw['copy_read_write'] / 1e9:.1f}"
             " GB/s (bound uses the larger).", "",
             "| tiny: format | batch | bytes/step (activated) | bound us | decode program us | engine step us | "
             "program / bound | predicted us (compiled roofline) | program / predicted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in r["tiny"]["rows"]:
        a, p = row["activated"], row.get("predicted")  # predicted: older results have none
        lines.append(f"| {row['format']} | {row['batch']} | {a['total'] / 1e6:.3f} MB | {a['bound_s'] * 1e6:.1f} | "
                     f"{row['program_s'] * 1e6:.1f} | {row['engine_step_s'] * 1e6:.1f} | "
                     f"{a['program_over_bound']:.1f} | {_f(p and p['predicted_s'] * 1e6, 1)} | "
                     f"{_f(row.get('measured_over_predicted'), 1)} |")
    lines += ["", "| Kimi K2.6, FP8 KV, ctx 8192: weights | batch | GB/step (activated) | GB/step (all experts) | "
                  "bound ms, 8xH200 | seeds ms/step | seeds / bound |", "|---|---|---|---|---|---|---|"]
    for row in r["kimi_k2.6"]["rows"]:
        if row["kv_dtype"] != "fp8":
            continue
        lines.append(f"| {row['weights']} | {row['batch']} | {row['activated']['total'] / 1e9:.1f} | "
                     f"{row['all_total'] / 1e9:.1f} | {row['bound_s_8xH200_tp'] * 1e3:.3f} | "
                     f"{_f(row.get('seeds_step_s', None) and row['seeds_step_s'] * 1e3, 2)} | "
                     f"{_f(row.get('seeds_step_over_8xH200_bound'), 1)} |")
    return lines + ["", r["kimi_k2.6"]["note"] + ".", "",
                    "The tiny model's step is ~MBs: on CPU it is far from the bandwidth bound (per-op and host "
                    "overhead dominate), so the ratio says nothing about an H200, where a Kimi step reads tens to "
                    "hundreds of GB and the bound is what batching and INT4/FP8 move.", ""]


SECTIONS: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "kv_dtype_concurrency": ("kv_dtype_concurrency.json", kv_section),
    "weight_formats": ("weight_formats.json", weights_section),
    "integrity_overhead": ("integrity_overhead.json", integrity_section),
    "kv_capacity": ("kv_capacity.json", capacity_section),
    "serving": ("serving.json", serving_section),
    "serving_pd": ("serving_pd.json", serving_pd_section),
    "peer_transformers": ("peer_transformers.json", peer_section),
    "roofline": ("roofline.json", roofline_section),
    "quality": ("quality.json", quality_section),
    "flop_bounds": ("flop_bounds.json", flop_bounds_section),
}


def build(results_dir: Path) -> str:
    results = {}
    for name, (fname, _) in SECTIONS.items():
        p = results_dir / fname
        if p.exists():
            results[name] = json.loads(p.read_text())
    lines = ["# jaxserve benchmark report", "",
             "Generated by `python bench/report.py` from `bench/results/*.json`. Seeds' figures are the provider's "
             "own (SGLang, H200, disaggregated prefill/decode; see FACTS.md); ours ran on this CPU host.", ""]
    lines += machine_section(results)
    for name, (fname, fn) in SECTIONS.items():
        if name in results:
            try:
                lines += fn(results[name])
            except (KeyError, TypeError, ZeroDivisionError) as e:  # an older schema: say so, keep the report
                lines += [f"## {name}", "", f"({fname} has an unexpected schema: {e!r})", ""]
        else:
            lines += [f"## {name}", "", f"(not run: {fname} absent)", ""]
    known = {f for f, _ in SECTIONS.values()}
    other = sorted(p.name for p in results_dir.glob("*.json") if p.name not in known)
    if other:
        lines += ["## Other result files", "", *[f"- {o}" for o in other], ""]
    lines += ["## What the CPU numbers do and do not say about an H200", "",
              "- Do: byte counts (KV bytes/token, pages per budget, admitted concurrency, weight bytes per format, "
              "bytes per decode step) are exact and carry over; so do correctness properties (greedy agreement, "
              "no preemption within budget, zero errors under load).",
              "- Do not: tokens/s, TTFT/ITL and the FP8/BF16 or INT4/FP8 speed ratios. On CPU there are no Pallas "
              "kernels, FP8/INT4 are dequantized by XLA ops, a tiny model's step is overhead-bound, and the host was "
              "shared. On an H200 a Kimi K2.6 decode step is memory-bound (tens of GB per step), so FP8 KV's extra "
              "admitted rows and INT4's smaller reads become throughput; that is what `bench/gpu.sh` would measure.",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=None, help="default: RESULTS/REPORT.md")
    args = ap.parse_args(argv)
    out = args.out or args.results / "REPORT.md"
    out.write_text(build(args.results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
