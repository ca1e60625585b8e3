"""Tests run on CPU with 8 simulated devices (the 8-way mesh of an H200 node), float32 matmuls exact."""
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Drop every module's compiled programs when it ends. Each XLA:CPU executable holds its own memory mappings;
    kept alive by jit caches across ~700 tests, one process nears the kernel's 65,530-mapping limit, and a late
    compile aborted (twice, in different tests that pass alone)."""
    yield
    # A shared server's engine thread may compile meanwhile (background programs): jax's cache registry is a weak
    # dict iterated without a lock, so the sweep can meet "dictionary changed size"; it is retried, never skipped.
    for attempt in range(20):
        try:
            jax.clear_caches()
            return
        except RuntimeError:
            if attempt == 19:
                raise
            time.sleep(0.05)
