"""Train a DeepSeek-V3-style MTP head (depth 1) for the frozen `checkpoints/tiny-kimi`, export it under HF names.

    python -m tools.train_mtp OUT_HF_DIR --minutes 12 [--seed 0] [--steps N] [--checkpoint checkpoints/tiny-kimi]

The head predicts t_{p+2} at position p: `h = eh_proj(concat[enorm(embed(t_{p+1})), hnorm(h_p)])` -> one decoder
layer (jaxserve's `DecoderLayer`, a MoE layer initialised from the target's last layer) -> `shared_head.norm` ->
the target's own lm_head. h_p is the target's last decoder layer output (before the final norm); the layer uses
rope position p, causal over positions <= p. The embedding and lm_head are the target's, frozen (as are all target
weights); the loss is the cross entropy of t_{p+2}. Training uses the block-grouped MoE of `tools.train_tiny`
(equal to the served MoE, tested), AdamW with warmup + cosine fitted to `--minutes`, and the aux-loss-free router
bias updates. Data: random windows of the stdlib train split (`jaxserve.eval.corpus`); held-out metrics on the
stdlib held-out split through the served layer math.

OUT_HF_DIR gets the target's HF export plus the head as `model.layers.{num_hidden_layers}.*` (config
`num_nextn_predict_layers: 1`), `mtp.safetensors` (the head's tensors alone) and `mtp_training_summary.json`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file
from tqdm import tqdm

import jaxserve
from jaxserve.eval import corpus
from jaxserve.models import CausalLM
from jaxserve.models.mtp import mtp_forward
from jaxserve.tokenizer import Tokenizer
from tools import train_tiny as tt

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-kimi"
SUMMARY_FILE = "mtp_training_summary.json"
MTP_FILE = "mtp.safetensors"
DEFAULT_TRAIN = replace(tt.TrainConfig(), minutes=12.0, batch_size=8, seq_len=256, peak_lr=2e-3, warmup_steps=20,
                        calib_steps=10, evals=3, eval_tokens=32768, eval_window=512)


def with_head(target: CausalLM, seed: int) -> CausalLM:
    """The target (its arrays shared, not copied) plus a fresh MTP head (`CausalLM.mtp`, a MoE layer like the
    target's last; a head the target already has is replaced): the layer copies the target's last layer,
    shared_head.norm copies the final norm, enorm and hnorm are ones, eh_proj starts as [I; I] (the sum of the two
    normalised inputs, a residual-stream-like start)."""
    cfg = replace(target.cfg, mtp_layers=1, mtp_mlp_type=target.cfg.mlp_layer_types[-1])
    model = CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    nnx.update(model, nnx.state(target))
    head = model.mtp
    nnx.update(head.layer, jax.tree.map(jnp.array, nnx.state(target.layers[cfg.num_layers - 1])))
    head.norm.weight[...] = jnp.array(target.norm.weight[...])
    head.enorm.weight[...] = jnp.ones_like(head.enorm.weight[...])
    head.hnorm.weight[...] = jnp.ones_like(head.hnorm.weight[...])
    eye = jnp.eye(cfg.hidden_size, dtype=jnp.float32)
    head.eh_proj.weight[...] = jnp.concatenate([eye, eye], axis=0)
    return model


def mtp_forward_train(model: CausalLM, h: jax.Array, next_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`jaxserve.models.mtp.mtp_forward` with the block-grouped MoE of training. h [B, T, H] (the target's h_p,
    positions 0..T-1), next_tokens [B, T] int32 (t_{p+1}) -> (logits [B, T, V] f32 of t_{p+2}, expert ids
    [B*T, k] int32)."""
    head = model.mtp
    x = head.combine(model.embed_tokens(next_tokens), h)
    mask, positions = tt._mask_and_positions(*next_tokens.shape)
    cos, sin = model.rope(positions)
    x, ids = tt.decoder_layer_train(head.layer, model.cfg.mtp_mlp_type, x, cos, sin, mask)
    return model.head_logits(head.norm(x)), ids


MTPStep = Callable[[dict, dict, Any, jax.Array, jax.Array], tuple[dict, Any, dict]]


def make_mtp_step(graphdef: nnx.GraphDef, template: nnx.State, tx: optax.GradientTransformation,
                  bias_rate: float) -> MTPStep:
    """-> jitted step(frozen, params, opt_state, batch [B, T+2] int32, lr f32) -> (params, opt_state, metrics).

    frozen: the model's pure-dict state without "mtp" (never differentiated; gives h_p for batch[:, :T]); params:
    the head's ("mtp"). metrics: {"loss": mean nats of t_{p+2} f32, "loads": [E] f32 routed slots per expert}."""
    def loss_fn(params: dict, frozen: dict, h: jax.Array, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = tt.merged(graphdef, template, {**frozen, "mtp": params})
        logits, ids = mtp_forward_train(model, h, batch[:, 1:-1])
        loads = jnp.bincount(ids.reshape(-1), length=model.cfg.n_routed_experts).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 2:]).mean(), loads

    @jax.jit
    def step(frozen: dict, params: dict, opt_state: Any, batch: jax.Array, lr: jax.Array) -> tuple[dict, Any, dict]:
        model = tt.merged(graphdef, template, {**frozen, "mtp": params})
        h = jax.lax.stop_gradient(tt.hidden_and_loads(model, batch[:, :-2])[0])
        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, h, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        mlp = params["layer"]["mlp"]  # aux-loss-free balancing, as tools.train_tiny does for the target
        mlp["router_bias"] = mlp["router_bias"] + bias_rate * jnp.sign(loads.mean() - loads)
        return params, opt_state, {"loss": loss, "loads": loads}

    return step


@nnx.jit
def _eval_batch(model: CausalLM, batch: jax.Array, weights: jax.Array) -> jax.Array:
    """Served math (`CausalLM.hidden`, `mtp.mtp_forward`). batch [B, T+2] int32, weights [B, T] f32 -> [4] f32
    sums: MTP nats, MTP top-1 hits of t_{p+2}, MTP argmax == the target's argmax after t_{p+1} (the greedy accept
    event), target top-1 hits of t_{p+2} (from t_0..t_{p+1})."""
    T = batch.shape[1] - 2
    h_all = model.hidden(batch[:, :-1])  # [B, T+1, H]
    logits, _ = mtp_forward(model, h_all[:, :T], batch[:, 1:-1])
    tgt = batch[:, 2:]
    greedy = jnp.argmax(model.logits(h_all[:, 1:]), -1)
    mtp = jnp.argmax(logits, -1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
    return jnp.stack([jnp.sum(ce * weights), jnp.sum((mtp == tgt) * weights), jnp.sum((mtp == greedy) * weights),
                      jnp.sum((greedy == tgt) * weights)])


def evaluate(model: CausalLM, tokens: np.ndarray, window: int, batch_size: int = 8) -> dict[str, float]:
    """Held-out MTP metrics of `model.mtp` over a token stream [N] int32: windows of `window` positions at stride
    `window`, so every t_j (j >= 2) is predicted once. -> {ce, top1, agree_greedy, target_top1, predictions}."""
    n_pred = len(tokens) - 2
    n_win = math.ceil(n_pred / window)
    padded = np.zeros(n_win * window + 2, np.int32)
    padded[:len(tokens)] = tokens
    w = (np.arange(n_win * window) < n_pred).astype(np.float32).reshape(n_win, window)
    x = np.stack([padded[k * window:(k + 1) * window + 2] for k in range(n_win)])
    pad = (-n_win) % batch_size  # one compiled shape
    x, w = np.pad(x, ((0, pad), (0, 0))), np.pad(w, ((0, pad), (0, 0)))
    total = np.zeros(4)
    for i in range(0, len(x), batch_size):
        total += np.asarray(_eval_batch(model, jnp.asarray(x[i:i + batch_size]), jnp.asarray(w[i:i + batch_size])),
                            np.float64)
    ce, top1, agree, target_top1 = (float(v) for v in total / n_pred)
    return {"ce": ce, "top1": top1, "agree_greedy": agree, "target_top1": target_top1, "predictions": n_pred}


def greedy_text_metrics(checkpoint_dir: str | Path, model: CausalLM, prompts: np.ndarray, new_tokens: int = 128
                        ) -> dict[str, float]:
    """The head on the target's own greedy text, what a greedy `serve` drafts against: the checkpoint's Engine (f32)
    continues each prompt [P] of prompts [B, P] int32 by `new_tokens` greedy tokens (eos ignored), then `model`
    scores the positions whose t_{p+2} is a generated token. -> evaluate()'s keys (agree_greedy ~ the accept rate of
    one drafted token; 1 + it is the mean tokens per verify step at k = 1)."""
    from jaxserve.engine import Engine, EngineConfig, SamplingParams  # serving stack: only this measurement needs it

    cfg = EngineConfig(kv_dtype="f32", prefill_weights="f32", decode_weights="f32", dtype="float32", max_batch=8)
    engine = Engine.from_checkpoint(checkpoint_dir, cfg, start=False)
    outs = engine.generate([p.tolist() for p in prompts],
                           SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    rows = np.concatenate([prompts, np.asarray([o.token_ids for o in outs], np.int32)], axis=1)
    weights = (np.arange(rows.shape[1] - 2) + 2 >= prompts.shape[1]).astype(np.float32)
    weights = np.broadcast_to(weights, (len(rows), rows.shape[1] - 2))
    ce, top1, agree, target_top1 = (float(v) for v in np.asarray(
        _eval_batch(model, jnp.asarray(rows), jnp.asarray(weights)), np.float64) / weights.sum())
    return {"ce": ce, "top1": top1, "agree_greedy": agree, "target_top1": target_top1,
            "predictions": int(weights.sum())}


def greedy_prompts(held: np.ndarray, n: int = 16, length: int = 64, stride: int = 2000) -> np.ndarray:
    """n prompts of `length` tokens from the held-out stream [N] int32 (at 100 + i * stride) -> [n, length] int32."""
    return np.stack([held[100 + i * stride:100 + i * stride + length] for i in range(n)])


def train_mtp(target: CausalLM, tcfg: tt.TrainConfig, train_tokens: np.ndarray, eval_tokens: np.ndarray | None = None,
              progress: bool = True) -> tuple[CausalLM, dict[str, Any]]:
    """Train a head for the frozen `target` on random windows of train_tokens [N] int32 (T = tcfg.seq_len
    positions, T+2 tokens per row); stops at the scheduled steps or the wall-time budget. eval_tokens [M] int32:
    scored `evals - 1` times during training. -> (target + trained head, summary: steps, wall time, losses, evals)."""
    graphdef, template = nnx.split(with_head(target, tcfg.seed))
    frozen = template.to_pure_dict()
    params = frozen.pop("mtp")
    tx = tt.make_optimizer(tcfg)
    opt_state = tx.init(params)
    step_fn = make_mtp_step(graphdef, template, tx, tcfg.bias_rate)
    rng = np.random.default_rng(tcfg.seed)
    budget = math.inf if tcfg.minutes is None else tcfg.minutes * 60.0
    total_steps = tcfg.steps if tcfg.steps is not None else 10**9  # fixed after calibration
    losses: list[float] = []
    evals: list[dict[str, float]] = []
    loads = np.zeros((0,))
    bar = tqdm(desc="train mtp", unit="step", disable=not progress)
    t0 = time.perf_counter()
    calib_start = t0
    step = 0
    while step < total_steps and time.perf_counter() - t0 < budget and step != tcfg.stop_after:
        lr = tt.learning_rate(step, total_steps, tcfg)
        batch = jnp.asarray(tt.sample_batch(train_tokens, rng, tcfg.batch_size, tcfg.seq_len + 1))
        params, opt_state, metrics = step_fn(frozen, params, opt_state, batch, jnp.float32(lr))
        losses.append(float(metrics["loss"]))  # blocks: the step timing is real
        step += 1
        if step == 1:
            calib_start = time.perf_counter()  # compilation excluded from the step-time estimate
        if tcfg.steps is None and step == 1 + tcfg.calib_steps:
            per_step = (time.perf_counter() - calib_start) / tcfg.calib_steps
            total_steps = step + int(tcfg.schedule_safety * (budget - (time.perf_counter() - t0)) / per_step)
            bar.reset(total=total_steps)
            bar.update(step - 1)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}")
        if eval_tokens is not None and total_steps < 10**9 and tcfg.evals > 1 and \
                step % max(1, total_steps // tcfg.evals) == 0 and step < total_steps:
            ev = evaluate(tt.merged(graphdef, template, {**frozen, "mtp": params}), eval_tokens, tcfg.eval_window)
            evals.append({"step": step, **ev, "train_loss_last50": float(np.mean(losses[-50:]))})
            tqdm.write(f"step {step}: held-out MTP ce {ev['ce']:.4f}, top-1 {ev['top1']:.4f}, "
                       f"agree with greedy target {ev['agree_greedy']:.4f}")
        loads = np.asarray(metrics["loads"])
    bar.close()
    summary = {"train_config": asdict(tcfg), "scheduled_steps": total_steps, "steps": step,
               "tokens_seen": step * tcfg.batch_size * tcfg.seq_len, "wall_seconds": time.perf_counter() - t0,
               "first_loss": losses[0] if losses else None,
               "final_train_loss_last50": float(np.mean(losses[-50:])) if losses else None, "evals": evals,
               "final_expert_loads": (loads / loads.sum()).tolist() if loads.size else [],
               "final_router_bias": np.asarray(params["layer"]["mlp"]["router_bias"]).tolist(),
               "parameters": int(sum(x.size for x in jax.tree.leaves(params))), "jax": jax.__version__}
    return tt.merged(graphdef, template, {**frozen, "mtp": params}), summary


def export_with_mtp(model: CausalLM, raw_config: dict[str, Any], out_dir: str | Path) -> Path:
    """`train_tiny.export_hf` of the target with its head (config `num_nextn_predict_layers: 1`); the head's
    tensors alone also go to OUT/mtp.safetensors."""
    out = tt.export_hf(model, {**raw_config, "num_nextn_predict_layers": 1}, out_dir)
    save_file(tt.hf_mtp_tensors(model), str(out / MTP_FILE), metadata={"format": "pt"})
    return out


# ---- CLI ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="HF output folder (target + MTP head)")
    parser.add_argument("--checkpoint", default=str(CHECKPOINT), help="the converted target checkpoint")
    parser.add_argument("--minutes", type=float, default=None,
                        help=f"wall-time budget (default {DEFAULT_TRAIN.minutes:g} when fitted to it; none with --steps)")
    parser.add_argument("--steps", type=int, default=None, help="fixed step count (default: fit to --minutes)")
    parser.add_argument("--seed", type=int, default=DEFAULT_TRAIN.seed)
    args = parser.parse_args(argv)
    minutes = args.minutes if args.minutes is not None or args.steps is not None else DEFAULT_TRAIN.minutes
    tcfg = replace(DEFAULT_TRAIN, minutes=minutes, steps=args.steps, seed=args.seed)
    _, target = jaxserve.load(args.checkpoint, dtype=jnp.float32)
    tokenizer = Tokenizer(args.checkpoint)
    eos_id = tokenizer.token_to_id(tt.EOS)
    train_tokens = tt.token_stream(corpus.read_texts(corpus.train_files()), tokenizer, eos_id)
    held, _ = tt.heldout_stream(tokenizer, max_tokens=tcfg.eval_tokens + 2)
    held = held[:tcfg.eval_tokens + 2]
    before = evaluate(with_head(target, tcfg.seed), held, tcfg.eval_window)
    model, summary = train_mtp(target, tcfg, train_tokens, held)
    prompts = greedy_prompts(held)
    summary.update(heldout_at_init=before, heldout=evaluate(model, held, tcfg.eval_window),
                   greedy_text=greedy_text_metrics(args.checkpoint, model, prompts), greedy_text_definition=(
                       f"{len(prompts)} held-out prompts of {prompts.shape[1]} tokens (tools.train_mtp.greedy_prompts)"
                       ", 128 greedy tokens each from the target's Engine (f32), scored on the generated tokens"),
                   heldout_definition=f"first {tcfg.eval_tokens} predictions of the stdlib held-out stream "
                   f"(tools.train_tiny.heldout_stream), windows of {tcfg.eval_window} positions, served layer math",
                   checkpoint=str(args.checkpoint), command="python -m tools.train_mtp " + " ".join(
                       sys.argv[1:] if argv is None else argv),
                   train_stream_tokens=int(len(train_tokens)))
    raw = json.loads((Path(args.checkpoint) / "config.json").read_text())
    out = export_with_mtp(model, raw, args.out_dir)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "train_config"}, indent=1))


if __name__ == "__main__":
    main()
