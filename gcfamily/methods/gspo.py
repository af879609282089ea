"""GSPO: GRPO's group advantage with one importance ratio per sequence, clipped per sequence.

Objective (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071, eq. 5), maximised:

    J    = aggregate_i[ min(s_i A_i, clip(s_i, 1 - eps, 1 + eps_high) A_i) ]  -  beta * aggregate_t[ KL_t ]
    s_i  = (pi(o_i) / pi_old(o_i)) ** (1 / |o_i|) = exp( (1/|o_i|) sum_t log(pi(o_t) / pi_old(o_t)) )
    A_i  = GRPO's group advantage; KL_t = GRPO's KL term (settings kl_estimator, kl_clamp; beta 0 by default)

aggregate_i weighs sequence i's term by the sum of its tokens' aggregation weights: with loss_norm=sequence
(the default) that is the paper's 1/G sum_i. The coefficient follows from d s_i / d logp_t = s_i / |o_i|:

    GC = s_i * A_i * 1[s_i not clipped]  -  beta * dKL_t/dlogp_t
    clipped = (A_i > 0 and s_i > 1 + eps_high) or (A_i < 0 and s_i < 1 - eps)

(clipped.py's g_t = dr/dlogp_t * (sum of the row's weights) / w_t is s_i under every loss_norm, since w_t is
constant along a row.) With the sampler correction (tis) the clipped term of token t is multiplied by c_t, so GC
multiplies s_i A_i by the row's mean of c (clipped.py); a sequence tis mode gives every token the row's one c. With one pass over one minibatch pi_old is pi, s_i = 1 and GSPO's gradient is GRPO's;
the paper splits each rollout batch into four minibatches (--set num_minibatches=4).

kl_estimator=k3-importance-weighted is refused: GRPO's weighs each token's k3 by the token ratio r_t, while TRL's
GSPO (use_bias_correction_kl, its default) weighs it by the sequence ratio s_i, whose gradient reaches every token
of the row, so the two KL terms and their gradients differ. (The paper trains without a KL term.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.clipped import kl_value
from gcfamily.methods.grpo import GRPO


class GSPO(GRPO):
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): s_i = exp(mean_t log(pi/pi_old)) clipped per sequence, GRPO's A_i.

    GC = s_i * A_i * 1[s_i not clipped] - beta * dKL_t/dlogp_t (derivation in the module docstring).
    """

    name = "gspo"
    gc_formula = "s_i * A_i * 1[s_i not clipped] + beta * (pi_ref/pi - 1),  s_i = exp(mean_t log(pi/pi_old))"
    ratio_level = "sequence"
    metric_prefix = "gspo"

    @dataclass
    class Settings(GRPO.Settings):
        beta: float = 0.0
        """KL weight to the frozen reference; GSPO's paper trains without a KL term (0 loads no reference)."""
        epsilon: float = 3e-4
        """Lower clip range of the sequence ratio: s_i is clipped below at 1 - epsilon (the paper's 3e-4, section 5.1)."""
        epsilon_high: Optional[float] = 4e-4
        """Upper clip range of the sequence ratio: s_i is clipped above at 1 + epsilon_high (the paper's 4e-4)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if cfg.settings.kl_estimator == "k3-importance-weighted":
            raise GcfError(
                f"{cls.name} refuses kl_estimator=k3-importance-weighted: it would weigh each token's k3 by the token "
                "ratio pi/pi_old, while GSPO's ratio is per sequence (TRL's GSPO weighs the k3 by s_i); "
                "use kl_estimator=k3, k2 or k1."
            )

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s_i on every token of o_i [B, L], its GC factor s_i): the geometric mean of the token ratios."""
        mask = batch.loss_mask.to(logps.dtype)  # [B, L]
        log_r = (logps - self._old(batch, logps)) * mask  # [B, L]
        s = torch.exp(log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))  # [B, 1]
        return s.expand_as(logps), s.expand_as(logps)

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        mask = batch.loss_mask.to(logps.dtype)  # [B, L]
        log_r = logps - self._old(batch, logps)  # [B, L] token log-ratios
        s = torch.exp((log_r * mask).sum(-1) / mask.sum(-1).clamp(min=1))  # [B]
        adv = batch.advantages.float()  # [B]
        lo, hi = self.clip_range()
        per_seq = torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv)  # [B]
        if self.settings.dual_clip is not None:  # dual-clip (clipped.py) on the sequence ratio: max(., c A) for A < 0
            per_seq = torch.where(adv < 0, torch.maximum(per_seq, self.settings.dual_clip * adv), per_seq)
        c = self.policy_weight(batch, logps)  # [B, L] each token's TIS weight, 1 with tis=off
        J = self.aggregate(per_seq[:, None] * mask * c, batch, Z)  # sequence i weighs sum_t w_t c_t
        if self.kl_in_loss(batch):
            log_rho = (batch.ref_logps - logps).clamp(-self.kl_clamp, self.kl_clamp)
            J = J - self.settings.beta * self.aggregate(kl_value(self.kl_name, log_rho, log_r) * mask, batch, Z)
        return J
