"""Train an EAGLE-3 draft for the frozen `checkpoints/tiny-kimi`, export it in the published layout.

    python -m tools.train_eagle3 OUT_DIR --minutes 10 [--seed 0] [--steps N] [--draft-vocab 2048]

The draft (`jaxserve.models.eagle3`: hidden = the target's, 4 heads / 2 KV heads of 64, intermediate 2H) reads the
target's residual stream at the inputs of layers 1, 2, 3 (config `eagle_aux_hidden_state_layer_ids` [0, 1, 2]: the
4-layer target's default 2, N // 2, N - 3 repeats a layer). Its vocabulary is the `--draft-vocab` most frequent
tokens of the train stream (`d2t` / `t2d`); the loss is the cross entropy against the target's next-token
distribution restricted to it. Two steps are unrolled ("training-time test", as EAGLE-3 trains): step 1 at position
p from fc(aux_p) and t_{p+1} predicts t_{p+2}; step 2 at p from step 1's output at p - 1 and t_{p+1} (what a chained
draft sees), attending to the step-1 rows before p and itself. lm_head starts as the target's rows of the draft
vocabulary and fc as the last aux state's identity. AdamW, warmup + cosine fitted to `--minutes`; the target's MoE
runs block-grouped (`tools.train_tiny`). OUT_DIR gets config.json, model.safetensors and a training summary with the
accept length the served engine measures (eagle3:OUT:3 on held-out prompts, greedy, f32).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file

import jaxserve
from jaxserve.eval import corpus
from jaxserve.models import CausalLM
from jaxserve.models.eagle3 import TENSORS, Eagle3Draft, attend, read_config
from jaxserve.tokenizer import Tokenizer
from tools import train_tiny as tt
from tools.train_mtp import CHECKPOINT, greedy_prompts

AUX_IDS = [0, 1, 2]  # layer outputs (SGLang's reading): the inputs of layers 1, 2, 3
SUMMARY_FILE = "eagle3_training_summary.json"


def draft_config(target_raw: dict, vocab_ids: np.ndarray) -> dict:
    """The draft's config.json for the target's HF config and its vocabulary (sorted target ids)."""
    H = target_raw["hidden_size"]
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 2 * H, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": target_raw["max_position_embeddings"], "vocab_size": target_raw["vocab_size"],
            "draft_vocab_size": int(len(vocab_ids)), "target_hidden_size": H,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS}}


def initial_draft(target: CausalLM, raw: dict, vocab_ids: np.ndarray, folder: Path, seed: int) -> Eagle3Draft:
    """A fresh draft: random projections, lm_head = the target's rows of the draft vocabulary, fc = [0; 0; I]."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    cfg = read_config(folder, target.cfg)
    draft = Eagle3Draft(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    H = cfg.hidden_size
    draft.fc[...] = jnp.concatenate([jnp.zeros((2 * H, H)), jnp.eye(H)], 0)
    head = target.lm_head.weight[...] if target.lm_head is not None else target.embed[...].T
    draft.lm_head[...] = jnp.asarray(head)[:, vocab_ids]
    draft.d2t[...] = jnp.asarray(vocab_ids - np.arange(len(vocab_ids)), jnp.int32)
    return draft


def target_pass(target: CausalLM, tokens: jax.Array, aux_layers: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """tokens [B, T] -> (aux [B, T, 3H] (the layer inputs), target logits [B, T, V] f32); no gradient."""
    mask, positions = tt._mask_and_positions(*tokens.shape)
    cos, sin = target.rope(positions)
    h, aux = target.embed_tokens(tokens), []
    for i, (layer, kind) in enumerate(zip(target.layers, target.cfg.mlp_layer_types)):
        if i in aux_layers:
            aux.append(h)
        h, _ = tt.decoder_layer_train(layer, kind, h, cos, sin, mask)
    aux += [h] * (len(target.layers) in aux_layers)
    return jax.lax.stop_gradient(jnp.concatenate(aux, -1)), jax.lax.stop_gradient(target.logits(h))


def unrolled_logits(draft: Eagle3Draft, embedded: jax.Array, aux: jax.Array) -> tuple[jax.Array, jax.Array]:
    """embedded [B, T, H] (of t_{p+1}), aux [B, T, 3H] -> (step-1 logits [B, T, Vd] of t_{p+2}, step-2 logits
    [B, T - 1, Vd] at positions 1.. of t_{p+2}, from step 1's h at p - 1)."""
    B, T, _ = embedded.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x, res = draft.layer_input(embedded, draft.project(aux))
    cos, sin = draft.rope(pos)
    q, k, v = draft.qkv(x, cos, sin)
    h1 = draft.finish(attend(q, k, v, pos[:, None, :] <= pos[:, :, None]), res)
    x2, res2 = draft.layer_input(embedded[:, 1:], h1[:, :-1])
    q2, k2, v2 = draft.qkv(x2, cos[:, 1:], sin[:, 1:])
    # keys: the step-1 rows before p, then the chained row itself
    mask = jnp.concatenate([pos[:, None, :] < pos[:, 1:, None], jnp.broadcast_to(jnp.eye(T - 1, dtype=bool),
                                                                                  (B, T - 1, T - 1))], -1)
    h2 = draft.finish(attend(q2, jnp.concatenate([k, k2], 1), jnp.concatenate([v, v2], 1), mask), res2)
    return draft.logits(h1), draft.logits(h2)


def make_step(graphdef: nnx.GraphDef, rest: nnx.State, target: CausalLM, vocab_ids: jax.Array,
              tx: optax.GradientTransformation):
    """-> jitted step(params, opt_state, batch [B, T + 2] int32, lr f32) -> (params, opt_state, metrics); rest: the
    draft's non-trained state (d2t); tx's updates are scaled by lr here."""

    def soft(tlogits: jax.Array) -> jax.Array:
        return jax.nn.softmax(tlogits[..., vocab_ids], -1)  # the target's distribution on the draft vocabulary

    def loss_fn(params: nnx.State, batch: jax.Array) -> tuple[jax.Array, dict]:
        draft = nnx.merge(graphdef, params, rest)
        T = batch.shape[1] - 2
        aux, tlogits = target_pass(target, batch, draft.cfg.aux_layers)
        l1, l2 = unrolled_logits(draft, target.embed_tokens(batch[:, 1:T + 1]), aux[:, :T])
        p1, p2 = soft(tlogits[:, 1:T + 1]), soft(tlogits[:, 2:T + 1])
        ce1 = optax.softmax_cross_entropy(l1, p1).mean()
        ce2 = optax.softmax_cross_entropy(l2, p2).mean()
        agree = (jnp.argmax(l1, -1) == jnp.argmax(p1, -1)).mean()
        return ce1 + 0.8 * ce2, {"ce1": ce1, "ce2": ce2, "agree1": agree}

    @jax.jit
    def step(params: nnx.State, opt_state: optax.OptState, batch: jax.Array, lr: jax.Array):
        (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p + lr * u, params, updates), opt_state, {"loss": loss, **m}

    return step


def learning_rate(n: int, total: int, peak: float = 2e-3, warmup: int = 20) -> float:
    """Linear warmup, then cosine to peak / 10 at `total`."""
    if n < warmup:
        return peak * (n + 1) / warmup
    frac = min(1.0, (n - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.45 * (1 + np.cos(np.pi * frac)))


def train(target: CausalLM, draft: Eagle3Draft, tokens: np.ndarray, vocab_ids: np.ndarray, minutes: float,
          steps: int | None, seed: int, batch_size: int = 8, seq_len: int = 128) -> dict:
    """Train `draft` in place on random windows of tokens [N] for `steps` (or as many as fit `minutes`, the
    schedule fitted after 10 timed steps); -> summary (steps, wall time, losses)."""
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1.0, weight_decay=0.01))
    opt_state = tx.init(params)
    step_fn = make_step(graphdef, rest, target, jnp.asarray(vocab_ids), tx)
    rng, t0, losses, n, total = np.random.default_rng(seed), time.perf_counter(), [], 0, steps or 10**9
    while n < total and time.perf_counter() - t0 < minutes * 60:
        batch = jnp.asarray(tt.sample_batch(tokens, rng, batch_size, seq_len + 1))
        params, opt_state, m = step_fn(params, opt_state, batch, jnp.float32(learning_rate(n, total)))
        losses.append({k: float(v) for k, v in m.items()})  # blocks: the timing is real
        n += 1
        if n == 1:
            t1 = time.perf_counter()  # compilation excluded from the estimate
        if steps is None and n == 11:
            total = n + int(0.95 * (minutes * 60 - (time.perf_counter() - t0)) / ((time.perf_counter() - t1) / 10))
        if n % 25 == 0:
            print(f"step {n}/{total}: {losses[-1]}", flush=True)
    nnx.update(draft, params)
    return {"steps": n, "wall_seconds": time.perf_counter() - t0, "first": losses[0], "last": losses[-1],
            "last50": {k: float(np.mean([x[k] for x in losses[-50:]])) for k in losses[-1]}}


def export(draft: Eagle3Draft, folder: Path, vocab: int) -> None:
    """The draft's tensors under the published names (torch [out, in]) into folder/model.safetensors."""
    out = {}
    for name, (attr, transposed) in TENSORS.items():
        var = draft
        for part in attr.split("."):
            var = getattr(var, part)
        arr = np.asarray(var[...])
        # contiguous: safetensors writes an array's buffer as is, so a transposed view would keep [in, out] order
        out[name] = np.ascontiguousarray(arr.T if transposed else arr, np.int64 if name == "d2t" else np.float32)
    ids = np.arange(len(out["d2t"])) + out["d2t"]
    t2d = np.zeros(vocab, bool)
    t2d[ids] = True
    save_file({**out, "t2d": t2d}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def accept_length(checkpoint: str | Path, draft_dir: Path, prompts: np.ndarray, k: int = 3, new: int = 64) -> dict:
    """The served engine's speculation stats with eagle3:DRAFT:k (greedy, f32) over prompts [n, P]."""
    from jaxserve.engine import Engine, EngineConfig, SamplingParams

    cfg = EngineConfig(kv_dtype="f32", prefill_weights="f32", decode_weights="f32", dtype="float32", max_batch=8,
                       speculative=f"eagle3:{draft_dir}:{k}")
    e = Engine.from_checkpoint(checkpoint, cfg, start=False)
    e.generate([p.tolist() for p in prompts], SamplingParams(max_tokens=new, ignore_eos=True))
    s = e.stats()
    return {"k": k, "verify_rows": s["verify_rows"], "draft_tokens": s["draft_tokens"],
            "accepted_tokens": s["accepted_tokens"], "accept_length": 1 + s["accepted_tokens"] / s["verify_rows"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--checkpoint", default=str(CHECKPOINT))
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab", type=int, default=2048)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    _, target = jaxserve.load(args.checkpoint, dtype=jnp.float32)
    tokenizer = Tokenizer(args.checkpoint)
    tokens = tt.token_stream(corpus.read_texts(corpus.train_files()), tokenizer, tokenizer.token_to_id(tt.EOS))
    counts = np.bincount(tokens, minlength=target.cfg.vocab_size)
    vocab_ids = np.sort(np.argsort(-counts, kind="stable")[:args.draft_vocab])
    raw = json.loads((Path(args.checkpoint) / "config.json").read_text())
    draft = initial_draft(target, draft_config(raw, vocab_ids), vocab_ids, out, args.seed)
    summary = train(target, draft, tokens, vocab_ids, args.minutes, args.steps, args.seed)
    export(draft, out, target.cfg.vocab_size)
    held, _ = tt.heldout_stream(tokenizer, max_tokens=40000)
    summary["served"] = accept_length(args.checkpoint, out, greedy_prompts(held, n=8))
    summary["draft_vocab_coverage"] = float(counts[vocab_ids].sum() / counts.sum())
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
