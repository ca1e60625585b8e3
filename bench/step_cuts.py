"""The c = 1 step cuts of issue #33 against their previous forms, in one process: each variant is an engine traced
with some cuts undone, its steady decode (plain) or verify (ngram:3) program captured, and the variants' calls
interleaved A B A B ... (a drift in the shared host's load hits every variant alike).

Usage: python bench/step_cuts.py [--rows 1,16] [--methods plain,ngram] [--reps 100]
                                 [--variants now,before] [--json bench/results/step_cuts.json]

Cuts (each undone by a variant):
- "pin" (paged_attention_xla.mla_decode): the page gathers tied to the loop index. Without it, one block covering a
  short context's table made the gathers loop-invariant: hoisted out of the loop, XLA:CPU fused the layer's KV
  write into them and copied the whole FP8 scale pool once per layer.
- "bdot" (layers.Experts.dense_all): gate and up batched over experts. As one [N, H] x [H, E * I] product XLA:CPU
  transposed each [E, H, I] weight to [H, E, I] on every call.
- "gbf16" (layers.Experts.gathered), dropped: a bf16 expert weight gathered as it is (XLA:CPU converts the
  gathered copy to f32 inside the gather), where its f32 twin's gather read twice the bytes for the same values.
  The experts hold no twin since, so the variant that gathered from it cannot run; its runs stay in
  bench/results/step_cuts_gather.json and step_cuts_gather_c1.json.
- "g8" (layers.MoE.routed): as many (token, slot) pairs as experts (the c = 1 verify's 4 x 2 over 8) take the
  gathers. Without it, dense_all (every expert's bf16 matmuls).
- "slots" (layers.MoE.routed_by_slots): more pairs than dense_all takes (the 16- and 32-row decode, a verify of 4+
  rows) fill expert slots, one batched product per projection. Without it, the grouped tile loop (a trip per tile).
- "gateup" (layers.MoE.routed, `layers.GATE_UP_ROWS`): up to 32 token rows run dense_all off the experts' gate_up
  twin, as two-dimensional products. Without it, the paths above.
- "swiglu" (layers.swiglu): a bf16 silu computed in f32 and rounded once (as torch's). Without it, jax.nn.silu on
  bf16, rounding after each of its ops.
Variants: "now" (the tree), "no-CUT" or "no-CUT+CUT..." (those undone), "before" (pin and bdot undone),
"wideN" (the tree with products of up to N token rows reading a Linear's f32 twin: `layers.WIDE_ROWS` = N),
"gateupN" (the tree with `layers.GATE_UP_ROWS` = N).
Per (method, rows, variant): program ms (median, min..max, p10 over --reps calls), the compiled program's copies (all,
and of >= 64K elements), and whether its first call's greedy tokens equal the first variant's. Load (/proc/loadavg) is recorded: the host may be shared.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.spec_profile import call, capture_program  # noqa: E402
from bench.speculative import CKPT, prompts_for  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.engine.config import Speculative  # noqa: E402
from jaxserve.models import layers, paged_attention_xla  # noqa: E402

CUTS = ("pin", "bdot", "g8", "slots", "gateup", "swiglu")
PIN = "lat, lat_scale = jax.lax.optimization_barrier(((latent, latent_scale), j))[0]"


def unpinned_mla_decode():  # noqa: ANN201
    """mla_decode as it was: the same source with the loop-index barrier replaced by the arrays themselves."""
    src = inspect.getsource(paged_attention_xla.mla_decode)
    if PIN not in src:
        raise SystemExit("mla_decode no longer has the barrier this bench undoes")
    ns = dict(vars(paged_attention_xla))
    exec(src.replace(PIN, "lat, lat_scale = latent, latent_scale"), ns)  # noqa: S102 - the module's own source
    return ns["mla_decode"]


def transposed_dense_all(self: layers.Experts, x: jax.Array, weight: jax.Array) -> jax.Array:
    """Experts.dense_all as it was: gate and up as one [N, H] x [H, E * I] product each."""
    n = x.shape[0]
    e, _, inter = self.gate.shape

    def up_proj(w):  # noqa: ANN001, ANN202
        return jnp.einsum("nh,ehi->nei", x, w[...].astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)

    h = jax.nn.silu(up_proj(self.gate)) * up_proj(self.up)  # [N, E, I]
    hw = jnp.where(weight[..., None] != 0, h.astype(jnp.float32) * weight[..., None], 0).astype(x.dtype)
    down = self.down[...].astype(x.dtype).reshape(e * inter, -1)
    return jnp.dot(hw.reshape(n, e * inter), down, preferred_element_type=jnp.float32)


G8 = "if not kernel and n * k <= e_local:"


def dense_at_e_routed():  # noqa: ANN201
    """MoE.routed as it was: as many (token, slot) pairs as experts went through dense_all, not the gathers."""
    src = textwrap.dedent(inspect.getsource(layers.MoE.routed))
    if G8 not in src:
        raise SystemExit("MoE.routed no longer has the condition this bench undoes")
    ns = dict(vars(layers))
    exec(src.replace(G8, "if not kernel and n * k < e_local:"), ns)  # noqa: S102 - the module's own source
    return ns["routed"]


def cuts_of(variant: str) -> set[str]:
    """The cuts a variant undoes: "now" none, "before" pin and bdot, "no-A+B" A and B."""
    if variant == "now":
        return set()
    if variant == "before":
        return {"pin", "bdot"}
    if re.fullmatch(r"(wide|gateup)\d+", variant):
        return set()
    cuts = set(variant.removeprefix("no-").split("+"))
    if not variant.startswith("no-") or not cuts <= set(CUTS):
        raise SystemExit(f"unknown variant {variant!r}: now, before, or no-CUT[+CUT...] of {', '.join(CUTS)}")
    return cuts


@contextlib.contextmanager
def undone(variant: str):
    """The tree with the variant's cuts undone while an engine is built and traced."""
    real = (paged_attention_xla.mla_decode, layers.Experts.dense_all, layers.MoE.routed, layers.swiglu)
    wide_rows, slots_max, gate_up_rows = layers.WIDE_ROWS, layers.SLOTS_MAX_ELEMENTS, layers.GATE_UP_ROWS
    cuts = cuts_of(variant)
    if "slots" in cuts:
        layers.SLOTS_MAX_ELEMENTS = -1
    if "gateup" in cuts:
        layers.GATE_UP_ROWS = 0
    if variant.startswith("wide"):
        layers.WIDE_ROWS = int(variant.removeprefix("wide"))
    if re.fullmatch(r"gateup\d+", variant):
        layers.GATE_UP_ROWS = int(variant.removeprefix("gateup"))
    if "pin" in cuts:
        paged_attention_xla.mla_decode = unpinned_mla_decode()
    if "bdot" in cuts:
        layers.Experts.dense_all = transposed_dense_all
    if "g8" in cuts:
        layers.MoE.routed = dense_at_e_routed()
    if "swiglu" in cuts:
        layers.swiglu = lambda gate, up: jax.nn.silu(gate) * up
    try:
        yield
    finally:
        paged_attention_xla.mla_decode, layers.Experts.dense_all, layers.MoE.routed, layers.swiglu = real
        layers.WIDE_ROWS, layers.SLOTS_MAX_ELEMENTS, layers.GATE_UP_ROWS = wide_rows, slots_max, gate_up_rows


def copies(hlo: str) -> tuple[int, int]:
    """(copy ops, copies of >= 64K elements) in a compiled module's text."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", hlo)
    return len(shapes), sum(int(np.prod([int(d) for d in s.split(",") if d] or [1])) >= 65536 for s in shapes)


def build(variant: str, method: str, rows: int) -> dict:
    with undone(variant):
        cfg = EngineConfig(prefix_cache=False, speculative=None if method == "plain" else Speculative(method, 3, None))
        engine = Engine.from_checkpoint(CKPT, cfg, start=False)
        fn, attr, rest = capture_program(engine, prompts_for(engine, rows, seed=1), 64)
        ph = engine.scheduler.programs.decode_phase
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), ph.pages)
        n_copy, big = copies(fn.lower(ph.params, spec, *rest).compile().as_text())
        tokens = np.asarray(call(engine, fn, rest)[0].tokens)
    return {"engine": engine, "fn": fn, "rest": rest, "program": attr, "copies": n_copy, "big_copies": big,
            "tokens": tokens, "ms": []}


def measure(variants: list[str], method: str, rows: int, reps: int) -> list[dict]:
    built = {v: build(v, method, rows) for v in variants}
    load0 = os.getloadavg()
    for i in range(reps + 5):  # 5 untimed rounds first
        for b in built.values():
            t0 = time.perf_counter()
            jax.block_until_ready(call(b["engine"], b["fn"], b["rest"]))
            if i >= 5:
                b["ms"].append((time.perf_counter() - t0) * 1e3)
    load1 = os.getloadavg()
    first = built[variants[0]]["tokens"]
    out = []
    for v, b in built.items():
        ms = {**common.spread(b["ms"]), "p10": float(np.percentile(b["ms"], 10))}
        out.append({"method": method, "rows": rows, "variant": v, "program": b["program"], "ms": ms,
                    "copies": b["copies"], "big_copies": b["big_copies"],
                    "tokens_equal_first": bool(np.array_equal(b["tokens"], first)),
                    "loadavg_start": load0, "loadavg_end": load1})
        b["engine"].close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--methods", default="plain,ngram")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--variants", default="now,before")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "step_cuts.json")
    args = ap.parse_args()
    out = {"bench": "step_cuts", "machine": common.machine(), "rows": []}
    lines = []
    for method in args.methods.split(","):
        for r in (int(x) for x in args.rows.split(",")):
            for row in measure(args.variants.split(","), method, r, args.reps):
                out["rows"].append(row)
                ms = row["ms"]
                lines.append(f"{method:>6} rows {r:>2} {row['variant']:<8} {ms['median']:.2f} ms ({ms['min']:.2f}.."
                             f"{ms['max']:.2f}, p10 {ms['p10']:.2f}), copies {row['copies']} ({row['big_copies']} >= 64K elements), tokens "
                             f"equal {row['tokens_equal_first']}, load {row['loadavg_start'][0]:.1f}->"
                             f"{row['loadavg_end'][0]:.1f}")
                print(lines[-1], flush=True)
    return common.write_result(out, "\n".join(lines), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
