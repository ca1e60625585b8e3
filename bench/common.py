"""What every bench shares: the machine description (the host may be shared: load average included), result output."""
from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import jax


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """CPU model, cores, load average, JAX backend and device, Python and JAX versions."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
            "backend": jax.default_backend(), "device": str(jax.devices()[0]), "python": platform.python_version(),
            "jax": jax.__version__}


def write_result(result: dict, table_text: str, path: Path) -> int:
    """Print the bench's table, write its JSON result to `path`; the exit code for main()."""
    print(table_text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


@dataclass(frozen=True)
class DecodeCall:
    """The arguments of one steady-state decode-program call: Programs.run_decode(batch, samp) (the pool, with its
    device tags, is the engine's own)."""

    batch: object
    samp: object


def steady_decode(engine: object, prompts: list[list[int]], max_tokens: int) -> DecodeCall:
    """Submit `prompts` to a synchronous engine, step until every one decodes, and capture the arguments of the
    next decode-program call (to time the program alone)."""
    from jaxserve.engine import Request, SamplingParams
    from jaxserve.engine.request import Status

    for p in prompts:
        engine.submit(Request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    sched = engine.scheduler
    while sum(s.status is Status.DECODING for s in sched.running) < len(prompts):
        engine.step()
    captured: list[DecodeCall] = []
    real = engine.programs.dispatch_decode  # the scheduler enqueues decodes through it (run_decode also waits)

    def capture(batch, samp):  # noqa: ANN001, ANN202 - the dispatch_decode signature
        captured.append(DecodeCall(batch, samp))
        return real(batch, samp)

    engine.programs.dispatch_decode = capture
    try:
        engine.step()
    finally:
        del engine.programs.dispatch_decode
    return captured[0]


def spread(xs: list[float]) -> dict:
    """median, min, max of repeated measurements (the host is shared: the spread is part of the figure)."""
    import statistics

    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def minimal_decode_step(model: object, batch: int, context: int):  # noqa: ANN201 - (jitted step, state, cache)
    """The benches' lower bound for a decode step: the same MLA model, one jitted function, a dense f32 latent
    cache [layers, batch, context, latent_dim] updated in place (donated), absorbed attention over all `context`
    positions (masked), greedy argmax. No pages, no tag check, no sampling filters, no host work.

    Returns (step, state, cache); step(state, cache, tokens [B] int32, pos [B] int32) -> (tokens [B], cache).
    """
    import jax.numpy as jnp
    from flax import nnx

    cfg = model.cfg
    if not cfg.is_mla:
        raise ValueError("minimal_decode_step is written for MLA models")
    graphdef, state = nnx.split(model)
    cache = jnp.zeros((cfg.num_layers, batch, context, cfg.kv_lora_rank + cfg.qk_rope_head_dim), jnp.float32)

    def step(state, cache, tokens, pos):  # noqa: ANN001, ANN202
        m = nnx.merge(graphdef, state)
        cos, sin = m.rope(pos[:, None])
        h = m.embed_tokens(tokens[:, None])
        rows = jnp.arange(tokens.shape[0])
        mask = (jnp.arange(context)[None, :] <= pos[:, None])[:, None, :]  # [B, T=1, S]
        for i, layer in enumerate(m.layers):
            x = layer.input_norm(h)
            q_nope, q_rope, latent, _ = layer.attn.project(x, cos, sin)
            cache = cache.at[i, rows, pos].set(latent[:, 0].astype(cache.dtype))
            o = layer.attn.attend_absorbed(q_nope, q_rope, cache[i], mask)
            h = h + layer.attn.o(o.reshape(tokens.shape[0], 1, -1))
            h = h + layer.mlp(layer.post_norm(h))
        return jnp.argmax(m.logits(h[:, 0]), axis=-1).astype(jnp.int32), cache

    return jax.jit(step, donate_argnums=(1,)), state, cache


def time_minimal_step(model: object, batch: int, context: int, reps: int = 20) -> dict:
    """Seconds per call of `minimal_decode_step` (after a compile call): spread() plus the load average."""
    import time

    import jax.numpy as jnp

    step, state, cache = minimal_decode_step(model, batch, context)
    tokens = jnp.ones((batch,), jnp.int32)
    pos = jnp.full((batch,), context // 2, jnp.int32)
    tokens, cache = step(state, cache, tokens, pos)
    tokens.block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tokens, cache = step(state, cache, tokens, pos)
        tokens.block_until_ready()
        times.append(time.perf_counter() - t0)
    return {**spread(times), "loadavg": os.getloadavg()[0]}
