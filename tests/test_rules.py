"""verl's and OpenRLHF's policy-loss rules as rules of the zoo (issue 47): dual-clip, CISPO, GPG, GMPO, SAPO.

Each rule: a coefficient worked by hand, `gcf check` on the case that reaches its branches, a bug planted where the
rule lives that the check must fail, and two steps of `gcf run` on the tiny model.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import metrics_rows

from gcfamily import check
from gcfamily.config import Config
from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError
from gcfamily.methods import get_method
from gcfamily.methods.clipped import ClippedOnPolicy
from gcfamily.methods.grpo import GRPO
from gcfamily.run.trainer import Trainer

FAST = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False}


def make(name: str, **settings):
    cls = get_method(name)
    cfg = Config(method=name, **settings)
    cls.validate(cfg)
    return cls(cfg)


def one_row(ratios: list[float], adv: float) -> tuple[Batch, torch.Tensor]:
    """One row whose tokens have these ratios pi/pi_old, advantage `adv`, no reference."""
    L = len(ratios)
    logps = torch.full((1, L), -1.0)
    old = logps - torch.log(torch.tensor([ratios]))
    batch = Batch(
        input_ids=torch.zeros(1, L, dtype=torch.long),
        attention_mask=torch.ones(1, L, dtype=torch.long),
        loss_mask=torch.ones(1, L, dtype=torch.long),
        advantages=torch.tensor([adv]),
        old_logps=old,
    )
    return batch, logps


def run_case(name: str, label: str) -> check.Outcome:
    cls = get_method(name)
    found = dict(check.cases(cls))
    assert label in found, f"{name} has no case {label!r}: {list(found)}"
    return check.run_case(cls, label, found[label])


def caught(name: str, label: str, monkeypatch: pytest.MonkeyPatch, plant: tuple[object, str, object]) -> str:
    """The case passes on the real code and fails with the plant in place: the report of the failure."""
    out = run_case(name, label)
    assert out.ok, check.report(name, get_method(name), [out])[0]
    monkeypatch.setattr(*plant)
    out = run_case(name, label)
    text, ok = check.report(name, get_method(name), [out])
    assert not ok and not out.ok, text
    return text


def two_steps(tmp_path, name: str, **extra) -> list[dict]:
    out = tmp_path / "run"
    cfg = Config(method=name, model="tiny", task="arithmetic", output_dir=str(out), max_steps=2, **{**FAST, **extra})
    Trainer(cfg).run()
    return metrics_rows(out)


# ============================================================================= dual-clip


def test_dual_clip_by_hand():
    m = make("grpo", group_size=4, beta=0.0, mu=2, dual_clip=3.0)
    # A = -1, eps 0.2, c 3: r 0.5 is clipped low (0); r 1 and 2 keep r A; r 4 > c: the bound -3 binds (0)
    batch, logps = one_row([0.5, 1.0, 2.0, 4.0], -1.0)
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([0.0, -1.0, -2.0, 0.0])
    # per token max(min(r A, clip(r) A), c A) = -0.8, -1, -2, -3; sequence mean over 4 tokens, 1 row
    assert float(m.objective(batch, logps, 1.0)) == pytest.approx(-(0.8 + 1 + 2 + 3) / 4)
    assert m.metrics(batch, logps, m.coefficient(batch, logps))["grpo/dual_clip_frac"] == 0.25
    # A = +1: the bound is for negative advantages only; r 4 is clipped high by the usual clip, r 2 as well
    batch, logps = one_row([0.5, 1.0, 2.0, 4.0], 1.0)
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([0.5, 1.0, 0.0, 0.0])
    off = make("grpo", group_size=4, beta=0.0, mu=2)
    batch, logps = one_row([4.0], -1.0)
    assert off.coefficient(batch, logps)[0].tolist() == pytest.approx([-4.0])


def test_dual_clip_must_exceed_one():
    with pytest.raises(GcfError, match="dual_clip must be > 1"):
        make("ppo", dual_clip=1.0)


@pytest.mark.parametrize("name", ["grpo", "ppo", "gspo"])
def test_gcf_check_passes_dual_clip_and_reaches_its_bound(name: str):
    out = run_case(name, "dual-clip 3, clip and KL")
    assert out.ok, check.report(name, get_method(name), [out])[0]
    assert any("past dual-clip's bound" in k and n > 0 for k, n in out.branches.items())


def _bound_on_positive(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    lo, hi = self.clip_range()
    out = ((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - lo))
    return out | ((adv > 0) & (ratio > self.settings.dual_clip))  # the planted bug: A > 0 instead of A < 0


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_dual_clip_on_positive_advantages_is_caught(name: str, monkeypatch: pytest.MonkeyPatch):
    text = caught(name, "dual-clip 3, clip and KL", monkeypatch, (ClippedOnPolicy, "clipped", _bound_on_positive))
    assert "FAILED (a) engine vs textbook" in text


def test_grpo_with_dual_clip_two_steps(tmp_path):
    rows = two_steps(tmp_path, "grpo", num_minibatches=2, dual_clip=1.5)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("grpo/dual_clip_frac" in r and math.isfinite(r["loss"]) for r in rows)


# ============================================================================= CISPO


def test_cispo_by_hand():
    m = make("cispo", group_size=4, mu=2)  # defaults: no lower bound (epsilon 1), weight at most 1 + 4 = 5
    batch, logps = one_row([0.1, 1.0, 2.0, 6.0], -1.0)
    # GC = clip(r) A: every token keeps a gradient, r 6 is capped at 5 (PPO's min would zero r 0.1, verl's keeps 0.8)
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([-0.1, -1.0, -2.0, -5.0])
    # J = token mean of sg(w) A log pi = w (-1)(-1) = w: (0.1 + 1 + 2 + 5) / 4
    assert float(m.objective(batch, logps, 4.0)) == pytest.approx(8.1 / 4)
    assert m.metrics(batch, logps, m.coefficient(batch, logps))["cispo/weight_capped_frac"] == 0.25
    verl = make("cispo", group_size=4, mu=2, epsilon=0.2, epsilon_high=0.2)  # verl's clip to [0.8, 1.2]
    assert verl.coefficient(batch, logps)[0].tolist() == pytest.approx([-0.8, -1.0, -1.2, -1.2])
    with pytest.raises(GcfError, match="cispo refuses dual_clip"):
        make("cispo", group_size=4, dual_clip=3.0)
    with pytest.raises(GcfError, match="epsilon must be > 0"):
        make("cispo", group_size=4, epsilon=0.0)


CISPO_CASES = ["clip and KL", "clip both sides (eps 0.2, verl's), KL", "sampler correction token_truncate, clip and KL"]


@pytest.mark.parametrize("label", CISPO_CASES)
def test_gcf_check_passes_cispo_and_reaches_its_branches(label: str):
    out = run_case("cispo", label)
    assert out.ok, check.report("cispo", get_method("cispo"), [out])[0]
    for branch in ("IS weight capped at 1 + eps_high, A < 0", "IS weight capped at 1 + eps_high, A > 0"):
        assert out.branches[f"tokens with the {branch}"] > 0
    assert (out.branches["tokens with the IS weight raised to 1 - eps"] > 0) == ("both sides" in label)


def _undetached_objective(self, batch, logps, Z):
    old = self._old(batch, logps)
    lo, hi = self.clip_range()
    w = torch.exp(logps - old).clamp(1 - lo, 1 + hi)  # the planted bug: the weight keeps its gradient
    per_token = w * self.token_advantages(batch) * logps * self.sampler_correction(batch, old)
    kl_only = batch.replaced(advantages=torch.zeros_like(batch.advantages))
    return self.aggregate(per_token * batch.loss_mask, batch, Z) + ClippedOnPolicy.objective(self, kl_only, logps, Z)


def _undetached_factor(self, batch, logps):
    """The coefficient of the undetached objective, d/dlogp of clip(r) log pi: clip(r) + 1[inside] r log pi."""
    ratio, _ = ClippedOnPolicy.importance_ratio(self, batch, logps)
    lo, hi = self.clip_range()
    inside = (ratio >= 1 - lo) & (ratio <= 1 + hi)
    return ratio, ratio.clamp(1 - lo, 1 + hi) + torch.where(inside, ratio * logps, 0.0)


def test_cispo_weight_given_a_gradient_in_its_objective_is_caught(monkeypatch: pytest.MonkeyPatch):
    cispo = get_method("cispo")
    text = caught("cispo", "clip and KL", monkeypatch, (cispo, "objective", _undetached_objective))
    assert "FAILED (a) engine vs own objective" in text


def test_cispo_weight_given_a_gradient_everywhere_is_caught_by_the_textbook(monkeypatch: pytest.MonkeyPatch):
    cispo = get_method("cispo")
    assert run_case("cispo", "clip and KL").ok
    monkeypatch.setattr(cispo, "importance_ratio", _undetached_factor)  # coefficient and objective agree ...
    monkeypatch.setattr(cispo, "objective", _undetached_objective)
    out = run_case("cispo", "clip and KL")
    text, ok = check.report("cispo", cispo, [out])
    assert not ok and not out.ok
    assert "FAILED (a) engine vs textbook" in text and "(a) engine vs own objective" in text
    assert "FAILED (a) engine vs own objective" not in text  # ... so only the textbook tells


def test_cispo_two_steps(tmp_path):
    rows = two_steps(tmp_path, "cispo", num_minibatches=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("cispo/weight_capped_frac" in r and math.isfinite(r["loss"]) for r in rows)


# ============================================================================= GPG


class _Sum:
    """A stand-in for the run's services: all_sum adds another process's tensor (none: one process)."""

    def __init__(self, other=None):
        self.other = other

    def all_sum(self, t):
        return t if self.other is None else t + self.other.to(t.dtype)


def test_gpg_by_hand():
    m = make("gpg", group_size=4)
    m.services = _Sum()
    R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[2, 3] = False  # a failed reward: no gradient
    # 12 samples, 4 in the equal group and 1 failed carry no gradient: alpha = 12 / 7; no std division
    adv = m.group_advantages(R, valid)
    assert adv[0].tolist() == pytest.approx([0.5 * 12 / 7, -0.5 * 12 / 7, -0.5 * 12 / 7, 0.5 * 12 / 7])
    assert adv[2, :3].tolist() == pytest.approx([(1 - 1 / 3) * 12 / 7, -(1 / 3) * 12 / 7, -(1 / 3) * 12 / 7])
    # another process holds 4 samples, all with a gradient: alpha = 16 / 11
    m.services = _Sum(torch.tensor([4.0, 4.0]))
    assert m.group_advantages(R, valid)[0, 0] == pytest.approx(0.5 * 16 / 11)
    # GC = A on every token, whatever the ratio (none enters the rule)
    batch, logps = one_row([0.1, 1.0, 9.0], -0.5)
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([-0.5, -0.5, -0.5])
    assert float(m.objective(batch, logps, 3.0)) == pytest.approx(0.5)  # token mean of (-0.5)(-1)
    for bad, why in (({"dual_clip": 2.0}, "gpg refuses dual_clip"), ({"zero_std": "exclude"}, "correct twice")):
        with pytest.raises(GcfError, match=why):
            make("gpg", group_size=4, **bad)


@pytest.mark.parametrize("label", ["defaults", "clip and KL", "two simulated ranks, batch std"])
def test_gcf_check_passes_gpg(label: str):
    out = run_case("gpg", label)
    assert out.ok, check.report("gpg", get_method("gpg"), [out])[0]
    assert out.branches["equal-reward groups"] > 0 and out.branches["failed rewards"] > 0


def _alpha_of_one_rank(self, rewards, valid):
    graded = valid & ~self.equal_reward_groups(rewards, valid)[:, None]
    return GRPO.group_advantages(self, rewards, valid) * (valid.numel() / max(int(graded.sum()), 1))


def test_gpg_alpha_of_one_rank_is_caught_on_two_ranks(monkeypatch: pytest.MonkeyPatch):
    gpg = get_method("gpg")
    text = caught("gpg", "two simulated ranks, batch std", monkeypatch, (gpg, "group_advantages", _alpha_of_one_rank))
    assert "FAILED (a) engine vs textbook" in text


def test_gpg_without_alpha_is_caught(monkeypatch: pytest.MonkeyPatch):
    gpg = get_method("gpg")
    text = caught("gpg", "defaults", monkeypatch, (gpg, "group_advantages", GRPO.group_advantages))
    assert "FAILED (a) engine vs textbook" in text


def test_gpg_two_steps(tmp_path):
    rows = two_steps(tmp_path, "gpg")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows) and "gpg/adv_abs_mean" in rows[0]


# ============================================================================= GMPO


def test_gmpo_by_hand():
    m = make("gmpo", group_size=4, mu=2)  # eps 0.4 on both sides, in log space
    logr = [0.0, 0.2, 0.6, -0.6]
    batch, logps = one_row([math.exp(x) for x in logr], 1.0)
    # A > 0: lt = min(l, 0.4) = 0, 0.2, 0.4 (clipped), -0.6 (kept): mean 0, rho 1; the clipped token loses its gradient
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0])
    assert float(m.objective(batch, logps, 1.0)) == pytest.approx(1.0)  # one row: A rho
    assert m.metrics(batch, logps, m.coefficient(batch, logps))["gmpo/clip_frac"] == 0.25
    batch, logps = one_row([math.exp(x) for x in logr], -1.0)
    # A < 0: lt = max(l, -0.4) = 0, 0.2, 0.6, -0.4 (clipped): mean 0.1, rho e^0.1
    rho = math.exp(0.1)
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([-rho, -rho, -rho, 0.0])
    assert float(m.objective(batch, logps, 1.0)) == pytest.approx(-rho)
    with pytest.raises(GcfError, match="gmpo refuses dual_clip"):
        make("gmpo", group_size=4, dual_clip=3.0)


@pytest.mark.parametrize(
    "label", ["clip and KL", "k3-iw clamp 0.5, zero_std exclude, token", "two simulated ranks, batch std"]
)
def test_gcf_check_passes_gmpo(label: str):
    out = run_case("gmpo", label)
    assert out.ok, check.report("gmpo", get_method("gmpo"), [out])[0]
    if label != "two simulated ranks, batch std":  # one pass: the ratio is 1
        assert out.branches["tokens with log r past eps_high, A > 0 (clipped)"] > 0
        assert out.branches["tokens with log r outside the clip on the side A keeps"] > 0


def _mean_over_every_position(self, batch, logps):
    lt = self.clipped_log_ratio(batch, logps)
    return torch.exp(lt.mean(-1, keepdim=True))  # the planted bug: over all L positions, prompt and padding too


def test_gmpo_mean_over_prompt_and_padding_is_caught(monkeypatch: pytest.MonkeyPatch):
    gmpo = get_method("gmpo")
    text = caught("gmpo", "clip and KL", monkeypatch, (gmpo, "sequence_ratio", _mean_over_every_position))
    assert "FAILED (a) engine vs textbook" in text


def test_gmpo_two_steps(tmp_path):
    rows = two_steps(tmp_path, "gmpo", num_minibatches=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("gmpo/clip_frac" in r and math.isfinite(r["loss"]) for r in rows)


# ============================================================================= SAPO


def test_sapo_by_hand():
    m = make("sapo", group_size=4, mu=2)  # tau_pos 1, tau_neg 1.05
    batch, logps = one_row([1.0, 2.0], 1.0)
    # r = 1: s = 1/2, GC = 4 * 1 * 1/4 * A = A; r = 2, tau 1: s = sigmoid(1), GC = 4 * 2 * s (1 - s)
    s = 1 / (1 + math.exp(-1.0))
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([1.0, 8 * s * (1 - s)])
    # J = sequence mean of (4 / tau) sigmoid(tau (r - 1)) A = (2 + 4 s) / 2
    assert float(m.objective(batch, logps, 1.0)) == pytest.approx((2 + 4 * s) / 2)
    batch, logps = one_row([2.0], -1.0)  # A < 0: tau_neg = 1.05
    s = 1 / (1 + math.exp(-1.05))
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([-8 * s * (1 - s)])
    with pytest.raises(GcfError, match="tau_neg must be > 0"):
        make("sapo", group_size=4, tau_neg=0.0)


@pytest.mark.parametrize("label", ["clip and KL", "sampler correction token_truncate, clip and KL"])
def test_gcf_check_passes_sapo(label: str):
    out = run_case("sapo", label)
    assert out.ok, check.report("sapo", get_method("sapo"), [out])[0]
    assert out.branches["tokens with A > 0, r != 1 (gate at tau_pos)"] > 0
    assert out.branches["tokens with A < 0, r != 1 (gate at tau_neg)"] > 0


def _gate_on_the_wrong_sign(self, batch):
    s = self.settings
    return torch.where(self.token_advantages(batch) < 0, s.tau_pos, s.tau_neg)  # the planted bug: A < 0 gets tau_pos


def test_sapo_gate_on_the_wrong_advantage_sign_is_caught(monkeypatch: pytest.MonkeyPatch):
    sapo = get_method("sapo")
    text = caught("sapo", "clip and KL", monkeypatch, (sapo, "gate_temperature", _gate_on_the_wrong_sign))
    assert "FAILED (a) engine vs textbook" in text and "FAILED (a) engine vs own objective" not in text


def test_sapo_two_steps(tmp_path):
    rows = two_steps(tmp_path, "sapo", num_minibatches=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("sapo/gate_slope_mean" in r and math.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("name", ["sapo", "gpg"])
@pytest.mark.parametrize("setting", ["epsilon=0.3", "epsilon_high=0.28"])
def test_rules_without_a_clip_refuse_its_settings_in_one_sentence(gcf, tmp_path, name, setting):
    """A clip range that does not enter the rule is refused, never silently ignored."""
    code, out, err = gcf("run", "--method", name, "--model", "tiny", "--task", "arithmetic", "--max-steps", "1",
                         "--output-dir", str(tmp_path / "run"), f"--set={setting}")  # fmt: skip
    assert code == 2 and "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
    assert f"{name} takes no epsilon or epsilon_high: " in err and err.strip().endswith("leave them unset.")


# ============================================================================= VESPO


def test_vespo_by_hand():
    m = make("vespo", group_size=4, mu=2)  # k_pos 2, lambda_pos 3, k_neg 3, lambda_neg 2
    batch, logps = one_row([2.0, 0.75], 1.0)  # w = 2 * 0.75 = 1.5
    phi = math.exp(3) * 1.5**2 * math.exp(-3 * 1.5)  # e^lambda w^k e^(-lambda w), A >= 0
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([phi, phi])  # the same on every token: GC = phi A
    batch, logps = one_row([2.0, 0.75], -0.5)
    phi = math.exp(2) * 1.5**3 * math.exp(-2 * 1.5)  # A < 0: k 3, lambda 2
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([-0.5 * phi] * 2)
    batch, logps = one_row([1.0, 1.0], 1.0)  # on-policy: phi(1) = 1, REINFORCE with A
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("label", ["clip and KL", "minibatches, k1, batch std"])
def test_gcf_check_passes_vespo(label: str):
    out = run_case("vespo", label)
    assert out.ok, check.report("vespo", get_method("vespo"), [out])[0]
    assert out.branches["rows with A > 0 weighed phi != 1"] > 0 and out.branches["rows with A < 0 weighed phi != 1"] > 0


def test_vespo_shape_on_the_wrong_advantage_sign_is_caught(monkeypatch: pytest.MonkeyPatch):
    vespo = get_method("vespo")
    real = vespo.gamma_weight

    def swapped(self, batch, logps):  # the planted bug: A >= 0 weighed with the negative pair, and A < 0 the positive
        return real(self, batch.replaced(advantages=-batch.advantages), logps)

    text = caught("vespo", "clip and KL", monkeypatch, (vespo, "gamma_weight", swapped))
    assert "FAILED (a) engine vs textbook" in text and "FAILED (a) engine vs own objective" not in text


def test_vespo_two_steps(tmp_path):
    rows = two_steps(tmp_path, "vespo", num_minibatches=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("vespo/phi_mean" in r and math.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"epsilon": 0.3}, "vespo takes no epsilon, epsilon_high or dual_clip: its weight replaces the clip."),
        ({"tis": "token_truncate"}, "vespo refuses tis=token_truncate: TRL folds the sampler's ratio into VESPO's"),
        ({"lambda_neg": 0.0}, "Invalid setting: lambda_neg must be >= 1e-4."),
    ],
)
def test_vespo_refusals_are_one_sentence(settings: dict, says: str):
    with pytest.raises(GcfError) as e:
        make("vespo", group_size=4, **settings)
    assert str(e.value).startswith(says)


# ============================================================================= the off-policy sequence mask (DeepSeek-V3.2)


def test_off_policy_mask_by_hand():
    m = make("grpo", group_size=4, mu=2, beta=0.0, off_policy_mask=0.1)
    batch, logps = one_row([1.0, 1.0], -1.0)  # on-policy: A < 0 but the mean log(pi_sampler/pi) is 0 <= 0.1, kept
    batch.sample_logps = logps.clone()
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([-1.0, -1.0])
    batch.sample_logps = logps + torch.tensor([[0.1, 0.3]])  # mean 0.2 > 0.1 with A < 0: dropped
    assert m.coefficient(batch, logps)[0].tolist() == [0.0, 0.0]
    batch = batch.replaced(advantages=torch.tensor([1.0]))  # A > 0 is never dropped
    assert m.coefficient(batch, logps)[0].tolist() == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("name", ["grpo", "cispo", "vespo", "ppo"])
def test_gcf_check_passes_the_off_policy_mask(name: str):
    out = run_case(name, "off-policy mask 0, clip and KL")
    assert out.ok, check.report(name, get_method(name), [out])[0]
    assert out.branches["rows with A < 0 dropped off-policy (mean KL > threshold)"] > 0
    assert out.branches["rows with A < 0 kept (mean KL <= threshold)"] > 0


def test_an_off_policy_mask_on_positive_advantages_is_caught(monkeypatch: pytest.MonkeyPatch):
    real = ClippedOnPolicy.off_policy_keep

    def on_positive(self, batch, logps):  # the planted bug: drops A > 0 rows instead of A < 0 ones
        return real(self, batch.replaced(advantages=-batch.advantages), logps)

    text = caught(
        "grpo", "off-policy mask 0, clip and KL", monkeypatch, (ClippedOnPolicy, "off_policy_keep", on_positive)
    )
    assert "FAILED (a) engine vs textbook" in text and "FAILED (a) engine vs own objective" not in text


# ============================================================================= verl's pass@k and OPO advantages


def test_grpo_passk_by_hand():
    m = make("grpo-passk", group_size=4, std_eps=1e-6)
    r = torch.tensor([[0.2, 0.9, 0.6, 0.1], [1.0, 0.0, 1.0, 0.0]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, True]])
    adv = m.group_advantages(r, valid)
    std = float(torch.tensor([0.2, 0.9, 0.6, 0.1]).std())  # the sample std, as torch.std
    assert adv[0].tolist() == pytest.approx([0.0, (0.9 - 0.6) / (std + 1e-6), 0.0, 0.0])
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # two best samples tie: the gap is 0
    valid[0, 1] = False  # the best failed: the next best gets the gap to the third
    adv = m.group_advantages(r, valid)
    std = float(torch.tensor([0.2, 0.6, 0.1]).std())
    assert adv[0].tolist() == pytest.approx([0.0, 0.0, (0.6 - 0.2) / (std + 1e-6), 0.0])


def test_opo_by_hand():
    m = make("opo", group_size=3)
    m.lengths = torch.tensor([[1.0, 3.0, 4.0]])
    r = torch.tensor([[1.0, 0.0, 0.5]])
    b = (1 * 1.0 + 3 * 0.0 + 4 * 0.5) / 8  # the length-weighted mean reward
    assert m.group_advantages(r, torch.ones(1, 3, dtype=torch.bool))[0].tolist() == pytest.approx([1 - b, -b, 0.5 - b])


@pytest.mark.parametrize("name", ["grpo-passk", "opo"])
def test_gcf_check_passes_the_estimators(name: str):
    out = run_case(name, "clip and KL")
    assert out.ok, check.report(name, get_method(name), [out])[0]


def test_passk_to_the_second_best_sample_is_caught(monkeypatch: pytest.MonkeyPatch):
    cls = get_method("grpo-passk")
    real = cls.group_advantages

    def to_the_worst(self, rewards, valid):  # the planted bug: the gap given to the worst sample, not the best
        adv = real(self, rewards, valid)
        return torch.where(adv != 0, 0.0, adv) + adv.sum(-1, keepdim=True) * (
            rewards == rewards.min(-1, keepdim=True).values
        )

    text = caught("grpo-passk", "clip and KL", monkeypatch, (cls, "group_advantages", to_the_worst))
    assert "FAILED (a) engine vs textbook" in text


def test_opo_with_an_unweighted_baseline_is_caught(monkeypatch: pytest.MonkeyPatch):
    cls = get_method("opo")

    def unweighted(self, batch):  # the planted bug: every length 1, OPO's baseline becomes the plain mean
        G = self.cfg.group_size
        self.lengths = torch.ones(batch.rows // G, G, dtype=torch.float64)
        return GRPO.add_advantages(self, batch)

    monkeypatch.setattr(cls, "add_advantages", unweighted)
    out = run_case("opo", "clip and KL")
    text, ok = check.report("opo", cls, [out])
    assert not ok and "FAILED (a) engine vs textbook" in text, text


@pytest.mark.parametrize("name", ["grpo-passk", "opo"])
def test_the_estimators_two_steps(tmp_path, name: str):
    rows = two_steps(tmp_path, name)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)


# ============================================================================= REINFORCE++ (verl's estimators)


def test_reinforce_pp_by_hand():
    m = make("reinforce-pp-baseline", group_size=2)
    m.services, m.lengths = _Sum(), torch.tensor([[1.0, 2.0], [1.0, 1.0]])
    r, valid = torch.tensor([[1.0, 0.0], [0.5, 0.5]]), torch.ones(2, 2, dtype=torch.bool)
    # centred: [0.5, -0.5], [0, 0]; per token: 0.5, -0.5, -0.5, 0, 0 -> mean -0.1, unbiased var 0.175
    mean, var = -0.1, sum((x + 0.1) ** 2 for x in [0.5, -0.5, -0.5, 0.0, 0.0]) / 4
    want = [
        [(0.5 - mean) / math.sqrt(var + 1e-8), (-0.5 - mean) / math.sqrt(var + 1e-8)],
        [(0 - mean) / math.sqrt(var + 1e-8)] * 2,
    ]
    assert m.group_advantages(r, valid).tolist() == [pytest.approx(w) for w in want]
    m = make("reinforce-pp", group_size=2)  # no baseline: the rewards themselves whitened
    m.services, m.lengths = _Sum(), torch.tensor([[1.0, 2.0], [1.0, 1.0]])
    toks = [1.0, 0.0, 0.0, 0.5, 0.5]
    mean = sum(toks) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in toks) / 4 + 1e-8)
    assert m.group_advantages(r, valid)[0].tolist() == pytest.approx([(1 - mean) / sd, (0 - mean) / sd])


@pytest.mark.parametrize("name", ["reinforce-pp", "reinforce-pp-baseline"])
def test_gcf_check_passes_reinforce_pp_on_two_ranks(name: str):
    out = run_case(name, "two simulated ranks, batch std")
    assert out.ok, check.report(name, get_method(name), [out])[0]


def test_reinforce_pp_whitened_per_sample_not_per_token_is_caught(monkeypatch: pytest.MonkeyPatch):
    cls = get_method("reinforce-pp-baseline")

    def ones(self, batch):  # the planted bug: every sample weighs one in the whitening, whatever its length
        G = self.cfg.group_size
        self.lengths = torch.ones(batch.rows // G, G, dtype=torch.float64)
        return GRPO.add_advantages(self, batch)

    monkeypatch.setattr(cls.__mro__[1], "add_advantages", ones)  # where it lives: ReinforcePP's
    out = run_case("reinforce-pp-baseline", "clip and KL")
    text, ok = check.report("reinforce-pp-baseline", cls, [out])
    assert not ok and "FAILED (a) engine vs textbook" in text, text


@pytest.mark.parametrize("name", ["reinforce-pp", "reinforce-pp-baseline"])
def test_reinforce_pp_two_steps(tmp_path, name: str):
    rows = two_steps(tmp_path, name)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
