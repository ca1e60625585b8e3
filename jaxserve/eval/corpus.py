"""Deterministic corpus of the running interpreter's standard-library `.py` sources.

The split is by top-level module/package (a fixed list, `HELDOUT_MODULES`), so it is identical on
any machine with the same Python version and stdlib layout, and no held-out module leaks into
training through a sibling file. Run `python -m jaxserve.eval.corpus` for a summary and fingerprint.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# Self-contained, commonly used modules (~5% of corpus bytes on CPython 3.11): a coding-agent eval set.
HELDOUT_MODULES: tuple[str, ...] = (
    "argparse",
    "calendar",
    "configparser",
    "csv",
    "dataclasses",
    "difflib",
    "fractions",
    "graphlib",
    "heapq",
    "json",
    "pprint",
    "shlex",
    "statistics",
    "textwrap",
    "tokenize",
    "tomllib",
)

# Directory names dropped anywhere in the path: installed packages, test suites and their data.
EXCLUDED_DIRS: frozenset[str] = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

# Top-level names whose content is build-machine specific (install paths, compiler flags).
EXCLUDED_TOP_PREFIXES: tuple[str, ...] = ("_sysconfigdata_", "config-")


@dataclass(frozen=True)
class CorpusSpec:
    """Where the corpus lives and how it is split.

    root: Path, the stdlib directory (`sysconfig.get_paths()["stdlib"]` by default).
    heldout_modules: tuple[str, ...], top-level module/package names that go to the held-out split.
    """

    root: Path
    heldout_modules: tuple[str, ...] = HELDOUT_MODULES


def default_spec() -> CorpusSpec:
    """The running interpreter's stdlib with the fixed held-out list -> CorpusSpec."""
    return CorpusSpec(root=Path(sysconfig.get_paths()["stdlib"]))


def top_module(relpath: PurePosixPath) -> str:
    """Top-level module or package name of a stdlib-relative path (`json/decoder.py` -> `json`) -> str."""
    return relpath.parts[0] if len(relpath.parts) > 1 else relpath.stem


def _is_utf8(path: Path) -> bool:
    """Whether the file's bytes decode as strict UTF-8 -> bool."""
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _is_excluded(relpath: PurePosixPath) -> bool:
    """Whether a stdlib-relative path is outside the corpus (tests, site-packages, build-specific) -> bool."""
    if any(part in EXCLUDED_DIRS for part in relpath.parts[:-1]):
        return True
    return relpath.parts[0].startswith(EXCLUDED_TOP_PREFIXES)


def all_files(spec: CorpusSpec | None = None) -> list[Path]:
    """Every corpus file, sorted by stdlib-relative POSIX path (machine independent order) -> list[Path]."""
    spec = spec or default_spec()
    rel = []
    for dirpath, dirnames, filenames in os.walk(spec.root):
        # Prune excluded directories so site-packages and test suites are never walked.
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            path = Path(dirpath) / name
            relpath = PurePosixPath(path.relative_to(spec.root).as_posix())
            # Symlinks out of the tree and non-files would make the corpus depend on the machine.
            if name.endswith(".py") and path.is_file() and not path.is_symlink() and not _is_excluded(relpath):
                rel.append(relpath)
    rel.sort(key=str)
    return [spec.root / r for r in rel if _is_utf8(spec.root / r)]


def relative(path: Path, spec: CorpusSpec | None = None) -> PurePosixPath:
    """Stdlib-relative POSIX path of a corpus file -> PurePosixPath."""
    spec = spec or default_spec()
    return PurePosixPath(path.relative_to(spec.root).as_posix())


def is_heldout(path: Path, spec: CorpusSpec | None = None) -> bool:
    """Whether a corpus file belongs to the held-out split -> bool."""
    spec = spec or default_spec()
    return top_module(relative(path, spec)) in spec.heldout_modules


def train_files(spec: CorpusSpec | None = None) -> list[Path]:
    """Training split, sorted by relative path -> list[Path]."""
    spec = spec or default_spec()
    return [p for p in all_files(spec) if not is_heldout(p, spec)]


def heldout_files(spec: CorpusSpec | None = None) -> list[Path]:
    """Held-out split, sorted by relative path -> list[Path]."""
    spec = spec or default_spec()
    return [p for p in all_files(spec) if is_heldout(p, spec)]


def read_texts(files: list[Path]) -> list[str]:
    """File contents decoded as UTF-8, newlines untouched (so byte counts match) -> list[str]."""
    return [p.read_bytes().decode("utf-8") for p in files]


def byte_count(files: list[Path]) -> int:
    """Total size in bytes of the files -> int."""
    return sum(p.stat().st_size for p in files)


def fingerprint(files: list[Path], spec: CorpusSpec | None = None) -> str:
    """SHA-256 over (relative path, content) of the files: equal on two machines iff same split -> str (hex)."""
    spec = spec or default_spec()
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(relative(path, spec)).encode("utf-8") + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    """CLI: print file counts, byte counts, held-out fraction and fingerprints of both splits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    spec = default_spec()
    train, heldout = train_files(spec), heldout_files(spec)
    n_train, n_heldout = byte_count(train), byte_count(heldout)
    print(f"stdlib: {spec.root}")
    print(f"train:   {len(train):4d} files {n_train:10d} bytes  sha256 {fingerprint(train, spec)}")
    print(f"heldout: {len(heldout):4d} files {n_heldout:10d} bytes  sha256 {fingerprint(heldout, spec)}")
    print(f"heldout fraction of bytes: {n_heldout / (n_train + n_heldout):.4f}")


if __name__ == "__main__":
    main()
