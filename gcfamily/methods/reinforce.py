"""REINFORCE with a running-mean baseline: A_i = R_i - b, b an exponential moving average of past mean rewards.

Objective (Williams 1992, "Simple statistical gradient-following algorithms for connectionist reinforcement
learning", section 4, with a reinforcement baseline b; run through the clipped surrogate of clipped.py, so
that with mu > 1 or several minibatches the ratio to pi_old is clipped as in PPO), maximised:

    J   = aggregate_t[ min(r_t A_i, clip(r_t, 1 - eps, 1 + eps_high) A_i) - beta * KL_t ]
    A_i = R_i - b_k                      (scale_rewards=none, the default)
    A_i = (R_i - b_k) / std(R of step)   (scale_rewards=batch: REINFORCE++'s global scale, without its re-centring)
    GC  = r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1)     (r_t = 1 with one pass: GC = A_i + KL part)

b_k is the bias-corrected moving average (as Adam's moments) of the mean valid reward of steps 0..k-1:

    m_k = decay * m_{k-1} + (1 - decay) * mean(R of step k-1),  b_k = m_k / (1 - decay^k),  b_0 = 0

The mean is taken over the whole global batch (summed over every process), so every rank holds the same b;
m and k are in the checkpoint, so a resumed run takes the same steps. Unlike GRPO, a group whose rewards are
all equal keeps its advantage R_i - b (the baseline is not the group's). This is not REINFORCE++ exactly
(Hu 2025, arXiv:2501.03262, which whitens advantages over the batch): hence the name reinforce-baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods.grpo import GRPO


class ReinforceBaseline(GRPO):
    """REINFORCE with an EMA baseline (Williams 1992): A_i = R_i - b; GC = r_t A_i 1[not clipped] + beta (rho - 1)."""

    name = "reinforce-baseline"
    data_source = "the policy's own samples (G per prompt), scored by the reward"
    gc_formula = "r_t * (R_i - b) * 1[not clipped] + beta * (pi_ref/pi - 1),  b = moving average of past mean rewards"
    metric_prefix = "reinforce"
    min_group_size = 1  # the baseline is a running mean, not the group's: one sample per prompt is enough

    @dataclass
    class Settings(GRPO.Settings):
        baseline_decay: float = 0.9
        """The baseline's moving-average decay: b follows decay * b + (1 - decay) * mean reward of the step, in [0, 1)."""
        scale_rewards: str = "none"
        """none: A_i = R_i - b; batch: also divide by the std of every reward of the step (all processes; no division
        where it is 0). group is refused: a group's std would zero the equal-reward groups this method keeps."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        s = cfg.settings
        if not 0 <= s.baseline_decay < 1:
            raise GcfError(f"Invalid setting: baseline_decay must be in [0, 1) (got {s.baseline_decay}).")
        if s.scale_rewards == "group":
            raise GcfError(
                "Invalid setting: reinforce-baseline takes scale_rewards none or batch; group would zero equal-reward groups."
            )
        if s.reward_aggregation != "sum_then_normalize":
            raise GcfError(
                "reinforce-baseline takes reward_aggregation=sum_then_normalize only: its baseline is a running mean of "
                "past rewards, and normalize_then_sum's group z-scores have none to keep."
            )

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.baseline_ema, self.baseline_steps = 0.0, 0  # m_k and k of the module docstring
        self.pending: tuple[float, float] | None = None  # (sum, count) of this step's valid rewards, all processes

    @property
    def baseline(self) -> float:
        """b_k: the bias-corrected moving average; 0 before the first step."""
        k = self.baseline_steps
        return self.baseline_ema / (1 - self.settings.baseline_decay**k) if k else 0.0

    def equal_reward_groups(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rewards.shape[0], dtype=torch.bool)  # [n]: every group keeps R_i - b

    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """A [n, G] = R - b (scaled by the step's std with scale_rewards=batch); records the step's mean for b."""
        r = rewards.double()  # [n, G]
        total = self.services.all_sum(torch.stack([(r * valid).sum(), valid.sum().double()]))
        self.pending = (float(total[0]), float(total[1]))
        adv = r - self.baseline
        if self.settings.scale_rewards == "batch":
            scale = self._batch_std(rewards, valid) + self.settings.std_eps  # [1, 1]
            adv = adv / torch.where(scale > 0, scale, 1.0)
        return torch.where(valid, adv, 0.0).float()

    def after_step(self, step: int) -> dict[str, float]:
        out = super().after_step(step)
        if self.pending is not None and self.pending[1] > 0:  # a step whose rewards all failed leaves b alone
            d = self.settings.baseline_decay
            self.baseline_ema = d * self.baseline_ema + (1 - d) * self.pending[0] / self.pending[1]
            self.baseline_steps += 1
        self.pending = None
        return {**out, f"{self.metric_prefix}/baseline": self.baseline}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "baseline_ema": self.baseline_ema, "baseline_steps": self.baseline_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.baseline_ema, self.baseline_steps = float(state["baseline_ema"]), int(state["baseline_steps"])
