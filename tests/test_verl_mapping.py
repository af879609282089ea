"""docs/verl-mapping.md's table is the mapping of benchmarks/verl_parity.py (so the page cannot go stale), and every
gcfamily spelling in it is a method and settings `gcf run` accepts. Runs without verl; the numeric check against
verl's own code is the benchmark itself (it needs verl in a venv of its own)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("verl_parity", ROOT / "benchmarks" / "verl_parity.py")
parity = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("verl_parity", parity)
_spec.loader.exec_module(parity)


def test_the_doc_table_is_the_mapping():
    doc = (ROOT / "docs" / "verl-mapping.md").read_text()
    start = doc.index("| verl option | gcfamily | status |")
    table = doc[start:].split("\n\n")[0].rstrip("\n")
    assert table == parity.markdown_table()
    rows = table.splitlines()[2:]
    assert len(rows) == len(parity.MAPPING) + len(parity.CONTROLS)
    # the rows a reader looks for first, and a refusal with its reason
    assert "| policy_loss.loss_mode=vanilla | `--method grpo --set" in table
    assert "| policy_loss.loss_mode=cispo | `--method cispo --set" in table
    assert "| policy_loss.loss_mode=clip_cov | not expressible | Clip-Cov" in table


def test_every_option_has_a_spelling_or_a_reason():
    for opt, entry in parity.MAPPING.items():
        if isinstance(entry, str):
            assert len(entry) > 20 and "\n" not in entry, opt
    checked = [o for o, e in parity.MAPPING.items() if isinstance(e, parity.Check)]
    refused = [o for o, e in parity.MAPPING.items() if isinstance(e, str)]
    assert len(checked) >= 30 and len(refused) >= 40, (len(checked), len(refused))
    assert all(c.expect == "differ" for c in parity.CONTROLS.values())


@pytest.mark.parametrize(
    "name,check",
    [(o, e) for o, e in parity.MAPPING.items() if isinstance(e, parity.Check)] + list(parity.CONTROLS.items()),
)
def test_each_spelling_is_a_method_and_settings_gcf_run_takes(name, check):
    method = parity.build_method(check.method, check.sets)  # typed, defaulted and validated as gcf run builds it
    assert method.name == check.method


def test_gcfamily_never_imports_verl():
    for path in (ROOT / "gcfamily").rglob("*.py"):
        text = path.read_text()
        assert "import verl" not in text and "from verl" not in text, path
