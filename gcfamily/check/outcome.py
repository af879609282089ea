"""A settings case's outcome, and how a check records into it: its largest differences, the branches its batch reached,
and a failure, named once, for a difference past tolerance or a NaN or an inf."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class Outcome:
    label: str
    settings: dict
    diffs: dict[str, tuple[float, float]] = field(default_factory=dict)
    """check -> (largest |difference|, largest |entry| of the expected side), worst over the seeds."""
    branches: Counter = field(default_factory=Counter)
    required: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    failed: dict[str, tuple[float, str]] = field(default_factory=dict)
    """check -> (worst relative difference, its message), for checks past their tolerance."""
    refused: str = ""
    textbook: bool = True
    rule: str = ""
    """The sentence of families.own_rule when only one of coefficient and objective is the class's own: it fails."""

    @property
    def failures(self) -> list[str]:
        return [msg for _, msg in self.failed.values()] + self.errors

    @property
    def missing(self) -> list[str]:
        return sorted(b for b in self.required if not any(k.endswith(b) and n > 0 for k, n in self.branches.items()))

    @property
    def ok(self) -> bool:
        return not self.failures and not self.missing and not self.refused and not self.rule


def _worse(a: float, b: float) -> float:
    """The larger of two differences, NaN when either is: a running max(0.0, nan) keeps 0.0 and hides the NaN."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _nonfinite(what: str, x: torch.Tensor | float, out: Outcome, seed: int) -> bool:
    """Whether x holds a NaN or an inf; if so a failure naming `what` and how many entries (once per quantity)."""
    x = torch.as_tensor(x).detach()
    if bool(torch.isfinite(x).all()):
        return False
    if x.numel() == 1:
        v = float(x)
        msg = f"{what} is {'NaN' if math.isnan(v) else ('+inf' if v > 0 else '-inf')} (seed {seed})"
    else:
        counts = [
            (int(torch.isnan(x).sum()), "NaN"),
            (int((x == math.inf).sum()), "+inf"),
            (int((x == -math.inf).sum()), "-inf"),
        ]
        msg = f"{what} has {' and '.join(f'{kind} in {n}' for n, kind in counts if n)} of {x.numel()} entries (seed {seed})"
    out.failed.setdefault(what, (math.inf, msg))
    return True


def _diff(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, out: Outcome, seed: int) -> None:
    """Record a check's largest difference; a failure once per check (its worst seed). A NaN or inf difference
    fails: `d <= tol` is False for NaN, and its relative size counts as inf."""
    d, scale = float((got - want).abs().max()), float(want.abs().max())
    old = out.diffs.get(name, (0.0, 0.0))
    out.diffs[name] = (_worse(old[0], d), _worse(old[1], scale))
    if d <= tol * scale + 1e-12:
        return
    if not math.isfinite(d):  # a NaN or an inf on either side (a non-finite scale makes d non-finite too)
        out.failed.setdefault(
            name, (math.inf, f"{name}: max |diff| is {d:.3g}, which no tolerance passes (seed {seed})")
        )
    elif d / max(scale, 1e-300) > out.failed.get(name, (0.0, ""))[0]:
        out.failed[name] = (
            d / max(scale, 1e-300),
            f"{name}: max |diff| {d:.3g} against a largest entry of {scale:.3g} (seed {seed})",
        )
