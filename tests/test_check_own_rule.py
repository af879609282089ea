"""`gcf check` on a user's own rule: what a class that overrides coefficient and objective (or one of them) is held to.

- both overridden (outside gcfamily): a rule of its own, checked against autograd of its OWN objective, and (b) with
  that objective's GC; the parent's textbook is not its textbook. A consistent rule passes, an inconsistent one fails
  naming the largest difference;
- only one overridden: FAILED, with a sentence saying that the other is the parent's and must change too;
- a built-in's coefficient and objective sharing a mistake are still caught by the textbook (planted in the
  built-in class itself, where the check holds it to its family's textbook).

The oracles are the rules' scales, worked by hand: a coefficient of 0.5 against an objective of 0.4 x SFT's differs
by 0.1 per unit of the objective's 0.4, a relative difference of 0.25 under every aggregation.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gcfamily import check
from gcfamily.methods import get_method
from gcfamily.methods.base import Batch
from gcfamily.methods.grpo import GRPO

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "half_sft.py"

HEAD = "import torch\nfrom gcfamily.methods.grpo import GRPO\nfrom gcfamily.methods.sft import SFT\n\n\n"
RULES = {
    "ObjectiveOnly": (
        "class ObjectiveOnly(SFT):\n    name = 'objective-only'\n\n"
        "    def objective(self, batch, logps, Z):\n        return 0.5 * super().objective(batch, logps, Z)\n"
    ),
    "Inconsistent": (
        "class Inconsistent(SFT):\n    name = 'inconsistent'\n\n"
        "    def coefficient(self, batch, logps):\n        return 0.5 * super().coefficient(batch, logps)\n\n"
        "    def objective(self, batch, logps, Z):\n        return 0.4 * super().objective(batch, logps, Z)\n"
    ),
    "HalfGRPO": (
        "class HalfGRPO(GRPO):\n    name = 'half-grpo'\n\n"
        "    def coefficient(self, batch, logps):\n        return 0.5 * super().coefficient(batch, logps)\n\n"
        "    def objective(self, batch, logps, Z):\n        return 0.5 * super().objective(batch, logps, Z)\n"
    ),
}


def _spec(tmp_path: Path, name: str) -> str:
    path = tmp_path / "rules.py"
    path.write_text(HEAD + "\n\n".join(RULES.values()))
    return f"{path}:{name}"


def test_a_consistent_rule_of_its_own_passes_against_its_own_objective(gcf) -> None:
    code, out, err = gcf("check", f"{EXAMPLE}:HalfSFT")
    assert code == 0, out + err
    assert (
        "textbook: none: HalfSFT.coefficient and HalfSFT.objective are its own (defined in HalfSFT), a rule of its own"
        in out
    )
    assert "checked against its own objective only: autograd of HalfSFT.objective" in out
    assert out.count(": ok\n") == 3 and "FAILED" not in out
    assert "(a) engine vs textbook" not in out and "(b) d loss/d logits vs own objective" in out
    assert out.rstrip().endswith("3 cases: 3 passed, 0 failed (against the method's own objective only)")


def test_only_the_coefficient_overridden_fails_saying_the_objective_must_change(gcf) -> None:
    code, out, _ = gcf("check", f"{EXAMPLE}:HalfCoefficientSFT")
    assert code == 1
    assert (
        "FAILED HalfCoefficientSFT.coefficient is its own but HalfCoefficientSFT.objective is SFT's: a coefficient is "
        "the gradient of an objective, so the objective must change too" in out
    )
    assert out.count("  FAILED HalfCoefficientSFT overrides one of coefficient and objective, not both") == 3
    assert out.rstrip().endswith("3 cases: 0 passed, 3 failed")


def test_only_the_objective_overridden_fails_saying_the_coefficient_must_change(gcf, tmp_path: Path) -> None:
    code, out, _ = gcf("check", _spec(tmp_path, "ObjectiveOnly"), "--seeds", "1")
    assert code == 1
    assert "FAILED ObjectiveOnly.objective is its own but ObjectiveOnly.coefficient is SFT's" in out
    assert "so it would train SFT's rule, not this objective; the coefficient must change too" in out
    assert out.rstrip().endswith("3 cases: 0 passed, 3 failed")


def test_an_inconsistent_rule_of_its_own_fails_naming_the_largest_difference(gcf, tmp_path: Path) -> None:
    code, out, _ = gcf("check", _spec(tmp_path, "Inconsistent"), "--seeds", "1")
    assert code == 1
    assert "textbook: none: Inconsistent.coefficient and Inconsistent.objective are its own" in out
    found = re.findall(
        r"FAILED \(a\) engine vs own objective: max \|diff\| (\S+) against a largest entry of (\S+) \(seed 0\)", out
    )
    assert len(found) == 3, out  # one per case: token, sequence and sum aggregation
    for d, scale in found:  # GC 0.5 against dJ/dlogp of 0.4 x SFT's: |0.5 - 0.4| / 0.4 = 0.25 on every token
        assert float(d) / float(scale) == pytest.approx(0.25, rel=2e-3)
    assert "FAILED (b) d loss/d logits vs own objective" in out
    assert out.rstrip().endswith("3 cases: 0 passed, 3 failed (against the method's own objective only)")


def test_a_grpo_subclass_overriding_both_consistently_passes_on_its_familys_batch(gcf, tmp_path: Path) -> None:
    code, out, err = gcf("check", _spec(tmp_path, "HalfGRPO"), "--seeds", "1")
    assert code == 0, out + err
    assert "textbook: none: HalfGRPO.coefficient and HalfGRPO.objective are its own" in out
    n = len(check.cases(GRPO))
    assert out.rstrip().endswith(f"{n} cases: {n} passed, 0 failed (against the method's own objective only)")
    # the batch is still the one GRPO's textbook designs, and its branches are required of a rule of its own too
    for branch in ("tokens clipped low", "tokens clipped high", "KL past the clamp", "equal-reward groups"):
        assert branch in out, branch


def test_the_rule_kind_of_each_class() -> None:
    half, coef_only = get_method(f"{EXAMPLE}:HalfSFT"), get_method(f"{EXAMPLE}:HalfCoefficientSFT")
    assert check.own_rule(half)[0] == "both" and check.own_rule(coef_only)[0] == "coefficient"
    assert check.own_rule(get_method("grpo")) == ("", "")  # a built-in's rule is the textbook's
    gspo_file = get_method(str(Path(EXAMPLE).with_name("gspo.py")) + ":GSPO")  # objective restated for its own hook
    assert check.own_rule(gspo_file) == ("", "") and check.textbook_for(gspo_file)[0] == {
        "advantage": "group-relative",
        "ratio": "sequence",
    }
    out = check.run_case(coef_only, "defaults", {})
    assert not out.ok and out.rule.startswith("HalfCoefficientSFT.coefficient is its own")


# ----------------------------------------------------------------------------- a built-in's shared mistake


COEFFICIENT, OBJECTIVE = GRPO.coefficient, GRPO.objective  # GRPO's own, before any plant


def _scaled_coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
    return COEFFICIENT(self, batch.replaced(advantages=1.7 * batch.advantages), logps)


def _scaled_objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
    return OBJECTIVE(self, batch.replaced(advantages=1.7 * batch.advantages), logps, Z)


def _flipped_kl_coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
    no_kl = COEFFICIENT(self, batch.replaced(ref_logps=None), logps)
    return 2 * no_kl - COEFFICIENT(self, batch, logps)


def _flipped_kl_objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
    no_kl = OBJECTIVE(self, batch.replaced(ref_logps=None), logps, Z)
    return 2 * no_kl - OBJECTIVE(self, batch, logps, Z)


@pytest.mark.parametrize(
    "coefficient, objective, settings",
    [
        (_scaled_coefficient, _scaled_objective, {}),  # advantages x 1.7, at GRPO's defaults
        (_flipped_kl_coefficient, _flipped_kl_objective, {"beta": 0.1}),  # the KL term's sign flipped
    ],
    ids=["advantages x 1.7", "flipped KL"],
)
def test_a_mistake_a_builtins_coefficient_and_objective_share_is_caught_by_the_textbook(
    coefficient, objective, settings: dict, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """Planted in GRPO itself, in coefficient and objective alike: they agree with each other, not with the textbook."""
    assert check.run_case(GRPO, "guard", settings).ok
    monkeypatch.setattr(GRPO, "coefficient", coefficient)
    monkeypatch.setattr(GRPO, "objective", objective)
    out = check.run_case(GRPO, "guard", settings)
    assert out.textbook and not out.ok
    assert any(f.startswith("(a) engine vs textbook") for f in out.failures), out.failures
    assert any(f.startswith("(b) d loss/d logits vs textbook") for f in out.failures), out.failures
    assert not any(f.startswith("(a) engine vs own objective") for f in out.failures)  # only the textbook can tell
    text, ok = check.report("grpo", GRPO, [out])
    assert not ok and "hint: the engine agrees with the class's own objective but not with the textbook" in text


def _unclipped_coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
    """s_i * A_i on every token, never clipped, plus GRPO's KL part (its coefficient at A = 0)."""
    kl_part = GRPO.coefficient(self, batch.replaced(advantages=torch.zeros_like(batch.advantages)), logps)
    return kl_part + self.importance_ratio(batch, logps)[1] * self.token_advantages(batch) * batch.loss_mask


def _unclipped_objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
    """s_i * A_i, never clipped, minus GRPO's KL term (its objective at A = 0)."""
    s = self.importance_ratio(batch, logps)[0]
    kl_only = GRPO.objective(self, batch.replaced(advantages=torch.zeros_like(batch.advantages)), logps, Z)
    return self.aggregate(s * self.token_advantages(batch) * batch.loss_mask, batch, Z) + kl_only


def test_a_builtin_gspo_without_its_clip_anywhere_is_caught_by_the_textbook(monkeypatch: pytest.MonkeyPatch) -> None:
    """gspo's sequence clip removed from its coefficient and its objective alike, in gcfamily's GSPO itself."""
    from gcfamily.methods import gspo

    assert check.run_case(gspo.GSPO, "clip and KL", {"mu": 2, "beta": 0.04}).ok
    monkeypatch.setattr(gspo.GSPO, "coefficient", _unclipped_coefficient)
    monkeypatch.setattr(gspo.GSPO, "objective", _unclipped_objective)
    out = check.run_case(gspo.GSPO, "clip and KL", {"mu": 2, "beta": 0.04})
    assert out.textbook and not out.ok
    assert out.branches["sequences clipped low"] > 0 and out.branches["sequences clipped high"] > 0
    assert any(f.startswith("(a) engine vs textbook") for f in out.failures), out.failures
    assert not any(f.startswith("(a) engine vs own objective") for f in out.failures)  # they agree with each other
