"""What every bench shares: the machine description (the host may be shared: load average included), result output."""
from __future__ import annotations

import json
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


def write_result(result: dict, table_text: str, path: Path) -> int:
    """Print the bench's table, write its JSON result to `path`; the exit code for main()."""
    print(table_text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0
