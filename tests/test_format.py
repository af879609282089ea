"""The house format and lint: `ruff format` at 120 columns leaves every file as it is, and `ruff check` with the
project's rules (pyproject.toml: pyflakes, pycodestyle's errors, sorted imports) finds nothing."""

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


PATHS = ["gcfamily", "tests", "benchmarks", "examples"]


def test_ruff_check_finds_nothing() -> None:
    out = subprocess.run([*_ruff(), "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, "run `ruff check --fix " + " ".join(PATHS) + "`:\n" + out.stdout[-3000:]


def test_a_planted_unused_import_fails_the_check(tmp_path: Path) -> None:
    """The lint test can fail: a copy of a module with one unused import added is caught, with the project's rules."""
    src = (ROOT / "gcfamily" / "core" / "batch.py").read_text()
    planted = tmp_path / "batch.py"
    planted.write_text(src.replace("import dataclasses\n", "import dataclasses\nimport json\n", 1))
    config = ["--config", str(ROOT / "pyproject.toml")]
    clean = subprocess.run(
        [*_ruff(), "check", *config, str(ROOT / "gcfamily" / "core" / "batch.py")], capture_output=True
    )
    out = subprocess.run([*_ruff(), "check", *config, str(planted)], cwd=tmp_path, capture_output=True, text=True)
    assert clean.returncode == 0 and out.returncode == 1 and "F401" in out.stdout and "json" in out.stdout
