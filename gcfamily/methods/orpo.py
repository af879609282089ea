"""ORPO: supervised fine-tuning on the chosen completion plus an odds-ratio penalty on the rejected one.

Hong, Lee & Thorne 2024, "ORPO: Monolithic Preference Optimization without Reference Model"
(arXiv:2403.07691, eqs. 6-8). Per pair (q, o_w, o_l), no reference model:

    a(o)       = (1/|o|) sum_t log pi(o_t | q, o_<t)                    mean log-prob; P(o) = exp(a)
    log odds   = log(P / (1 - P)) = a - log(1 - e^a)
    z          = log odds(o_w) - log odds(o_l)
    loss       = -a(o_w) + lambda * (-log sigmoid(z))                    NLL (token mean) + lambda * L_OR
    J          = -sum_pairs loss / Z,   Z = pairs in the step           ("sum" normalisation)

Coefficient: d log odds / d a = 1 + e^a / (1 - e^a) = 1 / (1 - P), d a / d logp_t = 1 / |o|, and
d(log sigmoid z)/dz = sigmoid(-z), so

    GC = (1 + lambda * sigmoid(-z) / (1 - P(o_w))) / |o_w|      on o_w's tokens (SFT part + odds-ratio part)
    GC = -lambda * sigmoid(-z) / (1 - P(o_l)) / |o_l|           on o_l's tokens

Normalisation: the NLL is each chosen completion's token mean, averaged over the pairs of the step (the
paper's per-sequence 1/m), on the completion's tokens only.

TRL's ORPO (`ORPOTrainer`, trl/experimental/orpo/orpo_trainer.py) computes a different NLL, so its loss and gradient
differ from this one even when every chosen completion has the same length: its `chosen_nll_loss` is the
cross-entropy over every non-padding token of the chosen rows but the first, the PROMPT's tokens included
(its code: "orpo chosen nll loss is computed over the full prompt and response"), averaged over all those
tokens of the batch at once, not per row. Its gradient therefore also reaches the prompt tokens, which this
method's loss mask leaves out. The two NLLs agree only where the prompt is one token (nothing of it is
predicted) and the chosen completions have one length. The odds-ratio term is the same in both: the mean over
pairs of -lambda log sigmoid(log odds_w - log odds_l), log odds from each completion's mean token log-prob
(TRL's `beta` is `orpo_lambda`). Data, layout (chosen 2i, rejected 2i+1, example weight 1/2)
and the odds-ratio term are DPO's pair loss on the margin z (its `rewards` hook gives log odds), scaled by
lambda; ORPO adds the chosen rows' NLL. P = 1 exactly (a = 0) has infinite log odds: such a step is
non-finite and the trainer skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gcfamily.config import Config, MethodSettings, resolve_settings
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.dpo import DPO


class ORPO(DPO):
    """ORPO (Hong et al. 2024, arXiv:2403.07691): NLL(o_w) + lambda * -log sigmoid(log odds(o_w) - log odds(o_l)).

    GC = (1 + lambda sigmoid(-z) / (1 - P_w)) / |o_w| on o_w's tokens, -lambda sigmoid(-z) / ((1 - P_l) |o_l|) on o_l's.
    """

    name = "orpo"
    data_source = "preference pairs (prompt, chosen, rejected), no reference model"
    gc_formula = "(1 + lambda*sigmoid(-z)/(1 - P_w))/|o_w| on chosen tokens, -lambda*sigmoid(-z)/((1 - P_l)|o_l|) on rejected; z = log odds_w - log odds_l"
    uses_reference = False

    @dataclass
    class Settings(MethodSettings):
        orpo_lambda: float = 0.1
        """lambda, the weight of the odds-ratio loss against the chosen NLL (TRL's ORPO `beta`, default 0.1)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super(DPO, cls).validate(cfg)  # Method's, not DPO's: ORPO has no beta
        lam = resolve_settings(cfg, cls).settings.orpo_lambda
        if lam < 0:
            raise GcfError(f"orpo needs orpo_lambda >= 0 (got {lam}); 0.1 is usual.")
        if cfg.loss_norm not in (None, "sum"):
            raise GcfError(f"orpo averages per-pair losses; loss_norm must be sum (got {cfg.loss_norm}).")

    def rewards(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log odds(o) per row [B] and its derivative in logp_t [B, L]: 1 / ((1 - P) |o|)."""
        mask = batch.loss_mask.to(logps.dtype)  # [B, L]
        n = mask.sum(-1).clamp(min=1)  # [B]
        a = (logps * mask).sum(-1) / n  # [B]
        one_minus_p = -torch.expm1(a)  # [B]: 1 - e^a without cancellation
        return a - torch.log(one_minus_p), mask / (one_minus_p * n)[:, None]

    def pair_loss(self, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, dloss = super().pair_loss(margin)  # DPO's -log sigmoid(z)
        return self.settings.orpo_lambda * loss, self.settings.orpo_lambda * dloss

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        mask = batch.loss_mask.to(logps.dtype)  # [B, L]
        sft = mask / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, L]: the token mean's derivative
        sft[1::2] = 0  # only the chosen rows are imitated
        return super().coefficient(batch, logps) + sft

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        mask = batch.loss_mask.to(logps.dtype)
        a = (logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B] mean log-prob
        log_odds = a - torch.log1p(-torch.exp(a))  # [B]
        nll = -a[0::2]  # [P]
        l_or = -F.logsigmoid(log_odds[0::2] - log_odds[1::2])  # [P]
        return -(nll + self.settings.orpo_lambda * l_or).sum() / Z

    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        odds, _ = self.rewards(batch, logps)
        z = odds[0::2] - odds[1::2]  # [P]
        mask = batch.loss_mask.to(logps.dtype)
        a = (logps * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return {
            "orpo/nll": float(-a[0::2].mean()),
            "orpo/log_odds_ratio": float(z.mean()),
            "orpo/or_loss": float(-F.logsigmoid(z).mean()),
            "orpo/accuracy": float((z > 0).float().mean()),
        }
