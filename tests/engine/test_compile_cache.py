"""The persistent compilation cache behind `jaxserve serve` / `generate` (engine/compile_cache.py): the serve
flags turn it on (programs written to the folder, a second process reads them back) or off."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jaxserve.cli import build_parser
from jaxserve.engine.compile_cache import default_cache_dir, enable_from_args

_CHILD = """
import sys, jax, jax.numpy as jnp
from jaxserve.cli import build_parser
from jaxserve.engine.compile_cache import enable_from_args
folder = enable_from_args(build_parser().parse_args(["serve", "--compile-cache", sys.argv[1]]))
assert str(folder) == sys.argv[1], folder
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(7.0)).block_until_ready()
"""


def _cached(folder: Path) -> dict[str, int]:
    """Cache files -> modification time (ns): a hit reads an entry, a miss (re)writes it."""
    return {p.name: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_serve_flags_enable_the_cache_and_a_restart_reads_it(tmp_path):
    folder = tmp_path / "xla"
    run = lambda: subprocess.run([sys.executable, "-c", _CHILD, str(folder)], check=True,  # noqa: E731
                                 cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True)
    run()
    first = _cached(folder)
    assert first  # the compiled program was written
    run()
    assert _cached(folder) == first  # the same program: read back, nothing compiled or written again


def test_no_compile_cache_changes_nothing():
    args = build_parser().parse_args(["serve", "--no-compile-cache"])
    assert enable_from_args(args) is None
    default = build_parser().parse_args(["serve"])
    assert default.compile_cache is None and not default.no_compile_cache  # on by default, in default_cache_dir()
    assert default_cache_dir().name == "xla"
