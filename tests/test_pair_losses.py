"""TRL's other DPO loss types (gcfamily/methods/pair_losses.py): each trains from the command line with the loss a
hand computation gives at the first step, refuses settings outside its domain in one sentence, and a mistake planted
in its loss (loss and derivative consistent with each other, so only the textbook can tell) fails `gcf check`.

Their parity with TRL 1.16's own `DPOTrainer._compute_loss` is benchmarks/trl_parity.py's (tests/test_trl_parity.py
where TRL is installed); `gcf check` on each at its cases is tests/test_exactness.py's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from gcfamily import check
from gcfamily.cli import main
from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods import get_method
from gcfamily.methods import pair_losses as pl

BETA = 0.1
LOG2 = math.log(2)
# at the first step pi = pi_ref, so h_w = h_l = 0 and m = 0: each loss there, worked by hand (TRL's defaults for
# the settings: label_smoothing 0.1 for robust, EXO's 1e-3, discopop_tau 0.05)
FIRST_LOSS = {
    "hinge": 1.0,  # max(0, 1 - 0)
    "robust-dpo": LOG2,  # ((1 - e) log 2 - e log 2) / (1 - 2e)
    "exo-pair": -LOG2 - 0.5 * math.log(1e-3 * (1 - 1e-3)),  # 1/2 (log 1/2 - log(1-e)) + 1/2 (log 1/2 - log e)
    "discopop": 0.5 * LOG2 + 0.5,  # g = 1/2: softplus(0) and exp(0) mixed equally
    "nca-pair": 2 * LOG2,  # log 2 + log 2 / 2 + log 2 / 2
    "bco-pair": 2 * LOG2,
    "sppo-hard": 2 * (1 / (2 * BETA)) ** 2,
    "apo-zero": 1.0,  # 1 - 1/2 + 1/2
    "apo-down": 1.0,  # 1/2 + 1 - 1/2
    "sigmoid-norm": LOG2,
    "ipo-norm": (1 / (2 * BETA)) ** 2,
}


@pytest.mark.parametrize("name", sorted(FIRST_LOSS))
def test_each_trains_from_the_command_line_with_the_hand_worked_first_loss(name: str, tmp_path) -> None:
    out = tmp_path / name
    args = ["run", "--method", name, "--model", "tiny", "--max-steps", "2", "--output-dir", str(out)]
    res = CliRunner().invoke(main, [*args, "--set", "progress=false", "--set", f"beta={BETA}"])
    assert res.exit_code == 0, res.output
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    assert all(math.isfinite(r["dpo/loss"]) and math.isfinite(r["grad_norm"]) for r in logged)
    assert logged[0]["dpo/margin"] == pytest.approx(0.0, abs=1e-6)  # the reference is the untouched policy
    assert logged[0]["dpo/loss"] == pytest.approx(FIRST_LOSS[name], rel=1e-5)
    assert logged[0]["grad_norm"] > 0  # every loss has a gradient at m = 0


@pytest.mark.parametrize(
    "name, settings, says",
    [
        ("robust-dpo", {"label_smoothing": 0.5}, "robust-dpo needs 0 <= label_smoothing < 0.5 (got 0.5)."),
        ("robust-dpo", {"label_smoothing": -0.1}, "robust-dpo needs 0 <= label_smoothing < 0.5 (got -0.1)."),
        ("exo-pair", {"label_smoothing": 0.0}, "exo-pair needs 0 < label_smoothing < 1 (got 0.0)."),
        ("exo-pair", {"label_smoothing": 1.0}, "exo-pair needs 0 < label_smoothing < 1 (got 1.0)."),
        ("discopop", {"discopop_tau": 0.0}, "discopop needs discopop_tau > 0 (got 0.0); 0.05 is the paper's."),
        ("sppo-hard", {"beta": 0.0}, "sppo-hard needs beta > 0 (got 0.0); 0.1 is usual for DPO."),
    ],
)
def test_settings_outside_a_loss_domain_are_one_sentence(name: str, settings: dict, says: str) -> None:
    with pytest.raises(GcfError) as e:
        get_method(name).validate(Config(method=name, **settings))
    assert str(e.value) == says


# ----------------------------------------------------------------------------- planted mistakes, caught by gcf check


def _plant(cls: type, loss_of: object) -> tuple[str, object]:
    """The hook cls defines (pair_loss of the margin, or pair_terms of h_w and h_l) rewritten from a wrong loss of
    (h_w, h_l, settings), its derivatives by autograd: loss and GC agree, so the method's own objective cannot tell
    the mistake; only the textbook can."""

    def pair_terms(self, h_w: torch.Tensor, h_l: torch.Tensor) -> tuple:
        w, lo = h_w.detach().requires_grad_(), h_l.detach().requires_grad_()
        with torch.enable_grad():
            loss = loss_of(w, lo, self.settings)
            d_w, d_l = torch.autograd.grad(loss.sum(), (w, lo))
        return loss_of(h_w, h_l, self.settings), d_w, d_l  # the loss on the objective's graph

    def pair_loss(self, margin: torch.Tensor) -> tuple:
        loss, d_w, _ = pair_terms(self, margin, torch.zeros_like(margin))
        return loss, d_w

    return ("pair_terms", pair_terms) if "pair_terms" in vars(cls) else ("pair_loss", pair_loss)


sp, sig = F.softplus, torch.sigmoid
PLANTS = {
    # the hinge measured from 0, not 1
    "hinge": (pl.Hinge, lambda w, lo, s: torch.relu(-(w - lo))),
    # robust DPO with cDPO's sign on the flipped term
    "robust-dpo": (
        pl.RobustDPO,
        lambda w, lo, s: (
            ((1 - s.label_smoothing) * sp(lo - w) + s.label_smoothing * sp(w - lo)) / (1 - 2 * s.label_smoothing)
        ),
    ),
    # EXO's target distribution the wrong way round: p = (eps, 1 - eps)
    "exo-pair": (
        pl.EXOPair,
        lambda w, lo, s: (
            sig(w - lo) * (F.logsigmoid(w - lo) - math.log(s.label_smoothing))
            + sig(lo - w) * (F.logsigmoid(lo - w) - math.log1p(-s.label_smoothing))
        ),
    ),
    # DiscoPOP's gate on -m
    "discopop": (
        pl.DiscoPOP,
        lambda w, lo, s: (
            (1 - sig(-(w - lo) / s.discopop_tau)) * sp(lo - w) + sig(-(w - lo) / s.discopop_tau) * torch.exp(lo - w)
        ),
    ),
    # NCA's rejected term without its 1/2
    "nca-pair": (pl.NCAPair, lambda w, lo, s: sp(-w) + 0.5 * sp(w) + sp(lo)),
    # BCO with the rejected classified as good
    "bco-pair": (pl.BCOPair, lambda w, lo, s: sp(-w) + sp(-lo)),
    # SPPO's targets swapped between chosen and rejected
    "sppo-hard": (pl.SPPOHard, lambda w, lo, s: ((w + 0.5) ** 2 + (lo - 0.5) ** 2) / s.beta**2),
    # APO-zero raising the rejected
    "apo-zero": (pl.APOZero, lambda w, lo, s: 1 - sig(w) - sig(lo)),
    # APO-down's margin term on the rejected reward alone
    "apo-down": (pl.APODown, lambda w, lo, s: sig(w) + 1 - sig(-lo)),
}


def _run(name: str) -> check.Outcome:
    cls = get_method(name)
    return check.run_case(cls, "defaults", dict(check.cases(cls))["defaults"])


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_mistake_in_the_loss_fails_gcf_check(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(name).ok
    cls, wrong = PLANTS[name]
    monkeypatch.setattr(cls, *_plant(cls, wrong))
    out = _run(name)
    text, ok = check.report(name, get_method(name), [out])
    assert not ok and "FAILED (a) engine vs textbook" in text, text
    assert "FAILED (a) engine vs own objective" not in text  # the plant is self-consistent


@pytest.mark.parametrize("name", ["sigmoid-norm", "ipo-norm"])
def test_a_sum_in_place_of_the_per_token_mean_fails_gcf_check(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's sigmoid_norm and ipo divide each completion's log-ratio sum by its length; DPO's sum is caught."""
    assert _run(name).ok

    def summed(self, batch, logps):  # type: ignore[no-untyped-def]
        mask = batch.loss_mask.to(logps.dtype)
        return self.settings.beta * ((logps - batch.ref_logps) * mask).sum(-1), self.settings.beta * mask

    monkeypatch.setattr(pl.SigmoidNorm, "rewards", summed)
    text, ok = check.report(name, get_method(name), [_run(name)])
    assert not ok and "FAILED (a) engine vs textbook" in text, text


@pytest.mark.parametrize("name", ["hinge", "bco-pair", "apo-zero"])
def test_thirty_steps_separate_most_training_pairs(name: str, tmp_path) -> None:
    """A margin loss and two losses of each reward on its own learn on the tiny model, as DPO does (tests/test_dpo.py):
    the implicit reward ranks chosen over rejected on most training pairs after thirty steps (near 0 before: m = 0)."""
    from gcfamily.run.trainer import Trainer

    settings = {"task_options": {"level": "1d-add"}, "max_steps": 30, "batch_size": 8, "micro_batch_size": 16}
    cfg = Config(
        method=name, model="tiny", output_dir=str(tmp_path / "run"), progress=False, lr=1e-3, beta=0.1, **settings
    )
    tr = Trainer(cfg)

    def accuracy() -> float:
        hits = []
        for s in range(math.ceil(len(tr.method.pairs) / 8)):  # the first epoch: every training pair once
            b, _ = tr.method.data(s)
            h, _ = tr.method.rewards(b, tr.services.logprobs(tr.policy, b))
            hits.append((h[0::2] > h[1::2]).float())
        return float(torch.cat(hits).mean())

    before = accuracy()
    tr.run()
    after = accuracy()
    assert before < 0.3 and after > 0.7, (before, after)


# ----------------------------------------------------------------------------- f-DPO's divergences, LD-DPO's weights


@pytest.mark.parametrize(
    "name, settings, says",
    [
        (
            "dpo",
            {"f_divergence": "chi2"},
            "f_divergence=chi2 is not one of reverse_kl, forward_kl, js_divergence, alpha_divergence.",
        ),
        ("dpo", {"ld_alpha": 1.5}, "ld_alpha=1.5 must be in [0, 1] (1: DPO's weights; none: off)."),
        ("simpo", {"ld_alpha": 0.5}, "simpo takes no ld_alpha: its reward is not DPO's sum of log-ratios."),
        (
            "nca-pair",
            {"f_divergence": "forward_kl"},
            "nca-pair takes f_divergence=reverse_kl only: its loss is of each completion's log-ratio itself (TRL "
            "ignores f_divergence_type there) or of a reward of its own.",
        ),
        (
            "online-dpo",
            {"ld_alpha": 0.5},
            "online-dpo takes neither f_divergence nor ld_alpha: they shape offline DPO's reward, as in TRL; leave "
            "them unset.",
        ),
    ],
)
def test_shaping_settings_outside_their_domain_are_one_sentence(name: str, settings: dict, says: str) -> None:
    with pytest.raises(GcfError) as e:
        get_method(name).validate(Config(method=name, **settings))
    assert str(e.value) == says


def _shaped_run(name: str, label: str) -> check.Outcome:
    cls = get_method(name)
    return check.run_case(cls, label, dict(check.cases(cls))[label])


def test_ld_weights_from_the_longer_completion_fail_gcf_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """LD-DPO weighs the tokens past the SHORTER completion of the pair; measured from the longer one, nothing is
    down-weighted, and the check's LD case (pairs of unequal lengths) says so."""
    from gcfamily.methods import dpo

    assert _shaped_run("dpo", "LD 0.5").ok

    def from_longer(mask, ld_alpha):  # type: ignore[no-untyped-def]
        if ld_alpha is None:
            return mask
        n = mask.sum(-1)
        longer = torch.maximum(n[0::2], n[1::2]).repeat_interleave(2)
        return mask * torch.where(mask.cumsum(-1) > longer[:, None], mask.new_tensor(ld_alpha), mask.new_tensor(1.0))

    monkeypatch.setattr(dpo, "ld_weights", from_longer)
    text, ok = check.report("dpo", get_method("dpo"), [_shaped_run("dpo", "LD 0.5")])
    assert not ok and "FAILED (a) engine vs textbook" in text, text


def test_a_score_of_the_wrong_divergence_fails_gcf_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """forward KL's score 1 - 1/t computed as js's (score and derivative consistent): only the textbook can tell."""
    from gcfamily.methods import dpo, pair_shaping

    label = "forward KL, LD 0.5"
    assert _shaped_run("hinge", label).ok
    real = pair_shaping.f_score
    monkeypatch.setattr(dpo, "f_score", lambda d, f, a: real(d, "js_divergence" if f == "forward_kl" else f, a))
    text, ok = check.report("hinge", get_method("hinge"), [_shaped_run("hinge", label)])
    assert not ok and "FAILED (a) engine vs textbook" in text, text


def test_dpo_with_a_divergence_and_ld_weights_trains(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["run", "--method", "dpo", "--model", "tiny", "--max-steps", "2", "--output-dir", str(out)]
    sets = ["f_divergence=alpha_divergence", "f_alpha=0.3", "ld_alpha=0.5", "progress=false"]
    res = CliRunner().invoke(main, [*args, *(x for kv in sets for x in ("--set", kv))])
    assert res.exit_code == 0, res.output
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["dpo/loss"] == pytest.approx(LOG2, rel=1e-5)  # every score is 0 at t = 1: m = 0
    assert logged[0]["grad_norm"] > 0 and math.isfinite(logged[1]["dpo/loss"])
