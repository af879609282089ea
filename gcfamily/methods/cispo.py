"""CISPO: the importance-sampling weight clipped and detached, so that every token keeps a gradient.

Objective (MiniMax-M1, Chen et al. 2025, arXiv:2506.13585), maximised:

    J    = aggregate_t[ sg(w_t) A_i log pi(o_t) * c_t - beta * KL_t ]
    w_t  = clip(r_t, 1 - eps, 1 + eps_high),   r_t = pi(o_t) / pi_old(o_t)
    A_i  = GRPO's group advantage; KL_t and the sampler correction c_t (tis) as in clipped.py

sg is stop-gradient: the weight is a constant of the step, so dJ/dlogp_t = w_t * w_agg_t * A_i c_t and

    GC = clip(r_t, 1 - eps, 1 + eps_high) * A_i * c_t  -  beta * dKL_t/dlogp_t

Unlike PPO's min(), no token loses its gradient: a token past the clip keeps A_i times the bound. The paper
clips above only ("we set eps_low^IS to a large value"): epsilon >= 1 makes 1 - epsilon <= 0 < r, no lower bound,
and is the default (1.0). The upper default eps_high = 4.0 (w_t <= 5) is the eps_max = 5 that TRL 1.16 recommends
for loss_type="cispo" from ScaleRL (arXiv:2510.13786); TRL clamps r at epsilon_high itself (its max=epsilon_high),
so TRL's epsilon_high=5.0 is this epsilon_high=4.0. verl's compute_policy_loss_cispo clips to
[1 - clip_ratio_low, 1 + clip_ratio_high], this rule's form: `--set epsilon=0.2 epsilon_high=0.2` is verl's default.
Like TRL's and verl's (token-mean), every token of the step weighs the same (Z = tokens); no KL (beta 0), as the paper.
Its size: three of the clipped surrogate's hooks change (the ratio's GC factor, no zeroed token, the objective),
and its metrics count capped and raised weights instead of PPO's clip fractions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.grpo import GRPO


class CISPO(GRPO):
    """CISPO (MiniMax-M1, arXiv:2506.13585): J = sg(clip(r_t)) A_i log pi(o_t); GC = clip(r_t) A_i (module docstring)."""

    name = "cispo"
    gc_formula = "clip(r_t, 1-eps, 1+eps_high) * A_i (weight detached, no token zeroed) + beta * (pi_ref/pi - 1)"
    default_norm = "token"
    metric_prefix = "cispo"
    epsilon_below_one = False

    @dataclass
    class Settings(GRPO.Settings):
        beta: float = 0.0
        """KL weight to the frozen reference; CISPO's paper trains without a KL term (0 loads no reference)."""
        epsilon: float = 1.0
        """Lower clip of the weight, 1 - epsilon; >= 1 is no lower bound (the paper's), 0.2 is verl's default."""
        epsilon_high: Optional[float] = 4.0
        """Upper clip of the weight, 1 + epsilon_high: 4.0 is TRL's recommended eps_max 5 (ScaleRL); verl's is 0.2."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if cfg.settings.dual_clip is not None:
            raise GcfError(
                f"{cls.name} refuses dual_clip: its weight is already at most 1 + epsilon_high and no token loses its "
                "gradient, so there is no bound to add; leave dual_clip unset."
            )

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(r [B, L], its GC factor: the clipped weight w_t, constant in logp)."""
        ratio, _ = super().importance_ratio(batch, logps)
        lo, hi = self.clip_range()
        return ratio, ratio.clamp(1 - lo, 1 + hi)

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """No token is zeroed: the clip bounds the weight, not the gradient."""
        return torch.zeros_like(ratio * adv, dtype=torch.bool)

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        old = self._old(batch, logps)
        lo, hi = self.clip_range()
        w = torch.exp(logps - old).clamp(1 - lo, 1 + hi).detach()  # sg(clip(r)): the weight carries no gradient
        per_token = w * self.token_advantages(batch) * logps * self.policy_weight(batch, logps)  # [B, L]
        kl_only = batch.replaced(advantages=torch.zeros_like(batch.advantages))  # GRPO's J at A = 0: its KL term
        return self.aggregate(per_token * batch.loss_mask, batch, Z) + super().objective(kl_only, logps, Z)

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        """The fractions of tokens whose weight is capped above or raised below, in place of PPO's clip fractions."""
        p, mask = self.metric_prefix, batch.loss_mask.bool()
        out = {k: v for k, v in super().metrics(batch, logps, coef).items() if "/clip_" not in k}
        ratio, (lo, hi), n = torch.exp(logps - self._old(batch, logps)), self.clip_range(), max(int(mask.sum()), 1)
        out[f"{p}/weight_capped_frac"] = float(((ratio > 1 + hi) & mask).sum()) / n
        out[f"{p}/weight_raised_frac"] = float(((ratio < 1 - lo) & mask).sum()) / n
        return out
