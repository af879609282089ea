"""VESPO: a gamma weight of the sequence's importance ratio, detached, in place of the clip.

Objective (TRL 1.16's loss_type="vespo", `GRPOTrainer.get_gamma_weights`), maximised:

    J    = aggregate_t[ sg(phi_i) A_i log pi(o_t) - beta * KL_t ]
    w_i  = exp(clip(sum_t clip(log r_t, -20, 20), log 1e-8, 20)),   r_t = pi(o_t) / pi_old(o_t)
    phi_i = w_i^k e^(lambda (1 - w_i)),  (k, lambda) = (k_pos, lambda_pos) where A_i >= 0, else (k_neg, lambda_neg)

phi(1) = 1, so on-policy VESPO is REINFORCE with GRPO's advantage; off-policy, phi rises then decays in w (a gamma
density's shape, its peak at w = k / lambda), softly down-weighting whole sequences whose ratio strays. GC = phi_i A_i
(the weight is a constant of the step), token-level as TRL's (Z = tokens), no KL by default. TRL folds its vLLM
sampler ratio into w; this rule refuses tis instead of weighing each token by it (its weight is per sequence).
Its size (past the zoo's 40 lines): four settings of TRL's with their docstrings, and the refusals of the clip's
settings and of tis, which the rule would otherwise ignore silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gcfamily.config import Config
from gcfamily.config.rules import require
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.grpo import GRPO


class VESPO(GRPO):
    """VESPO (TRL 1.16's loss_type="vespo"): J = sg(phi(w_i)) A_i log pi(o_t), phi the gamma weight of the sequence
    ratio w_i; GC = phi_i A_i (module docstring)."""

    name, metric_prefix, default_norm = "vespo", "vespo", "token"
    gc_formula = "phi(w_i) * A_i + beta * (pi_ref/pi - 1), phi(w) = w^k e^(lambda (1 - w)), w_i = prod_t pi/pi_old"

    @dataclass
    class Settings(GRPO.Settings):
        beta: float = 0.0
        """KL weight to the frozen reference (TRL's default 0 loads none)."""
        k_pos: float = 2.0
        """The weight's shape k where A_i >= 0 (TRL's vespo_k_pos)."""
        lambda_pos: float = 3.0
        """The weight's rate lambda where A_i >= 0 (TRL's vespo_lambda_pos)."""
        k_neg: float = 3.0
        """The weight's shape k where A_i < 0 (TRL's vespo_k_neg)."""
        lambda_neg: float = 2.0
        """The weight's rate lambda where A_i < 0 (TRL's vespo_lambda_neg)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        s, unset = cfg.settings, cls.Settings()
        if (s.epsilon, s.epsilon_high, s.dual_clip) != (unset.epsilon, unset.epsilon_high, None):
            raise GcfError(f"{cls.name} takes no epsilon, epsilon_high or dual_clip: its weight replaces the clip.")
        if s.tis != "off":
            raise GcfError(
                f"{cls.name} refuses tis={s.tis}: TRL folds the sampler's ratio into VESPO's sequence weight, not built here."
            )
        require(
            [(s.lambda_pos >= 1e-4, "lambda_pos must be >= 1e-4"), (s.lambda_neg >= 1e-4, "lambda_neg must be >= 1e-4")]
        )

    def gamma_weight(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        """phi_i [B, 1], no gradient: the gamma weight of the clamped sequence ratio, by the sign of A_i."""
        s, mask = self.settings, batch.loss_mask.to(logps.dtype)
        log_r = (logps - self._old(batch, logps)).detach().clamp(-20.0, 20.0)
        log_w = (log_r * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)  # [B, 1]
        pos = batch.advantages[:, None] >= 0
        k = torch.where(pos, logps.new_tensor(s.k_pos), logps.new_tensor(s.k_neg))  # in logps' dtype: 2.1 stays 2.1
        lam = torch.where(pos, logps.new_tensor(s.lambda_pos), logps.new_tensor(s.lambda_neg))
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ratio, _ = super().importance_ratio(batch, logps)
        return ratio, self.gamma_weight(batch, logps).expand_as(logps)

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(ratio * adv, dtype=torch.bool)  # no token is zeroed

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        per_token = self.gamma_weight(batch, logps) * self.token_advantages(batch) * logps  # [B, L]
        per_token = per_token * self.policy_weight(batch, logps)  # the off-policy mask (tis is refused)
        kl_only = batch.replaced(advantages=torch.zeros_like(batch.advantages))  # GRPO's J at A = 0: its KL term
        return self.aggregate(per_token * batch.loss_mask, batch, Z) + super().objective(kl_only, logps, Z)

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        out = {k: v for k, v in super().metrics(batch, logps, coef).items() if "clip" not in k}
        out[f"{self.metric_prefix}/phi_mean"] = float(self.gamma_weight(batch, logps).mean())
        return out
