"""An EAGLE-3 draft model (the published `LlamaForCausalLMEagle3` layout) and its loader.

Checkpoint folder: config.json (a Llama config with `draft_vocab_size`, optionally `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with `fc.weight` [H, 3 * H_target],
`midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`
(q/k/v over 2H inputs), `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight` [draft_vocab, H],
`d2t` [draft_vocab] int64 (target id = draft id + d2t[draft id]), and optionally `embed_tokens.weight` [V, H] (absent:
the target's embedding is used, as the references do).

Position p's draft row (as SGLang / vLLM run it): aux_p = concat of the target's residual stream at the *inputs* of
three layers (`Eagle3Config.aux_layers`; default 2, N // 2, N - 3, index N = the last layer's output before the final
norm; ids pinned in the config name layer *outputs*, so id j is the input of layer j + 1, SGLang's reading);
g = fc(aux_p), or the previous chained step's output; residual = g; x = concat[input_layernorm(embed(token_{p+1})),
hidden_norm(g)] [2H]; h = residual + o_proj(attn(x)) (Llama GQA attention with RoPE at position p over the draft's
rows <= p); h = h + mlp(post_attention_layernorm(h)). h (before `norm`) is the next chained step's input; the
logits lm_head(norm(h)) over the draft vocabulary predict token_{p+2}.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, RopeConfig, _rope_from_hf
from jaxserve.errors import CheckpointError, ConfigError
from jaxserve.models.decoder import causal_mask
from jaxserve.models.layers import INIT_STD, RMSNorm, abstract_build, swiglu
from jaxserve.models.rope import apply_rope, cos_sin

NEG = -1e30  # masked attention score: finite, so a fully masked (padding) row stays NaN-free


@dataclass(frozen=True)
class Eagle3Config:
    """The draft's shapes. aux_layers: the target layers whose input hidden state (the residual stream) `fc`
    reads, ascending (num_layers: the last layer's output); vocab_size: the target's."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False


def read_config(folder: str | Path, target: ModelConfig) -> Eagle3Config:
    """The draft config in `folder`/config.json, checked against the target's config (ConfigError naming the field
    that does not fit; CheckpointError when the file is missing or not JSON)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"EAGLE-3 draft config {path} cannot be read: {e}", value=str(path),
                              param="config.json") from e

    def bad(field: str, msg: str, value: object) -> ConfigError:
        return ConfigError(f"EAGLE-3 draft {path}: {field} {msg}", value=value, param=field)

    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise bad("num_hidden_layers", "must be 1 (one midlayer)", raw.get("num_hidden_layers"))
    if raw.get("hidden_act", "silu") != "silu":
        raise bad("hidden_act", "must be silu", raw.get("hidden_act"))
    H, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    ht = int(raw.get("target_hidden_size") or H)
    if ht != target.hidden_size:
        raise bad("target_hidden_size", f"is {ht}, but the target's hidden_size is {target.hidden_size}", ht)
    vocab = int(raw.get("vocab_size") or target.vocab_size)
    if vocab != target.vocab_size:
        raise bad("vocab_size", f"is {vocab}, but the target's vocab_size is {target.vocab_size}", vocab)
    n = target.num_layers
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
        raw.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(int(i) + 1 for i in ids) if ids else (2, n // 2, n - 3)
    if len(aux) != 3 or len(set(aux)) != 3 or not all(0 <= i <= n for i in aux):
        raise bad("eagle_aux_hidden_state_layer_ids", f"must name 3 distinct layers of the target's {n} "
                  f"(inputs {aux} resolved)", ids or aux)
    return Eagle3Config(hidden_size=H, num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                        head_dim=int(raw.get("head_dim") or H // heads),
                        intermediate_size=int(raw["intermediate_size"]),
                        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                        rope=_rope_from_hf(raw, int(raw.get("max_position_embeddings", 4096))), vocab_size=vocab,
                        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab), target_hidden_size=ht,
                        aux_layers=tuple(sorted(aux)), norm_before_residual=bool(raw.get("norm_before_residual")))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense GQA attention in f32: q [B, T, N, d], k/v [B, S, Nkv, d], mask [B, T, S] bool -> [B, T, N * d] in
    q's dtype."""
    B, T, N, d = q.shape
    kv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(B, T, kv, N // kv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * d ** -0.5
    p = jax.nn.softmax(jnp.where(mask[:, None, None], s, NEG), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, N * d).astype(q.dtype)


class Eagle3Draft(nnx.Module):
    """The draft's weights, matmul weights stored [in, out]: fc [3 Ht, H]; q [2H, N d]; k, v [2H, Nkv d];
    o [N d, H]; gate, up [H, I]; down [I, H]; lm_head [H, Vd]; d2t [Vd] int32; embed [V, H] or None (the target's).
    Plain arrays, not `layers.Linear`: the target's weight formats and shardings never apply to them (replicated)."""

    def __init__(self, cfg: Eagle3Config, *, dtype: jnp.dtype, rngs: nnx.Rngs, embed: bool = False) -> None:
        self.cfg = cfg
        H, d = cfg.hidden_size, cfg.head_dim

        def init(*shape: int) -> nnx.Param:
            return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD).astype(dtype))

        self.fc = init(3 * cfg.target_hidden_size, H)
        eps = cfg.rms_norm_eps
        self.hidden_norm, self.input_norm = RMSNorm(H, eps, dtype=dtype), RMSNorm(H, eps, dtype=dtype)
        self.post_norm, self.norm = RMSNorm(H, eps, dtype=dtype), RMSNorm(H, eps, dtype=dtype)
        self.q, self.o = init(2 * H, cfg.num_heads * d), init(cfg.num_heads * d, H)
        self.k, self.v = init(2 * H, cfg.num_kv_heads * d), init(2 * H, cfg.num_kv_heads * d)
        self.gate, self.up = init(H, cfg.intermediate_size), init(H, cfg.intermediate_size)
        self.down = init(cfg.intermediate_size, H)
        self.lm_head = init(H, cfg.draft_vocab_size)
        self.d2t = nnx.Variable(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))
        self.embed = init(cfg.vocab_size, H) if embed else None

    @property
    def dtype(self) -> jnp.dtype:
        return self.fc.get_value().dtype

    def project(self, aux: jax.Array) -> jax.Array:
        """aux [..., 3 Ht] (the target's three hidden states) -> the midlayer's hidden input [..., H]."""
        return jnp.dot(aux.astype(self.dtype), self.fc[...])

    def layer_input(self, embedded: jax.Array, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        """embedded [..., H] (the next tokens' embeddings), hidden [..., H] (fc output or the previous step's h)
        -> (attention input [..., 2H], residual [..., H])."""
        hidden = hidden.astype(self.dtype)
        normed = self.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        return jnp.concatenate([self.input_norm(embedded.astype(self.dtype)), normed], axis=-1), residual

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, 2H], cos/sin [B, T, d // 2] -> q [B, T, N, d], k, v [B, T, Nkv, d] (RoPE on q and k)."""
        B, T, _ = x.shape
        c = self.cfg
        q = jnp.dot(x, self.q[...]).reshape(B, T, c.num_heads, c.head_dim)
        k = jnp.dot(x, self.k[...]).reshape(B, T, c.num_kv_heads, c.head_dim)
        v = jnp.dot(x, self.v[...]).reshape(B, T, c.num_kv_heads, c.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [B, T] -> cos, sin [B, T, d // 2] f32."""
        return cos_sin(positions, self.cfg.rope, self.cfg.head_dim)

    def finish(self, o: jax.Array, residual: jax.Array) -> jax.Array:
        """o [..., N d] (attention output), residual [..., H] -> the layer's output h [..., H] (before `norm`)."""
        h = residual + jnp.dot(o, self.o[...])
        x = self.post_norm(h)
        return h + jnp.dot(swiglu(jnp.dot(x, self.gate[...]), jnp.dot(x, self.up[...])), self.down[...])

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., H] -> logits over the draft vocabulary [..., Vd] f32."""
        return jnp.dot(self.norm(h), self.lm_head[...], preferred_element_type=jnp.float32)

    def to_target(self, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> target ids (int32), through d2t."""
        return (draft_ids + self.d2t[...][draft_ids]).astype(jnp.int32)

    def top1(self, h: jax.Array) -> jax.Array:
        """h [..., H] -> the draft's top-1 next token [...] as a target id (int32)."""
        return self.to_target(jnp.argmax(self.logits(h), -1))


def eagle3_forward(draft: Eagle3Draft, embedded: jax.Array, hidden: jax.Array, positions: jax.Array | None = None,
                   lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The draft over a dense context (the reference for the paged path): embedded [B, T, H] (the embeddings of
    the token after each position), hidden [B, T, 3 Ht] (the target's aux states: `fc` applies) or [B, T, H],
    positions [B, T] int32 (default arange), lengths [B] int32 -> (logits [B, T, Vd] f32, h [B, T, H])."""
    B, T = embedded.shape[:2]
    positions, mask = causal_mask(B, T, positions, lengths)
    if hidden.shape[-1] != draft.cfg.hidden_size:
        hidden = draft.project(hidden)
    x, residual = draft.layer_input(embedded, hidden)
    cos, sin = draft.rope(positions)
    q, k, v = draft.qkv(x, cos, sin)
    h = draft.finish(attend(q, k, v, mask), residual)
    return draft.logits(h), h


# checkpoint name -> (attribute, transposed: torch [out, in] stored as [in, out])
TENSORS = {"fc.weight": ("fc", True), "midlayer.hidden_norm.weight": ("hidden_norm.weight", False),
           "midlayer.input_layernorm.weight": ("input_norm.weight", False),
           "midlayer.post_attention_layernorm.weight": ("post_norm.weight", False),
           "midlayer.self_attn.q_proj.weight": ("q", True), "midlayer.self_attn.k_proj.weight": ("k", True),
           "midlayer.self_attn.v_proj.weight": ("v", True), "midlayer.self_attn.o_proj.weight": ("o", True),
           "midlayer.mlp.gate_proj.weight": ("gate", True), "midlayer.mlp.up_proj.weight": ("up", True),
           "midlayer.mlp.down_proj.weight": ("down", True), "norm.weight": ("norm.weight", False),
           "lm_head.weight": ("lm_head", True), "d2t": ("d2t", False)}


def load_eagle3(folder: str | Path, target: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> Eagle3Draft:
    """The EAGLE-3 draft in `folder` (config.json + safetensors), for `target`, weights in `dtype` on the host's
    default device. A missing tensor or one whose shape does not fit the config: CheckpointError naming it."""
    from jaxserve.convert.safetensors_io import SafetensorsFolder

    cfg = read_config(folder, target)
    st = SafetensorsFolder(folder)
    names = dict(TENSORS)
    has_embed = "embed_tokens.weight" in st
    if has_embed:
        names["embed_tokens.weight"] = ("embed", False)
    elif cfg.hidden_size != target.hidden_size:
        raise CheckpointError(f"EAGLE-3 draft {folder}: no embed_tokens.weight, and its hidden_size "
                              f"{cfg.hidden_size} differs from the target's {target.hidden_size} (whose embedding "
                              "it would share)", value="embed_tokens.weight", param="embed_tokens.weight")
    draft = abstract_build(lambda rngs: Eagle3Draft(cfg, dtype=dtype, rngs=rngs, embed=has_embed))
    for name, (attr, transposed) in names.items():
        var = draft
        for part in attr.split("."):
            var = getattr(var, part)
        want = var.get_value()
        arr = st.read(name)  # CheckpointError when missing
        arr = arr.T if transposed else arr
        if tuple(arr.shape) != tuple(want.shape):
            raise CheckpointError(f"EAGLE-3 draft {folder}: {name} has shape {list(arr.shape)}, the config needs "
                                  f"{list(arr.T.shape) if transposed else list(want.shape)}", value=list(arr.shape),
                                  param=name)
        var.set_value(jnp.asarray(_checked_d2t(arr, cfg, folder) if name == "d2t" else arr, want.dtype))
    return draft


def _checked_d2t(d2t: np.ndarray, cfg: Eagle3Config, folder: str | Path) -> np.ndarray:
    """d2t, with every mapped id inside the target vocabulary (CheckpointError otherwise)."""
    mapped = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
    if mapped.min() < 0 or mapped.max() >= cfg.vocab_size:
        raise CheckpointError(f"EAGLE-3 draft {folder}: d2t maps draft ids outside the target vocabulary "
                              f"[0, {cfg.vocab_size})", value=int(mapped.max()), param="d2t")
    return d2t
