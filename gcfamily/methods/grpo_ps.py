"""GRPO with process supervision: each step of an output is scored, and a token's advantage sums the rewards of the
steps that end at or after it (DeepSeekMath, Shao et al. 2024, section 4.1.3).

Objective, maximised (GRPO's clipped surrogate and KL term, with a per-token advantage):

    J    = aggregate_t[ min(r_t A_t, clip(r_t, 1 - eps, 1 + eps_high) A_t) - beta * k3_t ]
    r~_j = (R_j - mean(R)) / (std(R) + std_eps)   over every step reward R_j of the G outputs of a prompt
    A_t  = sum of r~_j over the steps j of o_i whose last token is at or after t

Coefficient, as GRPO's: GC = r_t * A_t * 1[not clipped] + beta * (rho - 1).

A reward gives step scores as a list of (end, score) pairs per completion, `end` the character offset just after
the step (gcfamily/rewards/scoring.py); OnPolicy.data places each step on the token that holds its last character
(batch fields step_rewards and step_mask, [N, L]). A completion scored with one number is one step ending at its
last token, so with outcome rewards A_t = A_i on every token and the gradient is GRPO's (tests/test_grpo_ps.py).
An output with no scored step gets A_t = 0; a group whose step rewards are all equal (or that has fewer than two)
gets no gradient, and with zero_std=exclude leaves the normaliser. Tokens after an output's last step get A_t = 0.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from einops import rearrange, repeat

from gcfamily.config import Config
from gcfamily.config.rules import require
from gcfamily.methods.base import Batch, Stats
from gcfamily.methods.grpo import GRPO


def process_advantages(
    step_rewards: torch.Tensor, step_mask: torch.Tensor, valid: torch.Tensor, G: int, unbiased: bool, std_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages [N, L] and the [n] groups whose step rewards are all equal (or fewer than two).

    step_rewards, step_mask: [N, L], a step's reward on the token holding its last character; valid: [N]. Computed in
    float64: the group's step rewards are normalised together (mean, and the sample or population std), then summed
    from each token to the output's end (a reversed cumulative sum)."""
    on = step_mask.bool() & valid.bool()[:, None]  # [N, L]
    r = rearrange(step_rewards.double() * on, "(n g) l -> n (g l)", g=G)  # [n, G*L]
    m = rearrange(on, "(n g) l -> n (g l)", g=G).double()  # [n, G*L]
    count = m.sum(-1)  # [n]
    mean = r.sum(-1) / count.clamp(min=1)  # [n]
    dof = count - 1 if unbiased else count
    sq = (((r - mean[:, None]) * m) ** 2).sum(-1)  # [n]
    std = torch.where(dof > 0, sq / dof.clamp(min=1), torch.zeros_like(sq)).sqrt()  # [n]
    hi = r.masked_fill(m == 0, -torch.inf).amax(-1)  # [n]
    lo = r.masked_fill(m == 0, torch.inf).amin(-1)  # [n]
    equal = (count < 2) | (hi <= lo)  # [n]
    scale = std + std_eps  # [n]
    keep = (~equal & (scale > 0))[:, None]  # [n, 1]
    normed = torch.where(keep & (m > 0), (r - mean[:, None]) / torch.where(scale > 0, scale, 1.0)[:, None], 0.0)
    normed = rearrange(normed, "n (g l) -> (n g) l", g=G)  # [N, L]
    adv = normed.flip(-1).cumsum(-1).flip(-1)  # [N, L]: the steps ending at or after each token
    return adv, equal


class GRPOProcess(GRPO):
    """GRPO whose advantage is per token, from step rewards (process supervision)."""

    name = "grpo-ps"
    data_source = "on-policy groups of G outputs per prompt, each step of an output scored (process supervision)"
    gc_formula = "r_t * A_t * 1[not clipped] + beta * (pi_ref/pi - 1),  A_t = sum of the group-normalised step rewards at or after t"
    metric_prefix = "grpo_ps"
    reads_steps: ClassVar[bool] = True

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        s = cfg.settings
        require(
            [
                (
                    s.scale_rewards == "group",
                    "grpo-ps normalises the step rewards of each group (DeepSeekMath 4.1.3); scale_rewards must be group",
                ),
                (
                    s.kl_placement == "loss",
                    "grpo-ps keeps the KL term in the loss; a KL in the reward has no step to join, so kl_placement must be loss",
                ),
            ]
        )

    def add_advantages(self, batch: Batch) -> tuple[Batch, Stats]:
        """token_advantages [N, L] from the step rewards; equal groups per zero_std; their share and the steps logged."""
        G, s = self.cfg.group_size, self.settings
        adv, equal = process_advantages(
            batch.step_rewards, batch.step_mask, batch.valid, G, s.std == "sample", s.std_eps
        )
        batch.token_advantages = adv.float()  # [N, L]
        if s.zero_std == "exclude":  # their tokens leave the normaliser as well as the gradient
            batch.valid = batch.valid.bool() & ~repeat(equal, "n -> (n g)", g=G)
        steps = (batch.step_mask.bool() & batch.valid.bool()[:, None]).sum(-1).float()  # [N]
        return batch, {
            f"{self.metric_prefix}/zero_std_frac": float(equal.float().mean()),
            f"{self.metric_prefix}/steps_mean": float(steps.mean()) if len(steps) else 0.0,
            f"{self.metric_prefix}/no_step_frac": float((steps == 0).float().mean()) if len(steps) else 0.0,
        }

    def token_advantages(self, batch: Batch) -> torch.Tensor:
        return batch.token_advantages  # [B, L]
