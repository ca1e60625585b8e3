"""A roofline of one compiled decode step, per device: the bytes the step must move (its minimum), the bytes the
compiled program moves outside the kernels, the collectives, and the step time and tokens/s those bound at a
chip's HBM and interconnect bandwidth (jaxserve/targets.py). Pure functions; the compiled program's traffic comes
from jaxserve/hlo_bytes.py (via plan_compile.PhaseCompile.traffic), the driver is bench/roofline_compiled.py.

Minimum bytes per device and step: the weights the step reads (everything but the routed experts and the MTP head,
each device's shard; of the embedding only the batch's rows; of the routed experts the ones the batch touches in
expectation under uniform routing, E * (1 - (1 - k/E)^B) of E per layer), the KV of the live context in the decode
pool's format (MLA under TP attention: every device reads every row's latent; GLM-5.x DSA: the top-k selected
latent rows and every context token's indexer key), the new KV rows written, and the residual stream (read and
written by each layer's attention and MLP). Outside the kernels: every fusion, copy, convert, transpose, scatter,
slice that is neither a Pallas kernel nor an XLA matmul (hlo_bytes). These are bounds, not measurements: launch
and collective latency, compute, and the kernels' own efficiency are not in them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from jaxserve.hlo_bytes import CATEGORIES

BF16 = 2


@dataclass(frozen=True)
class StepShape:
    """What one decode step reads per device. dense_weight_bytes: every weight read in full each step (attention,
    norms, routers, shared experts, dense MLPs, lm_head: this device's shards); routed_weight_bytes: all routed
    experts of all MoE layers on this device; experts / top_k: E and k; hidden; layers (main, no MTP);
    kv_layer_bytes: one token's KV in one layer (latent + scale); index_layers / index_token_bytes: DSA indexer key
    layers and one token's key bytes in one (0: none); sparse_topk: DSA's selected tokens (0: dense attention);
    kv_rows_per_device: the fraction of rows whose KV a device reads (1: TP attention's replicated latent, 1/N: DP)."""

    dense_weight_bytes: int
    routed_weight_bytes: int
    experts: int
    top_k: int
    hidden: int
    layers: int
    kv_layer_bytes: int
    index_layers: int = 0
    index_token_bytes: int = 0
    sparse_topk: int = 0
    kv_rows_per_device: float = 1.0


def touched_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens route to, each to top_k of `experts` (uniform routing)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens) if experts else 0.0


def minimum_bytes(s: StepShape, rows: int, context: int) -> dict[str, float]:
    """Bytes one device must move in one decode step of `rows` rows at `context` tokens each."""
    frac = touched_experts(s.experts, s.top_k, rows) / s.experts if s.experts else 0.0
    attended = min(context, s.sparse_topk) if s.sparse_topk else context
    kv_rows = rows * s.kv_rows_per_device
    kv = kv_rows * s.layers * (attended * s.kv_layer_bytes) + kv_rows * s.index_layers * context * s.index_token_bytes
    out = {
        "dense_weights": float(s.dense_weight_bytes + rows * s.hidden * BF16),  # + the batch's embedding rows
        "routed_weights": s.routed_weight_bytes * frac,
        "kv_read": float(kv),
        "kv_write": kv_rows * (s.layers * s.kv_layer_bytes + s.index_layers * s.index_token_bytes),
        "activations": float(s.layers * rows * s.hidden * BF16 * 4),  # residual read + written by attention and MLP
        "touched_experts_per_layer": touched_experts(s.experts, s.top_k, rows),
    }
    out["total"] = sum(v for k, v in out.items() if k != "touched_experts_per_layer")
    return out


def collective_seconds(kind: str, result_bytes: int, devices: int, link_bytes_per_s: float) -> float:
    """Bandwidth time of one collective over `devices` (ring algorithms; each device sends what it must, at one
    direction's link bandwidth). result_bytes: the op's result size on one device."""
    n = max(devices, 1)
    if n == 1 or link_bytes_per_s <= 0:
        return 0.0
    sent = {"all-reduce": 2 * (n - 1) / n * result_bytes, "all-gather": (n - 1) / n * result_bytes,
            "reduce-scatter": (n - 1) * result_bytes, "all-to-all": (n - 1) / n * result_bytes,
            "collective-permute": result_bytes}.get(kind, result_bytes)
    return sent / link_bytes_per_s


@dataclass(frozen=True)
class Chip:
    """A device's bandwidths: HBM bytes/s, interconnect bytes/s per direction per device, and where they are from."""

    name: str
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    source: str = ""


def predict(minimum: dict[str, float], outside_bytes: float, matmul_bytes: float,
            collectives: list[dict], chip: Chip, devices: int, rows: int) -> dict[str, float]:
    """Step time and tokens/s bounds. collectives: [{kind, count, bytes}] per step.
    - ideal: the minimum bytes at HBM bandwidth, collectives overlapped (max): no program can beat it;
    - overlapped: minimum + outside-kernel bytes + the XLA matmuls' activation bytes (their weights are in the
      minimum) at HBM bandwidth, collectives overlapped (max);
    - serial: the same bytes, then the collectives (sum): each layer's all-reduce feeds the next layer."""
    link = sum(c["count"] * collective_seconds(c["kind"], c["bytes"], devices, chip.link_bytes_per_s)
               for c in collectives)
    ideal = minimum["total"] / chip.hbm_bytes_per_s
    hbm = (minimum["total"] + outside_bytes + matmul_bytes) / chip.hbm_bytes_per_s
    out = {"ideal_s": max(ideal, link), "overlapped_s": max(hbm, link), "serial_s": hbm + link,
           "hbm_s": hbm, "collective_s": link,
           "collective_bytes": float(sum(c["count"] * c["bytes"] for c in collectives))}
    for k in ("ideal", "overlapped", "serial"):
        out[f"{k}_tokens_per_s"] = rows / out[f"{k}_s"] if out[f"{k}_s"] > 0 else math.inf
    return out


def traffic_summary(rows: list[dict]) -> dict[str, float]:
    """Bytes per category (hlo_bytes.CATEGORIES) over plan_compile traffic rows ({category, bytes, count, ...})."""
    out = {c: 0.0 for c in CATEGORIES}
    for r in rows:
        out[r["category"]] = out.get(r["category"], 0.0) + float(r["bytes"]) * int(r["count"])
    return out


def offenders(rows: list[dict], top: int = 8) -> list[dict]:
    """The outside-kernel rows that move most per step: [{op, what, result, count, bytes_each, bytes}]."""
    out = [{"op": r["op"], "what": r["what"], "result": r["result"], "count": int(r["count"]),
            "bytes_each": int(r["bytes"]), "bytes": int(r["bytes"]) * int(r["count"])}
           for r in rows if r["category"] == "outside" and int(r["count"]) > 0]
    return sorted(out, key=lambda r: -r["bytes"])[:top]


def roofline_row(shape: StepShape, rows: int, context: int, traffic: list[dict], collectives: list[dict],
                 chip: Chip, devices: int) -> dict:
    """One concurrency's row: minimum bytes, the compiled step's traffic by category, the outside / minimum ratio,
    its largest offenders, and the predicted bounds. weights_read_over_dense: the weight bytes the compiled
    program reads outside the Pallas kernels over the model's dense weights (1: each read once, as the minimum
    assumes; the check that the two accountings agree)."""
    minimum = minimum_bytes(shape, rows, context)
    t = traffic_summary(traffic)
    pred = predict(minimum, t["outside"], t["matmul"], collectives, chip, devices, rows)
    return {"rows": rows, "context": context, "minimum_bytes": minimum, "traffic_bytes": t,
            "weights_read_over_dense": t["weights"] / shape.dense_weight_bytes if shape.dense_weight_bytes else 0.0,
            "outside_over_minimum": t["outside"] / minimum["total"],
            "offenders": offenders(traffic), "predicted": pred, "chip": asdict(chip)}
