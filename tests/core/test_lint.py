"""The lint, run by the test suite (so by the README's test command and CI): ruff with the rules of
pyproject.toml's [tool.ruff] over the whole checkout. `ruff check --fix .` repairs the import order
and unused imports; the rest it names with file and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_code_passes_the_lint() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "--no-cache", str(ROOT)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"ruff check failed (fix with `ruff check --fix .` or by hand):\n{done.stdout}{done.stderr}"


def test_the_declared_python_is_one_the_code_runs_on() -> None:
    """decentrl/config/load.py reads configs with tomllib (3.11+): pyproject must not promise 3.10,
    and the lint checks the syntax of the same version."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert "import tomllib" in (ROOT / "decentrl" / "config" / "load.py").read_text()
