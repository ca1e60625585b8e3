"""Tiny random EAGLE-3 draft checkpoints (the published `LlamaForCausalLMEagle3` layout) and an independent torch
reference of the draft forward, built from transformers' Llama parts with a 2H-input attention as the references
(SGLang / vLLM llama_eagle3) build it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from jaxserve.config import ModelConfig

SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, draft_vocab_size=64)


def write_draft(folder: Path, target: ModelConfig, *, seed: int = 0, std: float = 0.2, embed: bool = False,
                aux_ids: list[int] | None = None, drop: str | None = None, **overrides: object) -> dict[str, np.ndarray]:
    """A random draft for `target` in `folder` (config.json + model.safetensors); drop: a tensor left out.
    -> the tensors written (torch layout, [out, in])."""
    rng = np.random.default_rng(seed)
    H, V = target.hidden_size, target.vocab_size
    raw = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=H, num_hidden_layers=1,
               max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
               hidden_act="silu", **SHAPE)
    if aux_ids is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    raw.update(overrides)
    nh, nkv, d, inter, vd = (raw[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                              "intermediate_size", "draft_vocab_size"))

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rng.standard_normal(H) * 0.1).astype(np.float32)

    ids = np.sort(rng.choice(V, vd, replace=False))  # the draft vocabulary: a subset of the target's
    t2d = np.zeros(V, bool)
    t2d[ids] = True
    out = {"fc.weight": w(H, 3 * H), "midlayer.hidden_norm.weight": norm(),
           "midlayer.input_layernorm.weight": norm(), "midlayer.post_attention_layernorm.weight": norm(),
           "midlayer.self_attn.q_proj.weight": w(nh * d, 2 * H), "midlayer.self_attn.k_proj.weight": w(nkv * d, 2 * H),
           "midlayer.self_attn.v_proj.weight": w(nkv * d, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, nh * d),
           "midlayer.mlp.gate_proj.weight": w(inter, H), "midlayer.mlp.up_proj.weight": w(inter, H),
           "midlayer.mlp.down_proj.weight": w(H, inter), "norm.weight": norm(), "lm_head.weight": w(vd, H),
           "d2t": (ids - np.arange(vd)).astype(np.int64), "t2d": t2d}
    if embed:
        out["embed_tokens.weight"] = w(V, H)
    if drop is not None:
        del out[drop]
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return out


class TorchEagle3(torch.nn.Module):
    """The draft forward in torch: fc over the aux states (or the previous step's h), residual = that, then
    concat[input_layernorm(embed), hidden_norm(g)] through a LlamaAttention whose q/k/v take 2H inputs, the
    residual add, LlamaMLP after post_attention_layernorm, norm and lm_head."""

    def __init__(self, tensors: dict[str, np.ndarray], config: dict) -> None:
        super().__init__()
        cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "eagle_config")})
        cfg._attn_implementation = "eager"
        H, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H = H
        self.fc = torch.nn.Linear(3 * H, H, bias=False)
        self.hidden_norm, self.input_layernorm, self.post_attention_layernorm, self.norm = (
            LlamaRMSNorm(H, cfg.rms_norm_eps) for _ in range(4))
        self.self_attn = LlamaAttention(cfg, layer_idx=0)
        self.self_attn.q_proj = torch.nn.Linear(2 * H, nh * d, bias=False)
        self.self_attn.k_proj = torch.nn.Linear(2 * H, nkv * d, bias=False)
        self.self_attn.v_proj = torch.nn.Linear(2 * H, nkv * d, bias=False)
        self.mlp = LlamaMLP(cfg)
        self.lm_head = torch.nn.Linear(H, config["draft_vocab_size"], bias=False)
        self.rotary = LlamaRotaryEmbedding(cfg)
        state = {k.removeprefix("midlayer."): torch.from_numpy(v) for k, v in tensors.items()
                 if k not in ("d2t", "t2d", "embed_tokens.weight")}
        self.load_state_dict(state, strict=False)
        self.d2t = torch.from_numpy(tensors["d2t"])

    @torch.no_grad()
    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embedded [B, T, H], hidden [B, T, 3H] (or [B, T, H]) -> (draft logits [B, T, Vd], h [B, T, H])."""
        B, T, _ = embedded.shape
        g = self.fc(hidden) if hidden.shape[-1] != self.H else hidden
        x = torch.cat([self.input_layernorm(embedded), self.hidden_norm(g)], -1)
        pos = torch.arange(T)[None].expand(B, T)
        cos, sin = self.rotary(x, pos)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        a, _ = self.self_attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)
        h = g + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)), h

    def top1(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] -> target ids of their argmax."""
        i = logits.argmax(-1)
        return i + self.d2t[i]
