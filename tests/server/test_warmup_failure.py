"""`jaxserve serve --warmup full` over its memory-mapping budget with no compile cache to drop programs to: the
warm-up fails, and the process exits at once (code 2) with the error on one line naming the fixes, instead of
serving a /ready that never turns 200."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_full_warmup_over_the_budget_without_the_cache_ends_the_process_with_the_error():
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--warmup", "full", "--no-compile-cache",
           "--max-maps", "1", "--max-model-len", "64"]  # any process holds more than 1 mapping: over at once
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jaxserve serve: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for fix in ("compile cache", "--no-compile-cache", "max_model_len", "--warmup fast"):
        assert fix in errors[0], errors[0]
    assert "serving tiny-kimi on http://127.0.0.1:" in proc.stderr  # it had started listening: the warm-up ended it
