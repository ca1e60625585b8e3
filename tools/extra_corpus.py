"""Extra training text for the embedded model: the pure-Python sources of the project's pinned dependencies.

    python -m tools.extra_corpus          # summary and fingerprint of the extra corpus

The stdlib train split (`jaxserve.eval.corpus`, 3.3M tokens) is overfit by a 100-minute run (2 epochs: train loss
2.71 vs 3.93 held-out, `bench/results/embedded_retrain.json`). These files add general Python (web, CLI, packaging,
numerics, testing libraries) from the virtual environment that `make` builds from pyproject.toml's pins, so the
selection is the same wherever the same pins are installed.

The held-out split stays exactly the stdlib one. A file leaks if it is a copy of held-out text (a vendored backport
such as `tomli` for `tomllib`): files whose long lines are in the held-out split's long lines at more than
`LEAK_LINE_FRACTION` are dropped, as are byte-identical duplicates.
"""
from __future__ import annotations

import argparse
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from jaxserve.eval import corpus

# General-purpose, mostly hand-written packages; left out: generated or data-heavy trees (torch, transformers,
# sympy, scipy, openai's generated types, pygments' lexer tables, jaxlib's generated bindings).
EXTRA_PACKAGES: tuple[str, ...] = (
    "_pytest", "absl", "anyio", "attr", "charset_normalizer", "click", "etils", "filelock", "flask", "flax",
    "fsspec", "httpcore2", "httpx2", "huggingface_hub", "hypothesis", "idna", "jax", "jinja2", "jsonschema",
    "markdown_it", "networkx", "numpy", "opt_einsum", "optax", "orbax", "packaging", "pip", "prometheus_client",
    "psutil", "pydantic", "requests", "rich", "setuptools", "sortedcontainers", "tqdm", "treescope", "typer",
    "urllib3", "waitress", "werkzeug", "yaml",
)
EXCLUDED_DIRS: frozenset[str] = frozenset({"test", "tests", "testing", "__pycache__", "_vendor", "vendor"})
LEAK_LINE_FRACTION = 0.1  # share of a file's long lines found verbatim in the held-out split
LONG_LINE = 40  # characters (stripped): shorter lines (`return None`, `else:`) are common to all code


@dataclass(frozen=True)
class ExtraSpec:
    """root: Path, the site-packages directory; packages: tuple[str, ...], its top-level folders to read."""

    root: Path
    packages: tuple[str, ...] = EXTRA_PACKAGES


def default_spec() -> ExtraSpec:
    """The running interpreter's site-packages (the project's venv under `make`) -> ExtraSpec."""
    return ExtraSpec(root=Path(sysconfig.get_paths()["purelib"]))


def _long_lines(text: str) -> set[str]:
    """Stripped lines of at least LONG_LINE characters -> set[str]."""
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= LONG_LINE}


def heldout_lines() -> set[str]:
    """Long lines of the stdlib held-out split -> set[str]."""
    lines: set[str] = set()
    for text in corpus.read_texts(corpus.heldout_files()):
        lines |= _long_lines(text)
    return lines


def leaks(text: str, heldout: set[str]) -> bool:
    """Whether more than LEAK_LINE_FRACTION of the text's long lines occur in the held-out split -> bool."""
    lines = _long_lines(text)
    return bool(lines) and len(lines & heldout) > LEAK_LINE_FRACTION * len(lines)


def extra_files(spec: ExtraSpec | None = None) -> tuple[list[Path], dict[str, int]]:
    """UTF-8 `.py` files of the packages, sorted, minus tests, vendored trees, duplicates and held-out copies.

    -> (files, counts of what was dropped: {"duplicate", "leak", "not_utf8", "missing_package"}).
    """
    spec = spec or default_spec()
    heldout = heldout_lines()
    seen: set[str] = set()
    files: list[Path] = []
    dropped = {"duplicate": 0, "leak": 0, "not_utf8": 0, "missing_package": 0}
    for package in spec.packages:
        top = spec.root / package
        if not top.is_dir():
            dropped["missing_package"] += 1
            continue
        for path in sorted(top.rglob("*.py")):
            if any(part in EXCLUDED_DIRS for part in path.relative_to(spec.root).parts[:-1]):
                continue
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                dropped["not_utf8"] += 1
                continue
            digest = hashlib.sha256(raw).hexdigest()
            if digest in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(digest)
            if leaks(text, heldout):
                dropped["leak"] += 1
                continue
            files.append(path)
    return files, dropped


def fingerprint(files: list[Path], spec: ExtraSpec | None = None) -> str:
    """SHA-256 over (site-packages-relative path, content) -> str (hex)."""
    spec = spec or default_spec()
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(spec.root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    spec = default_spec()
    files, dropped = extra_files(spec)
    print(f"site-packages: {spec.root}")
    print(f"extra: {len(files)} files {corpus.byte_count(files)} bytes  sha256 {fingerprint(files, spec)}")
    print(f"dropped: {dropped}")


if __name__ == "__main__":
    main()
