"""What every bench records about the machine it ran on (the host may be shared: load average included)."""
from __future__ import annotations

import os
import platform
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
