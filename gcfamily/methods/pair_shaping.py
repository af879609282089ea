"""What DPO's implicit reward reads besides beta (methods/dpo.py): f-DPO's score and LD-DPO's token weights.

    Delta = sum_t u_t log(pi(o_t | q, o_<t) / pi_ref(o_t | q, o_<t)),  h = beta * f'(e^Delta)

u_t = 1 on the completion, or with ld_alpha (LD-DPO, Liu et al. 2024, arXiv:2409.06411) ld_alpha on the tokens past
the shorter completion of the pair; f' the derivative of the f-divergence's generator (f-DPO, Wang et al. 2023,
arXiv:2309.16240), as TRL 1.16's DPOTrainer computes its `chosen_scores` (f_divergence_type, ld_alpha).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from gcfamily.config import Config
from gcfamily.errors import GcfError

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
ALPHA_CAP = 80.0
"""TRL caps (alpha - 1) * Delta at 80 before the exponential (its float32 bound), which has no gradient past it."""


def ld_weights(mask: torch.Tensor, ld_alpha: Optional[float]) -> torch.Tensor:
    """u [B, L] for pairs laid out chosen 2k, rejected 2k+1: the mask, times ld_alpha past the pair's shorter length."""
    if ld_alpha is None:
        return mask
    n = mask.sum(-1)  # [B]
    shared = torch.minimum(n[0::2], n[1::2]).repeat_interleave(2)  # [B]
    past = mask.cumsum(-1) > shared[:, None]  # [B, L]
    return mask * torch.where(past, mask.new_tensor(ld_alpha), mask.new_tensor(1.0))  # in mask's dtype: 0.3 stays 0.3


def f_score(delta: torch.Tensor, f: str, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """f'(e^Delta) per row and its derivative in Delta: log t, 1 - 1/t, log(2t/(1+t)) or (t^(alpha-1) - 1)/(alpha-1)
    (alpha within 1e-6 of 1: log t, as TRL)."""
    if f == "alpha_divergence" and abs(alpha - 1.0) < 1e-6:
        f = "reverse_kl"
    if f == "forward_kl":
        e = torch.exp(-delta)
        return 1 - e, e
    if f == "js_divergence":
        return math.log(2) + F.logsigmoid(delta), torch.sigmoid(-delta)
    if f == "alpha_divergence":
        x = (alpha - 1) * delta
        e = torch.exp(x.clamp(max=ALPHA_CAP))
        return (e - 1) / (alpha - 1), torch.where(x < ALPHA_CAP, e, 0.0)
    return delta, torch.ones_like(delta)


def check_shaping(cls: Any, cfg: Config, s: Any, dpo_rewards: Callable) -> None:
    """f_divergence and ld_alpha in their domains, and given only to a method whose h reads them (one sentence)."""
    f, ld = getattr(s, "f_divergence", "reverse_kl"), getattr(s, "ld_alpha", None)
    own = cls.rewards is dpo_rewards or cls.own_shaping  # h is DPO's, or a subclass's that applies both
    if f not in F_DIVERGENCES:
        raise GcfError(f"f_divergence={f} is not one of {', '.join(F_DIVERGENCES)}.")
    if f != "reverse_kl" and not (cls.scored and own):
        raise GcfError(
            f"{cfg.method} takes f_divergence=reverse_kl only: its loss is of each completion's log-ratio itself (TRL "
            "ignores f_divergence_type there) or of a reward of its own."
        )
    if ld is not None and not 0 <= ld <= 1:
        raise GcfError(f"ld_alpha={ld} must be in [0, 1] (1: DPO's weights; none: off).")
    if ld is not None and not own:
        raise GcfError(f"{cfg.method} takes no ld_alpha: its reward is not DPO's sum of log-ratios.")
