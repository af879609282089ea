"""The advantages of gcf check's on-policy textbook (gcfamily/check/textbook.py), restated from each paper and
library, sharing no code with the methods: the group-relative ones, the running baseline, REINFORCE++'s whitening,
TRL's normalize_then_sum and mask_truncated_completions."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from gcfamily.check.world import G
from gcfamily.methods.base import Batch


def _group_advantages(
    R: torch.Tensor, valid: torch.Tensor, tb: dict, s: Any, b: float, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N] and the rows of groups whose valid rewards are all equal. group: (R - mean) / (std + std_eps) over the
    group (DeepSeekMath 4.1.2; std of the whole step with scale_rewards=batch, none: R - mean), 0 for an equal
    group; leave-one-out: R - mean of the others (RLOO); running baseline: R - b (Williams 1992)."""
    A, equal = torch.zeros(len(R), dtype=torch.float64), torch.zeros(len(R), dtype=torch.bool)
    sample = getattr(s, "std", "sample") == "sample"
    allv = R[valid]
    step_std = float(allv.std(unbiased=sample)) if len(allv) > int(sample) else 0.0
    for g in range(len(R) // G):
        idx = [i for i in range(g * G, (g + 1) * G) if valid[i]]
        r = R[idx]
        equal[g * G : (g + 1) * G] = len(r) < 2 or bool((r == r[0]).all())
        if tb["advantage"] == "running baseline":
            a = r - b
            scale = step_std + s.std_eps if s.scale_rewards == "batch" else 1.0
            A[idx] = a / scale if not scale <= 0 else a  # a NaN scale divides: the textbook J is NaN and fails by name
            continue
        if equal[g * G]:
            continue
        if tb["advantage"] == "leave-one-out":
            A[idx] = r - (r.sum() - r) / (len(r) - 1)
            continue
        if tb["advantage"] == "pass@k":  # Chen et al. 2025: the best sample gets the gap to the second best
            best, second = sorted(r.tolist(), reverse=True)[:2]
            scale = float(r.std(unbiased=sample)) + s.std_eps if s.scale_rewards == "group" else 1.0
            A[idx[r.tolist().index(best)]] = (best - second) / scale
            continue
        if tb["advantage"] == "opo":  # Hao et al. 2025: the length-weighted mean reward as the baseline
            n = lengths[idx]
            A[idx] = r - (n * r).sum() / n.sum()
            continue
        c = r - r.mean()
        if s.scale_rewards == "none":
            A[idx] = c
        else:
            scale = (float(r.std(unbiased=sample)) if s.scale_rewards == "group" else step_std) + s.std_eps
            A[idx] = c / scale if not scale <= 0 else 0.0
    if tb["advantage"] == "gpg":  # GPG's alpha = B / (B - M), M the samples with no gradient (equal group, failed)
        A = A * len(R) / max(int((valid & ~equal).sum()), 1)
    if tb["advantage"] in WHITENED:
        A = _whitened(R, valid, tb["advantage"] == "rf++ baseline", lengths, s)
    return A, equal


WHITENED = ("rf++", "rf++ baseline")
"""REINFORCE++'s advantages: a group that is all equal still gets one (the whitening moves it off 0)."""


def _whitened(R: torch.Tensor, valid: torch.Tensor, baseline: bool, lengths: torch.Tensor, s: Any) -> torch.Tensor:
    """REINFORCE++ (Hu 2025) at gamma = 1: every token of a sample carries its return R (less its group's mean with
    the baseline), whitened over the step's valid tokens, as verl's masked_whiten ((x - mean) / sqrt(unbiased var +
    1e-8); std=sample) or OpenRLHF ((x - mean) / sqrt(max(population var, 1e-8)); std=population), or only centred
    (whiten=false); written here token by token."""
    per_token, owner = [], []
    for i in range(len(R)):
        if not valid[i]:
            continue
        g = [j for j in range(i - i % G, i - i % G + G) if valid[j]]
        x = R[i] - (R[g].mean() if baseline and len(g) > 1 else 0.0)
        per_token += [x] * int(lengths[i])
        owner += [i] * int(lengths[i])
    t = torch.stack(per_token)
    mean = t.mean()
    if not s.whiten:
        sd = torch.ones((), dtype=torch.float64)
    elif s.std == "sample":
        sd = torch.sqrt(t.var(unbiased=True) + 1e-8)
    else:
        sd = torch.sqrt(torch.clamp(t.var(unbiased=False), min=1e-8))
    A = torch.zeros(len(R), dtype=torch.float64)
    for i, x in zip(owner, per_token):
        A[i] = (x - mean) / sd
    return A


def _running_baseline(means: list[float], decay: float) -> float:
    """b after K steps: the bias-corrected exponential moving average of the steps' mean rewards (as Adam's moments),
    sum_k (1 - d) d^(K-1-k) mean_k / (1 - d^K), written out in closed form."""
    K = len(means)
    return sum((1 - decay) * decay ** (K - 1 - k) * x for k, x in enumerate(means)) / (1 - decay**K)


def _normalized_sum(parts: torch.Tensor, valid: torch.Tensor, s: Any, weights: list, br: Counter) -> torch.Tensor:
    """TRL 1.16's normalize_then_sum: each reward function's value standardised within its group over the valid
    samples, (r_k - mean) / (std + std_eps) (0 where a group's r_k are all equal and std_eps is 0), weighted, summed."""
    w = weights or [1.0] * parts.shape[1]
    out = torch.zeros(len(parts), dtype=torch.float64)
    for g in range(len(parts) // G):
        idx = [i for i in range(g * G, (g + 1) * G) if valid[i]]
        for k in range(parts.shape[1]):
            r = parts[idx, k]
            scale = (float(r.std(unbiased=s.std == "sample")) if len(r) > 1 else 0.0) + s.std_eps
            out[idx] += float(w[k]) * ((r - r.mean()) / scale if scale > 0 else torch.zeros_like(r))
    br["rewards standardised apart, then summed"] += int(valid.sum())
    return out.float().double()  # as the method's, which hands float32 rewards on


def _truncated_off(s: Any, raw: Batch, valid: torch.Tensor, br: Counter) -> torch.Tensor:
    """[N] the valid samples whose tokens mask_truncated takes out of the loss (none unless it is set)."""
    cut = raw.truncated.bool() & valid if getattr(s, "mask_truncated", False) else torch.zeros_like(valid)
    br["truncated samples masked, their rewards kept"] += int(cut.sum())
    return cut
