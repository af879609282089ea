"""GRPO variants: each is a subclass that overrides one function (plus class-level defaults).

Everything else (sampling, the clip, the k3 KL term, the reference, logging) is GRPO's. Each
variant's objective is GRPO's `objective` with its one function swapped in, and the exactness
tests check its coefficient against autograd of that objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gcfamily.methods.grpo import GRPO


class RLOO(GRPO):
    """RLOO: the leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs").

    A_i = R_i - 1/(G-1) sum_{j != i} R_j = G/(G-1) (R_i - mean R), no std scaling: the baseline
    of sample i does not depend on o_i, so the estimator is exactly unbiased (the chapter's
    "one honest dependence" removed).

    GC = r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1). With mu = 1 the ratio is 1 and
    nothing is clipped, so GC = A_i + beta * (pi_ref/pi - 1): RLOO's REINFORCE estimator, with
    the KL as a loss term rather than in the reward. The paper treats a whole completion as one
    action (a sum over its tokens): `--set loss_norm=sum` gives that aggregation.
    """

    name = "rloo"
    gc_formula = "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = R_i - mean_{j != i} R_j"

    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        r, v = rewards.double(), valid.double()  # [n, G]
        k = v.sum(-1, keepdim=True)  # [n, 1] valid samples per group
        others = ((r * v).sum(-1, keepdim=True) - r) / (k - 1).clamp(min=1)  # mean of the other valid rewards
        return torch.where((k > 1) & valid, r - others, 0.0).float()


class DrGRPO(GRPO):
    """Dr. GRPO: GRPO done right (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
    Critical Perspective").

    Removes GRPO's two normalisations: no division by the group's std (which up-weights prompts
    that are nearly always or nearly never solved), and no 1/|o_i| (which favours long wrong
    answers and short right ones). Advantage A_i = R_i - mean R; the token sum is divided by a
    constant, max_new_tokens per sample (norm_constant, when left at its default):

        J  = 1/(N * max_new_tokens) sum_i sum_t [ min(r_t A_i, clip(r_t) A_i) - beta * k3_t ]
        GC = r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1)
    """

    name = "dr-grpo"
    gc_formula = "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = R_i - mean R; constant normaliser"
    default_norm = "constant"
    setting_defaults = {"norm_constant": lambda cfg: float(cfg.max_new_tokens)}

    @dataclass
    class Settings(GRPO.Settings):
        scale_rewards: str = "none"
        """Dr. GRPO does not divide by the group's std (group or batch would)."""


class DAPO(GRPO):
    """DAPO's clip-higher with token-level normalisation (Yu et al. 2025, "DAPO: An Open-Source
    LLM Reinforcement Learning System at Scale").

    The ratio is clipped to [1 - eps_low, 1 + eps_high] with eps_high = 0.28 > eps_low = 0.2
    (epsilon_high, when unset), so a low-probability token the advantage favours may grow further
    before its gradient is cut, which keeps entropy from collapsing. Every token of the step weighs
    the same (Z = tokens), so long completions are not down-weighted.

        GC = r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1)
        clipped = (A_i > 0 and r_t > 1 + eps_high) or (A_i < 0 and r_t < 1 - eps_low)

    Not reproduced: dynamic sampling (over-sample, drop groups whose rewards are all equal, refill
    the batch); `--set zero_std=exclude` drops those groups from the loss without refilling. The
    paper trains without the KL term: `--set beta=0`.
    """

    name = "dapo"
    gc_formula = "r_t * A_i * 1[not clipped to [1-eps, 1+eps_high=0.28]] + beta * (pi_ref/pi - 1); token-level"
    default_norm = "token"

    @dataclass
    class Settings(GRPO.Settings):
        epsilon_high: Optional[float] = 0.28
        """Upper clip range: DAPO's clip-higher (TRL's loss_type="dapo" keeps it symmetric: set it to epsilon)."""
