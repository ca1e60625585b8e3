"""FLOP bounds on the context goals of the speed issue: the best ratio any implementation of a model could show.

A decode step of one row at context c does F + A * c FLOPs: F the per-token matmuls (every weight matrix a token
multiplies, routed experts counted at top-k / n_experts, lm_head included; the embedding is a gather), A the
attention FLOPs per (query, context token) pair summed over layers. A prefill of T tokens does
T * (F - lm_head) + lm_head + A * T (T + 1) / 2 (causal pairs, logits for the last token only). If attention ran
at the same FLOP rate as the matmuls, the step-time and tokens/s ratios the goals ask for would be these; a
larger measured ratio would need attention to run *slower* per FLOP than the rest.

F is counted from the loaded model's parameter shapes, A from its config, for the form the programs use (MLA
absorbed: scores over r + dr latent columns, values over r) and for the plain form (MLA expanded through kv_b,
each context token expanded once) beside it. The measured ratios come from bench/results/peer_transformers.json
when present.

Usage: python bench/flop_bounds.py [--checkpoint checkpoints/tiny-kimi] [--json bench/results/flop_bounds.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxserve  # noqa: E402
from bench import common  # noqa: E402
from jaxserve.config import ModelConfig  # noqa: E402

DECODE_CONTEXTS = (1030, 2000)  # the goal: decode step at 2000 vs 1030 tokens of context >= 1.5x
PREFILL_LENGTHS = (256, 2000)  # the goal: prefill tok/s at 2000 >= 0.8x its value at 256


def matmul_flops(model: object) -> dict[str, int]:
    """Per-token matmul FLOPs from the parameter tree: {"all": incl. lm_head, "lm_head": its share}."""
    cfg = model.cfg
    total, head = 0, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        key = jax.tree_util.keystr(path)
        if leaf.ndim < 2 or "['embed']" in key:  # norms, biases; the embedding is a row gather
            continue
        n = leaf.size
        if "['experts']" in key:  # a stack [E, ...]: a token runs top-k of them
            n = n * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += 2 * n
        if "lm_head" in key:
            head += 2 * n
    return {"all": total, "lm_head": head}


def attention_flops_per_pair(cfg: ModelConfig, form: str) -> int:
    """FLOPs of one (query, context token) pair over all layers: scores + weighted values, per head."""
    if cfg.has_indexer:
        raise ValueError(f"{cfg.model_type}: DSA attention reads a top-k selection, not the context; not modelled")
    if cfg.is_mla:
        if form == "absorbed":
            per = 2 * cfg.num_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * cfg.num_heads * cfg.kv_lora_rank
        elif form == "plain":
            per = 2 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) + 2 * cfg.num_heads * cfg.v_head_dim
        else:
            raise ValueError(f"unknown attention form {form!r}: absorbed | plain")
    else:
        per = 4 * cfg.num_heads * cfg.head_dim
    return per * cfg.num_layers


def bounds(cfg: ModelConfig, flops: dict[str, int], form: str, seen: dict | None) -> dict:
    """The ideal ratios at equal FLOP rates, for one attention form; with `seen` (`measured`), the attention rate
    its ratios imply."""
    a = attention_flops_per_pair(cfg, form)
    f, head = flops["all"], flops["lm_head"]
    c1, c2 = DECODE_CONTEXTS
    t1, t2 = PREFILL_LENGTHS

    def prefill_per_token(t: int) -> float:
        return ((f - head) * t + head + a * t * (t + 1) / 2) / t

    def decode_rate(ratio: float) -> float:
        """Attention's FLOP rate relative to the matmuls' that gives this step-time ratio (solve
        (1 + c2 v) / (1 + c1 v) = ratio for v = (a / rate_a) / (f / rate_f))."""
        return (a / f) * (c2 - ratio * c1) / (ratio - 1)

    def prefill_rate(ratio: float) -> float:
        """The same for a prefill tokens/s ratio (tok/s at t2 over tok/s at t1)."""
        g1, g2 = (f - head) + head / t1, (f - head) + head / t2
        return a * (ratio * (t2 + 1) - (t1 + 1)) / (2 * (g1 - ratio * g2))

    out = {"attention_flops_per_pair": a,
           "decode_goal_needs_attention_rate_at_most": decode_rate(1.5),
           "prefill_goal_needs_attention_rate_at_least": prefill_rate(0.8),
            "decode_flops_per_row": {str(c1): f + a * c1, str(c2): f + a * c2},
            "decode_step_ratio": (f + a * c2) / (f + a * c1),
            "prefill_flops_per_token": {str(t1): prefill_per_token(t1), str(t2): prefill_per_token(t2)},
            "prefill_tok_s_ratio": prefill_per_token(t1) / prefill_per_token(t2)}
    if seen:
        out["measured_attention_rate"] = {
            "decode": {k: decode_rate(v) for k, v in seen["decode_program_ratio"].items() if v > 1},
            "prefill": prefill_rate(seen["prefill_tok_s_ratio"]) if "prefill_tok_s_ratio" in seen else None}
    return out


def measured(peer: Path) -> dict | None:
    """The ratios the peer bench measured (decode program at each batch; prefill tokens/s), if it ran."""
    if not peer.exists():
        return None
    r = json.loads(peer.read_text())
    out: dict = {"source": str(peer.relative_to(ROOT)), "decode_program_ratio": {}}
    rows = {(x["batch"], x["context"]): x["decode_program_s"]["median"] for x in r.get("context_rows", [])}
    c1, c2 = DECODE_CONTEXTS
    for b in sorted({b for b, _ in rows}):
        if (b, c1) in rows and (b, c2) in rows:
            out["decode_program_ratio"][str(b)] = rows[b, c2] / rows[b, c1]
    if r.get("prefill"):
        out["prefill_tok_s_ratio"] = r["prefill"]["longest_over_shortest"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "tiny-kimi")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "flop_bounds.json")
    args = ap.parse_args(argv)
    cfg, model = jaxserve.load(args.checkpoint, mtp=False)  # a plain decode step: the MTP head runs only to draft
    flops = matmul_flops(model)
    forms = ("absorbed", "plain") if cfg.is_mla else ("gqa",)
    m = measured(ROOT / "bench" / "results" / "peer_transformers.json")
    result = {"checkpoint": str(args.checkpoint.resolve().relative_to(ROOT)) if args.checkpoint.resolve().is_relative_to(ROOT)
              else str(args.checkpoint), "machine": common.machine(),
              "matmul_flops_per_token": flops, "decode_contexts": DECODE_CONTEXTS, "prefill_lengths": PREFILL_LENGTHS,
              "goals": {"decode_step_ratio": 1.5, "prefill_tok_s_ratio": 0.8},
              "bounds": {form: bounds(cfg, flops, form, m) for form in forms}, "measured": m}
    c1, c2 = DECODE_CONTEXTS
    t1, t2 = PREFILL_LENGTHS
    lines = [f"per-token matmul FLOPs {flops['all'] / 1e6:.2f} M (lm_head {flops['lm_head'] / 1e6:.2f} M)",
             "ratios at equal FLOP rates; 'needs': attention's FLOP rate relative to the matmuls' that the goal takes",
             f"{'form':10} {'attn/pair':>10} {f'decode {c2}/{c1}':>16} {'needs':>8} "
             f"{f'prefill tok/s {t2}/{t1}':>24} {'needs':>8}"]
    for form, b in result["bounds"].items():
        lines.append(f"{form:10} {b['attention_flops_per_pair']:>10,} {b['decode_step_ratio']:>16.3f} "
                     f"{'<= ' + format(b['decode_goal_needs_attention_rate_at_most'], '.2f'):>8} "
                     f"{b['prefill_tok_s_ratio']:>24.3f} "
                     f"{'>= ' + format(b['prefill_goal_needs_attention_rate_at_least'], '.2f'):>8}")
    lines.append(f"{'goal':10} {'':>10} {'>= 1.5':>16} {'':>8} {'>= 0.8':>24}")
    if m:
        dec = ", ".join(f"b{b} {v:.2f}" for b, v in m["decode_program_ratio"].items())
        lines.append(f"measured ({m['source']}): decode {dec}; prefill {m.get('prefill_tok_s_ratio', float('nan')):.2f}")
    return common.write_result(result, "\n".join(lines), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
