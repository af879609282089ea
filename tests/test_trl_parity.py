"""Parity with TRL 1.16's own loss code, one random case per row of docs/trl-mapping.md.

Runs benchmarks/trl_parity.py's comparison (TRL's real `_generate_and_score_completions` and
`_compute_loss`, DPOTrainer's and CPOTrainer's loss code, against gcfamily's method classes and
engine). Skipped where TRL is not installed (CI does not install it): the benchmark is the check.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "trl_parity.py"
_spec = importlib.util.spec_from_file_location("trl_parity", _PATH)
parity = importlib.util.module_from_spec(_spec)
sys.modules["trl_parity"] = parity  # dataclasses resolve the module of the Row class by name
_spec.loader.exec_module(parity)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("trl-parity"))


@pytest.mark.parametrize("row", parity.ROWS, ids=[r.name for r in parity.ROWS])
def test_row(row: "parity.Row", workdir: str) -> None:
    res = parity.compare(row, seed=0, workdir=workdir)
    diffs = {"loss": res["loss_diff"], "grad": res["grad_diff"], "advantages": res["adv_diff"] or 0.0}
    if row.expect == "match":
        assert max(diffs.values()) <= parity.TOL, f"{row.name}: TRL and gcfamily differ: {diffs}"
        assert res["grad_scale"] > 1e-3, "the gradient compared is not trivially zero"
    else:  # a near-miss setting: the comparison must be able to tell it apart
        assert max(diffs.values()) >= parity.CONTROL_MIN, f"control {row.name} matched TRL: {diffs}"
    if row.kind != "grpo":
        return
    calls = res["trl_calls"]  # which log-probs TRL's own advantage and loss code asked for
    assert calls.count("policy") == 1
    assert ("old" in calls) == (row.trl.get("num_iterations", 1) > 1 or row.trl.get("use_vllm", False))
    assert ("ref" in calls) == (row.trl.get("beta", 0.0) > 0)
    if "coverage" in res:  # pi_old != pi at token level: every branch the row relies on was reached
        c = res["coverage"]
        assert c["clip_low"] > 0 and c["clip_high"] > 0, c
        assert c["equal_groups"] == 1 and c["past_clamp"] > 0 and c["padded_rows"] > 0 and c["truncated_rows"] > 0, c


def test_without_trl_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl now raises ImportError
    assert parity.main(["--seeds", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("TRL is not installed")
