"""Truncated importance sampling (TIS): each sampled token's term weighed by pi_old / pi_sampler, truncated or masked.

A rollout engine (vLLM beside the trainer, another kernel or dtype) samples from a copy of the policy whose
log-probs differ slightly from the trainer's. The on-policy rules assume the samples came from pi_old; TIS corrects
the difference as TRL 1.16 does (`vllm_importance_sampling_correction`, `grpo_trainer.py`), and as verl's rollout
correction does:

    d_t  = (log pi_old(o_t) - log pi_sampler(o_t)) * m_t        m_t: the completion (loss) mask; sample_logps
    rho  = exp(d_t) per token (token_*), or exp(sum_t d_t) once per row, on each of its tokens (sequence_*)
    w    = clamp(rho, tis_min, tis_max)                          *_truncate (tis_min none: no lower bound)
    w    = rho * 1[tis_min <= rho <= tis_max]                    *_mask (tis_min none: no lower bound)

w is a constant of the step (no gradient). pi_old is the trainer's policy at rollout time: `old_logps` when prepare
computed them (several passes or minibatches), else the current log-probs, which are exactly pi_old with one pass.
Where w multiplies each method's rule is the method's docstring (OnPolicy.sampler_correction).
"""

from __future__ import annotations

from typing import Optional

import torch

MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""The settings' `tis` values; the four on are TRL's `vllm_importance_sampling_mode` names."""


def sampler_ratio(mode: str, old_logps: torch.Tensor, sample_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rho [B, L]: pi_old/pi_sampler of each completion token (token_*), or of the whole row on each of its tokens
    (sequence_*); 1 off the mask (token_*)."""
    # where(), not * mask: a sampler's NaN off the completion (padding) stays out; one on it makes w NaN, not 1
    d = torch.where(mask.bool(), old_logps.detach() - sample_logps.to(old_logps.dtype), 0.0)  # [B, L]
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True).expand_as(d)  # [B, L]: the row's sum on each of its positions
    return torch.exp(d)


def outside(rho: torch.Tensor, tis_min: Optional[float], tis_max: float) -> torch.Tensor:
    """[B, L] bool: rho past tis_max, or below tis_min where there is one."""
    low = rho < tis_min if tis_min is not None else torch.zeros_like(rho, dtype=torch.bool)
    return (rho > tis_max) | low


def weight(mode: str, rho: torch.Tensor, tis_min: Optional[float], tis_max: float) -> torch.Tensor:
    """w [B, L] of a ratio: clamped into [tis_min, tis_max] (*_truncate) or 0 outside it (*_mask)."""
    if mode.endswith("truncate"):
        return rho.clamp(min=tis_min, max=tis_max)
    return rho.masked_fill(outside(rho, tis_min, tis_max), 0.0)


def mismatch_metrics(
    mode: str,
    old_logps: torch.Tensor,
    sample_logps: torch.Tensor,
    loss_mask: torch.Tensor,
    on: torch.Tensor,
    tis_min: Optional[float],
    tis_max: float,
) -> dict[str, float]:
    """The sampler/trainer figures over the tokens `on` (the loss tokens of valid rows):

    rollout/logp_diff_mean, _max   |log pi_old - log pi_sampler| per token (whatever `mode`)
    tis/ratio_mean, _min, _max     the weight w each token's term is multiplied by (after truncation or masking; a
                                   sequence mode's row weight counted on each of the row's tokens); with tis on
    tis/masked_frac                the share of tokens whose w is 0 because rho is out of range; *_mask modes

    Means are over the tokens, so the step's token-weighted average of its micro-batches' means is the step's mean.
    A `_max` or `_min` is left out where `on` holds no token (methods/base.py's EXTREMES: combined by max and min)."""
    on = on.bool()
    n = int(on.sum())
    diff = (old_logps.detach() - sample_logps.to(old_logps.dtype)).abs()[on]  # [n]
    out = {"rollout/logp_diff_mean": float(diff.sum()) / max(n, 1)}
    if n:
        out["rollout/logp_diff_max"] = float(diff.max())
    if mode == "off":
        return out
    rho = sampler_ratio(mode, old_logps, sample_logps, loss_mask)  # [B, L]
    w = weight(mode, rho, tis_min, tis_max)[on]  # [n]
    out["tis/ratio_mean"] = float(w.sum()) / max(n, 1)
    if n:
        out["tis/ratio_min"], out["tis/ratio_max"] = float(w.min()), float(w.max())
    if mode.endswith("mask"):
        out["tis/masked_frac"] = float(outside(rho, tis_min, tis_max)[on].sum()) / max(n, 1)
    return out
