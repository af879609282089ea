"""docs/openrlhf-mapping.md is benchmarks/openrlhf_parity.py's OPTIONS dict, and every spelling it checks is one gcfamily
builds. Runs without OpenRLHF: the comparison itself is the benchmark (its output: benchmarks/results-openrlhf-parity-cpu.txt).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("openrlhf_parity", ROOT / "benchmarks" / "openrlhf_parity.py")
parity = importlib.util.module_from_spec(_spec)
sys.modules["openrlhf_parity"] = parity  # dataclasses resolve the module of the Entry class by name
_spec.loader.exec_module(parity)


def test_the_doc_table_is_the_dict() -> None:
    doc = (ROOT / "docs" / "openrlhf-mapping.md").read_text()
    start = doc.index("| OpenRLHF 0.11.2 | gcfamily | status | |")
    assert doc[start : doc.index("\n\n", start)] == parity.markdown_table()
    rows = parity.markdown_table().splitlines()[2:]
    assert len(rows) == len(parity.OPTIONS)
    assert (
        "| `--actor.dual_clip` | `--method grpo --set mu=2 std_eps=1e-9 loss_norm=token beta=0 dual_clip=3` | checked |"
        in (parity.markdown_table())
    )
    assert "| `--actor.entropy_coef` | - | not expressible |" in parity.markdown_table()


def test_every_scoped_flag_has_a_row() -> None:
    """Each flag of OpenRLHF's parsers the harness counts as a loss option is a key of OPTIONS or starts one (the
    harness also checks each choice of a `choices=` flag, reading the parser, where OpenRLHF is installed)."""
    keys = list(parity.OPTIONS)
    for flags in parity.SCOPE.values():
        for flag in flags:
            assert any(k == flag or k.startswith(flag + " ") for k in keys), flag


@pytest.mark.parametrize(
    "key",
    [k for k, e in parity.OPTIONS.items() if e.status in ("checked", "checked: differs", "control (must differ)")],
)
def test_a_checked_spelling_is_a_method_gcfamily_builds(key: str) -> None:
    """The `--method ... --set ...` of every compared row is typed, defaulted and validated as `gcf run` does it."""
    e = parity.OPTIONS[key]
    tp = parity._trl_parity()
    shared = {"group_size": parity.G} if e.kind == "ppo" else {}
    method = parity._method(tp, e.gcf, shared)
    assert method.name == e.gcf.split()[1]
    assert e.orl, f"{key}: a compared row needs OpenRLHF's settings"


def test_parser_flags_reads_choices(tmp_path: Path) -> None:
    """The enumeration reads every add_argument, its choices, and f-string flags, from a parser's source."""
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse\np = argparse.ArgumentParser()\n"
        'p.add_argument("--a.kl", type=str, choices=["k1", "k2"])\n'
        'p.add_argument("--b", type=float, default=0.2)\n'
        'for prefix in ("actor",):\n    p.add_argument(f"--{prefix}.optim", choices=["adam"])\n'
    )
    assert parity.parser_flags(script) == {"--a.kl": ["k1", "k2"], "--b": None, "--{}.optim": ["adam"]}


def test_without_openrlhf_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(parity, "openrlhf_dir", lambda: None)
    assert parity.main(["--seeds", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("OpenRLHF is not installed")
