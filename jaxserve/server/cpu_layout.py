"""`jaxserve serve`'s CPU layout: how one server process spreads the model over a CPU host's cores.

XLA:CPU fixes its device count when JAX starts, so the serve entry point (server.main.start_jax) resolves the
layout from the core count first, creates the CPU devices it needs, and only then lets JAX start; the library keeps
no such state (an Engine uses whatever devices it is given). `auto` is the layout bench/cpu_cores.py measured best
on a 2-core host (README, "Every core": one device, XLA's own thread pool over the cores, with XLA:CPU's
concurrency-optimized scheduler); on a GPU or TPU host the layout changes nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jaxserve.errors import ConfigError

CPU_LAYOUTS = ("auto", "single", "sched", "tp", "dp", "workers")
# XLA:CPU orders a program's independent thunks so that more of them run at once on the thread pool
SCHED_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=true"


@dataclass(frozen=True)
class CpuLayout:
    """name: the layout (what `auto` resolved to); cpu_devices: XLA CPU devices to create; devices and sharding:
    each engine's (EngineConfig); workers: engine replicas (SessionRouter), one slice of `devices` each; xla_flags:
    XLA flags the process needs before JAX starts (appended to XLA_FLAGS)."""

    name: str
    cpu_devices: int = 1
    devices: int = 1
    sharding: str = "tp"
    workers: int = 1
    xla_flags: str = ""


def resolve(choice: str, cores: int, platform: str, devices: int = 1, workers: int = 1) -> CpuLayout | None:
    """The layout `choice` means on a host with `cores` usable cores and JAX platform `platform` ("cpu", "gpu",
    "tpu"); None where no CPU layout applies (an accelerator host: --devices / --workers rule there as given).

    auto: the measured winner (AUTO) on more than one core, one device on one core; with --devices or --workers
    above 1, auto takes them as given ("manual", with the CPU devices they need). single: one device (XLA's own
    threads only); sched: one device, XLA:CPU's concurrency-optimized scheduler (SCHED_FLAG); tp / dp: one device per core, one engine (tensor parallel / DP attention); workers: one engine
    replica per core, one device each.
    """
    if choice not in CPU_LAYOUTS:
        raise ConfigError(f"--cpu-layout must be one of {', '.join(CPU_LAYOUTS)}", value=choice, param="cpu_layout")
    if cores < 1:
        raise ConfigError("a host needs at least one usable core", value=cores, param="cores")
    if platform != "cpu":
        return None
    if devices > 1 or workers > 1:
        if choice != "auto":
            raise ConfigError(f"--cpu-layout {choice} sets the devices and workers itself: leave --devices and "
                              "--workers at 1, or use --cpu-layout auto", value=choice, param="cpu_layout")
        return CpuLayout("manual", cpu_devices=devices * workers, devices=devices, workers=workers)
    if choice == "auto":
        choice = AUTO if cores > 1 else "single"
    if choice == "single" or cores == 1:
        return CpuLayout("single")
    if choice == "sched":
        return CpuLayout("sched", xla_flags=SCHED_FLAG)
    if choice == "tp":
        return CpuLayout("tp", cpu_devices=cores, devices=cores)
    if choice == "dp":
        return CpuLayout("dp", cpu_devices=cores, devices=cores, sharding="dp_attention")
    return CpuLayout("workers", cpu_devices=cores, workers=cores)


# auto on more than one core: one device with the concurrency-optimized scheduler led one device alone in three quiet
# 2-core runs (bench/results/cpu_cores_quiet*.json: 1.25-1.55x vs 1.11-1.18x a pinned core at c = 1, 1.13-1.32x vs
# 1.06-1.14x at c = 16, the same greedy tokens); workers was close but changes greedy rows (0.87), tp / dp lost
AUTO = "sched"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or taskset's limit, not the host's count)."""
    return len(os.sched_getaffinity(0))
