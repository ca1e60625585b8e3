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
    """The arguments of one steady-state decode-program call: Programs.run_decode(tags, batch, samp)."""

    tags: object
    batch: object
    samp: object


def steady_decode(engine: object, prompts: list[list[int]], max_tokens: int) -> DecodeCall:
    """Submit `prompts` to a synchronous engine, step until every one decodes, and capture the arguments of the
    next decode-program call (to time the program alone). The captured tags stay valid until the engine steps
    again (a step may donate them)."""
    from jaxserve.engine import Request, SamplingParams
    from jaxserve.engine.request import Status

    for p in prompts:
        engine.submit(Request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    sched = engine.scheduler
    while sum(s.status is Status.DECODING for s in sched.running) < len(prompts):
        engine.step()
    captured: list[DecodeCall] = []
    real = engine.programs.run_decode

    def capture(tags, batch, samp):  # noqa: ANN001, ANN202 - the run_decode signature
        captured.append(DecodeCall(tags, batch, samp))
        return real(tags, batch, samp)

    engine.programs.run_decode = capture
    try:
        engine.step()
    finally:
        engine.programs.run_decode = real
    return captured[0]
