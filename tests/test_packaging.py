"""The package stands on its own: the listed packages are the source tree's, `pallas_kernels` imports alone, and a
non-editable `pip install <repo>` into a fresh venv outside the repo runs `jaxserve generate` on the embedded model
(shipped as package data)."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_listed_packages_are_the_source_tree():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for top in ("jaxserve", "pallas_kernels")
             for p in (REPO / top).rglob("__init__.py")}
    assert listed == found | {"jaxserve.embedded"}  # the embedded checkpoint: checkpoints/ as package data


def test_pallas_kernels_imports_first_in_a_fresh_interpreter():
    code = "import sys, pallas_kernels; assert not [m for m in sys.modules if m.startswith('jaxserve')]"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=300)


@pytest.mark.slow
def test_non_editable_install_in_a_fresh_venv_generates(tmp_path):
    """`pip install <repo>` (not -e) into a new venv in a temporary folder, then `jaxserve generate` from there.
    The venv gets this interpreter's site-packages through a .pth line for the pinned dependencies (no download;
    the build runs without isolation, on the setuptools found there): jaxserve itself and the embedded checkpoint
    come only from the install."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", str(REPO)],
                   cwd=tmp_path, env=env, check=True, timeout=900)
    where = subprocess.run([py, "-c", "import jaxserve, pallas_kernels; print(jaxserve.__file__)"], cwd=tmp_path,
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(site)  # the installed copy, not the checkout
    assert Path(site, "jaxserve", "embedded", "tiny-kimi", "jaxserve.json").is_file()
    out = subprocess.run([venv / "bin" / "jaxserve", "generate", "--prompt", "def add(a, b):", "--max-tokens", "8"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("def add(a, b):") and len(out.stdout.strip()) > len("def add(a, b):")
