"""The text `gcf check` prints for a method's outcomes, and whether every case passed."""

from __future__ import annotations

import inspect
from pathlib import Path

from gcfamily.check.families import family_of, own_rule, textbook_for
from gcfamily.check.outcome import Outcome
from gcfamily.check.surrogates import STATED
from gcfamily.methods.base import Method


def _source(cls: type) -> str:
    """The module of a library class, or the file of a user's (relative to the working folder where it can be)."""
    if cls.__module__.startswith("gcfamily."):
        return cls.__module__
    try:
        path = Path(inspect.getfile(cls)).resolve()
    except (TypeError, OSError):
        return cls.__module__
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def report(spec: str, cls: type[Method], outcomes: list[Outcome]) -> tuple[str, bool]:
    """The text `gcf check` prints, and whether every case passed."""
    fam = family_of(cls)
    lines = [f"gcf check {spec}: {cls.__qualname__} from {_source(cls)}"]
    why = ""
    if fam is None or not cls.trains_policy:
        lines.append("trains no policy: its coefficient must be 0 and its objective constant in the policy")
    else:
        tb, why = textbook_for(cls)
        lines.append(f"family: {fam.name}; batches from its own setup and prepare on a stub trainer")
        lines.append(
            f"textbook: none: {why}; checked against its own objective only: autograd of {cls.__name__}.objective, "
            "and (b) with that objective's GC"
            if why
            else f"textbook: {STATED.get(tb.get('surrogate', ''), fam.textbook)}"
            + (f" [{', '.join(f'{k}: {v}' for k, v in tb.items())}]" if tb else "")
        )
        kind, rule = own_rule(cls)
        if kind in ("coefficient", "objective"):
            lines.append(f"FAILED {rule}")
    for o in outcomes:
        status = "ok" if o.ok else ("refused" if o.refused else "FAILED")
        lines.append(f"case {o.label} {o.settings or '(its defaults)'}: {status}")
        if o.refused:
            lines.append(f"  the method refuses these settings: {o.refused}")
        width = max([62, *map(len, o.diffs)])
        for name, (d, scale) in o.diffs.items():
            lines.append(f"  {name:<{width}} max |diff| {d:.2e}  (largest entry {scale:.2e})")
        if o.branches:
            lines.append("  branches: " + ", ".join(f"{k} {n}" for k, n in sorted(o.branches.items()) if n))
        lines += [f"  FAILED {f}" for f in o.failures]
        if o.missing:
            lines.append(f"  FAILED branches that did not occur on the check's batch: {', '.join(o.missing)}")
        if o.rule:
            lines.append(f"  FAILED {cls.__name__} overrides one of coefficient and objective, not both (above)")
    ok = all(o.ok for o in outcomes)
    if any(k.startswith("(a) engine vs textbook") for o in outcomes for k in o.failed) and not any(
        k.startswith("(a) engine vs own") for o in outcomes for k in o.failed
    ):
        lines.append(
            "hint: the engine agrees with the class's own objective but not with the textbook: both share a mistake, "
            "or the rule changes the objective itself, which the textbook of its family does not state"
        )
    n, passed, refused = len(outcomes), sum(o.ok for o in outcomes), sum(bool(o.refused) for o in outcomes)
    lines.append(
        f"{n} case{'' if n == 1 else 's'}: {passed} passed, {n - passed - refused} failed"
        + (f", {refused} refused by the method" if refused else "")
        + (" (against the method's own objective only)" if why else "")
    )
    return "\n".join(lines), ok
