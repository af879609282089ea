"""The textbook of gcf check's preference pairs (gcfamily/check/): each pair loss restated from its paper, and from
TRL 1.16's loss code for its other DPO loss types, sharing no code with the methods."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from gcfamily.check.textbook import Textbook
from gcfamily.check.world import World
from gcfamily.methods.base import Method


def _pair_loss(
    name: str, s: Any, lp: torch.Tensor, ref: torch.Tensor | None, mask: torch.Tensor, w: list[int], l: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss per pair [P] and its branch variable minus the loss's pivot (its sign is the branch):
    DPO -log sigmoid(beta d) (Rafailov et al. 2023), cDPO (Mitchell 2023), IPO (d - 1/(2 beta))^2 (Azar et al. 2023,
    eq. 17), SimPO -log sigmoid(beta (mean_w - mean_l) - gamma) (Meng et al. 2024), ORPO -mean_w - lambda log
    sigmoid(log odds_w - log odds_l) (Hong et al. 2024); d = sum_t log(pi/pi_ref), chosen minus rejected."""
    mean = (lp * mask).sum(-1) / mask.sum(-1)  # [B]
    if name in ("dpo", "cdpo", "ipo"):
        tot = _scores(_delta(s, lp, ref, mask, w, l), s, True)  # [B]
        d = tot[w] - tot[l]  # [P]
        beta = s.beta
        if name == "ipo":
            return (d - 1 / (2 * beta)) ** 2, beta * d - 0.5
        m = beta * d
        if name == "dpo":
            return F.softplus(-m), m
        eps = s.label_smoothing
        return (1 - eps) * F.softplus(-m) + eps * F.softplus(m), m - math.log((1 - eps) / eps) if eps > 0 else m
    if name in TRL_PAIR_LOSSES:
        return _trl_pair_loss(name, s, lp, ref, mask, w, l)
    if name == "simpo":
        u = s.beta * (mean[w] - mean[l]) - s.simpo_gamma
        return F.softplus(-u), u
    odds = mean - torch.log(-torch.expm1(mean))  # log(P / (1 - P)), P = exp(mean)
    z = odds[w] - odds[l]
    return -mean[w] + s.orpo_lambda * F.softplus(-z), z


def _delta(s: Any, lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, w: list[int], l: list[int]) -> torch.Tensor:
    """Each row's completion log-ratio sum [B]; with ld_alpha (LD-DPO, Liu et al. 2024), the tokens of a completion
    after the first min(|o_w|, |o_l|) of its pair count ld_alpha times."""
    weight = mask.clone()
    ld = getattr(s, "ld_alpha", None)
    for i, j in zip(w, l):
        keep = int(min(mask[i].sum(), mask[j].sum()))
        for row in (i, j):
            later = [t for t in range(mask.shape[1]) if mask[row, t] > 0][keep:]
            if ld is not None:
                weight[row, later] = ld
    return ((lp - ref) * weight).sum(-1)


def _scores(delta: torch.Tensor, s: Any, scored: bool) -> torch.Tensor:
    """f-DPO (Wang et al. 2023): f'(t) at t = pi/pi_ref = e^delta for the f-divergence set (TRL's f_divergence_type:
    reverse KL log t, forward KL 1 - 1/t, Jensen-Shannon log(2t/(1+t)), alpha (t^(a-1) - 1)/(a-1) with the exponent
    clamped at 80); the log-ratio itself for the losses that do not read a score."""
    f = getattr(s, "f_divergence", "reverse_kl") if scored else "reverse_kl"
    a = getattr(s, "f_alpha", 0.5)
    if f == "forward_kl":
        return 1 - 1 / torch.exp(delta)
    if f == "js_divergence":
        t = torch.exp(delta)
        return torch.log(2 * t / (1 + t))
    if f == "alpha_divergence" and abs(a - 1) >= 1e-6:
        return (torch.exp(torch.clamp((a - 1) * delta, max=80.0)) - 1) / (a - 1)
    return delta


TRL_PAIR_LOSSES = (
    "hinge",
    "robust-dpo",
    "exo-pair",
    "discopop",
    "nca-pair",
    "bco-pair",
    "sppo-hard",
    "apo-zero",
    "apo-down",
    "sigmoid-norm",
    "ipo-norm",
)
UNSCORED = ("nca-pair", "bco-pair", "sppo-hard", "apo-zero", "apo-down")
"""Losses of each completion's log-ratio itself: TRL reads no f-divergence score for them."""
NORMALISED = ("sigmoid-norm", "ipo-norm")
"""Losses whose Delta is each completion's mean log-ratio, not its sum."""


def _trl_pair_loss(
    name: str, s: Any, lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, w: list[int], l: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.16's other DPO loss types, restated from their papers: hinge (SLiC) max(0, 1 - m); robust DPO
    (Chowdhury et al. 2024) [-(1-e) log sig(m) + e log sig(-m)] / (1 - 2e); EXO (Ji et al. 2024, eq. 16) the KL of
    softmax(m, 0) from (1 - e, e); DiscoPOP (Lu et al. 2024, eq. 5); NCA (Chen et al. 2024); BCO on pairs; SPPO hard
    (Wu et al. 2024, eq. 4.7); APO zero and down (D'Oosterlinck et al. 2024, eqs. 7-8); DPO and IPO on per-token mean
    log-ratios (TRL's sigmoid_norm and ipo). m = beta (Delta_w - Delta_l); the branch variable is m minus the pivot."""
    delta = _scores(_delta(s, lp, ref, mask, w, l), s, name not in UNSCORED)  # [B]
    if name in NORMALISED:
        delta = delta / mask.sum(-1)
    b, e = s.beta, getattr(s, "label_smoothing", 0.0)
    cw, cl = b * delta[w], b * delta[l]  # [P]
    m = cw - cl
    sig = torch.sigmoid
    losses = {
        "hinge": lambda: torch.clamp(1 - m, min=0),
        "robust-dpo": lambda: ((1 - e) * F.softplus(-m) - e * F.softplus(m)) / (1 - 2 * e),
        "exo-pair": lambda: (
            sig(m) * (torch.log(sig(m)) - math.log(1 - e)) + sig(-m) * (torch.log(sig(-m)) - math.log(e))
        ),
        "discopop": lambda: (1 - sig(m / s.discopop_tau)) * F.softplus(-m) + sig(m / s.discopop_tau) * torch.exp(-m),
        "nca-pair": lambda: F.softplus(-cw) + 0.5 * F.softplus(cw) + 0.5 * F.softplus(cl),
        "bco-pair": lambda: F.softplus(-cw) + F.softplus(cl),
        "sppo-hard": lambda: (delta[w] - 0.5 / b) ** 2 + (delta[l] + 0.5 / b) ** 2,
        "apo-zero": lambda: 1 - sig(cw) + sig(cl),
        "apo-down": lambda: sig(cw) + 1 - sig(m),
        "sigmoid-norm": lambda: F.softplus(-m),
        "ipo-norm": lambda: (delta[w] - delta[l] - 1 / (2 * b)) ** 2,
    }
    return losses[name](), m - PIVOT.get(name, lambda s: 0.0)(s)


# the margin m = beta * d where each loss turns: DPO's sign, IPO's target 1/2, where cDPO's GC changes sign; where the
# hinge stops, where EXO's GC changes sign
PIVOT = {
    "dpo": lambda s: 0.0,
    "ipo": lambda s: 0.5,
    "cdpo": lambda s: math.log((1 - s.label_smoothing) / s.label_smoothing) if s.label_smoothing > 0 else 0.0,
    "hinge": lambda s: 1.0,
    "exo-pair": lambda s: math.log((1 - s.label_smoothing) / s.label_smoothing),
    "ipo-norm": lambda s: 0.5,
    **{n: (lambda s: 0.0) for n in ("robust-dpo", "discopop", "nca-pair", "bco-pair", "sppo-hard", "apo-zero")},
    **{n: (lambda s: 0.0) for n in ("apo-down", "sigmoid-norm")},
}


def _pairs_textbook(
    lp_all: torch.Tensor,
    pairs: list[tuple[int, int]],
    ref_all: torch.Tensor | None,
    world: World,
    m: Method,
    tb: dict,
    br: Counter,
) -> Textbook:
    w, l = [p[0] for p in pairs], [p[1] for p in pairs]
    loss, u = _pair_loss(tb["loss"], m.settings, lp_all, ref_all, world.loss_mask.double(), w, l)
    br["pairs above the loss's pivot"] += int((u.detach() > 0).sum())
    br["pairs below the loss's pivot"] += int((u.detach() < 0).sum())
    req = {"pairs above the loss's pivot", "pairs below the loss's pivot"}
    if getattr(m.settings, "ld_alpha", None) is not None:  # LD-DPO's down-weighted tail occurs
        n = world.loss_mask.sum(-1)
        br["tokens past the pair's shorter completion (ld_alpha)"] += sum(abs(int(n[i]) - int(n[j])) for i, j in pairs)
        req.add("tokens past the pair's shorter completion (ld_alpha)")
    return Textbook(-loss.sum() / len(pairs), br, req)
