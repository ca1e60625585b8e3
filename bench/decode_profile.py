"""Where the embedded model's decode program spends its time on XLA:CPU, at c = 1 and c = 16: per thunk (each
fusion, dot, loop or copy the thunk runtime executes), grouped by the model code that made it, the thunks run per
step, and the dispatch; variants side by side in one process, calls interleaved.

Usage: python bench/decode_profile.py [--concurrency 1 16] [--reps 200] [--trace-steps 30]
                                      [--variants wide bf16-only] [--json bench/results/decode_profile.json]

Per concurrency, each variant is an `Engine` in `serve`'s formats (FP8 KV, INT4 decode weights, FP8 prefill, bf16
activations, the CPU's compute weight layout; no prefix cache) stepped to steady decode of c 64-token prompts
(128 new tokens, greedy); the next decode program call's arguments are captured and the program is then called
back to back on them (the pool threaded through, as the engine does):
- ms: wall time per call to its result (median, min..max over --reps calls, the variants' calls interleaved A B A
  B ...), cpu_ms: this process's CPU time per call (every thread: > ms when a second core works), dispatch_ms: the
  time `jit` takes to return (argument handling and enqueue; the program then runs on XLA's threads);
- a `jax.profiler` trace of --trace-steps calls: every thunk event's self time (its duration less the thunk events
  nested in it, e.g. a while loop's body), summed per step and per thunk, each thunk mapped to the Python frames
  of its HLO instruction (the compiled module's stack frames) and so to a part of the model (`GROUPS`);
  thunks_per_step counts the events (loop bodies once per trip).
Variants: "wide" (the engine as it is: on CPU the compute layout also holds every bf16 Linear weight as f32 for
one-row products, `engine.layouts.wide_weights`; the routed experts hold none since the MoE gathers bf16 experts,
after bench/results/decode_profile.json was run), "bf16-only" (without those twins, as before: XLA:CPU converted
each weight a one-row product read to f32 on every step). Load (/proc/loadavg) is recorded: the host may be shared.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.speculative import CKPT, prompts_for  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402

NEW_TOKENS = 128
# (group, file, function) rules, first match over a thunk's Python frames from the innermost out
GROUPS = (  # (group, file, qualified function prefix; "" any)
    ("sampling", "engine/sampling.py", ""),
    ("tag check", "cache/integrity.py", ""),
    ("tag check", "models/paged.py", "guard_decode"),
    ("KV write", "cache/pool.py", ""),
    ("attention (paged loop)", "models/paged_attention_xla.py", ""),
    ("MoE routing", "models/layers.py", "MoE.route"),
    ("MoE experts", "models/layers.py", "Experts."),
    ("MoE sort / combine", "models/layers.py", "MoE.routed"),
    ("norms", "models/layers.py", "RMSNorm."),
    ("MLA absorb (kv_b)", "models/attention.py", "MLAttention.absorb"),
    ("MLA absorb (kv_b)", "models/attention.py", "MLAttention.kv_b_split"),
    ("rope", "models/rope.py", ""),
    ("MLA projections", "models/attention.py", "MLAttention.project"),
    ("LM head", "models/transformer.py", "CausalLM.logits"),
    ("embedding", "models/transformer.py", "CausalLM.embed_tokens"),
)
# a matmul (quant/ops.py) is named by the first of these among its callers' functions
MATMUL_CALLERS = (("MoE experts", "Experts."), ("MLP (dense, shared)", "MLP."), ("LM head", "CausalLM.head_logits"),
                  ("MLA projections", "MLAttention.project"), ("attention output", "decode"))


class HloFrames:
    """Python frames of each instruction of a compiled module's text (`metadata={... stack_frame_id=N}`)."""

    def __init__(self, text: str) -> None:
        def table(name: str) -> dict[int, str]:
            m = re.search(rf"^{name}\n((?:\d+ .*\n)+)", text, re.M)
            return {int(k): v for k, v in (ln.split(" ", 1) for ln in m.group(1).splitlines())} if m else {}

        files, funcs = table("FileNames"), table("FunctionNames")
        locs = {k: re.findall(r"(\w+)=(\d+)", v) for k, v in table("FileLocations").items()}
        self.frames = {k: dict((a, int(b)) for a, b in re.findall(r"(\w+)=(\d+)", v))
                       for k, v in table("StackFrames").items()}
        self.loc = {k: (files.get(d["file_name_id"], "").strip('"'), funcs.get(d["function_name_id"], "").strip('"'),
                        d["line"]) for k, d in ((k, dict((a, int(b)) for a, b in v)) for k, v in locs.items())}
        self.inst: dict[str, tuple[str, int | None, tuple[str, ...]]] = {}  # name -> (shape, frame, operands)
        for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([^\n]*)$", text, re.M):
            f = re.search(r"stack_frame_id=(\d+)", m.group(3))
            ops = re.match(r"[\w\-]+\(([^)]*)\)", m.group(3))
            self.inst[m.group(1)] = (m.group(2), int(f.group(1)) if f else None,
                                     tuple(re.findall(r"%([\w.\-]+)", ops.group(1))) if ops else ())

    def stack(self, name: str) -> list[tuple[str, str, int]]:
        """(file, function, line) of the instruction's frames, innermost first; an instruction a compiler pass
        made without metadata (a dot rewritten from a dot_general) takes its first operand's that has them."""
        frame = self.inst.get(name, ("", None, ()))[1]
        todo = list(self.inst.get(name, ("", None, ()))[2])
        while frame is None and todo:
            op = todo.pop(0)
            frame = self.inst.get(op, ("", None, ()))[1]
            todo += [] if frame is not None or len(todo) > 16 else list(self.inst.get(op, ("", None, ()))[2])
        out, seen = [], set()
        while frame and frame not in seen:
            seen.add(frame)
            f = self.frames.get(frame, {})
            out.append(self.loc.get(f.get("file_location_id"), ("", "", 0)))
            frame = f.get("parent_frame_id")
        return out

    def group(self, name: str) -> str:
        """The part of the model a thunk belongs to (`GROUPS`); "other" when no rule matches."""
        if self.inst.get(name, ("", None))[1] is None and name.startswith("dot"):
            return "matmul (XLA-made dot)"  # a dot a pass rewrote loses its frames: its shape says which
        st = self.stack(name)
        funcs = [fn for _, fn, _ in st]
        for file, fn, _ in st:
            if file.endswith("quant/ops.py"):  # a matmul: named by the module that called it
                return next((label for label, caller in MATMUL_CALLERS
                             if any(f.startswith(caller) or f == caller for f in funcs)), "matmul (other)")
            for label, rfile, rfn in GROUPS:
                if file.endswith(rfile) and fn.startswith(rfn):
                    return label
        return "other"


def thunk_times(pd: jax.profiler.ProfileData, steps: int) -> dict[str, list[float]]:
    """{thunk name: [self us per step, events per step]} over the trace's XLA threads."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for plane in pd.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            evs = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events
                          if not e.name.startswith(("ThunkExecutor", "ThreadpoolListener"))),
                         key=lambda e: (e[0], -e[1]))
            stack: list[tuple[int, str]] = []  # (end ns, name) of the open thunks
            for start, dur, name in evs:
                while stack and stack[-1][0] <= start:
                    stack.pop()
                if stack:  # nested in a thunk (a loop's body): not that thunk's own time
                    out[stack[-1][1]][0] -= dur / 1e3 / steps
                done = name.startswith("end: ")  # a thunk's completion: its time, not another thunk
                name = name.removeprefix("end: ")
                out[name][0] += dur / 1e3 / steps
                out[name][1] += 0 if done else 1 / steps
                stack.append((start + dur, name))
    return dict(out)


@contextlib.contextmanager
def no_wide_weights():
    """The "bf16-only" variant: no f32 twins of the bf16 Linear weights (the engine before them)."""
    from jaxserve.engine import layouts

    real = layouts.wide_weights
    layouts.wide_weights = lambda model, devices: False
    try:
        yield
    finally:
        layouts.wide_weights = real


class Variant:
    """One engine stepped to steady decode at concurrency c, and its captured decode call."""

    def __init__(self, name: str, c: int) -> None:
        self.name = name
        with no_wide_weights() if name == "bf16-only" else contextlib.nullcontext():
            self.engine = Engine.from_checkpoint(CKPT, EngineConfig(prefix_cache=False), start=False)
        call = common.steady_decode(self.engine, prompts_for(self.engine, c, seed=1), NEW_TOKENS)
        self.prog = self.engine.programs
        self.batch, self.samp = call.batch, self.prog.forms.form(call.samp, self.prog.decode_rows)
        self.ms: list[float] = []
        self.cpu_ms: list[float] = []
        self.dispatch_ms: list[float] = []
        for _ in range(5):
            jax.block_until_ready(self.call())

    def call(self):  # noqa: ANN201
        ph = self.prog.decode_phase
        out = self.prog._decode(ph.params, ph.pages, self.batch, self.samp)
        ph.pages = out[2]
        return out

    def timed(self) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.call()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        self.ms.append((time.perf_counter() - t0) * 1e3)
        self.cpu_ms.append((time.process_time() - c0) * 1e3)
        self.dispatch_ms.append((t1 - t0) * 1e3)

    def hlo(self) -> str:
        ph = self.prog.decode_phase
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), ph.pages)
        return self.prog._decode.lower(ph.params, spec, self.batch, self.samp).compile().as_text()

    def profile(self, steps: int) -> dict:
        from jax._src.lib import _profiler

        frames = HloFrames(self.hlo())
        session = _profiler.ProfilerSession()
        for _ in range(steps):
            jax.block_until_ready(self.call())
        pd = jax.profiler.ProfileData.from_serialized_xspace(session.stop())
        per = thunk_times(pd, steps)
        groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for name, (us, n) in per.items():
            g = groups[frames.group(name)]
            g[0] += us
            g[1] += n
        top = sorted(per.items(), key=lambda kv: -kv[1][0])[:25]
        kinds = collections.Counter(kind_of(n) for n in per)
        return {"thunks_per_step": sum(n for _, n in per.values()), "thunk_us_per_step": sum(u for u, _ in per.values()),
                "distinct_thunks": len(per), "thunk_kinds": dict(kinds),
                "groups": {g: {"us": u, "thunks": n} for g, (u, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])},
                "top": [{"thunk": n, "us": u, "per_step": k, "shape": frames.inst.get(n, ("",))[0],
                         "group": frames.group(n)} for n, (u, k) in top]}


def kind_of(name: str) -> str:
    """A thunk's kind from its instruction name (fusion names end in their root op's)."""
    base = re.sub(r"\.\d+$", "", name)
    for k in ("convert", "dot", "ynn_fusion", "gather", "scatter", "while", "conditional", "copy", "reduce", "sort"):
        if k in base:
            return k
    return "fusion/other" if "fusion" in base else base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--trace-steps", type=int, default=30)
    ap.add_argument("--variants", nargs="+", default=["wide", "bf16-only"])
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "decode_profile.json")
    args = ap.parse_args()
    out = {"bench": "decode_profile", "machine": common.machine(), "new_tokens": NEW_TOKENS,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
    lines = []
    for c in args.concurrency:
        variants = [Variant(v, c) for v in args.variants]
        load0 = os.getloadavg()
        for _ in range(args.reps):
            for v in variants:
                v.timed()
        load1 = os.getloadavg()
        for v in variants:
            row = {"c": c, "variant": v.name, "ms": common.spread(v.ms), "cpu_ms": common.spread(v.cpu_ms),
                   "dispatch_ms": common.spread(v.dispatch_ms), "loadavg_start": load0, "loadavg_end": load1,
                   "profile": v.profile(args.trace_steps)}
            out["rows"].append(row)
            lines += table(row)
        for v in variants:
            v.engine.close()
    return common.write_result(out, "\n".join(lines), args.json)


def table(row: dict) -> list[str]:
    p, ms = row["profile"], row["ms"]
    lines = [f"c = {row['c']} {row['variant']}: {ms['median']:.2f} ms ({ms['min']:.2f}..{ms['max']:.2f}), cpu "
             f"{row['cpu_ms']['median']:.2f} ms, dispatch {row['dispatch_ms']['median']:.3f} ms; traced: "
             f"{p['thunks_per_step']:.0f} thunks/step ({p['distinct_thunks']} distinct), "
             f"{p['thunk_us_per_step']:.0f} us of thunk self time/step; load {row['loadavg_start'][0]:.1f}"
             f"->{row['loadavg_end'][0]:.1f}",
             f"  {'group':<26} {'us/step':>8} {'thunks':>7}"]
    lines += [f"  {g:<26} {v['us']:>8.0f} {v['thunks']:>7.1f}" for g, v in p["groups"].items()]
    lines.append(f"  {'top thunks':<26} {'us/step':>8} {'x/step':>7}  shape")
    lines += [f"  {t['thunk']:<26} {t['us']:>8.0f} {t['per_step']:>7.1f}  {t['shape'][:34]:<34} {t['group']}"
              for t in p["top"][:12]]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
