"""GPG: the plain policy gradient on group-relative advantages, no ratio, no clip, no KL, with a batch correction.

Objective (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
arXiv:2504.02546; verl's compute_policy_loss_gpg and compute_gpg_outcome_advantage), maximised:

    J    = aggregate_t[ A_i log pi(o_t) * c_t ]  -  beta * aggregate_t[ KL_t ]
    A_i  = alpha * (R_i - mean(R of o_i's group)) / F_norm,   F_norm = 1 (scale_rewards=none; group divides by the std)
    alpha = B / (B - M): B the step's samples, M those with no gradient (in a group whose valid rewards are all equal,
            or whose reward failed), counted over every process

so GC = A_i * c_t - beta * dKL_t/dlogp_t (c_t the sampler correction, tis). alpha undoes the dilution of the batch mean
by the samples that carry no gradient (the paper's bias correction). verl computes alpha as B over the count of
non-zero rewards, which is this M only for 0/1 rewards where every group is mixed; this follows the paper. Defaults as
verl's: token-mean aggregation, beta 0. No pi_old enters the rule, so several inner passes train the same A log pi.
Its size: the advantage, the ratio (none), the clip (none) and the objective each change, one short hook each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.grpo import GRPO


class GPG(GRPO):
    """GPG (Chu et al. 2025, arXiv:2504.02546): J = A_i log pi(o_t), A_i = alpha (R_i - mean R); GC = A_i."""

    name = "gpg"
    gc_formula = "A_i + beta * (pi_ref/pi - 1),  A_i = alpha (R_i - mean R), alpha = B / (samples with a gradient)"
    default_norm = "token"
    metric_prefix = "gpg"

    @dataclass
    class Settings(GRPO.Settings):
        beta: float = 0.0
        """KL weight to the frozen reference; GPG trains without a KL term (0 loads no reference)."""
        scale_rewards: str = "none"
        """GPG's F_norm = 1: R_i - mean R, not divided by a std (group or batch would divide)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        unset = cls.Settings()
        if (cfg.settings.epsilon, cfg.settings.epsilon_high) != (unset.epsilon, unset.epsilon_high):
            raise GcfError(
                f"{cls.name} takes no epsilon or epsilon_high: it has no importance ratio to clip; leave them unset."
            )
        if cfg.settings.dual_clip is not None:
            raise GcfError(f"{cls.name} refuses dual_clip: it has no importance ratio to bound; leave dual_clip unset.")
        if cfg.settings.zero_std == "exclude":
            raise GcfError(
                f"{cls.name} refuses zero_std=exclude: its alpha already scales the step for the groups with no "
                "gradient, so excluding them from the normaliser would correct twice; leave zero_std=keep."
            )

    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """alpha * GRPO's advantage [n, G], alpha = the step's samples over those that carry a gradient."""
        graded = valid & ~self.equal_reward_groups(rewards, valid)[:, None]  # [n, G]
        counts = torch.tensor([valid.numel(), int(graded.sum())], dtype=torch.float64)
        B, kept = self.services.all_sum(counts).tolist()
        return super().group_advantages(rewards, valid) * (B / max(kept, 1.0))

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """No ratio: (1, GC factor 1) on every token."""
        one = torch.ones_like(logps)
        return one, one

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """No clip: no token is zeroed."""
        return torch.zeros_like(ratio * adv, dtype=torch.bool)

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        c = self.policy_weight(batch, logps)  # [B, L], 1 with tis=off
        per_token = self.token_advantages(batch) * logps * c * batch.loss_mask  # [B, L]
        kl_only = batch.replaced(advantages=torch.zeros_like(batch.advantages))  # GRPO's J at A = 0: its KL term
        return self.aggregate(per_token, batch, Z) + super().objective(kl_only, logps, Z)
