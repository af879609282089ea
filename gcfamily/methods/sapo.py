"""SAPO: a smooth sigmoid gate on the importance ratio in place of the hard clip, softer for negative advantages.

Objective (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347; TRL 1.16 loss_type="sapo",
verl's compute_policy_loss_sapo), maximised:

    J    = aggregate_t[ f(r_t; tau_t) A_i c_t - beta * KL_t ],   r_t = pi(o_t) / pi_old(o_t)
    f(r; tau) = (4 / tau) sigmoid(tau (r - 1)),   tau_t = tau_pos if A_i > 0 else tau_neg

With z = tau (r - 1), s = sigmoid(z): df/dr = 4 s (1 - s) and dr/dlogp = r, so

    GC = 4 r_t s_t (1 - s_t) A_i c_t  -  beta * dKL_t/dlogp_t

At r = 1 the gate's slope is 4 * 1/4 = 1: GC = A_i, the policy gradient; away from 1 it decays smoothly (no token is
cut off at a threshold), faster for the larger tau, which the paper gives the negative advantages (tau_neg = 1.05 >
tau_pos = 1.0, the defaults of the paper, TRL and verl). Aggregation as verl's (seq-mean-token-mean) and TRL's
(sapo normalises as grpo): the sequence mean. epsilon and epsilon_high do not enter the rule.
Its size: the gate's temperature, the ratio's GC factor, no zeroed token and the objective are each a hook, and
its metrics log the gate's mean slope instead of clip fractions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcfamily.config import Config
from gcfamily.config.rules import require
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.grpo import GRPO


class SAPO(GRPO):
    """SAPO (arXiv:2511.20347): J_t = (4/tau) sigmoid(tau (r_t - 1)) A_i; GC = 4 r_t s_t (1 - s_t) A_i (module docstring)."""

    name = "sapo"
    gc_formula = "4 r_t s (1 - s) A_i + beta * (pi_ref/pi - 1),  s = sigmoid(tau (r_t - 1)), tau = tau_pos if A_i > 0 else tau_neg"
    metric_prefix = "sapo"

    @dataclass
    class Settings(GRPO.Settings):
        beta: float = 0.0
        """KL weight to the frozen reference; SAPO trains without a KL term, as TRL's and verl's defaults (0 loads none)."""
        tau_pos: float = 1.0
        """The gate's temperature on tokens with A > 0 (the paper's, TRL's sapo_temperature_pos, verl's tau_pos)."""
        tau_neg: float = 1.05
        """The gate's temperature on tokens with A <= 0 (the paper's, TRL's sapo_temperature_neg, verl's tau_neg)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        unset = cls.Settings()
        if (cfg.settings.epsilon, cfg.settings.epsilon_high) != (unset.epsilon, unset.epsilon_high):
            raise GcfError(
                f"{cls.name} takes no epsilon or epsilon_high: its gate replaces the clip; leave them unset."
            )
        s = cfg.settings
        require([(s.tau_pos > 0, "tau_pos must be > 0"), (s.tau_neg > 0, "tau_neg must be > 0")])
        if s.dual_clip is not None:
            raise GcfError(f"{cls.name} refuses dual_clip: its gate replaces the clip; leave dual_clip unset.")

    def gate_temperature(self, batch: Batch) -> torch.Tensor:
        """tau [B, 1] (or [B, L] for a per-token A): tau_pos where A > 0, else tau_neg."""
        s = self.settings
        return torch.where(self.token_advantages(batch) > 0, s.tau_pos, s.tau_neg)

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(r [B, L], its GC factor r f'(r) = 4 r s (1 - s), s = sigmoid(tau (r - 1)))."""
        ratio, _ = super().importance_ratio(batch, logps)
        s = torch.sigmoid(self.gate_temperature(batch) * (ratio - 1))
        return ratio, 4 * ratio * s * (1 - s)

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """No hard clip: the gate's slope does the bounding."""
        return torch.zeros_like(ratio * adv, dtype=torch.bool)

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        old = self._old(batch, logps)
        tau = self.gate_temperature(batch)
        gate = 4 / tau * torch.sigmoid(tau * (torch.exp(logps - old) - 1))  # [B, L]
        per_token = gate * self.token_advantages(batch) * self.policy_weight(batch, logps)
        kl_only = batch.replaced(advantages=torch.zeros_like(batch.advantages))  # GRPO's J at A = 0: its KL term
        return self.aggregate(per_token * batch.loss_mask, batch, Z) + super().objective(kl_only, logps, Z)

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        """The mean gate slope 4 s (1 - s) over the step's tokens (1 on-policy) in place of clip fractions."""
        p, mask = self.metric_prefix, batch.loss_mask.bool()
        out = {k: v for k, v in super().metrics(batch, logps, coef).items() if "clip" not in k}
        ratio, factor = self.importance_ratio(batch, logps)
        out[f"{p}/gate_slope_mean"] = float((factor / ratio)[mask].sum()) / max(int(mask.sum()), 1)
        return out
