"""Python 3.11-3.13 (pyproject.toml, the CI matrix, scripts/check_python.py agree), and `make`
on another Python stops in one line before it creates or downloads anything."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SUPPORTED = ["3.11", "3.12", "3.13"]


def test_requires_python_the_ci_matrix_and_the_check_name_the_same_versions():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11,<3.14"' in pyproject
    jobs = yaml.safe_load((ROOT / ".github/workflows/review.yml").read_text())["jobs"]
    assert jobs["test"]["strategy"]["matrix"]["python"] == SUPPORTED
    check = (ROOT / "scripts/check_python.py").read_text()
    assert re.search(r"SUPPORTED = \(\(3, 11\), \(3, 12\), \(3, 13\)\)", check)
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" in SUPPORTED


def _other_python() -> str | None:
    """An installed Python quantpipe does not support (pyenv's 3.10 here), if any that runs."""
    pyenv = Path.home() / ".pyenv/versions"
    candidates = [str(v / "bin/python") for v in sorted(pyenv.glob("3.10.*")) + sorted(pyenv.glob("3.9.*"))]
    candidates += [found for name in ("python3.10", "python3.9", "python3.14")
                   if (found := shutil.which(name))]
    for python in candidates:
        try:  # a pyenv shim without its version behind it does not run
            if subprocess.run([python, "--version"], capture_output=True, timeout=30).returncode == 0:
                return python
        except OSError:
            continue
    return None


def test_make_on_an_unsupported_python_is_one_line_and_creates_nothing(tmp_path):
    python = _other_python()
    if python is None:
        pytest.skip("no Python other than 3.11-3.13 installed to try make with")
    for name in ("Makefile", "requirements.txt", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/check_python.py", tmp_path / "scripts")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    result = subprocess.run(["make", "env", f"PYTHON={python}"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if not re.match(r"make(\[\d+\])?: ", line)]
    assert len(lines) == 1 and lines[0].startswith("error: Python 3."), result.stderr
    assert "is not supported: quantpipe needs 3.11, 3.12, 3.13" in lines[0]
    assert not (tmp_path / ".venv").exists()  # nothing created, nothing downloaded
