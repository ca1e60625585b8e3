"""Which threads an XLA:CPU compile started on a nice-19 thread runs on, and at what nice value: a 60-op jit (no
compile cache) lowered and compiled on a thread that lowered its own priority as `fallback.lower_priority` does,
after the client has run a program; the CPU ticks each thread of the process spent meanwhile (/proc/self/task/*/stat,
utime + stime) with its nice value, and whether it existed before the compile.

Usage: python bench/compile_thread_priority.py --json OUT.json
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from jaxserve.engine.fallback import lower_priority  # noqa: E402


def _threads() -> dict[int, tuple[str, int, int]]:
    """tid -> (name, nice, utime + stime ticks) of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        s = Path(f"/proc/self/task/{tid}/stat").read_text()
        r = s[s.rindex(")") + 2:].split()
        out[int(tid)] = (s[s.index("(") + 1:s.rindex(")")], int(r[16]), int(r[11]) + int(r[12]))
    return out


def _chain(x: jax.Array) -> jax.Array:
    for i in range(60):
        x = jnp.sin(x @ x.T + i) * jnp.cos(x)
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # the client and its pools exist
    before = _threads()
    own: dict[str, int] = {}

    def compile_low() -> None:
        lower_priority()
        tid = threading.get_native_id()
        t0 = _threads()[tid][2]
        lowered = jax.jit(_chain).lower(jnp.ones((64, 64)))
        t1 = _threads()[tid][2]
        lowered.compile()
        own.update(tid=tid, nice=_threads()[tid][1], lower_ticks=t1 - t0, compile_ticks=_threads()[tid][2] - t1)

    t = threading.Thread(target=compile_low, name="nice19-compile")
    t.start()
    t.join()
    others = [{"tid": tid, "name": name, "nice": nice, "ticks": ticks - before.get(tid, (0, 0, 0))[2],
               "existed_before": tid in before} for tid, (name, nice, ticks) in sorted(_threads().items())
              if ticks - before.get(tid, (0, 0, 0))[2] > 0]
    out = {"bench": "compile_thread_priority", "command": "python bench/compile_thread_priority.py " +
           " ".join(sys.argv[1:] if argv is None else argv), "machine": common.machine(), "compiling_thread": own,
           "other_threads_with_ticks": others, "ticks_per_s": os.sysconf("SC_CLK_TCK")}
    text = f"compiling thread {own}; others: " + ", ".join(f"{o['name']} nice {o['nice']} {o['ticks']} ticks"
                                                            for o in others)
    return common.write_result(out, text, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
