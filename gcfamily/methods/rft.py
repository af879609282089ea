"""Rejection sampling fine-tuning, online: sample, keep what clears the reward threshold, imitate it.

Objective (DeepSeekMath 5.2.1, "RFT"/"Online RFT"), maximised:

    J  = sum_{o kept} sum_t log pi(o_t | q, o_<t) / (tokens of the kept samples in the step)
    GC = 1[o kept],   kept = reward(o) >= reward_threshold (and the reward did not fail)

Samples that are not kept get valid=False: no gradient and no place in the normaliser, so J is
SFT's token mean over the kept samples alone (rather than diluted by the rejected ones). A step
that keeps nothing has a zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcfamily.config import MethodSettings
from gcfamily.methods.base import Batch, Stats
from gcfamily.methods.onpolicy import OnPolicy


class RFT(OnPolicy):
    """Online rejection sampling: the policy's own samples, kept if correct, trained with GC = 1."""

    name = "rft"
    data_source = "the policy's own samples, kept if reward >= reward_threshold"
    gc_formula = "1[o kept] = 1[reward(o) >= reward_threshold]"
    default_norm = "token"

    @dataclass
    class Settings(MethodSettings):
        reward_threshold: float = 0.5
        """A sample is kept (GC = 1) when its reward is at least this."""

    @torch.no_grad()
    def prepare(self, batch: Batch) -> tuple[Batch, Stats]:
        kept = batch["valid"].bool() & (batch["rewards"] >= self.settings.reward_threshold)  # [N]
        batch["kept"] = kept
        batch["valid"] = kept
        return batch, {"rft/kept_frac": float(kept.float().mean())}

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return batch["kept"].float()[:, None] * batch["loss_mask"].float()  # [B, L]

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        return self.aggregate(batch["kept"].float()[:, None] * logps, batch, Z)
