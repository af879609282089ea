"""verl's other group advantage estimators as GRPO variants, each one overridden function.

    grpo-passk  Pass@k training (Chen et al. 2025, arXiv:2503.19595; verl's adv_estimator=grpo_passk): only the best
                valid sample of a group gets an advantage, (R_max - R_second) / (std + std_eps), or the gap itself
                with scale_rewards=none; every other sample 0.
    opo         OPO (Hao et al. 2025, arXiv:2505.23585; verl's adv_estimator=opo): A_i = R_i - b, b the group's
                length-weighted mean reward sum_j |o_j| R_j / sum_j |o_j| (the optimal baseline of a sequence-level
                REINFORCE when the gradient's norm grows with length); no std.

The rest is GRPO's rule (clip, KL, aggregation); verl's GRPO-style runs use loss_norm=token and std_eps=1e-6.
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
