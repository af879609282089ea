"""The central invariant, for every registered method: the engine's gradient is the textbook one.

gcfamily/check/ runs the checks (the same ones as `gcf check SPEC`). For each method, at its own defaults
and at settings that reach every branch, on a batch its own setup/prepare build on a stub trainer:

(a) the engine's gradient (micro-batched coefficient + engine.weighted_loss, Z = engine.normaliser) equals
    autograd of an independent textbook objective, written in check.py from the papers (advantages from the
    rewards, ratio, min() of the clipped surrogate, KL estimators, GAE, DPO/IPO/cDPO/SimPO/ORPO/KTO losses,
    the aggregation and Z), sharing no formula with the method or the engine; and autograd of method.objective;
(b) d loss / d logits through the engine's chunked log-prob backward equals GC * w / Z * (onehot - softmax),
    GC = (dJ/dlogp) / (w / Z) from the textbook, not from the method's coefficient.

A case fails when a branch its settings make reachable did not occur on its batch (clipped low, clipped
high and unclipped tokens or sequences, the band between eps and eps_high, KL past and within the clamp,
an equal-reward group, a failed reward, several micro-batches, both sides of a pair loss's pivot, ...).

This file adds what one method's check cannot: every registered method has a family and a textbook; the
methods' defaults are the papers'; and the check fails on the bugs it exists to catch (a guard each).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gcfamily import check
from gcfamily.config import FIELD_NAMES
from gcfamily.errors import GcfError
from gcfamily.methods import METHODS, get_method
from gcfamily.methods.base import Batch, Method
from gcfamily.methods.grpo import GRPO
from gcfamily.methods.reward_model import RewardModelTraining
from gcfamily.methods.sft import SFT


def _cases() -> list[Any]:
    return [
        pytest.param(name, label, s, id=f"{name}-{label}")
        for name in METHODS
        for label, s in check.cases(get_method(name))
    ]


@pytest.mark.parametrize("name, label, settings", _cases())
def test_engine_gradient_is_the_textbook_gradient(name: str, label: str, settings: dict) -> None:
    cls = get_method(name)
    out = check.run_case(cls, label, settings)
    text, _ = check.report(name, cls, [out])
    assert out.textbook, f"{name} has no independent textbook in gcfamily/check/textbook.py:\n{text}"
    assert not out.refused, f"{name} refuses the check's settings {settings}: {out.refused}"
    assert out.ok, text
    assert out.branches["micro-batches"] >= 4 or not cls.trains_policy  # two seeds, two micro-batches or more each


def test_every_method_in_gcf_methods_is_covered() -> None:
    assert {c.values[0] for c in _cases()} == set(METHODS)
    for name in METHODS:  # the defaults case first, and at least one more for a method that trains the policy
        labels = [label for label, _ in check.cases(get_method(name))]
        assert labels[0] == "defaults" and (len(labels) > 1 or not get_method(name).trains_policy), name


# the settings each paper states (a mutated default, e.g. DAPO's upper clip set to the lower, fails here)
PAPER_DEFAULTS = {
    "grpo": {"epsilon": 0.2, "epsilon_high": None, "beta": 0.04, "norm": "sequence"},  # DeepSeekMath 4.2
    "dapo": {"epsilon": 0.2, "epsilon_high": 0.28, "norm": "token"},  # DAPO 3.1 clip-higher, 3.3 token-level loss
    "dr-grpo": {
        "scale_rewards": "none",
        "norm": "constant",
        "norm_constant": "max_new_tokens",
    },  # Dr. GRPO: no std, no 1/|o|
    "gspo": {"epsilon": 3e-4, "epsilon_high": 4e-4, "beta": 0.0},  # GSPO 5.1
    "ppo": {"epsilon": 0.2},  # PPO, eps = 0.2
    "dpo": {"beta": 0.1},  # DPO 6
}


@pytest.mark.parametrize("name", sorted(PAPER_DEFAULTS))
def test_methods_default_to_their_papers_settings(name: str) -> None:
    if name not in METHODS:
        pytest.skip(f"{name} is not registered")
    m = check.make(get_method(name), {})
    for key, want in PAPER_DEFAULTS[name].items():
        got = (
            m.norm if key == "norm" else getattr(m.cfg if key in FIELD_NAMES else m.settings, key)
        )  # one spelling each
        want = getattr(m.cfg, want) if key == "norm_constant" else want  # Dr. GRPO divides by the generation budget
        assert got == want, f"{name}: {key} = {got}, the paper's is {want}"


# ----------------------------------------------------------------------------- the check's own guards


class _NoObjective(SFT):
    name = "no-objective"
    objective = Method.objective  # type: ignore[assignment]


class _NoFamily(Method):
    name = "no-family"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(logps)


class _WrongCoefficient(SFT):
    name = "wrong"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return 2 * torch.ones_like(logps)  # the objective is SFT's, whose GC is 1


class _ScaledAdvantages(GRPO):
    """Advantages x 1.7 in coefficient and objective alike: they agree with each other, not with the textbook."""

    name = "scaled"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return super().coefficient(batch.replaced(advantages=1.7 * batch.advantages), logps)

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return super().objective(batch.replaced(advantages=1.7 * batch.advantages), logps, Z)


class _UnclippedSequence(GRPO):
    """GSPO's sequence ratio with no clip in coefficient or objective."""

    name = "unclipped-sequence"
    ratio_level = "sequence"

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch.loss_mask.to(logps.dtype)
        s = torch.exp(((logps - self._old(batch, logps)) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
        return s.expand_as(logps), s.expand_as(logps)

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return self.importance_ratio(batch, logps)[1] * self.token_advantages(batch) * batch.loss_mask

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return self.aggregate(
            self.importance_ratio(batch, logps)[0] * self.token_advantages(batch) * batch.loss_mask, batch, Z
        )


class _FlippedKL(GRPO):
    """The KL term's sign flipped in coefficient and objective alike."""

    name = "flipped-kl"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        no_kl = super().coefficient(batch.replaced(ref_logps=None), logps)
        return 2 * no_kl - super().coefficient(batch, logps)

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        no_kl = super().objective(batch.replaced(ref_logps=None), logps, Z)
        return 2 * no_kl - super().objective(batch, logps, Z)


class _OwnAdvantage(GRPO):
    name = "own-advantage"

    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, rewards, 0.0)


class _TouchesThePolicy(RewardModelTraining):
    name = "touches"

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(logps)


def _failures(cls: type[Method], settings: dict) -> list[str]:
    out = check.run_case(cls, "guard", settings)
    return out.failures + [f"missing {b}" for b in out.missing]


@pytest.mark.parametrize(
    "cls, settings, message",
    [
        (_NoObjective, {}, "has no objective"),
        (_WrongCoefficient, {}, "(a) engine vs own objective"),
        (_TouchesThePolicy, {}, "trains no policy"),
    ],
)
def test_a_method_that_cannot_be_checked_or_is_wrong_fails(cls: type[Method], settings: dict, message: str) -> None:
    assert any(message in f for f in _failures(cls, settings)), _failures(cls, settings)


@pytest.mark.parametrize(
    "cls, settings",
    [
        (_ScaledAdvantages, {}),  # at GRPO's own defaults: no clip, the KL in the loss
        (_UnclippedSequence, {"mu": 2, "beta": 0.0}),  # the sequence clip alone
        (_FlippedKL, {"beta": 0.1}),
    ],
)
def test_a_subclass_overriding_coefficient_and_objective_is_a_rule_of_its_own(
    cls: type[Method], settings: dict
) -> None:
    """A class outside gcfamily whose coefficient and objective agree is checked against its own objective (issue 30);
    the same mistakes planted in the built-in classes are caught by the textbook in tests/test_check_own_rule.py."""
    out = check.run_case(cls, "guard", settings)
    assert not out.textbook and out.ok, out.failures
    assert "(a) engine vs own objective" in out.diffs and "(a) engine vs textbook" not in out.diffs


def test_a_family_the_check_cannot_build_is_one_sentence() -> None:
    with pytest.raises(GcfError, match="belongs to no data family"):
        check.run_case(_NoFamily, "guard", {})


def test_a_hook_the_textbook_does_not_know_is_named_and_checked_against_its_objective() -> None:
    out = check.run_case(_OwnAdvantage, "guard", {"mu": 2})
    assert not out.textbook and out.ok
    assert "(a) engine vs own objective" in out.diffs and "(a) engine vs textbook" not in out.diffs
    text, _ = check.report("own", _OwnAdvantage, [out])
    assert "_OwnAdvantage.group_advantages is its own" in text


def test_a_batch_that_cannot_tell_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the designed pi_old no token is clipped: the check says which branches did not occur."""
    from gcfamily.check import builders as check_builders

    monkeypatch.setattr(check_builders, "_design_ratios", lambda *a, **k: None)
    out = check.run_case(get_method("dapo"), "clip and KL", {"mu": 2})
    assert not out.ok and {
        "clipped low",
        "clipped high",
        "in the band between eps and eps_high",
        "unclipped, r != 1",
    } <= set(out.missing)
