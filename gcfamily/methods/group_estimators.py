"""verl's other group advantage estimators as GRPO variants, each one overridden function.

    grpo-passk  Pass@k training (Chen et al. 2025, arXiv:2503.19595; verl's adv_estimator=grpo_passk): only the best
                valid sample of a group gets an advantage, (R_max - R_second) / (std + std_eps), or the gap itself
                with scale_rewards=none; every other sample 0.
    opo         OPO (Hao et al. 2025, arXiv:2505.23585; verl's adv_estimator=opo): A_i = R_i - b, b the group's
                length-weighted mean reward sum_j |o_j| R_j / sum_j |o_j| (the optimal baseline of a sequence-level
                REINFORCE when the gradient's norm grows with length); no std.

The rest is GRPO's rule (clip, KL, aggregation); verl's GRPO-style runs use loss_norm=token and std_eps=1e-6.
REINFORCE++'s class is past the zoo's 40 lines: its whitening is over every process's tokens (an all_sum of three
sums) in two variances (verl's and OpenRLHF's), and it refuses the settings that would change what it whitens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Stats
from gcfamily.methods.grpo import GRPO
from gcfamily.methods.onpolicy import masked_group_stats


class GRPOPassK(GRPO):
    """Pass@k advantage (arXiv:2503.19595): A = (R_max - R_second) / (std + std_eps) on the group's best sample only."""

    name = "grpo-passk"
    one_row_per_group = True  # at most one sample per group has an advantage (gcf check's cases read it)
    gc_formula = (
        "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = (R_max - R_2nd)/std on the best sample, else 0"
    )

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if cfg.settings.scale_rewards == "batch":
            raise GcfError(f"{cls.name} scales the best sample's gap by its group's std (group) or not at all (none).")

    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        s = self.settings
        r = rewards.double().masked_fill(~valid, float("-inf"))  # [n, G]
        top = r.topk(2, dim=-1).values  # [n, 2]
        gap = torch.where(valid.sum(-1) >= 2, top[:, 0] - top[:, 1], 0.0)  # [n]
        if s.scale_rewards == "group":
            _, std, _ = masked_group_stats(rewards, valid, unbiased=s.std == "sample")
            gap = gap / torch.where(std + s.std_eps > 0, std + s.std_eps, 1.0)
        best = torch.nn.functional.one_hot(r.argmax(-1), r.shape[-1]).bool()  # [n, G]: the first best
        return torch.where(best, gap[:, None], 0.0).float()


class OPO(GRPO):
    """OPO (arXiv:2505.23585): A_i = R_i - sum_j |o_j| R_j / sum_j |o_j| over the group's valid samples; no std."""

    name = "opo"
    gc_formula = "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = R_i - sum_j |o_j| R_j / sum_j |o_j|"

    @dataclass
    class Settings(GRPO.Settings):
        scale_rewards: str = "none"
        """OPO's advantage is not divided by a std (group or batch would)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if cfg.settings.scale_rewards != "none":
            raise GcfError(f"{cls.name} takes scale_rewards=none only: its length-weighted baseline is the whole rule.")
        if cfg.settings.mask_truncated:
            raise GcfError(
                f"{cls.name} refuses mask_truncated: its baseline weighs each reward by its completion's length, which the mask would zero."
            )

    def add_advantages(self, batch: Batch) -> tuple[Batch, Stats]:
        # each sample's completion length, read by group_advantages (its hook has the rewards only)
        self.lengths = rearrange(batch.loss_mask.sum(-1).double(), "(n g) -> n g", g=self.cfg.group_size)
        return super().add_advantages(batch)

    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        r, w = rewards.double(), self.lengths * valid  # [n, G]
        b = (w * r).sum(-1, keepdim=True) / w.sum(-1, keepdim=True).clamp(min=1)  # [n, 1]
        return torch.where(valid, r - b, 0.0).float()


class ReinforcePP(GRPO):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262; verl's adv_estimator=reinforce_plus_plus at its gamma = 1): each
    sample's reward whitened over every valid token of the step, A_i = (R_i - mu) / sqrt(var + 1e-8), mu and var (the
    unbiased variance) of R over the step's tokens, each sample counted once per completion token, over all processes;
    std=population is OpenRLHF's whitening (the population variance floored at 1e-8), whiten=false its centring only.
    The `-baseline` variant (verl's reinforce_plus_plus_baseline, OpenRLHF's reinforce_baseline) first subtracts the
    group's mean reward."""

    name = "reinforce-pp"
    gc_formula = "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = R_i whitened over the step's tokens"
    baseline = False

    @dataclass
    class Settings(GRPO.Settings):
        scale_rewards: str = "none"
        """The whitening over the step's tokens is the advantage's scale (group or batch would add another)."""
        whiten: bool = True
        """Divide by the tokens' std after centring (false: centre only, OpenRLHF's no_std_norm)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        s = cfg.settings
        if s.scale_rewards != "none" or s.mask_truncated:
            raise GcfError(
                f"{cls.name} takes neither scale_rewards nor mask_truncated: its whitening weighs each sample by its completion's tokens."
            )
        if not cls.baseline and s.kl_placement == "reward" and s.beta > 0:
            raise GcfError(
                f"{cls.name} with the KL in the reward discounts token rewards per token (verl's returns), not built; use kl_placement=loss."
            )

    def add_advantages(self, batch: Batch) -> tuple[Batch, Stats]:
        self.lengths = rearrange(batch.loss_mask.sum(-1).double(), "(n g) -> n g", g=self.cfg.group_size)
        return super().add_advantages(batch)

    def equal_reward_groups(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rewards.shape[0], dtype=torch.bool)  # the whitening moves an equal group off 0 too

    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = rewards.double()  # [n, G]
        if self.baseline:
            mean, _, count = masked_group_stats(rewards, valid, unbiased=True)
            x = x - torch.where(count > 1, mean, 0.0)[:, None]  # a lone sample keeps its reward, as verl's
        w = self.lengths * valid  # [n, G] each sample's weight: its tokens
        n, sx, sxx = self.services.all_sum(torch.stack([w.sum(), (w * x).sum(), (w * x * x).sum()]))
        mu = sx / n.clamp(min=1)
        if not self.settings.whiten:
            return torch.where(valid, x - mu, 0.0).float()
        if self.settings.std == "sample":  # verl's masked_whiten: the unbiased variance, 1e-8 added
            scale = torch.rsqrt(((sxx - n * mu * mu) / (n - 1).clamp(min=1)).clamp(min=0) + 1e-8)
        else:  # OpenRLHF's: the population variance, floored at 1e-8
            scale = torch.rsqrt(((sxx - n * mu * mu) / n.clamp(min=1)).clamp(min=1e-8))
        return torch.where(valid, (x - mu) * scale, 0.0).float()


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++ with the group-mean baseline (verl's reinforce_plus_plus_baseline): R_i - mean of its group, then
    whitened over the step's tokens."""

    name = "reinforce-pp-baseline"
    gc_formula = "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = (R_i - mean R) whitened over the tokens"
    baseline = True

    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return super().group_advantages(rewards, valid)  # its own definition: gcf check's textbook names it
