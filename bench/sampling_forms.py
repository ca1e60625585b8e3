"""What the general sampling form costs (engine/sampling_forms.py): the jitted decode program alone, per step, in
the form a batch runs since it (greedy rows: the greedy form, unchanged; every other batch: the general "any" form)
against the program each batch ran before (the specialised "greedy" / "top_k" / "full" modes, no extras), and the
general form on a greedy batch (what merging everything into one program would cost greedy traffic).

Usage: python bench/sampling_forms.py [--reps 15] [--calls 10] [--rows 1,16] --json OUT.json

The embedded model under `jaxserve serve`'s default engine config (not started): `rows` requests of 64-token
prompts are decoding (bench.common.steady_decode captures the next decode call's batch), then each variant's
program is compiled and timed on that batch: `--reps` rounds, each round timing `--calls` calls of every variant
in turn (interleaved, so host load drifts hit all alike). Reports wall and process CPU seconds per call (median
of the rounds' means, min..max), each general-form variant's cost against the program the same rows ran before
(on medians and on minima: on a shared host the minimum is the least disturbed), and the load average (`uptime`)
before and after.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

# variant -> (row kind, form): "today" is the mode the host picked before the general form existed
VARIANTS = {"greedy/greedy": ("greedy", "greedy"), "greedy/any": ("greedy", "any"),
            "seeded/full (today)": ("seeded", "full"), "seeded/any": ("seeded", "any"),
            "top_k/top_k (today)": ("top_k", "top_k"), "top_k/any": ("top_k", "any")}


# each general-form variant against the program the same rows ran before
BASELINES = {"greedy/any": "greedy/greedy", "seeded/any": "seeded/full (today)", "top_k/any": "top_k/top_k (today)"}


def variant_arrays(engine: object, samp: object, rows: str, form: str) -> object:
    """The captured greedy batch's SamplingArrays with `rows` sampling parameters, in form `form`."""
    import jax.numpy as jnp

    n = samp.temperature.shape[0]
    if rows != "greedy":
        samp = dataclasses.replace(samp, temperature=jnp.ones(n, jnp.float32),
                                   top_k=jnp.full(n, 40 if rows == "top_k" else 0, jnp.int32),
                                   seed=jnp.arange(n, dtype=jnp.uint32) + 7)
    if form == "any":
        return engine.programs.forms.general(samp, engine.programs.decode_rows)
    return dataclasses.replace(samp, mode=form)


def time_calls(engine: object, batch: object, samp: object, calls: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per call of the decode program alone (the pool threaded through, as the engine
    does). CPU time counts every thread's work: on a host shared with other jobs it moves less than wall time."""
    p = engine.programs
    ph = p.decode_phase
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        out, ok, ph.pages = p._decode(ph.params, ph.pages, batch, samp)
    out.tokens.block_until_ready()
    return (time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls


def measure(rows: int, reps: int, calls: int) -> dict:
    from jaxserve.cli import build_parser, default_checkpoint
    from jaxserve.engine import Engine
    from jaxserve.server.main import engine_config

    engine = Engine.from_checkpoint(default_checkpoint(), engine_config(build_parser().parse_args(["serve"])),
                                    start=False)
    prompts = [[(17 * i + 31 * j) % 4000 + 10 for j in range(64)] for i in range(rows)]
    call = common.steady_decode(engine, prompts, max_tokens=1000)
    arrays = {name: variant_arrays(engine, call.samp, *kind) for name, kind in VARIANTS.items()}
    for s in arrays.values():  # compile each program (and settle) outside the timing
        time_calls(engine, call.batch, s, 2)
    wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(reps):
        for name, s in arrays.items():
            w, c = time_calls(engine, call.batch, s, calls)
            wall[name].append(w)
            cpu[name].append(c)
    engine.close()
    out = {name: {"wall": common.spread(wall[name]), "cpu": common.spread(cpu[name])} for name in VARIANTS}
    for name, base in BASELINES.items():
        out[name]["cost"] = {f"{clock} {stat}": out[name][clock][stat] / out[base][clock][stat] - 1
                             for clock in ("wall", "cpu") for stat in ("median", "min")}
    return out


def uptime() -> str:
    return subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rows", default="1,16", help="decode rows (concurrency) to measure, comma-separated")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    out: dict = {"bench": "sampling_forms", "machine": common.machine(), "reps": args.reps, "calls": args.calls,
                 "uptime_before": uptime(), "load_before": os.getloadavg()[0], "rows": {}}
    lines = []
    for c in (int(x) for x in args.rows.split(",")):
        out["rows"][c] = r = measure(c, args.reps, args.calls)
        for name, x in r.items():
            w, u = x["wall"], x["cpu"]
            cost = "  cost " + ", ".join(f"{k} {v:+.1%}" for k, v in x["cost"].items()) if "cost" in x else ""
            lines.append(f"c={c:<3} {name:<20} wall {w['median'] * 1e3:6.2f} ms ({w['min'] * 1e3:.2f}.."
                         f"{w['max'] * 1e3:.2f}) cpu {u['median'] * 1e3:6.2f} ms ({u['min'] * 1e3:.2f}.."
                         f"{u['max'] * 1e3:.2f}){cost}")
    out["uptime_after"], out["load_after"] = uptime(), os.getloadavg()[0]
    lines.append(f"load {out['load_before']:.1f} .. {out['load_after']:.1f}")
    return common.write_result(out, "\n".join(lines), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
