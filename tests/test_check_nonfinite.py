"""`gcf check` fails a method whose gradient, coefficient or objective holds a NaN or an inf, and says which one.

A NaN slips past every tolerance test written `d > tol` (False for NaN) and every running `max(0.0, d)` (which
keeps 0.0): before this guard a coefficient of NaN everywhere passed with every difference printed as 0.00e+00.
Each case below plants one non-finite quantity in a subclass of a built-in method; the oracle is the count of
entries the test planted, worked from the check's batch sizes (gcfamily/check/world.py: L = 8 tokens per row,
SFT's batch is N // 2 = 8 demonstrations, GRPO's is N = 16 samples), never read back from the check.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from gcfamily import check
from gcfamily.methods.base import Batch, Method
from gcfamily.methods.grpo import GRPO
from gcfamily.methods.sft import SFT

SFT_ENTRIES = 8 * 8  # SFT's batch: 8 rows x L = 8 positions; the coefficient has one entry per position
GRPO_ENTRIES = 16 * 8  # GRPO's batch: 4 prompts x G = 4 samples, L = 8 positions


class _NanCoefficient(SFT):
    name = "nan-coefficient"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return torch.full_like(logps, float("nan"))


class _OneNanCoefficient(SFT):
    """SFT's GC of 1, with a NaN on row 0's first completion token only: one poisoned entry must be enough."""

    name = "one-nan-coefficient"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        coef = super().coefficient(batch, logps).clone()
        if 0 in batch.row_id.tolist():
            r = batch.row_id.tolist().index(0)
            coef[r, int(batch.loss_mask[r].nonzero()[0])] = float("nan")
        return coef


class _InfCoefficient(GRPO):
    name = "inf-coefficient"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return torch.full_like(logps, float("inf"))


class _NanObjective(SFT):
    name = "nan-objective"

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return super().objective(batch, logps, Z) * float("nan")


class _InfObjectiveValue(GRPO):
    """J + inf: the gradient is GRPO's own, only the objective's value is not finite."""

    name = "inf-objective-value"

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return super().objective(batch, logps, Z) + float("inf")


def _run(cls: type[Method]) -> tuple[check.Outcome, str]:
    out = check.run_case(cls, "defaults", {})
    text, ok = check.report(cls.name, cls, [out])
    assert ok == out.ok
    return out, text


def _counts(pattern: str, failures: list[str]) -> tuple[int, int]:
    """(planted, of) from the first failure matching `pattern`, whose groups are the two counts."""
    hits = [m for f in failures if (m := re.search(pattern, f))]
    assert hits, failures
    return int(hits[0].group(1)), int(hits[0].group(2))


def test_a_nan_coefficient_everywhere_fails_naming_the_coefficient() -> None:
    out, text = _run(_NanCoefficient)
    assert (
        not out.ok
        and "case defaults (its defaults): FAILED" in text
        and text.rstrip().endswith("1 case: 0 passed, 1 failed")
    )
    assert _counts(r"^the method's coefficient has NaN in (\d+) of (\d+) entries \(seed 0\)$", out.failures) == (
        SFT_ENTRIES,
        SFT_ENTRIES,
    )
    assert any(f.startswith("the engine's gradient has NaN in") for f in out.failures), out.failures
    assert "FAILED the method's coefficient has NaN in 64 of 64 entries (seed 0)" in text
    assert (
        "max |diff| 0.00e+00" not in text.split("(a) engine vs own objective")[1].splitlines()[0]
    )  # a NaN is not shown as 0


def test_one_nan_entry_is_enough() -> None:
    out, _ = _run(_OneNanCoefficient)
    assert not out.ok
    assert _counts(r"^the method's coefficient has NaN in (\d+) of (\d+) entries", out.failures) == (1, SFT_ENTRIES)


def test_an_inf_coefficient_fails_naming_the_coefficient() -> None:
    out, text = _run(_InfCoefficient)
    assert not out.ok and "FAILED" in text
    assert _counts(r"^the method's coefficient has \+inf in (\d+) of (\d+) entries", out.failures) == (
        GRPO_ENTRIES,
        GRPO_ENTRIES,
    )


def test_a_nan_objective_fails_naming_the_objective() -> None:
    out, text = _run(_NanObjective)
    assert not out.ok and "FAILED" in text
    assert "the method's objective is NaN (seed 0)" in out.failures
    assert any(f.startswith("the gradient of the method's own objective has NaN in") for f in out.failures), (
        out.failures
    )
    assert not any("coefficient" in f for f in out.failures)  # its coefficient is SFT's, finite


def test_an_inf_objective_value_with_a_finite_gradient_fails() -> None:
    out, _ = _run(_InfObjectiveValue)
    assert out.failures == ["the method's objective is +inf (seed 0)"]  # the gradients agree; only J is not finite


def test_the_unmodified_methods_still_pass() -> None:
    for cls in (SFT, GRPO):
        out, text = _run(cls)
        assert out.ok, text
        assert not any(re.search(r"max \|diff\| (nan|inf)", line) for line in text.splitlines()), text


def test_gcf_check_of_a_file_exits_1_and_names_the_nan(gcf, tmp_path: Path) -> None:
    path = tmp_path / "nan_rule.py"
    path.write_text(
        "import torch\nfrom gcfamily.methods.sft import SFT\n\n\nclass NanSFT(SFT):\n    name = 'nan-sft'\n\n"
        "    def coefficient(self, batch, logps):\n        return torch.full_like(logps, float('nan'))\n"
    )
    code, out, err = gcf("check", f"{path}:NanSFT", "--seeds", "1")
    assert code == 1, out + err
    assert "FAILED the method's coefficient has NaN in 64 of 64 entries (seed 0)" in out
    assert "case defaults (its defaults): FAILED" in out and out.rstrip().endswith("3 cases: 0 passed, 3 failed")
