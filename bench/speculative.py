"""Speculative decoding on the embedded model: tokens/s with and without drafts (n-gram or its MTP head), side by side
in one run.

Usage: python bench/speculative.py [--method ngram|mtp] [--reps N] [--concurrency 1,16] [--k 3] [--new-tokens 128] [--quick]
                                   [--grammar] [--unchained] [--max-rows N|none] [--json bench/results/speculative.json]

Workload: c requests at once, each a 64-token window of held-out stdlib text (the embedded model's own domain,
`jaxserve.eval.quality.heldout_tokens`), 128 new tokens, greedy, ignore_eos; the serving engine configuration
(`EngineConfig()` defaults: FP8 prefill weights, INT4 decode weights, FP8 KV, bf16; no prefix cache, so a
repeated pass prefills again and runs the shapes the untimed pass compiled). Two engines on the same
weights, one with `speculative="METHOD:K"`, each first runs the workload once untimed (its compiles), then the
timed passes alternate between them (plain, speculative, plain, ...), so a change in the shared host's load hits
both alike. A pass is timed from submit to the last token (prefill included): tokens/s = c * new_tokens / wall.
Reported per (c, k): median and min..max tokens/s of each side, the speed-up of the medians, the accept length
(tokens a row emits per verify step), the draft acceptance rate, whether the greedy outputs were identical, and
the host's load average at the start and end (the host may be shared with other work: read the spread with it).
--grammar: every request has a JSON-schema response format (GRAMMAR: a record with free-text fields, so its
length is the model's; tokens/s counts the tokens emitted): grammar rows' drafts are cut and extended by the
grammar and verified under its masks (engine.spec_grammar).
--unchained: a third engine, interleaved with the two, speculating with the same drafts but reading each verify
before building the next (n-gram verifies otherwise chain on the device, engine.spec_chain): the chain's own gain.
--max-rows: the speculative engines' `Speculative.max_rows` (default: the config's DEFAULT_MAX_ROWS, above which
they decode plainly); "none" speculates at every row count (where the crossover is measured).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from jaxserve.engine import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from jaxserve.engine.config import DEFAULT_MAX_ROWS, Speculative  # noqa: E402
from jaxserve.engine.structured import StructuredOutput, json_schema_output  # noqa: E402

CKPT = ROOT / "checkpoints" / "tiny-kimi"
OUT = ROOT / "bench" / "results" / "speculative.json"
PROMPT_LEN = 64
GRAMMAR = json_schema_output({"type": "object", "properties": {
    "name": {"type": "string"}, "module": {"type": "string"}, "summary": {"type": "string"},
    "arguments": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "type": {"type": "string"}, "default": {"type": "string"}},
        "required": ["name", "type", "default"]}}, "returns": {"type": "string"}},
    "required": ["name", "module", "summary", "arguments", "returns"]})


def prompts_for(engine: Engine, c: int, seed: int) -> list[list[int]]:
    """c distinct 64-token windows of held-out text."""
    from jaxserve.eval.quality import heldout_tokens

    stream = heldout_tokens(engine.tokenizer, 64 * PROMPT_LEN + 4096)
    step = (len(stream) - PROMPT_LEN) // 64
    return [stream[(seed * 7 + i) % 64 * step:][:PROMPT_LEN].tolist() for i in range(c)]


def timed(engine: Engine, prompts: list[list[int]], new_tokens: int, grammar: StructuredOutput | None = None
          ) -> tuple[float, list[list[int]], dict]:
    """One pass on a synchronous engine -> (wall seconds, each request's tokens, stats delta); with a grammar a
    request may end before new_tokens (its document is complete)."""
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True, structured=grammar)
    before = engine.stats()
    t0 = time.perf_counter()
    streams = [engine.submit(Request(p, sp)) for p in prompts]
    while engine.scheduler.has_work():
        engine.step()
    wall = time.perf_counter() - t0
    tokens = [[ev.token_id for ev in s if ev.token_id is not None] for s in streams]
    after = engine.stats()
    if grammar is None and any(len(t) != new_tokens for t in tokens):
        raise RuntimeError("a request ended early")
    return wall, tokens, {k: after[k] - before[k] for k in ("verify_rows", "draft_tokens", "accepted_tokens")}


def run(concurrency: list[int], ks: list[int], reps: int, new_tokens: int, method: str = "ngram",
        grammar: StructuredOutput | None = None, unchained: bool = False, max_rows: int | None = DEFAULT_MAX_ROWS
        ) -> dict:
    cfg = EngineConfig(prefix_cache=False)  # every pass prefills its prompt: the passes are alike
    plain = Engine.from_checkpoint(CKPT, cfg, start=False)
    rows = []
    for k in ks:
        spec = Engine.from_checkpoint(CKPT, replace(cfg, speculative=Speculative(method, k, max_rows)), start=False)
        sides = [("plain", plain), ("spec", spec)]
        if unchained:  # the same drafts, every verify read before the next is built (as before engine.spec_chain)
            unchained_cfg = replace(cfg, speculative=Speculative(method, k, max_rows))
            sides.append(("unchained", Engine.from_checkpoint(CKPT, unchained_cfg, start=False)))
            sides[-1][1].scheduler._speculation.chains = False
        for c in concurrency:
            prompts = prompts_for(plain, c, seed=c)
            for _, e in sides:
                timed(e, prompts, new_tokens, grammar)  # untimed: compiles this workload's shapes
            load0 = os.getloadavg()
            walls: dict[str, list[float]] = {name: [] for name, _ in sides}
            emitted: dict[str, int] = {}
            outs: dict[str, list] = {}
            acc = {"verify_rows": 0, "draft_tokens": 0, "accepted_tokens": 0}
            for _ in range(reps):
                for name, e in sides:
                    wall, toks, delta = timed(e, prompts, new_tokens, grammar)
                    walls[name].append(wall)
                    emitted[name] = sum(map(len, toks))
                    outs[name] = toks
                    if name == "spec":
                        acc = {key: acc[key] + delta[key] for key in acc}
            tps = {n: [emitted[n] / w for w in ws] for n, ws in walls.items()}
            sp_, pl = common.spread(tps["spec"]), common.spread(tps["plain"])
            extra = {"unchained_tokens_per_s": common.spread(tps["unchained"]),
                     "speedup_unchained": common.spread(tps["unchained"])["median"] / pl["median"]} if unchained else {}
            rows.append({
                "method": method, "c": c, "k": k, "max_rows": max_rows, "new_tokens": new_tokens,
                "prompt_len": PROMPT_LEN,
                "grammar": grammar is not None, "emitted_tokens": emitted["spec"],
                "plain_tokens_per_s": pl, "spec_tokens_per_s": sp_, "speedup": sp_["median"] / pl["median"],
                "accept_length": (acc["accepted_tokens"] + acc["verify_rows"]) / max(acc["verify_rows"], 1),
                "draft_acceptance": acc["accepted_tokens"] / max(acc["draft_tokens"], 1),
                "identical_requests": sum(a == b for a, b in zip(outs["plain"], outs["spec"])), "requests": c,
                "loadavg_start": load0, "loadavg_end": os.getloadavg(), **extra})
    return {"bench": "speculative", "machine": common.machine(), "engine_config": repr(cfg), "reps": reps,
            "note": f"embedded model, greedy, {method} drafts{', JSON-schema rows' if grammar else ''}; timed passes interleaved plain/spec; the host may be "
                    "shared with other processes (see the load averages)", "rows": rows}


def table(result: dict) -> str:
    lines = [f"{'c':>3} {'k':>2} {'plain tok/s (min..max)':>26} {'spec tok/s (min..max)':>26} {'x':>6} "
             f"{'acc.len':>7} {'drafts ok':>9} {'same':>6} {'load start->end':>16}"]
    for r in result["rows"]:
        p, s = r["plain_tokens_per_s"], r["spec_tokens_per_s"]
        lines.append(f"{r['c']:>3} {r['k']:>2} {p['median']:>8.1f} ({p['min']:.1f}..{p['max']:.1f})".ljust(34)
                     + f"{s['median']:>8.1f} ({s['min']:.1f}..{s['max']:.1f})".ljust(27)
                     + f"{r['speedup']:>6.2f} {r['accept_length']:>7.2f} {r['draft_acceptance']:>9.2f} "
                     f"{r['identical_requests']:>3}/{r['requests']:<2} "
                     f"{r['loadavg_start'][0]:>6.2f}->{r['loadavg_end'][0]:.2f}"
                     + (f"   unchained {r['unchained_tokens_per_s']['median']:.1f} tok/s ({r['speedup_unchained']:.2f}x)"
                        if "speedup_unchained" in r else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--method", default="ngram", choices=("ngram", "mtp"))
    ap.add_argument("--k", default="3")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="2 timed passes per side")
    ap.add_argument("--grammar", action="store_true", help="every request with the GRAMMAR JSON schema")
    ap.add_argument("--unchained", action="store_true", help="a third side: the same drafts without chained verifies")
    ap.add_argument("--max-rows", default=str(DEFAULT_MAX_ROWS), help='speculate up to N decoding rows ("none": always)')
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args()
    result = run([int(x) for x in args.concurrency.split(",")], [int(x) for x in args.k.split(",")],
                 2 if args.quick else args.reps, args.new_tokens, args.method, GRAMMAR if args.grammar else None,
                 args.unchained, None if args.max_rows == "none" else int(args.max_rows))
    return common.write_result(result, table(result), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
