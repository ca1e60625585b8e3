"""jaxserve.targets.target_devices loads libtpu beside another process that holds libtpu's lock (a user's plan next to
a running TPU job, or another plan): it sets ALLOW_MULTIPLE_LIBTPU_LOAD itself. Both processes start with the
variable removed (this tier's conftest sets it for the test process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# takes libtpu's lock (no ALLOW_MULTIPLE_LIBTPU_LOAD) and holds it until its stdin closes
HOLD = ("import sys; from jax.experimental import topologies; "
        "topologies.get_topology_desc(topology_name='v5p:2x2x1', platform='tpu'); print('held', flush=True); "
        "sys.stdin.read()")
PLAN = ("from jaxserve.targets import target, target_devices; "
        "print(len(target_devices(target('v5p'), 4)), target_devices(target('v5p'), 4)[0].device_kind)")
LOCKED = "libtpu multi-process lockfile"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    return dict(env, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TPU_WORKER_HOSTNAMES="localhost")


def test_target_devices_loads_libtpu_beside_a_process_holding_its_lock():
    holder = subprocess.Popen([sys.executable, "-c", HOLD], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        if line.strip() != "held":  # the lock was held already (another process): then that one holds it
            assert LOCKED in holder.communicate(timeout=60)[1]
        bare = subprocess.run([sys.executable, "-c", HOLD.replace("sys.stdin.read()", "")], env=_env(),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        assert bare.returncode != 0 and LOCKED in bare.stderr  # the precondition: a plain load is refused
        plan = subprocess.run([sys.executable, "-c", PLAN], env=_env(), capture_output=True, text=True, timeout=120)
        assert plan.returncode == 0, plan.stderr[-2000:]
        count, kind = plan.stdout.split(maxsplit=1)
        assert int(count) == 4 and "TPU v5" in kind
    finally:
        if holder.poll() is None:
            holder.stdin.close()
            holder.wait(timeout=60)
