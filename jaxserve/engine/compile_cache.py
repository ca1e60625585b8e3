"""Persistent XLA compilation cache: compiled programs survive restarts, so a warm start loads them from disk
instead of compiling (JAX's `jax_compilation_cache_dir`).

Called once by the entry points (`jaxserve generate`, `jaxserve serve`) before anything compiles; the library
(`Engine`) never sets it on its own. Keys are JAX's own (the HLO, the compile options, the backend and the
jax/jaxlib versions), so a changed program or upgrade never loads a stale executable.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/jaxserve/xla, or ~/.cache/jaxserve/xla."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxserve" / "xla"


def enable_compile_cache(path: str | Path | None = None, *, enabled: bool = True) -> Path | None:
    """Point JAX's persistent compilation cache at `path` (default `default_cache_dir()`); returns the folder,
    or None when `enabled` is False (nothing is changed then).

    Every program is cached, however fast it compiled (JAX's default skips those under 1 s, which on the
    embedded model is most of them, while together they are most of a cold start).
    """
    if not enabled:
        return None
    folder = Path(path) if path is not None else default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    """`--compile-cache DIR` / `--no-compile-cache` for a subcommand that compiles the engine."""
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help=f"persistent XLA compilation cache (default {default_cache_dir()})")
    p.add_argument("--no-compile-cache", action="store_true", help="compile everything afresh, cache nothing")


def enable_from_args(args: argparse.Namespace) -> Path | None:
    """`enable_compile_cache` as the flags of `add_cache_arguments` say (defaults when they are absent)."""
    return enable_compile_cache(getattr(args, "compile_cache", None),
                                enabled=not getattr(args, "no_compile_cache", False))
