"""Bugs that only other test files caught, each planted where it lives and caught by `gcf check` (check.run_case).

| planted bug | where | the check's case that catches it |
|---|---|---|
| DPO's rows laid out rejected-first | DPO.data | every pair case: the batch is the method's own data(), the textbook knows each pair by its rows' contents |
| REINFORCE's EMA baseline drops its history | ReinforceBaseline.after_step | every case: three warm-up steps of different means before the checked one |
| Z counted on one micro-batch, times their number | engine.normaliser | every case: micro-batches of unequal counts |
| the constant normaliser (verl's seq-mean-token-sum-norm) divided by the batch size | engine.normaliser | dr-grpo's defaults: the check's C is not its sequence count |
| the batch std (GRPO) or the whitening (PPO) of one rank only | GRPO._batch_std, ppo.whiten | "two simulated ranks": each rank's all_sum waits for the other's |
| PPO's clipped value loss taking min instead of max | ppo.value_loss_terms | every one-rank PPO case: the critic's step against the clipped value loss |
| the reward model's pairs rejected-first, or its step divided by rows | RewardModelTraining.data, .auxiliary_step | its defaults: the reward model's step against Bradley-Terry |

Each plant fails the check and the real code passes the same case. On the check before these cases (commit 5bbd753)
every plant passed: the pair batch was laid out by the check itself, one warm-up step has b = its mean whatever the
EMA keeps, micro-batches of four rows each held equal counts, there was one rank, and no second model was checked.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gcfamily import check
from gcfamily.check.world import Collective
from gcfamily.core import engine, logprobs
from gcfamily.core.batch import select
from gcfamily.methods import get_method, ppo
from gcfamily.methods.dpo import DPO
from gcfamily.methods.grpo import GRPO
from gcfamily.methods.reinforce import ReinforceBaseline
from gcfamily.methods.reward_model import RewardModelTraining


def _case(name: str, label: str) -> tuple[type, str, dict]:
    cls = get_method(name)
    found = dict(check.cases(cls))
    assert label in found, f"{name} has no case {label!r}: {list(found)}"
    return cls, label, found[label]


def _run(name: str, label: str = "defaults") -> check.Outcome:
    cls, label, settings = _case(name, label)
    return check.run_case(cls, label, settings)


def _caught(name: str, label: str, monkeypatch: pytest.MonkeyPatch, plant: tuple[object, str, object]) -> str:
    """The case passes on the real code, and fails with the plant in place: its report."""
    assert _run(name, label).ok, check.report(name, get_method(name), [_run(name, label)])[0]
    monkeypatch.setattr(*plant)
    out = _run(name, label)
    text, ok = check.report(name, get_method(name), [out])
    assert not ok and not out.ok, text
    return text


def _swap_pairs(batch: dict) -> dict:
    """Rows 2k and 2k+1 exchanged: rejected first."""
    order = torch.arange(batch.input_ids.shape[0]).view(-1, 2).flip(1).flatten()
    return select(batch, order)


# ----------------------------------------------------------------------------- the pair layout


@pytest.mark.parametrize("name", ["dpo", "simpo"])
def test_pairs_laid_out_rejected_first_are_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = DPO.data
    text = _caught(name, "defaults", monkeypatch, (DPO, "data", lambda self, step: _swap(real(self, step))))
    assert "FAILED (a) engine vs textbook" in text


def _swap(out: tuple[dict, dict]) -> tuple[dict, dict]:
    return _swap_pairs(out[0]), out[1]


# ----------------------------------------------------------------------------- a method's state over several steps


def _forgetful_after_step(self: ReinforceBaseline, step: int) -> dict[str, float]:
    """The EMA with its history dropped: m_k = (1 - d) * mean_k, not d * m_{k-1} + (1 - d) * mean_k."""
    out = GRPO.after_step(self, step)
    if self.pending is not None and self.pending[1] > 0:
        d = self.settings.baseline_decay
        self.baseline_ema = (1 - d) * self.pending[0] / self.pending[1]
        self.baseline_steps += 1
    self.pending = None
    return out


def test_a_baseline_that_drops_its_history_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # b after steps of means 0.45, 0.925, 0.05 (decay 0.9): (0.081 * 0.45 + 0.09 * 0.925 + 0.1 * 0.05) / 0.271 = 0.460;
    # the forgetful one: 0.1 * 0.05 / 0.271 = 0.018, so every A = R - b moves by 0.44
    text = _caught(
        "reinforce-baseline", "defaults", monkeypatch, (ReinforceBaseline, "after_step", _forgetful_after_step)
    )
    assert "(a) engine vs textbook" in text


# ----------------------------------------------------------------------------- the normaliser over the whole step


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_a_normaliser_counted_on_one_micro_batch_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine.normaliser

    def one_micro_batch(batches, mode, norm_constant=1.0, group=None):  # type: ignore[no-untyped-def]
        batches = list(batches)
        return len(batches) * real(batches[:1], mode, norm_constant, group)

    out = _run(name)
    assert out.branches["micro-batches of unequal counts"] == 2  # both seeds' micro-batches could tell
    _caught(name, "defaults", monkeypatch, (engine, "normaliser", one_micro_batch))


def test_a_constant_normaliser_divided_by_the_batch_size_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's seq-mean-token-sum-norm (gcfamily's loss_norm=constant: the token sums over sequences * C): the constant
    taken as the step's sequence count, so the sums are divided by the batch size twice (the confusion issue 47 names)."""
    real = engine.normaliser

    def by_batch_size(batches, mode, norm_constant=1.0, group=None):  # type: ignore[no-untyped-def]
        batches = list(batches)
        if mode != "constant":
            return real(batches, mode, norm_constant, group)
        n = real(batches, "sum", 1.0, group)  # the step's sequences
        assert n != norm_constant  # else the plant would be the real thing
        return real(batches, "sum", n, group)

    _caught("dr-grpo", "defaults", monkeypatch, (engine, "normaliser", by_batch_size))


# ----------------------------------------------------------------------------- two simulated ranks


def _local_batch_std(self: GRPO, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    r = rewards.double()[valid]
    return r.std(unbiased=self.settings.std == "sample").reshape(1, 1)  # this rank's rewards only


@pytest.mark.parametrize("name", ["grpo", "reinforce-baseline"])
def test_a_batch_std_of_one_rank_is_caught_on_two_ranks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    label = "two simulated ranks, batch std"
    out = _run(name, label)
    assert out.branches["simulated ranks"] == 4  # two ranks, two seeds
    _caught(name, label, monkeypatch, (GRPO, "_batch_std", _local_batch_std))
    assert _run(name, "batch sample std").ok  # on one rank its own rewards are the step's: the hole this case closes


def test_a_whitening_of_one_rank_is_caught_on_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ppo.whiten

    def local(x, mask, all_sum=None):
        return real(x, mask)

    _caught("ppo", "two simulated ranks (whitening over both)", monkeypatch, (ppo, "whiten", local))


def test_the_simulated_ranks_sum_over_both_and_an_error_does_not_hang() -> None:
    coll = Collective(2)
    got = coll.run(
        [lambda: coll.all_sum(0, torch.tensor([1.0, 2.0])), lambda: coll.all_sum(1, torch.tensor([3.0, 4.0]))]
    )
    assert [g.tolist() for g in got] == [[4.0, 6.0], [4.0, 6.0]]

    def boom() -> None:
        raise ValueError("rank 1 failed")

    coll = Collective(2)
    with pytest.raises(ValueError, match="rank 1 failed"):
        coll.run([lambda: coll.all_sum(0, torch.ones(1)), boom])
    assert threading.active_count() < 10


# ----------------------------------------------------------------------------- the second model's loss


def _min_value_loss(values, old_values, returns, clip):  # type: ignore[no-untyped-def]
    unclipped = (values - returns) ** 2
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return torch.minimum(unclipped, clipped), clipped < unclipped


def test_a_value_loss_taking_min_instead_of_max_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _run("ppo")
    assert out.branches["value loss: clipped term larger"] > 0 and out.branches["value loss: unclipped term larger"] > 0
    text = _caught("ppo", "defaults", monkeypatch, (ppo, "value_loss_terms", _min_value_loss))
    assert "FAILED (c) the critic's step vs the clipped value loss" in text


def test_the_reward_models_loss_is_checked() -> None:
    out = _run("reward-model")
    assert out.ok
    assert "the reward model's step vs Bradley-Terry" in out.diffs
    assert out.branches["pairs ranked right"] > 0 and out.branches["pairs ranked wrong"] > 0


def test_a_reward_model_with_pairs_rejected_first_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = RewardModelTraining.data
    text = _caught(
        "reward-model", "defaults", monkeypatch, (RewardModelTraining, "data", lambda self, s: _swap(real(self, s)))
    )
    assert "FAILED the reward model's step vs Bradley-Terry" in text


def test_a_reward_model_step_divided_by_rows_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = RewardModelTraining.auxiliary_step

    def by_rows(self, batch):  # type: ignore[no-untyped-def]
        out = real(self, batch)
        self.pairs_in_step += batch.input_ids.shape[0] // 2  # counts rows, not pairs
        return out

    _caught("reward-model", "defaults", monkeypatch, (RewardModelTraining, "auxiliary_step", by_rows))


# ----------------------------------------------------------------------------- the engine and the class's flags


def test_a_soft_cap_backward_without_its_derivative_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's final-logit soft-cap c * tanh(z / c): a backward that drops its derivative 1 - tanh^2 fails (b)'s pass
    through the cap, which every case runs (before it only tests/test_families.py's Gemma 2 rows caught this)."""
    real = logprobs._chunk_logits

    def no_derivative(*args, **kwargs):
        logits, dcap = real(*args, **kwargs)
        return logits, (None if dcap is None else torch.ones_like(dcap))

    text = _caught("sft", "defaults", monkeypatch, (logprobs, "_chunk_logits", no_derivative))
    assert "FAILED (b) the same through a final-logit soft-cap (Gemma 2) vs autograd" in text


def test_ppo_whitening_switched_off_in_the_code_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whitening is the `whiten` setting, which the textbook reads from the settings: advantages left raw by the code
    while whiten=true fail, and whiten=false is its own case that passes."""
    _caught("ppo", "defaults", monkeypatch, (ppo, "whiten", lambda x, mask, all_sum=None: x * mask))
    monkeypatch.undo()
    assert _run("ppo", "GAE unwhitened").ok
