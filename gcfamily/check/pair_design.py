"""The check's preference pairs by design (gcfamily/check/): pi_ref set so that each pair's margin falls on the side
of its loss's pivot the case needs, under DPO's sums, per-token means, f-DPO's scores and LD-DPO's weights."""

from __future__ import annotations

import math
from typing import Any

from gcfamily.check.pair_textbook import NORMALISED, PIVOT, UNSCORED
from gcfamily.check.world import World


def _score_inverse(y: float, s: Any) -> float:
    """The log-ratio whose f-DPO score is y < 0 (every score reaches below 0): log t, 1 - 1/t, log(2t/(1+t)),
    (t^(a-1) - 1)/(a-1) solved for log t."""
    f, a = getattr(s, "f_divergence", "reverse_kl"), getattr(s, "f_alpha", 0.5)
    if f == "forward_kl":
        return -math.log(1 - y)
    if f == "js_divergence":
        p = math.exp(y) / 2
        return math.log(p / (1 - p))
    if f == "alpha_divergence" and abs(a - 1) >= 1e-6:
        return math.log(1 + (a - 1) * y) / (a - 1)
    return y


def _set_log_ratio(world: World, row: int, delta: float, keep: int, ld: float | None) -> None:
    """pi_ref moved on the row's first completion token (weight 1 under any ld_alpha) so that its log-ratio sum, the
    tokens after the first `keep` weighed ld_alpha, is delta."""
    pos = world.positions(row)
    now = -sum(float(world.ref_offset[row, t]) * (1.0 if i < keep or ld is None else ld) for i, t in enumerate(pos))
    world.ref_offset[row, pos[0]] += now - delta


def _design_margins(world: World, pairs: list[tuple[int, int]], tb: dict | None, s: Any) -> None:
    """pi_ref such that the pairs' margins lie on both sides of the loss's pivot (losses with a reference). Under an
    f-divergence's score or LD weights the margin is set exactly: one completion at log-ratio 0 (score 0), the other
    at the score's inverse of the margin (a score of the rejected row of the TRL losses that read the log-ratio)."""
    if not tb or tb["loss"] not in PIVOT:
        return
    shaped = getattr(s, "f_divergence", "reverse_kl") != "reverse_kl" or getattr(s, "ld_alpha", None) is not None
    for k, (w, l) in enumerate(pairs):
        if shaped:
            m = (PIVOT[tb["loss"]](s) + (1 if k % 2 == 0 else -1) * (0.4 + 0.2 * k)) / s.beta  # score margin wanted
            n_w, n_l = (
                (float(world.loss_mask[w].sum()), float(world.loss_mask[l].sum()))
                if tb["loss"] in NORMALISED
                else (1, 1)
            )
            inv = (lambda y: y) if tb["loss"] in UNSCORED else (lambda y: _score_inverse(y, s))
            keep, ld = min(len(world.positions(w)), len(world.positions(l))), getattr(s, "ld_alpha", None)
            _set_log_ratio(world, w, 0.0 if m >= 0 else inv(m * n_w), keep, ld)
            _set_log_ratio(world, l, inv(-m * n_l) if m >= 0 else 0.0, keep, ld)
            continue
        n_w, n_l = (world.loss_mask[w].sum(), world.loss_mask[l].sum()) if tb["loss"] in NORMALISED else (1, 1)
        d = float(
            -(world.ref_offset[w] * world.loss_mask[w]).sum() / n_w
            + (world.ref_offset[l] * world.loss_mask[l]).sum() / n_l
        )
        target = (PIVOT[tb["loss"]](s) + (1 if k % 2 == 0 else -1) * (0.4 + 0.2 * k)) / s.beta  # d at the wanted margin
        world.ref_offset[w, world.positions(w)[0]] += (d - target) * float(n_w)
