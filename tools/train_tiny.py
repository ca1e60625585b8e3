"""Train the tiny DeepSeek-V3-architecture model shipped as `checkpoints/tiny-kimi`, export it as an HF folder.

    python -m tools.train_tiny OUT_HF_DIR --minutes 40 [--seed 0] [--steps N]
    python -m tools.train_tiny --evaluate CHECKPOINT_DIR     # converted checkpoint -> CHECKPOINT_DIR/eval.json
    python -m tools.train_tiny --repetition CHECKPOINT_DIR   # distinct-n of greedy 128-token completions (JSON)

The model is jaxserve's own `CausalLM` (MLA with q LoRA, sigmoid-routed MoE with score-correction bias, one
dense first layer), trained in float32 with AdamW (linear warmup + cosine) on the stdlib corpus train split
(`jaxserve.eval.corpus`), tokenized with `checkpoints/tiny-kimi-tokenizer`, documents joined with `<|endoftext|>`,
random fixed-length windows. Experts are balanced the DeepSeek-V3 aux-loss-free way: after each step every MoE
layer's `router_bias` moves by +/- `bias_rate` toward equal load. The run stops by wall time: the first steps are
timed and the cosine schedule is fitted to the steps that fit `--minutes` (`--steps N` fixes it instead, and then
runs to its end unless `--minutes` is given too).
`--extra-fraction F` draws that share of the rows from `tools.extra_corpus` (pinned dependencies' sources); the
held-out split is the stdlib one either way.

The export inverts `jaxserve.convert`: [in, out] -> [out, in], stacked experts -> per-expert HF modules, and the
half-split RoPE rows of q_b_proj / kv_a_proj_with_mqa back to interleaved order (`rope_interleave: true`).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file
from tqdm import tqdm

from jaxserve.eval import corpus
from jaxserve.convert.converter import _rope_rows
from jaxserve.checkpoint import model_params
from jaxserve.config import ModelConfig, from_hf_config
from jaxserve.models import CausalLM, forward
from jaxserve.tokenizer import Tokenizer
from tools import extra_corpus

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-kimi-tokenizer"
EOS = "<|endoftext|>"
EVAL_FILE = "eval.json"
SUMMARY_FILE = "training_summary.json"


@dataclass(frozen=True)
class ModelSize:
    """Architecture of the tiny model (a DeepSeek-V3 / Kimi K2 shape, scaled down)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4  # first_k_dense_replace dense layers, then MoE layers
    first_k_dense: int = 1
    num_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 768
    moe_intermediate_size: int = 256
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    yarn_factor: float = 4.0  # YaRN as Kimi K2 ships it (mscale = mscale_all_dim = 1), 512 -> 2048
    yarn_original_max_position: int = 512
    rms_norm_eps: float = 1e-6
    eos_token_id: int = 4090


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and data settings. minutes: wall-time budget of the training loop (evaluations included);
    None: no wall-time stop (a fixed `steps` schedule runs to its end)."""

    seed: int = 0
    minutes: float | None = 40.0
    steps: int | None = None  # None: fit the schedule to `minutes` after timing `calib_steps` steps
    stop_after: int | None = None  # stop after this many steps, schedule unchanged (replays a wall-time stop)
    batch_size: int = 8
    seq_len: int = 512
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    bias_rate: float = 1e-3  # DeepSeek-V3's gamma for the aux-loss-free balancing
    calib_steps: int = 20
    schedule_safety: float = 0.96  # fraction of the estimated steps scheduled, so the cosine ends in time
    evals: int = 4  # subset evaluations during training
    eval_tokens: int = 16384
    eval_window: int = 512
    extra_fraction: float = 0.0  # share of batch rows drawn from `tools.extra_corpus` (0: the stdlib split only)

    def __post_init__(self) -> None:
        if self.minutes is None and self.steps is None:
            raise ValueError("TrainConfig: minutes=None (no wall-time stop) needs a fixed step count (steps)")


def hf_config_dict(size: ModelSize) -> dict[str, Any]:
    """The `config.json` of the exported model: a real transformers `deepseek_v3` config."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "moe_intermediate_size": size.moe_intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_heads,
        "n_shared_experts": size.n_shared_experts,
        "n_routed_experts": size.n_routed_experts,
        "routed_scaling_factor": size.routed_scaling_factor,
        "kv_lora_rank": size.kv_lora_rank,
        "q_lora_rank": size.q_lora_rank,
        "qk_rope_head_dim": size.qk_rope_head_dim,
        "v_head_dim": size.v_head_dim,
        "qk_nope_head_dim": size.qk_nope_head_dim,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": size.num_experts_per_tok,
        "first_k_dense_replace": size.first_k_dense,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": size.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": size.rms_norm_eps,
        "use_cache": True,
        "bos_token_id": size.eos_token_id,
        "eos_token_id": size.eos_token_id,
        "tie_word_embeddings": False,
        "rope_theta": size.rope_theta,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": size.yarn_factor,
            "original_max_position_embeddings": size.yarn_original_max_position,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "float32",
    }


# ---- data ---------------------------------------------------------------------------------------------------------


def token_stream(texts: list[str], tokenizer: Tokenizer, eos_id: int, max_tokens: int | None = None) -> np.ndarray:
    """Documents joined as [eos] doc0 [eos] doc1 ... -> tokens [N] int32 (every document token has a left context).

    max_tokens: stop tokenizing once the stream is at least this long (the returned stream may be longer).
    """
    parts: list[np.ndarray] = []
    n = 0
    for text in tqdm(texts, desc="tokenize", unit="doc", leave=False):
        ids = np.asarray([eos_id] + tokenizer.encode(text), np.int32)
        parts.append(ids)
        n += len(ids)
        if max_tokens is not None and n >= max_tokens:
            break
    return np.concatenate(parts)


def heldout_stream(tokenizer: Tokenizer, max_tokens: int | None = None) -> tuple[np.ndarray, int]:
    """The held-out split as one token stream -> (tokens [N] int32, UTF-8 bytes of the held-out documents).

    The byte count covers all held-out documents (meaningful with max_tokens=None).
    """
    files = corpus.heldout_files()
    texts = corpus.read_texts(files)
    eos_id = tokenizer.token_to_id(EOS)
    return token_stream(texts, tokenizer, eos_id, max_tokens), sum(len(t.encode("utf-8")) for t in texts)


def sample_batch(tokens: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int,
                 extra: np.ndarray | None = None, extra_fraction: float = 0.0) -> np.ndarray:
    """Random windows of the train stream -> [batch_size, seq_len + 1] int32 (inputs [:, :-1], targets [:, 1:]).

    extra [M] int32: a second stream; each row comes from it with probability extra_fraction. Without it the
    draws are those of the stdlib-only runs (the shipped checkpoint replays).
    """
    if extra is None or extra_fraction <= 0.0:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        return np.stack([tokens[s:s + seq_len + 1] for s in starts])
    rows = []
    for use_extra in rng.random(batch_size) < extra_fraction:
        stream = extra if use_extra else tokens
        s = int(rng.integers(0, len(stream) - seq_len - 1))
        rows.append(stream[s:s + seq_len + 1])
    return np.stack(rows)


# ---- evaluation ---------------------------------------------------------------------------------------------------


def stream_nats(model: CausalLM, tokens: np.ndarray, window: int, batch_size: int = 8,
                progress: bool = False) -> tuple[float, int]:
    """Next-token cross entropy over a token stream in windows of `window` predictions.

    tokens [N] int32: windows start at 0, window, 2*window, ...; window k predicts tokens k*window+1 .. (k+1)*window
    from the preceding ones in the window, so all N-1 tokens after the first are predicted exactly once.
    -> (total nats f64, number of predicted tokens).
    """
    n_pred = len(tokens) - 1
    n_win = math.ceil(n_pred / window)
    padded = np.zeros(n_win * window + 1, np.int32)
    padded[:len(tokens)] = tokens
    weight = np.zeros(n_win * window, np.float32)
    weight[:n_pred] = 1.0  # padding targets at the end are not counted (causal: they cannot affect real ones)
    x = np.stack([padded[k * window:(k + 1) * window] for k in range(n_win)])
    y = np.stack([padded[k * window + 1:(k + 1) * window + 1] for k in range(n_win)])
    w = weight.reshape(n_win, window)
    total = 0.0
    for i in tqdm(range(0, n_win, batch_size), desc="eval", unit="batch", leave=False, disable=not progress):
        xb, yb, wb = x[i:i + batch_size], y[i:i + batch_size], w[i:i + batch_size]
        if len(xb) < batch_size:  # pad the batch to keep one compiled shape
            pad = batch_size - len(xb)
            xb, yb = np.pad(xb, ((0, pad), (0, 0))), np.pad(yb, ((0, pad), (0, 0)))
            wb = np.pad(wb, ((0, pad), (0, 0)))
        total += float(_batch_nats(forward(model, jnp.asarray(xb)), jnp.asarray(yb), jnp.asarray(wb)))
    return total, n_pred


@jax.jit
def _batch_nats(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """logits [B, T, V] f32, targets [B, T] int32, weights [B, T] f32 -> summed weighted nats, f32 scalar."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * weights)


def heldout_subset_perplexity(model: CausalLM, tokenizer: Tokenizer, n_tokens: int = 16384, window: int = 512) -> float:
    """Perplexity on a fixed small held-out subset: the first `n_tokens` predictions of the held-out stream.

    Subset: the held-out stream ([eos] doc0 [eos] doc1 ..., `jaxserve.eval.corpus.heldout_files()` order) truncated to
    n_tokens + 1 tokens, scored in windows of `window` predictions (n_tokens // window windows when divisible).
    -> exp(mean nats/token).
    """
    tokens, _ = heldout_stream(tokenizer, max_tokens=n_tokens + 1)
    total, n = stream_nats(model, tokens[:n_tokens + 1], window)
    return math.exp(total / n)


def heldout_metrics(model: CausalLM, tokenizer: Tokenizer, window: int = 512, progress: bool = True) -> dict[str, Any]:
    """Full held-out evaluation -> {heldout_loss_nats, heldout_ppl, bits_per_byte, heldout_tokens, heldout_bytes}.

    bits_per_byte = total nats / ln 2 / held-out UTF-8 bytes (the separators' predictions count, with 0 bytes).
    """
    tokens, n_bytes = heldout_stream(tokenizer)
    total, n = stream_nats(model, tokens, window, progress=progress)
    return {"heldout_loss_nats": total / n, "heldout_ppl": math.exp(total / n),
            "bits_per_byte": total / math.log(2) / n_bytes, "heldout_tokens": n, "heldout_bytes": n_bytes,
            "window": window}


# Prompts of the repetition measure: openings of the kinds of code the corpus holds.
REPETITION_PROMPTS = ("def ", "import os\n", "class Stack:\n", "for i in range(", "# Compute the ",
                      "if __name__ == ", "def fibonacci(n):\n", "    return ")


def distinct_n(ids: list[int], n: int) -> float:
    """Distinct n-grams / n-grams of a token sequence (1.0: no n-gram repeats; low: the text loops)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / max(len(grams), 1)


def repetition_metrics(checkpoint_dir: str | Path, new_tokens: int = 128,
                       prompts: tuple[str, ...] = REPETITION_PROMPTS) -> dict[str, Any]:
    """Greedy `new_tokens`-token completions of `prompts` through jaxserve's Engine (f32 weights and KV, eos
    ignored) -> {distinct_1/2/3: mean over prompts of distinct-n of each completion's new tokens, samples}."""
    from jaxserve.engine import Engine, EngineConfig, SamplingParams

    cfg = EngineConfig(kv_dtype="f32", prefill_weights="f32", decode_weights="f32", dtype="float32", max_batch=8)
    engine = Engine.from_checkpoint(checkpoint_dir, cfg, start=False)
    outs = engine.generate(list(prompts), SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    result: dict[str, Any] = {"new_tokens": new_tokens, "prompts": list(prompts)}
    for n in (1, 2, 3):
        result[f"distinct_{n}"] = float(np.mean([distinct_n(o.token_ids, n) for o in outs]))
    result["samples"] = [p + o.text for p, o in zip(prompts, outs)]
    return result


# ---- training -----------------------------------------------------------------------------------------------------


def _mask_and_positions(batch: int, seq: int) -> tuple[jax.Array, jax.Array]:
    """Causal mask [B, T, T] bool and positions [B, T] int32 for full rows (as CausalLM.__call__ builds them)."""
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    mask = positions[:, None, :] <= positions[:, :, None]
    return mask, positions


def _blocked_expert_mm(x_pad: jax.Array, w: jax.Array, block_expert: jax.Array, block: int) -> jax.Array:
    """x_pad [nb * block, K] (rows grouped by expert, groups padded to whole blocks), w [E, K, N] -> [nb * block, N].

    One dense [block, K] @ [K, N] per block with that block's expert: the same product as `jax.lax.ragged_dot`,
    which XLA:CPU evaluates densely over all E experts (about 8x the work here).
    """
    nb = block_expert.shape[0]
    xb = x_pad.reshape(nb, block, x_pad.shape[-1])
    return jnp.einsum("tbk,tkn->tbn", xb, w[block_expert]).reshape(nb * block, w.shape[-1])


def moe_blocked(moe: nnx.Module, x: jax.Array, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """`MoE.__call__` with the routed experts as block-grouped dense matmuls (training speed on CPU).

    x [B, T, H] f32 -> (out [B, T, H], expert ids [B*T, k] int32). Same routing (`moe.route`), same combine.
    """
    cfg = moe.cfg
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    n, k, E = flat.shape[0], cfg.num_experts_per_tok, cfg.n_routed_experts
    w, ids = moe.route(flat)
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    sizes = jnp.bincount(flat_ids, length=E).astype(jnp.int32)
    padded = (sizes + block - 1) // block * block
    pstart = jnp.cumsum(padded) - padded  # first padded row of each expert's group
    ustart = jnp.cumsum(sizes) - sizes
    sorted_ids = flat_ids[order]
    pos = pstart[sorted_ids] + jnp.arange(n * k, dtype=jnp.int32) - ustart[sorted_ids]  # padded row of each slot
    nb = (n * k + block - 1) // block + E  # static bound on the padded block count
    block_expert = jnp.clip(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(nb) * block, side="right"), 0, E - 1)
    x_pad = jnp.zeros((nb * block, shape[-1]), flat.dtype).at[pos].set(flat[token_of])
    ex = moe.experts
    h = jax.nn.silu(_blocked_expert_mm(x_pad, ex.gate[...], block_expert, block)) * \
        _blocked_expert_mm(x_pad, ex.up[...], block_expert, block)
    y_sorted = _blocked_expert_mm(h, ex.down[...], block_expert, block)[pos]
    contrib = y_sorted.astype(jnp.float32) * w.reshape(-1)[order][:, None]
    out = jnp.zeros((n, shape[-1]), jnp.float32).at[token_of].add(contrib).astype(x.dtype)
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.reshape(shape), ids


def logits_and_loads(model: CausalLM, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """CausalLM.__call__ (no padding, plain MLA, block-grouped experts) that also counts routed slots per expert.

    tokens [B, T] int32 -> (logits [B, T, V] f32, loads [n_moe_layers, E] f32 token-slot counts per expert).
    """
    h, loads = hidden_and_loads(model, tokens)
    return model.logits(h), loads


def decoder_layer_train(layer: nnx.Module, kind: str, h: jax.Array, cos: jax.Array, sin: jax.Array,
                        mask: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """One `DecoderLayer` as CausalLM.__call__ applies it (plain MLA, block-grouped experts).

    h [B, T, H] -> (h [B, T, H], expert ids [B*T, k] int32 for a "sparse" layer, else None)."""
    a, _ = layer.attn(layer.input_norm(h), cos, sin, mask, absorbed=False, prev_selected=None)
    h = h + a
    x = layer.post_norm(h)
    if kind != "sparse":
        return h + layer.mlp(x), None
    y, ids = moe_blocked(layer.mlp, x)
    return h + y, ids


def hidden_and_loads(model: CausalLM, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The training forward up to the last decoder layer's output (before the final norm).

    tokens [B, T] int32 -> (h [B, T, H], loads [n_moe_layers, E] f32 token-slot counts per expert).
    """
    cfg = model.cfg
    B, T = tokens.shape
    mask, positions = _mask_and_positions(B, T)
    cos, sin = model.rope(positions)
    h = model.embed_tokens(tokens)
    loads = []
    for layer, kind in zip(model.layers, cfg.mlp_layer_types):
        h, ids = decoder_layer_train(layer, kind, h, cos, sin, mask)
        if ids is not None:
            loads.append(jnp.bincount(ids.reshape(-1), length=cfg.n_routed_experts).astype(jnp.float32))
    return h, jnp.stack(loads)


def _is_router_bias(path: tuple) -> bool:
    return any(getattr(k, "key", None) == "router_bias" for k in path)


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW direction without the learning rate (the train step scales by -lr): clip, Adam, decoupled decay.

    Decay applies to matrices only (ndim >= 2); router_bias is never touched by the optimizer.
    """
    def labels(params: dict) -> dict:
        return jax.tree_util.tree_map_with_path(lambda p, _: "frozen" if _is_router_bias(p) else "train", params)

    def decay_mask(params: dict) -> dict:
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    train = optax.chain(optax.scale_by_adam(b1=tcfg.b1, b2=tcfg.b2, eps=1e-8),
                        optax.add_decayed_weights(tcfg.weight_decay, mask=decay_mask))
    return optax.chain(optax.clip_by_global_norm(tcfg.grad_clip),
                       optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, labels))


def learning_rate(step: int, total_steps: int, tcfg: TrainConfig) -> float:
    """Linear warmup to peak_lr over warmup_steps, then cosine down to min_lr_ratio * peak_lr at total_steps."""
    if step < tcfg.warmup_steps:
        return tcfg.peak_lr * (step + 1) / tcfg.warmup_steps
    frac = min(1.0, (step - tcfg.warmup_steps) / max(1, total_steps - tcfg.warmup_steps))
    return tcfg.peak_lr * (tcfg.min_lr_ratio + (1 - tcfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


TrainStep = Callable[[dict, Any, jax.Array, jax.Array], tuple[dict, Any, dict]]


def make_train_step(graphdef: nnx.GraphDef, template: nnx.State, tx: optax.GradientTransformation,
                    bias_rate: float) -> TrainStep:
    """-> jitted step(params, opt_state, batch [B, T+1] int32, lr f32 scalar) -> (params, opt_state, metrics).

    params: the model's pure-dict state (f32). metrics: {"loss": mean nats f32, "loads": [n_moe, E] f32}.
    """
    def model_of(params: dict) -> CausalLM:
        state = jax.tree.map(lambda x: x, template)  # a fresh State to fill, so the template stays untouched
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def loss_fn(params: dict, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits, loads = logits_and_loads(model_of(params), batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), loads

    @jax.jit
    def step(params: dict, opt_state: Any, batch: jax.Array, lr: jax.Array) -> tuple[dict, Any, dict]:
        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        # Aux-loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded ones.
        moe_layers = [i for i in sorted(params["layers"]) if "router_bias" in params["layers"][i]["mlp"]]
        for j, i in enumerate(moe_layers):
            mlp = params["layers"][i]["mlp"]
            mlp["router_bias"] = mlp["router_bias"] + bias_rate * jnp.sign(loads[j].mean() - loads[j])
        return params, opt_state, {"loss": loss, "loads": loads}

    return step


def build_model(size: ModelSize, seed: int) -> tuple[dict[str, Any], ModelConfig, CausalLM]:
    """-> (HF config dict, ModelConfig parsed from it, freshly initialised float32 CausalLM)."""
    raw = hf_config_dict(size)
    cfg = from_hf_config(raw)
    return raw, cfg, CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))


def merged(graphdef: nnx.GraphDef, template: nnx.State, params: dict) -> CausalLM:
    """A CausalLM holding `params` (pure dict), for evaluation and export."""
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def train(size: ModelSize, tcfg: TrainConfig, train_tokens: np.ndarray, eval_tokens: np.ndarray | None = None,
          progress: bool = True, extra_tokens: np.ndarray | None = None) -> tuple[CausalLM, dict[str, Any]]:
    """Train from scratch; stops at the scheduled step count or the wall-time budget, whichever comes first.

    train_tokens [N] int32: the train stream. eval_tokens [M] int32 or None: a held-out stream scored `evals`
    times during training. extra_tokens [K] int32 or None: the extra stream (`tcfg.extra_fraction` of the rows).
    -> (trained model, summary dict: steps, tokens, wall time, losses, evals, loads).
    """
    raw, cfg, model = build_model(size, tcfg.seed)
    graphdef, template = nnx.split(model)
    params = template.to_pure_dict()
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    tx = make_optimizer(tcfg)
    opt_state = tx.init(params)
    step_fn = make_train_step(graphdef, template, tx, tcfg.bias_rate)
    rng = np.random.default_rng(tcfg.seed)
    budget = math.inf if tcfg.minutes is None else tcfg.minutes * 60.0
    total_steps = tcfg.steps if tcfg.steps is not None else 10**9  # fixed after calibration
    t0 = time.perf_counter()
    calib_start: float | None = None
    losses: list[float] = []
    evals: list[dict[str, float]] = []
    loads = np.zeros((0,))
    eval_at: set[int] = set()
    bar = tqdm(total=total_steps if tcfg.steps is not None else None, desc="train", unit="step",
               disable=not progress)
    step = 0
    while step < total_steps and time.perf_counter() - t0 < budget and step != tcfg.stop_after:
        lr = learning_rate(step, total_steps, tcfg)
        batch = jnp.asarray(sample_batch(train_tokens, rng, tcfg.batch_size, tcfg.seq_len, extra_tokens,
                                         tcfg.extra_fraction))
        params, opt_state, metrics = step_fn(params, opt_state, batch, jnp.float32(lr))
        loss = float(metrics["loss"])  # blocks: step timing below is real
        losses.append(loss)
        step += 1
        if step == 1:
            calib_start = time.perf_counter()  # exclude compilation from the step-time estimate
        if tcfg.steps is None and step == 1 + tcfg.calib_steps:
            per_step = (time.perf_counter() - calib_start) / tcfg.calib_steps
            remaining = budget - (time.perf_counter() - t0)
            total_steps = step + int(tcfg.schedule_safety * remaining / per_step)
            bar.reset(total=total_steps)
            bar.update(step)
        if total_steps < 10**9 and not eval_at:
            eval_at = {max(1, round(total_steps * k / tcfg.evals)) for k in range(1, tcfg.evals)}
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")
        if eval_tokens is not None and step in eval_at:
            total, n = stream_nats(merged(graphdef, template, params), eval_tokens, tcfg.eval_window)
            evals.append({"step": step, "loss": total / n, "ppl": math.exp(total / n),
                          "train_loss_last50": float(np.mean(losses[-50:]))})
            tqdm.write(f"step {step}: held-out subset loss {total / n:.4f} nats/token, ppl {math.exp(total / n):.2f}")
        loads = np.asarray(metrics["loads"])
    bar.close()
    wall = time.perf_counter() - t0
    model = merged(graphdef, template, params)
    bias = [np.asarray(params["layers"][i]["mlp"]["router_bias"]).tolist() for i in sorted(params["layers"])
            if "router_bias" in params["layers"][i]["mlp"]]
    summary = {
        "model_size": asdict(size), "train_config": asdict(tcfg), "parameters": n_params,
        "scheduled_steps": total_steps, "steps": step, "tokens_seen": step * tcfg.batch_size * tcfg.seq_len,
        "train_stream_tokens": int(len(train_tokens)),
        "extra_stream_tokens": int(len(extra_tokens)) if extra_tokens is not None else 0, "wall_seconds": wall,
        "final_train_loss_last50": float(np.mean(losses[-50:])) if losses else None,
        "first_loss": losses[0] if losses else None, "evals": evals,
        # Fraction of each MoE layer's routed token-slots that went to each expert, on the last batch.
        "final_expert_loads": (loads / loads.sum(-1, keepdims=True)).tolist() if loads.size else [],
        "final_router_bias": bias, "jax": jax.__version__, "optax": optax.__version__,
    }
    return model, summary


# ---- export -------------------------------------------------------------------------------------------------------


def _half_split_to_interleaved(w_out_in: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Inverse of the converter's `w[rows]`: jaxserve rows (half-split RoPE) -> HF rows (interleaved). [out, in]."""
    hf = np.empty_like(w_out_in)
    hf[rows] = w_out_in
    return hf


def hf_layer_tensors(cfg: ModelConfig, p: dict[str, np.ndarray], J: str, L: str, kind: str) -> dict[str, np.ndarray]:
    """One decoder layer's weights under HF DeepSeek-V3 names: jaxserve flat params `p` under prefix `J` (e.g.
    "layers.3") -> {f"{L}.self_attn...": [out, in] array} with `L` the HF prefix (e.g. "model.layers.3"); kind
    "dense" | "sparse". The half-split RoPE rows go back to HF's interleaved order."""
    N, qk, dn, dr, r = cfg.num_heads, cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q_rows = _rope_rows(N, qk, dn, dr)
    kv_rows = _rope_rows(1, r + dr, r, dr)
    out = {f"{L}.input_layernorm.weight": p[f"{J}.input_norm.weight"],
           f"{L}.post_attention_layernorm.weight": p[f"{J}.post_norm.weight"]}
    A, a = f"{L}.self_attn", f"{J}.attn"
    out[f"{A}.q_a_proj.weight"] = p[f"{a}.q_a.weight"].T
    out[f"{A}.q_a_layernorm.weight"] = p[f"{a}.q_a_norm.weight"]
    out[f"{A}.q_b_proj.weight"] = _half_split_to_interleaved(p[f"{a}.q_b.weight"].T, q_rows)
    out[f"{A}.kv_a_proj_with_mqa.weight"] = _half_split_to_interleaved(p[f"{a}.kv_a.weight"].T, kv_rows)
    out[f"{A}.kv_a_layernorm.weight"] = p[f"{a}.kv_a_norm.weight"]
    out[f"{A}.kv_b_proj.weight"] = p[f"{a}.kv_b.weight"].T
    out[f"{A}.o_proj.weight"] = p[f"{a}.o.weight"].T
    M, m = f"{L}.mlp", f"{J}.mlp"
    if kind == "dense":
        for name in ("gate", "up", "down"):
            out[f"{M}.{name}_proj.weight"] = p[f"{m}.{name}.weight"].T
        return out
    out[f"{M}.gate.weight"] = p[f"{m}.router"].T
    out[f"{M}.gate.e_score_correction_bias"] = p[f"{m}.router_bias"]
    for e in range(cfg.n_routed_experts):
        for name in ("gate", "up", "down"):
            out[f"{M}.experts.{e}.{name}_proj.weight"] = p[f"{m}.experts.{name}"][e].T
    for name in ("gate", "up", "down"):
        out[f"{M}.shared_experts.{name}_proj.weight"] = p[f"{m}.shared.{name}.weight"].T
    return out


def hf_tensors(model: CausalLM) -> dict[str, np.ndarray]:
    """The model's weights under real HF DeepSeek-V3 names, [out, in] linears, f32 contiguous arrays."""
    cfg = model.cfg
    p = model_params(model)
    out = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["norm.weight"],
           "lm_head.weight": p["lm_head.weight"].T}
    for i, kind in enumerate(cfg.mlp_layer_types):
        out.update(hf_layer_tensors(cfg, p, f"layers.{i}", f"model.layers.{i}", kind))
    if model.mtp is not None:
        out.update(hf_mtp_tensors(model))
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def hf_mtp_tensors(model: CausalLM) -> dict[str, np.ndarray]:
    """The MTP head (`model.mtp`) as DeepSeek-V3's layer N = num_hidden_layers: eh_proj [H, 2H], enorm, hnorm,
    shared_head.norm and its decoder layer named as `hf_layer_tensors` names layer N; f32 contiguous arrays."""
    cfg = model.cfg
    p = model_params(model.mtp)
    L = f"model.layers.{cfg.num_layers}"
    out = {f"{L}.eh_proj.weight": p["eh_proj.weight"].T, f"{L}.enorm.weight": p["enorm.weight"],
           f"{L}.hnorm.weight": p["hnorm.weight"], f"{L}.shared_head.norm.weight": p["norm.weight"]}
    out.update(hf_layer_tensors(cfg, p, "layer", L, cfg.mtp_mlp_type))
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def export_hf(model: CausalLM, raw_config: dict[str, Any], out_dir: str | Path,
              tokenizer_dir: str | Path = TOKENIZER_DIR) -> Path:
    """Write an HF folder: config.json, model.safetensors (f32), generation_config.json and tokenizer files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    save_file(hf_tensors(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(tokenizer_dir).iterdir():
        if f.suffix == ".json" and f.name != "training_meta.json":
            shutil.copy2(f, out_dir / f.name)
    return out_dir


# ---- CLI ----------------------------------------------------------------------------------------------------------


def evaluate_checkpoint(checkpoint_dir: str | Path, summary_path: str | Path | None = None) -> dict[str, Any]:
    """Score a converted checkpoint (jaxserve.load + forward) on the whole held-out split and the fixed subset;
    writes CHECKPOINT_DIR/eval.json and returns it."""
    import jaxserve  # the loader; imported here so training does not need Orbax restore paths

    checkpoint_dir = Path(checkpoint_dir)
    _, model = jaxserve.load(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    result = heldout_metrics(model, tokenizer)
    n_sub, win = 16384, 512
    result["subset_ppl"] = heldout_subset_perplexity(model, tokenizer, n_sub, win)
    result["repetition"] = {k: v for k, v in repetition_metrics(checkpoint_dir).items() if k != "samples"}
    result["subset"] = {"n_tokens": n_sub, "window": win, "definition": (
        "first n_tokens predictions of the held-out stream [eos] doc0 [eos] doc1 ... "
        "(jaxserve.eval.corpus.heldout_files order), windows of `window` predictions; "
        "tools.train_tiny.heldout_subset_perplexity")}
    if summary_path is not None:
        s = json.loads(Path(summary_path).read_text())
        result["training"] = {k: s[k] for k in ("steps", "tokens_seen", "wall_seconds", "parameters")}
    (checkpoint_dir / EVAL_FILE).write_text(json.dumps(result, indent=1) + "\n")
    return result


def wall_budget(minutes: float | None, steps: int | None) -> float | None:
    """The run's wall-time budget in minutes from the CLI: as given; else none for a fixed --steps schedule (it used
    to inherit the 40-minute default and stop at step 912 of 2300), the default when the schedule is fitted to it."""
    if minutes is not None:
        return minutes
    return None if steps is not None else TrainConfig.minutes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="HF output folder")
    parser.add_argument("--minutes", type=float, default=None,
                        help=f"wall-time budget (default: {TrainConfig.minutes:g} when the schedule is fitted to it; "
                             "none with --steps, so a fixed schedule is never cut short)")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--steps", type=int, default=None, help="fixed step count (default: fit to --minutes)")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this many steps without changing the schedule (replays a wall-time stop)")
    parser.add_argument("--evaluate", metavar="CHECKPOINT_DIR", help="score a converted checkpoint, write eval.json")
    parser.add_argument("--repetition", metavar="CHECKPOINT_DIR",
                        help="distinct-n of greedy 128-token completions of a converted checkpoint, with samples")
    parser.add_argument("--extra-fraction", type=float, default=TrainConfig.extra_fraction,
                        help="share of batch rows drawn from tools.extra_corpus (pinned dependencies' sources)")
    parser.add_argument("--summary", help="with --evaluate: training_summary.json to copy numbers from")
    args = parser.parse_args(argv)
    if args.repetition:
        print(json.dumps(repetition_metrics(args.repetition), indent=1))
        return
    if args.evaluate:
        print(json.dumps(evaluate_checkpoint(args.evaluate, args.summary), indent=1))
        return
    if not args.out_dir:
        parser.error("out_dir is required unless --evaluate is given")
    tcfg = replace(TrainConfig(), minutes=wall_budget(args.minutes, args.steps), seed=args.seed, steps=args.steps,
                   stop_after=args.stop_after, extra_fraction=args.extra_fraction)
    size = ModelSize()
    tokenizer = Tokenizer(TOKENIZER_DIR)
    eos_id = tokenizer.token_to_id(EOS)
    t0 = time.perf_counter()
    train_tokens = token_stream(corpus.read_texts(corpus.train_files()), tokenizer, eos_id)
    sub_tokens, _ = heldout_stream(tokenizer, max_tokens=tcfg.eval_tokens + 1)
    extra_tokens = None
    if tcfg.extra_fraction > 0.0:
        files, dropped = extra_corpus.extra_files()
        extra_tokens = token_stream(corpus.read_texts(files), tokenizer, eos_id)
        print(f"extra stream: {len(extra_tokens)} tokens, {len(files)} files, dropped {dropped}, "
              f"sha256 {extra_corpus.fingerprint(files)}")
    print(f"train stream: {len(train_tokens)} tokens ({time.perf_counter() - t0:.1f} s to tokenize)")
    model, summary = train(size, tcfg, train_tokens, sub_tokens[:tcfg.eval_tokens + 1], extra_tokens=extra_tokens)
    final = heldout_metrics(model, tokenizer)
    summary["heldout"] = final
    summary["subset_ppl_in_memory"] = heldout_subset_perplexity(model, tokenizer, tcfg.eval_tokens, tcfg.eval_window)
    out = export_hf(model, hf_config_dict(size), args.out_dir)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("model_size", "train_config")}, indent=1))


if __name__ == "__main__":
    main()
