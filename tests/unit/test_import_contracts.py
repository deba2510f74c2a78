"""The layers of the code (pyproject.toml's `[tool.importlinter]`, docs/architecture.md): imports
point down only, checked by import-linter on the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(root)}  # this tree's `dyad`, not the installed one
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--no-cache", str(root / "pyproject.toml")],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )


def test_imports_point_down():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_a_wrong_way_import_fails_naming_both_modules(tmp_path):
    shutil.copytree(REPO / "dyad", tmp_path / "dyad", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    layout = tmp_path / "dyad" / "layout.py"
    layout.write_text(layout.read_text() + "\nfrom dyad.router import steps  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "dyad.layout -> dyad.router.steps" in result.stdout, result.stdout
