"""GMPO: the geometric mean of the token ratios, each clipped in log space, as one ratio per sequence.

Objective (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673; verl's
compute_policy_loss_geo_mean), maximised:

    J    = aggregate_i[ A_i rho_i ]  -  beta * aggregate_t[ KL_t ]
    rho_i = exp( (1/|o_i|) sum_t lt_t ),   l_t = log(pi(o_t) / pi_old(o_t))
    lt_t = sgn(A_i) min( sgn(A_i) l_t, sgn(A_i) clip(l_t, -eps_low, eps_high) )

the mean over o_i's completion tokens only (its loss mask). lt_t is the clip in log space turned by the sign of
A_i: for A_i > 0 it is min(l_t, eps_high), for A_i < 0 max(l_t, -eps_low), so d lt_t / d l_t = 1[t not clipped],

    clipped_t = (A_i > 0 and l_t > eps_high) or (A_i < 0 and l_t < -eps_low).

aggregate_i weighs sequence i by the sum of its tokens' weights W_i = |o_i| w_t (w_t is constant along a row), so

    dJ/dlogp_t = W_i A_i rho_i (1/|o_i|) 1[t not clipped] = w_t A_i rho_i 1[t not clipped]
    GC_t       = A_i rho_i 1[t not clipped]  -  beta * dKL_t/dlogp_t

Unlike GSPO a clipped token keeps its place in the mean (a constant there) and only loses its own gradient.
Defaults are the paper's: eps_low = eps_high = 0.4 (the range (e^-0.4, e^0.4)), sequence mean (verl takes the mean
of the sequences' terms), beta 0. With the sampler correction (tis) the sequence term of each token is weighed by its
c_t, as GSPO's (clipped.py), so GC multiplies by the row's mean of c; verl weighs by the geometric mean instead.
Its size: the sign-dependent log clip, the sequence ratio, the zeroed tokens and the objective are each a hook,
and its metrics count clipped log ratios instead of the linear clip's fractions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.grpo import GRPO


class GMPO(GRPO):
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): rho_i = exp(mean_t of log ratios clipped by the sign of A_i);
    GC = A_i rho_i 1[t not clipped] (derivation in the module docstring)."""

    name = "gmpo"
    gc_formula = "A_i * rho_i * 1[t not clipped] + beta * (pi_ref/pi - 1),  rho_i = exp(mean_t clip_A(log pi/pi_old))"
    ratio_level = "sequence"
    metric_prefix = "gmpo"

    @dataclass
    class Settings(GRPO.Settings):
        beta: float = 0.0
        """KL weight to the frozen reference; GMPO's paper trains without a KL term (0 loads no reference)."""
        epsilon: float = 0.4
        """Lower clip of the log ratio, -epsilon (the paper's 0.4: the ratio's range is (e^-0.4, e^0.4))."""
        epsilon_high: Optional[float] = 0.4
        """Upper clip of the log ratio, epsilon_high (the paper's 0.4)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if cfg.settings.dual_clip is not None:
            raise GcfError(
                f"{cls.name} refuses dual_clip: its clip is in log space per token and bounds the sequence ratio "
                "already; leave dual_clip unset."
            )

    def clipped_log_ratio(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        """lt [B, L]: log(pi/pi_old) clipped to [-eps_low, eps_high] on the side the sign of A_i clips."""
        log_r = logps - self._old(batch, logps)  # [B, L]
        sgn = torch.sign(batch.advantages.float())[:, None]  # [B, 1]
        lo, hi = self.clip_range()
        return sgn * torch.minimum(sgn * log_r, sgn * log_r.clamp(-lo, hi))

    def sequence_ratio(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        """rho [B, 1]: exp of the mean of lt over the completion's tokens (the loss mask)."""
        mask = batch.loss_mask.to(logps.dtype)  # [B, L]
        lt = self.clipped_log_ratio(batch, logps) * mask
        return torch.exp(lt.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the token ratio r_t, which `clipped` reads, [B, L]; the GC factor rho_i on every token of o_i)."""
        ratio = torch.exp(logps - self._old(batch, logps))
        return ratio, self.sequence_ratio(batch, logps).expand_as(logps)

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """Tokens whose log ratio the sign of A clips (they keep their place in the mean, not their gradient)."""
        lo, hi = self.clip_range()
        log_r = torch.log(ratio)
        return ((adv > 0) & (log_r > hi)) | ((adv < 0) & (log_r < -lo))

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        adv = batch.advantages.float()[:, None]  # [B, 1]
        c = self.policy_weight(batch, logps)  # [B, L], 1 with tis=off
        per_seq = adv * self.sequence_ratio(batch, logps)  # [B, 1]
        kl_only = batch.replaced(advantages=torch.zeros_like(batch.advantages))  # GRPO's J at A = 0: its KL term
        return self.aggregate(per_seq * batch.loss_mask * c, batch, Z) + super().objective(kl_only, logps, Z)

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        """The fraction of tokens whose log ratio is clipped, in place of the linear clip's fractions."""
        p, mask = self.metric_prefix, batch.loss_mask.bool()
        out = {k: v for k, v in super().metrics(batch, logps, coef).items() if "clip" not in k}
        ratio, _ = self.importance_ratio(batch, logps)
        cut = self.clipped(ratio, batch.advantages.float()[:, None]) & mask
        out[f"{p}/clip_frac"] = float(cut.sum()) / max(int(mask.sum()), 1)
        return out
