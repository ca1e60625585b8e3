"""A warm start of `--warmup full` that loads only what it keeps: a manifest in the persistent compile cache, written
by a full warm-up once every program of its plan was stored there, lets a later full warm-up of the same plan load
only the fast set before ready (`fallback.largest_keys`, the programs it then runs once: `engine.priming`) and the
rest after it, as "fast" does: one background thread loads them from the cache in demand order while a step whose
shape is not loaded yet runs padded in a loaded one (`engine.fallback`), so no load runs on the engine thread.

Why: on a warm cache each plan job still traces and lowers its program before JAX can look it up (JAX's cache key
is the lowered module's hash): ~0.5-1 s a program on this host, the GIL held for most of it (bench/warmup_grid.py
`spent`), and the default grid's 817 programs pass the memory-mapping bound several times over, so most of what a
warm full warm-up loads it drops again before ready (`warmup.run_jobs`). With a valid manifest every other program of
the plan is known to be in the cache: what the background loads is an XLA cache hit, never an XLA compile.

Valid: named by a digest, computed without tracing, of what decides the plan's lowered programs (`digest`: the
source of jaxserve and pallas_kernels, the jax / jaxlib / flax / numpy versions, JAX's config, the XLA and JAX
environment variables, the backend's devices, the engine and model configs, the weights' and pools' shapes, dtypes
and shardings, the plan's keys), and every cache entry the writing warm-up used (the keys JAX logs for each lookup)
is still in the folder. A stale executable is never served either way: what loads is still looked up by JAX's own
key of the lowered module; a factor the digest missed would cost a compile after ready, not a wrong program.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import flax
import jax
import jaxlib
import numpy as np

from jaxserve.engine.warmup import Key, WarmupReport, _cache_holds_everything, labelled_job, plan_keys, run_jobs

if TYPE_CHECKING:
    from jaxserve.engine.programs import Programs

FOLDER = "jaxserve-warm"  # the manifests' subfolder of the compile cache folder (one file per digest)
SOURCES = ("jaxserve", "pallas_kernels")  # the packages whose code the programs are traced from
ENV_PREFIXES = ("XLA_", "JAX", "TPU_", "LIBTPU", "CUDA", "NVIDIA_", "TF_")
JAX_LOGGER = "jax._src.compiler"  # logs each persistent-cache lookup's key (at DEBUG unless jax_log_compiles)
_LOOKUPS = ("Persistent compilation cache hit for", "PERSISTENT COMPILATION CACHE MISS for")
_ENTRY_SUFFIX = "-cache"  # JAX's file name for a cache key (`jax._src.lru_cache`): a renamed one only invalidates
log = logging.getLogger("jaxserve.warmup")


def tree_digest(roots: list[Path]) -> str:
    """sha256 over every file under `roots` (relative path and bytes, sorted; __pycache__ left out)."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(f"{root.name}/{path.relative_to(root)}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def source_roots() -> list[Path]:
    """The folders of `SOURCES` as imported."""
    return [Path(importlib.import_module(name).__file__).parent for name in SOURCES]


SOURCE_DIGEST = tree_digest(source_roots())  # at import: the code this process runs, whatever changes on disk later


def _abstract(tree: Any) -> list[str]:
    """Each leaf's shape, dtype and sharding (no values: the weights are program arguments)."""
    return [f"{x.shape} {x.dtype} {getattr(x, 'sharding', '')}" for x in jax.tree.leaves(tree)]


def digest(programs: Programs, keys: list[Key], roots: list[Path] | None = None) -> str:
    """The manifest name of a plan (see the module docstring); roots: other source folders to digest (default: this
    process's, `SOURCE_DIGEST`)."""
    config = {k: repr(v) for k, v in jax.config.values.items() if k != "jax_compilation_cache_dir"}
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    parts = {
        "source": SOURCE_DIGEST if roots is None else tree_digest(roots),
        "versions": [jax.__version__, jaxlib.__version__, flax.__version__, np.__version__, sys.version],
        "jax_config": sorted(config.items()),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)),
        "backend": [jax.default_backend(), jax.devices()[0].client.platform_version, devices],
        "engine": repr(programs.cfg), "model": repr(programs.model_cfg), "layouts": repr(programs.layouts),
        "phases": [_abstract((ph.params, ph.pages)) for ph in programs.phases()],
        "plan": [list(k) for k in keys],
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


class _Lookups(logging.Filter):
    """Collects the cache keys of JAX's persistent-cache lookups from its logger's records, passing on only the
    records the logger's own level would have let through."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level
        self.sinks: list[set[str]] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_LOOKUPS) and len(record.args or ()) == 2:
            for sink in self.sinks:
                sink.add(str(record.args[1]))
        return record.levelno >= self.level


_lock = threading.Lock()
_active: list[Any] = []  # [the installed _Lookups, the logger's own level] while any recording runs


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """The JAX cache keys looked up (hits and misses, any thread) while the block runs. Nests and overlaps (two
    engines' warm-ups in one process): the logger drops to DEBUG while any runs, passing on only what it did before."""
    logger, keys = logging.getLogger(JAX_LOGGER), set()
    with _lock:
        if not _active:
            _active[:] = [_Lookups(logger.getEffectiveLevel()), logger.level]
            logger.addFilter(_active[0])
            logger.setLevel(logging.DEBUG)
        _active[0].sinks.append(keys)
    try:
        yield keys
    finally:
        with _lock:
            _active[0].sinks.remove(keys)
            if not _active[0].sinks:
                logger.removeFilter(_active[0])
                logger.setLevel(_active[1])
                _active.clear()


def _path(folder: Path, name: str) -> Path:
    return folder / FOLDER / f"{name}.json"


def complete(folder: Path, name: str) -> bool:
    """Whether the manifest `name` exists in the compile cache `folder` and every entry it lists is still there."""
    try:
        entries = json.loads(_path(folder, name).read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(entries) and all((folder / f"{key}{_ENTRY_SUFFIX}").is_file() for key in entries)


def write(folder: Path, name: str, entries: set[str], jobs: int) -> bool:
    """Record that the plan `name`'s programs are all in `folder` (the cache keys its warm-up looked up).
    -> whether written (not when no lookup was seen: JAX logged none, or the cache was off)."""
    if not entries or not all((folder / f"{key}{_ENTRY_SUFFIX}").is_file() for key in entries):
        log.info("warm-up full: no warm-start manifest written (%d cache lookups seen, not all stored)", len(entries))
        return False
    path = _path(folder, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"digest": name, "jobs": jobs, "entries": sorted(entries)}))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return True


def cache_folder() -> Path | None:
    """The persistent compile cache's folder, when it is on and stores every program (else None: no manifest)."""
    return Path(jax.config.jax_compilation_cache_dir) if _cache_holds_everything() else None


def holds_plan(programs: Programs) -> bool:
    """Whether the compile cache holds every program of this engine's plan (a complete manifest of its digest)."""
    folder = cache_folder()
    return folder is not None and complete(folder, digest(programs, plan_keys(programs)))


def run_full(programs: Programs, progress: bool, max_maps: int | None) -> WarmupReport:
    """A cold `--warmup full`: the whole plan (`warmup.run_jobs`), then its manifest, when the cache stored it all."""
    keys = plan_keys(programs)
    folder = cache_folder()
    with recording() as entries:
        # labelled: the engine learns which keys the mapping bound dropped meanwhile (`CompiledShapes.adopt`)
        report = run_jobs("full", [labelled_job(programs, k) for k in keys], progress, max_maps=max_maps,
                          resident=programs.resident)
    if folder is not None:
        write(folder, digest(programs, keys), entries, len(keys))
    return report
