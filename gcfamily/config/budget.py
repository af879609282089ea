"""The steps a run plans, from max_steps and epochs: one function the trainer and the methods that size work ahead
(DPO's reference log-probs, the reward model's schedule) share, so they agree."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from gcfamily.errors import GcfError


def planned_steps(cfg: Any, n: int | None) -> int:
    """The steps a run plans: max_steps; with `epochs` given, ceil(epochs * n / batch_size), the steps that many passes
    over n examples take, or max_steps where it is given and comes first."""
    if not cfg.epochs:
        return cfg.max_steps
    if n is None:
        raise GcfError(
            f"epochs={cfg.epochs:g} needs the number of examples in a pass, which method {cfg.method} does not give "
            "(define examples_per_epoch() on it); set max_steps instead."
        )
    # the decimal the user wrote, exactly: 0.1 * 30 / 3 is 1 step, where float arithmetic gives 1.0000000000000002
    by_epochs = math.ceil(Fraction(repr(float(cfg.epochs))) * n / cfg.batch_size)
    return min(cfg.max_steps, by_epochs) if "max_steps" in cfg.explicit else by_epochs
