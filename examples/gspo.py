"""GSPO as a rule in a file of your own: `gcf run --method examples/gspo.py:GSPO --model tiny --max-steps 2`."""

import torch

from gcfamily.methods.base import Batch
from gcfamily.methods.grpo import GRPO


class GSPO(GRPO):
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071): GRPO's ratio and clip per sequence.

    J   = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps_high) A_i)  -  beta * 1/G sum_i 1/|o_i| sum_t k3_t
    s_i = exp(mean_t (logp_t - old_logp_t)) = (pi(o_i) / pi_old(o_i)) ** (1 / |o_i|)
    A_i = GRPO's group advantage; k3_t = GRPO's KL to pi_ref, rho - log rho - 1 with rho = pi_ref/pi

    d s_i / d logp_t = s_i / |o_i|, so with the sequence-mean aggregation (w_t = 1/|o_i|) the coefficient is

    GC  = s_i * A_i * 1[s_i not clipped] + beta * (rho_t - 1)

    The paper clips s_i far tighter than a token ratio: --set epsilon=3e-4 --set epsilon_high=4e-4.
    """

    name = "gspo"
    gc_formula = "s_i * A_i * 1[s_i not clipped] + beta * (pi_ref/pi - 1),  s_i = exp(mean_t log(pi/pi_old))"
    ratio_level = "sequence"

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch.loss_mask.float()  # [B, L]
        log_s = ((logps - self._old(batch, logps)) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
            min=1
        )
        s = torch.exp(log_s).expand_as(logps)  # [B, L]: s_i on every token of o_i
        return s, s  # GC factor s_i: the s_i / |o_i| of d s_i / d logp_t is the aggregation's w_t

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        s, adv, (lo, hi) = self.importance_ratio(batch, logps)[0], self.token_advantages(batch), self.clip_range()
        surrogate = torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv)  # [B, L]
        if self.settings.dual_clip is not None:  # dual-clip: for A < 0 the term is at least c A
            surrogate = torch.where(adv < 0, torch.maximum(surrogate, self.settings.dual_clip * adv), surrogate)
        surrogate = surrogate * batch.loss_mask
        surrogate = surrogate * self.sampler_correction(batch, self._old(batch, logps))  # tis: each token's weight
        kl_only = batch.replaced(advantages=torch.zeros_like(batch.advantages))  # GRPO's J with A = 0: its KL term
        return self.aggregate(surrogate, batch, Z) + super().objective(kl_only, logps, Z)
