"""Holes the exactness check had, each shown closed by a bug planted where it lives and caught by `check.run_case`.

- No case sampled at a temperature other than 1, so log-probs taken at temperature 1 instead of the sampling one (or a
  chunked backward without its 1/tau) passed every case: the on-policy families now have a case at tau = 0.7, where
  the textbook's pi is log softmax(logits / 0.7) whatever the method's `logprob_temperature` says.
- scale_rewards=batch was checked only with std=population, so the population std in place of the sample std under
  scale_rewards=batch passed: GRPO's family now has a case with std=sample.
- gspo accepted kl_estimator=k3-importance-weighted, which weighs each token's k3 by the token ratio where TRL's GSPO
  weighs it by the sequence ratio: it now refuses it in one sentence. docs/trl-mapping.md maps TRL's GSPO to the
  built-in `gspo`, whose rule is the one benchmarks/trl_parity.py's rows check (its own copy of GSPO): shown equal here.

Each plant is shown to pass every case but the new one (the hole), and to fail the new one (closed).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from gcfamily import check
from gcfamily.config import Config
from gcfamily.core import engine, logprobs
from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError
from gcfamily.methods import get_method
from gcfamily.methods.grpo import GRPO
from gcfamily.methods.gspo import GSPO
from gcfamily.methods.onpolicy import OnPolicy

ON_POLICY = ["grpo", "ppo", "grpo-ps"]  # one per on-policy family: groups, a critic's GAE, step rewards


def _temperature_case(name: str) -> tuple[str, dict]:
    found = [(label, s) for label, s in check.cases(get_method(name)) if s.get("temperature") == check.TAU]
    assert len(found) == 1, check.cases(get_method(name))
    return found[0]


def _outcomes(name: str) -> dict[str, check.Outcome]:
    cls = get_method(name)
    return {label: check.run_case(cls, label, s, seeds=(0,)) for label, s in check.cases(cls)}


@pytest.mark.parametrize("name", ON_POLICY)
def test_each_on_policy_family_has_a_case_sampled_at_another_temperature(name: str) -> None:
    label, settings = _temperature_case(name)
    assert check.TAU != 1.0 and settings["temperature"] == check.TAU
    out = check.run_case(get_method(name), label, settings)
    assert out.ok, check.report(name, get_method(name), [out])[0]
    assert out.branches[f"log-probs at temperature {check.TAU:g}"] == 2  # both seeds ran at tau = 0.7


@pytest.mark.parametrize("name", ON_POLICY)
def test_log_probs_at_temperature_1_instead_of_the_sampling_one_are_caught(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(OnPolicy, "logprob_temperature", lambda self: 1.0)
    label, _ = _temperature_case(name)
    outcomes = _outcomes(name)
    failed = [lab for lab, o in outcomes.items() if not o.ok]
    assert failed == [label], failed  # the hole: every case at temperature 1 passes the plant
    failures = outcomes[label].failures
    assert any(f.startswith("(b) d loss/d logits vs textbook") for f in failures), failures


def test_a_chunked_backward_without_its_1_over_tau_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    backward = logprobs._ChunkedTokenLogprob.backward

    def without_tau(ctx, *grads):  # noqa: ANN001, ANN202
        out = backward(ctx, *grads)
        return (out[0] * ctx.temperature, *out[1:])  # d/d hidden times tau: the 1/tau undone

    monkeypatch.setattr(logprobs._ChunkedTokenLogprob, "backward", staticmethod(without_tau))
    label, _ = _temperature_case("grpo")
    outcomes = _outcomes("grpo")
    assert [lab for lab, o in outcomes.items() if not o.ok] == [label]
    failures = outcomes[label].failures
    assert any(f.startswith("(b) d loss/d logits vs textbook") for f in failures), failures


def _population_batch_std(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return rewards.double()[valid].std(unbiased=False).reshape(1, 1)  # 1/n, whatever settings.std says


def test_the_population_std_in_place_of_the_sample_std_under_batch_scaling_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    label = "batch sample std"
    assert dict(check.cases(GRPO))[label] == {"scale_rewards": "batch", "std": "sample"}
    assert check.run_case(GRPO, label, {"scale_rewards": "batch", "std": "sample"}).ok
    monkeypatch.setattr(GRPO, "_batch_std", _population_batch_std)
    outcomes = _outcomes("grpo")
    # the batch-std case at population std passes; the two-rank case's std is the sample one too (and this plant's
    # std is one rank's), so it fails as well
    # (and the two-reward case, whose summed z-scores are scaled over the step by the same std)
    failing = [lab for lab, o in outcomes.items() if not o.ok]
    assert failing == ["two rewards standardised apart, then summed", label, "two simulated ranks, batch std"]
    # 15 valid rewards (one failed): A grows by sqrt(15/14), so the engine's gradient is not the textbook's
    failures = outcomes[label].failures
    assert any(f.startswith("(a) engine vs textbook") for f in failures), failures


def test_gspo_refuses_the_token_weighted_kl_in_one_sentence() -> None:
    cfg = Config(method="gspo", beta=0.04, kl_estimator="k3-importance-weighted")
    with pytest.raises(GcfError) as e:
        GSPO.validate(cfg)
    msg = str(e.value)
    assert msg.startswith("gspo refuses kl_estimator=k3-importance-weighted: ") and msg.count(". ") == 0
    assert "token ratio" in msg and "per sequence" in msg and "use kl_estimator=k3" in msg
    for ok in ("k3", "k1", "auto"):  # the other estimators stay
        GSPO.validate(Config(method="gspo", beta=0.04, kl_estimator=ok))
    GRPO.validate(Config(method="grpo", beta=0.04, kl_estimator="k3-importance-weighted"))  # GRPO's is TRL's


def test_gcf_check_gspo_runs_its_kl_case_with_plain_k3_and_refuses_the_setting(gcf) -> None:
    labels = [label for label, _ in check.cases(GSPO)]
    assert "k3 clamp 0.5, zero_std exclude, token" in labels and not any("k3-iw" in x for x in labels)
    code, out, err = gcf("check", "gspo", "--set", "kl_estimator=k3-importance-weighted")
    assert code == 2 and out == ""
    assert err.strip().startswith("error: gspo refuses kl_estimator=k3-importance-weighted") and err.count("\n") == 1


def _parity_module():  # noqa: ANN202
    """benchmarks/trl_parity.py, whose rows check its own copy of GSPO against TRL (it imports TRL only to run)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "trl_parity.py"
    spec = importlib.util.spec_from_file_location("trl_parity", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("trl_parity", module)  # dataclasses resolve the module of its Row class by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "sets",
    [  # the settings of docs/trl-mapping.md's GSPO rows (TRL's epsilon 3e-4 and 4e-4 passed explicitly)
        {"beta": 0.0},
        {"beta": 0.04, "kl_estimator": "k3", "kl_clamp": None},
        {"beta": 0.0, "loss_norm": "sum"},
    ],
    ids=["beta 0", "beta 0.04, plain k3", "luspo (sum)"],
)
def test_the_builtin_gspo_is_the_rule_the_trl_parity_rows_check(sets: dict) -> None:
    """docs/trl-mapping.md maps TRL's GSPO to the built-in `gspo`; the benchmark runs its own copy `class GSPO`: both
    give the same objective, gradient and coefficient on one random batch with sequences clipped on both sides."""
    copy = _parity_module().GSPO
    g = torch.Generator().manual_seed(0)
    B, L = 16, 9
    start = torch.randint(1, 3, (B, 1), generator=g)
    end = start + torch.randint(2, L - 3, (B, 1), generator=g)
    mask = ((torch.arange(L) >= start) & (torch.arange(L) < end)).float()  # [B, L]
    logps = -3 * torch.rand(B, L, generator=g, dtype=torch.float64) * mask
    # log s_i cycles through +-1e-3 (past either clip) and +-1e-4 (inside), each with A > 0 and A < 0
    log_s = torch.tensor([1e-3, -1e-3, 1e-4, -1e-4], dtype=torch.float64).repeat(4)[:, None]  # [B, 1]
    noise = 1e-3 * torch.randn(B, L, generator=g, dtype=torch.float64) * mask
    noise = noise - (noise.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)) * mask  # mean 0 over each row
    batch = Batch(
        input_ids=torch.zeros(B, L, dtype=torch.long),
        loss_mask=mask,
        old_logps=(logps - log_s - noise) * mask,
        ref_logps=(logps + 0.5 * torch.randn(B, L, generator=g, dtype=torch.float64)) * mask,
        advantages=torch.tensor([1.0] * 4 + [-1.0] * 4).repeat(2) * torch.rand(B, generator=g),
        valid=torch.ones(B, dtype=torch.bool),
    )
    s = torch.exp(((logps - batch.old_logps) * mask).sum(-1) / mask.sum(-1))
    A = batch.advantages
    assert ((A > 0) & (s > 1 + 4e-4)).any() and ((A < 0) & (s < 1 - 3e-4)).any()  # both clips reached
    got = []
    for cls in (GSPO, copy):
        m = check.make(cls, {"group_size": 4, "mu": 2, "std_eps": 1e-4, "epsilon": 3e-4, "epsilon_high": 4e-4, **sets})
        b = batch if m.settings.beta > 0 else batch.replaced(ref_logps=None)
        Z = engine.normaliser([b], m.norm, m.cfg.norm_constant)
        lp = logps.clone().requires_grad_(True)
        J = m.objective(b, lp, Z)
        got.append((J.detach(), torch.autograd.grad(J, lp)[0], m.coefficient(b, logps.clone()).double()))
    for ours, theirs in zip(*got):
        assert torch.allclose(ours.double(), theirs.double(), rtol=0, atol=1e-12)
