"""The house format: `ruff format` at 120 columns (pyproject.toml) leaves every file as it is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    return [found]


def test_ruff_format_leaves_every_file_unchanged() -> None:
    out = subprocess.run(
        [*_ruff(), "format", "--check", "gcfamily", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, (
        "run `ruff format gcfamily tests benchmarks examples`:\n" + out.stdout[-2000:] + out.stderr[-2000:]
    )


def test_no_import_at_the_bottom_of_a_module() -> None:
    out = subprocess.run([*_ruff(), "check", "--select", "E402", "gcfamily"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:]
