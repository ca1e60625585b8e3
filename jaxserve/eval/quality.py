"""`jaxserve eval-quality CKPT`: how much the serving formats (FP8 / INT4 weights, FP8 KV) change the model.

Teacher-forced, on held-out text (`jaxserve.eval.corpus` held-out split, tokenized, cut into fixed non-overlapping
windows): every window goes through the paged prefill over a page pool of the given KV dtype (over an FP8 pool,
attention reads exactly the FP8 KV that decode reads), giving next-token log-probs for each format. Pairs are
compared by perplexity, mean KL(a || b) of the next-token distributions (a is the reference) and top-1 agreement.

Free-running, through the real Engine: greedy continuations of a few held-out prompts under two engine configs
(e.g. BF16 KV vs FP8 KV), scored by the fraction of identical tokens.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.eval import corpus
from jaxserve.cache import init_pages
from jaxserve.checkpoint import load, load_formats
from jaxserve.engine import Engine, EngineConfig, SamplingParams
from jaxserve.engine.layouts import kv_layout
from jaxserve.errors import ConfigError
from jaxserve.models import CausalLM
from jaxserve.models.paged import PrefillBatch, prefill
from jaxserve.quant.apply import quantize_model
from jaxserve.quant.weight_format import WeightFormat
from jaxserve.tokenizer import Tokenizer


# ------------------------------------------------------------------------------------------------ held-out data


def heldout_tokens(tokenizer: Tokenizer, n_tokens: int) -> np.ndarray:
    """The first `n_tokens` of the held-out stream `[eos] doc0 [eos] doc1 ...` (corpus.heldout_files() order)
    -> int32 [n_tokens]. Raises ConfigError if the held-out split is shorter."""
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
    out: list[int] = []
    for text in corpus.read_texts(corpus.heldout_files()):
        out.append(eos)
        out.extend(tokenizer.encode(text))
        if len(out) >= n_tokens:
            return np.asarray(out[:n_tokens], np.int32)
    raise ConfigError(f"the held-out split has only {len(out)} tokens", value=n_tokens, param="tokens")


def make_windows(tokens: np.ndarray, window: int) -> np.ndarray:
    """tokens [N] -> non-overlapping windows [N // (window + 1), window + 1] int32 (inputs [:, :-1], targets
    [:, 1:]); a trailing partial window is dropped."""
    if window < 1:
        raise ConfigError(f"window must be >= 1, got {window}", value=window, param="window")
    n = len(tokens) // (window + 1)
    if n == 0:
        raise ConfigError(f"{len(tokens)} tokens do not fill one window of {window + 1}", value=len(tokens),
                          param="tokens")
    return np.asarray(tokens[: n * (window + 1)], np.int32).reshape(n, window + 1)


# ---------------------------------------------------------------------------------------- teacher-forced logits


@nnx.jit(static_argnames=("kv_dtype", "page_size", "index_dtype"))
def _window_logprobs(model: CausalLM, tokens: jax.Array, kv_dtype: str, page_size: int,
                     index_dtype: str | None = None) -> jax.Array:
    """tokens [B, T] int32 -> next-token log-probs [B, T, V] f32 via the paged prefill over a fresh pool of
    `kv_dtype` pages (row b owns pages 1 + b*M .. (b+1)*M; page 0 is the null page); GLM-5 DSA indexer keys in
    `index_dtype` (None: kv_dtype)."""
    B, T = tokens.shape
    M = -(-T // page_size)
    pages = init_pages(kv_layout(model.cfg, page_size, kv_dtype, index_dtype), 1 + B * M)
    bt = 1 + jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    slots = jnp.take_along_axis(bt, pos // page_size, axis=1) * page_size + pos % page_size
    full = jnp.full((B,), T, jnp.int32)
    logits, _, _ = prefill(model, pages, PrefillBatch(tokens, pos, slots, bt, full, full), all_logits=True)
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def logprobs(model: CausalLM, windows: np.ndarray, kv_dtype: str = "bf16", *, batch_size: int = 8,
             page_size: int = 16, progress: bool = False, index_dtype: str | None = None) -> np.ndarray:
    """windows [W, T+1] int32 -> log-probs [W, T, V] f32 of each input position's next token (batches padded
    to one compiled shape)."""
    x = windows[:, :-1]
    out = []
    for i in tqdm(range(0, len(x), batch_size), desc=f"logprobs kv={kv_dtype}", leave=False, disable=not progress):
        xb = x[i:i + batch_size]
        pad = batch_size - len(xb)
        lp = _window_logprobs(model, jnp.asarray(np.pad(xb, ((0, pad), (0, 0)))), kv_dtype, page_size, index_dtype)
        out.append(np.asarray(lp[:len(xb)]))
    return np.concatenate(out)


def compare_logprobs(lp_a: np.ndarray, lp_b: np.ndarray, windows: np.ndarray) -> dict[str, float]:
    """Reference log-probs lp_a vs candidate lp_b (both [W, T, V] f32), targets windows[:, 1:] ->
    {ppl_a, ppl_b, mean_kl (nats, KL(a || b) per token), max_kl, top1_agreement, n_tokens}."""
    y = windows[:, 1:]
    nll_a = -np.take_along_axis(lp_a, y[..., None], axis=-1)[..., 0]
    nll_b = -np.take_along_axis(lp_b, y[..., None], axis=-1)[..., 0]
    kl = (np.exp(lp_a) * (lp_a - lp_b)).sum(-1)
    agree = lp_a.argmax(-1) == lp_b.argmax(-1)
    return {"ppl_a": float(math.exp(nll_a.mean())), "ppl_b": float(math.exp(nll_b.mean())),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "top1_agreement": float(agree.mean()),
            "n_tokens": int(y.size)}


def compare(model_a: CausalLM, model_b: CausalLM, windows: np.ndarray, kv_a: str = "bf16", kv_b: str = "bf16", *,
            batch_size: int = 8, index_b: str | None = None) -> dict[str, float]:
    """Teacher-forced comparison of (model_a, KV kv_a), the reference, with (model_b, KV kv_b; GLM-5 indexer keys
    index_b, None: as kv_b) on windows [W, T+1] int32 -> compare_logprobs' dict."""
    return compare_logprobs(logprobs(model_a, windows, kv_a, batch_size=batch_size),
                            logprobs(model_b, windows, kv_b, batch_size=batch_size, index_dtype=index_b), windows)


# ------------------------------------------------------------------------------------------- engine, free-running


def engine_greedy(model: CausalLM, cfg: EngineConfig, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations (max_tokens each, eos ignored) of token-id prompts through a synchronous Engine."""
    engine = Engine(model, cfg, start=False)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for o in outs:
        if o.error is not None:
            raise o.error
    return [o.token_ids for o in outs]


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Positionwise identical-token fraction of two sets of continuations, and the mean fraction of each
    continuation before the first divergence (after it, the two are conditioned on different text)."""
    same = [x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    prefix = []
    for ra, rb in zip(a, b, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra))
        prefix.append(k / max(len(ra), 1))
    return {"identical_fraction": float(np.mean(same)), "prefix_fraction": float(np.mean(prefix)),
            "n_tokens": len(same)}


def small_engine_config(kv_dtype: str, prefill_weights: str, decode_weights: str, group_size: int = 32,
                        max_model_len: int = 256) -> EngineConfig:
    """An EngineConfig sized for a few short prompts (small pools, short context)."""
    return EngineConfig(kv_dtype=kv_dtype, prefill_weights=prefill_weights, decode_weights=decode_weights,
                        int4_group_size=group_size, num_decode_pages=128, num_prefill_pages=128,
                        max_model_len=max_model_len, max_batch=8, max_prefill_tokens=256, prefill_chunk=256)


# ------------------------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class QualitySpec:
    """tokens: held-out tokens scored teacher-forced; window: predictions per window; prompts x new_tokens:
    greedy engine runs (prompt_len tokens each); group_size: INT4 group."""

    tokens: int = 8192
    window: int = 256
    prompts: int = 4
    prompt_len: int = 32
    new_tokens: int = 32
    group_size: int = 32
    batch_size: int = 8


# (name, weights, kv) configurations scored teacher-forced, and the pairs compared (reference first)
# "int4_mlps": INT4 on every MLP projection (int4_scope "mlps"), beside the routed-experts-only default
CONFIGS = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "bf16"), "int4": ("int4", "bf16"),
           "int4_mlps": ("int4_mlps", "bf16"), "bf16+fp8kv": ("bf16", "fp8"), "int4+fp8kv": ("int4", "fp8")}
PAIRS = (("bf16", "fp8", "BF16 vs FP8 weights"), ("fp8", "int4", "FP8 vs INT4 weights"),
         ("bf16", "int4", "BF16 vs INT4 weights"),
         ("bf16", "int4_mlps", "BF16 vs INT4, all MLPs"), ("bf16", "bf16+fp8kv", "BF16 vs FP8 KV"),
         ("bf16", "int4+fp8kv", "BF16 vs decode (INT4 + FP8 KV)"))


def format_models(checkpoint: str | Path, group_size: int) -> dict[str, CausalLM]:
    """{"bf16", "fp8", "int4", "int4_mlps"} -> model: the checkpoint's stored format when it has one (a `jaxserve
    quantize` output), else quantize_model of its BF16 weights; "int4_mlps" is always quantized here."""
    have = load_formats(checkpoint)
    _, base = load(checkpoint)
    out = {"bf16": base}
    for fmt in ("fp8", "int4"):
        out[fmt] = load(checkpoint, weights=fmt)[1] if fmt in have else \
            quantize_model(base, WeightFormat(fmt, group_size))
    out["int4_mlps"] = quantize_model(base, WeightFormat("int4", group_size, int4_scope="mlps"))
    return out


def evaluate(checkpoint: str | Path, spec: QualitySpec = QualitySpec(), *, progress: bool = True) -> dict:
    """The full report (JSON-ready): teacher-forced metrics per config and per pair, greedy engine agreement."""
    tokenizer = Tokenizer(checkpoint)
    models = format_models(checkpoint, spec.group_size)
    n_windows = -(-spec.tokens // spec.window)
    windows = make_windows(heldout_tokens(tokenizer, n_windows * (spec.window + 1)), spec.window)
    lps = {name: logprobs(models[w], windows, kv, batch_size=spec.batch_size, progress=progress)
           for name, (w, kv) in tqdm(CONFIGS.items(), desc="teacher-forced configs", disable=not progress)}
    pairs = [{"a": a, "b": b, "label": label, **compare_logprobs(lps[a], lps[b], windows)} for a, b, label in PAIRS]
    del lps
    stream = heldout_tokens(tokenizer, spec.tokens)
    step = len(stream) // spec.prompts
    prompts = [stream[i * step: i * step + spec.prompt_len].tolist() for i in range(spec.prompts)]
    engine_cfgs = {"bf16": small_engine_config("bf16", "bf16", "bf16"),
                   "bf16+fp8kv": small_engine_config("fp8", "bf16", "bf16"),
                   "fp8+int4+fp8kv": small_engine_config("fp8", "fp8", "int4", spec.group_size)}
    runs = {name: engine_greedy(models["bf16"], c, prompts, spec.new_tokens)
            for name, c in tqdm(engine_cfgs.items(), desc="engine greedy runs", disable=not progress)}
    greedy = [{"a": "bf16", "b": b, **greedy_agreement(runs["bf16"], runs[b])} for b in ("bf16+fp8kv",
                                                                                      "fp8+int4+fp8kv")]
    return {"checkpoint": str(checkpoint), "backend": jax.default_backend(), "spec": asdict(spec),
            "n_windows": int(len(windows)), "configs": {k: {"weights": w, "kv": kv} for k, (w, kv) in CONFIGS.items()},
            "pairs": pairs, "greedy": greedy,
            "notes": "teacher-forced via paged prefill (an FP8 pool reads the FP8 KV decode reads); KL(a||b) in "
                     "nats/token with a the reference; greedy = engine runs, eos ignored, engine configs named "
                     "prefill-weights+decode-weights+kv (bf16: all BF16)"}


def report_table(report: dict) -> str:
    """The report as a text table."""
    lines = [f"{'pair':<34}{'ppl a':>11}{'ppl b':>11}{'mean KL':>10}{'max KL':>9}{'top-1':>8}"]
    for p in report["pairs"]:
        lines.append(f"{p['label']:<34}{p['ppl_a']:>11.4f}{p['ppl_b']:>11.4f}{p['mean_kl']:>10.5f}"
                     f"{p['max_kl']:>9.4f}{p['top1_agreement']:>8.4f}")
    lines.append(f"{'engine greedy (vs all-BF16)':<34}{'identical':>12}{'before 1st diff':>17}")
    for g in report["greedy"]:
        lines.append(f"{g['b']:<34}{g['identical_fraction']:>12.4f}{g['prefix_fraction']:>17.4f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", default=None, help="jaxserve checkpoint (default: the embedded model)")
    p.add_argument("--tokens", type=int, default=QualitySpec.tokens, help="held-out tokens scored teacher-forced")
    p.add_argument("--window", type=int, default=QualitySpec.window)
    p.add_argument("--prompts", type=int, default=QualitySpec.prompts)
    p.add_argument("--new-tokens", type=int, default=QualitySpec.new_tokens)
    p.add_argument("--group-size", type=int, default=QualitySpec.group_size)
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")


def run(args: argparse.Namespace) -> int:
    from jaxserve.cli import default_checkpoint

    ckpt = args.checkpoint or default_checkpoint()
    spec = QualitySpec(tokens=args.tokens, window=args.window, prompts=args.prompts, new_tokens=args.new_tokens,
                       group_size=args.group_size)
    report = evaluate(ckpt, spec)
    print(report_table(report))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json_out}")
    return 0
