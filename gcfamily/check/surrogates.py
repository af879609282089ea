"""Surrogates of gcf check's textbook (gcfamily/check/textbook.py) other than PPO's clipped one, each restated from its
paper, sharing no code with the methods: the per-token term J_t whose aggregate is the objective, and the branches it
reached."""

from __future__ import annotations

import math
from collections import Counter

import torch

STATED = {
    "cispo": "sg(clip(r, 1 - eps, 1 + eps_high)) A log pi - beta KL_t (MiniMax-M1); A from the rewards",
    "gpg": "A log pi - beta KL_t, A = alpha (R - mean R), alpha = B / (B - M) (GPG)",
    "gmpo": "A exp(mean_t sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps, eps_high))) - beta KL_t (GMPO)",
    "sapo": "(4 / tau) sigmoid(tau (r - 1)) A - beta KL_t, tau = tau_pos if A > 0 else tau_neg (SAPO)",
    "vespo": "sg(w^k e^(lambda (1 - w))) A log pi - beta KL_t, w the clamped sequence ratio, (k, lambda) by sgn A (VESPO)",
}
"""What the textbook states for each surrogate, in a line (`gcf check` prints it in place of the family's)."""


def cispo_terms(
    r: torch.Tensor, A: torch.Tensor, lp: torch.Tensor, lo: float, hi: float, on: torch.Tensor, br: Counter
) -> torch.Tensor:
    """CISPO (MiniMax-M1): sg(clip(r, 1 - eps, 1 + eps_high)) A log pi per token; the weight is a constant, so
    no token loses its gradient. Counts capped weights of both signs of A, raised ones and those inside."""
    rd, Ad = r.detach(), A.expand_as(r)
    for sign, name in ((Ad > 0, "A > 0"), (Ad < 0, "A < 0")):
        br[f"tokens with the IS weight capped at 1 + eps_high, {name}"] += int((sign & (rd > 1 + hi) & on).sum())
    br["tokens with the IS weight raised to 1 - eps"] += int(((Ad != 0) & (rd < 1 - lo) & on).sum())
    inside = (rd >= 1 - lo) & (rd <= 1 + hi) & ((rd - 1).abs() > 1e-6)
    br["tokens with the IS weight r inside the clip, != 1"] += int(((Ad != 0) & inside & on).sum())
    return torch.clamp(r, 1 - lo, 1 + hi).detach() * A * lp


def gmpo_terms(
    lp: torch.Tensor,
    old: torch.Tensor,
    A: torch.Tensor,
    mask: torch.Tensor,
    lo: float,
    hi: float,
    on: torch.Tensor,
    br: Counter,
) -> torch.Tensor:
    """GMPO (Zhao et al. 2025): A_i exp((1/|o_i|) sum_t sgn(A_i) min(sgn(A_i) l_t, sgn(A_i) clip(l_t, -eps_low,
    eps_high))), l_t = log pi/pi_old, the mean over the completion's tokens; the row's value on each of its tokens [B, L]
    (the aggregate weighs a row by the sum of its tokens' weights). Counts the log ratios clipped on each side."""
    l, sgn = lp - old, torch.sign(A).expand_as(lp)
    lt = sgn * torch.minimum(sgn * l, sgn * torch.clamp(l, -lo, hi))
    rho = torch.exp((lt * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))  # [B, 1]
    ld = l.detach()
    br["tokens with log r past eps_high, A > 0 (clipped)"] += int(((sgn > 0) & (ld > hi) & on).sum())
    br["tokens with log r below -eps_low, A < 0 (clipped)"] += int(((sgn < 0) & (ld < -lo) & on).sum())
    br["tokens with log r outside the clip on the side A keeps"] += int(
        ((((sgn > 0) & (ld < -lo)) | ((sgn < 0) & (ld > hi))) & on).sum()
    )
    br["tokens with log r inside the clip, != 0"] += int(
        ((sgn != 0) & (ld.abs() > 1e-6) & (ld >= -lo) & (ld <= hi) & on).sum()
    )
    return (A * rho).expand_as(lp)


def sapo_terms(r: torch.Tensor, A: torch.Tensor, s: object, on: torch.Tensor, br: Counter) -> torch.Tensor:
    """SAPO (Gao et al. 2025): (4 / tau) sigmoid(tau (r - 1)) A per token, tau = tau_pos where A > 0, tau_neg where
    A < 0 (and A = 0, whose term is 0). Counts the tokens off r = 1 under each temperature."""
    Ae = A.expand_as(r)
    tau = torch.where(Ae > 0, s.tau_pos, s.tau_neg)  # type: ignore[attr-defined]
    off = (r.detach() - 1).abs() > 1e-6
    br["tokens with A > 0, r != 1 (gate at tau_pos)"] += int(((Ae > 0) & off & on).sum())
    br["tokens with A < 0, r != 1 (gate at tau_neg)"] += int(((Ae < 0) & off & on).sum())
    return 4 / tau * torch.sigmoid(tau * (r - 1)) * Ae


def vespo_terms(
    lp: torch.Tensor, old: torch.Tensor, A: torch.Tensor, mask: torch.Tensor, s: object, on: torch.Tensor, br: Counter
) -> torch.Tensor:
    """VESPO (TRL 1.16's get_gamma_weights): sg(phi(w)) A log pi per token, w = exp of the row's sum of log r_t (each
    within +-20, the sum within [log 1e-8, 20]), phi(w) = e^lambda w^k e^(-lambda w), (k, lambda) the positive pair
    where A >= 0. Counts the rows weighed off 1 on each side of A."""
    log_w = ((lp - old).detach().clamp(-20, 20) * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20)  # [B, 1]
    nonneg = A >= 0
    f64 = lambda x: torch.tensor(float(x), dtype=torch.float64)  # noqa: E731
    k = torch.where(nonneg, f64(s.k_pos), f64(s.k_neg))  # type: ignore[attr-defined]
    lam = torch.where(nonneg, f64(s.lambda_pos), f64(s.lambda_neg))  # type: ignore[attr-defined]
    phi = torch.exp(lam) * torch.exp(log_w) ** k * torch.exp(-lam * torch.exp(log_w))
    rows = on.any(-1, keepdim=True)
    off = (phi - 1).abs() > 1e-9
    br["rows with A > 0 weighed phi != 1"] += int(((A > 0) & off & rows).sum())
    br["rows with A < 0 weighed phi != 1"] += int(((A < 0) & off & rows).sum())
    return phi * A * lp
