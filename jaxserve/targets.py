"""Compile targets of `jaxserve plan --target`: which devices a plan's mesh is built over, and which attention
backend its programs use.

"cpu" is the host's own devices (the XLA attention path). "h200" / "h100" (XLA:GPU + Triton, sm_90a) and "v5p" /
"v6e" (XLA:TPU + Mosaic, libtpu) are compile-only topology devices (`jax.experimental.topologies`): a real compile
for that chip on a host that has none. They need the "aot" extra (jax-cuda12-plugin + nvcc, libtpu): `make
install-aot`, .venv-aot; jaxserve imports without it and asks for it only here. The GPU target configs in
target_configs/ are XLA's own device specs (openxla/xla xla/backends/gpu/target_config/specs/) minus
`collective_memory_granularity`, which jaxlib 0.10.2's XLA does not know.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jaxserve.errors import ConfigError

CONFIGS = Path(__file__).parent / "target_configs"


@dataclass(frozen=True)
class Target:
    """platform: "cpu" | "cuda" | "tpu"; attention: the backend the target's programs compile with; memory_bytes:
    one device's memory; topologies: devices -> the topology name (TPU: libtpu's; GPU: slices x hosts x GPUs);
    config: the GPU target config file in target_configs/. hbm_bytes_per_s / link_bytes_per_s: one device's HBM
    bandwidth and interconnect bandwidth per direction (the roofline's, jaxserve/roofline.py), from `bandwidth_source`
    (the vendors' public spec sheets; "cpu" has none: bench/roofline.py measures the host's)."""

    name: str
    platform: str
    attention: str
    memory_bytes: float
    topologies: dict[int, str]
    config: str | None = None
    hbm_bytes_per_s: float = 0.0
    link_bytes_per_s: float = 0.0
    bandwidth_source: str = ""


TARGETS: dict[str, Target] = {
    "cpu": Target("cpu", "cpu", "xla", 141e9, {}),  # the memory is an H200's: the CPU plan stands in for one
    # NVLink 4: 900 GB/s per GPU, both directions together -> 450e9 per direction
    "h200": Target("h200", "cuda", "pallas", 141e9, {n: f"1x1x{n}" for n in (1, 2, 4, 8)}, "h200.txtpb",
                   4.8e12, 450e9, "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, NVLink 900 GB/s"),
    "h100": Target("h100", "cuda", "pallas", 80e9, {n: f"1x1x{n}" for n in (1, 2, 4, 8)}, "h100_sxm.txtpb",
                   3.35e12, 450e9, "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, NVLink 900 GB/s"),
    # ICI: the per-chip figure (all links, both directions) halved per direction
    "v5p": Target("v5p", "tpu", "pallas_tpu", 95e9, {4: "v5p:2x2x1", 8: "v5p:2x2x2", 16: "v5p:2x2x4"}, None,
                  2.765e12, 300e9, "Google Cloud TPU v5p spec: 2,765 GB/s HBM, ICI 4,800 Gbps per chip"),
    "v6e": Target("v6e", "tpu", "pallas_tpu", 32e9, {1: "v6e:1x1", 4: "v6e:2x2", 8: "v6e:2x4", 16: "v6e:4x4",
                                                        32: "v6e:4x8", 64: "v6e:8x8"},
                  None, 1.64e12, 224e9, "Google Cloud TPU v6e spec: 1,640 GB/s HBM, ICI 3,584 Gbps per chip"),
}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ConfigError(f"--target must be one of {', '.join(TARGETS)}, got {name!r}", value=name, param="target")
    return TARGETS[name]


def target_devices(t: Target, n: int) -> list:
    """n compile-only devices of `t` (a list of jax.Device). Raises ConfigError when the target's compiler is not
    installed or it has no n-device topology here. A TPU target sets ALLOW_MULTIPLE_LIBTPU_LOAD=1 (unless set) before
    libtpu loads, so a plan runs beside another TPU process."""
    import jax

    if t.platform == "cpu":
        devices = jax.devices("cpu")[:n]
        if len(devices) < n:
            raise ConfigError(f"plan needs {n} CPU devices, JAX has {len(devices)}", value=n, param="devices")
        return devices
    if n not in t.topologies:
        raise ConfigError(f"--target {t.name}: devices must be one of {sorted(t.topologies)}, got {n}",
                          value=n, param="devices")
    plugin = "jax_cuda12_plugin" if t.platform == "cuda" else "libtpu"
    if t.platform == "tpu":
        # compile-only devices guard no chip: without this, libtpu refuses to load beside another process that
        # holds its lock ("Internal error when accessing libtpu multi-process lockfile"); read when it loads
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        __import__(plugin)
        from jax.experimental import topologies
    except ImportError as e:
        raise ConfigError(f"--target {t.name} compiles with {plugin}, which is not installed: install the aot "
                          f"extra (make install-aot; .venv-aot)", value=t.name, param="target") from e
    if t.platform == "cuda":
        config = (CONFIGS / t.config).read_text()
        desc = topologies.get_topology_desc(platform="cuda", topology=t.topologies[n], target_config=config)
    else:
        desc = topologies.get_topology_desc(topology_name=t.topologies[n], platform="tpu")
    return list(desc.devices)
