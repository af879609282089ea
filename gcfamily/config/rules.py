"""The tests a shared setting's value must pass, declared beside each field (`setting(default, test, rule)`), and the caps
past which a size is a typo. The bottom of config/: imports nothing of gcfamily but its error."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

from gcfamily.errors import GcfError

# Caps far past any run one machine can hold; past them a setting is a typo (1e9 for 1e3), refused before any allocation.
MAX_SEQUENCE_TOKENS = 2**20
"""max_length and max_new_tokens: no model gcfamily can train has a longer context (1,048,576 tokens)."""
MAX_ROWS = 2**20
"""batch_size, and batch_size * group_size rows sampled per step (the sampler holds a [rows, vocabulary] logits tensor)."""
MAX_GROUP = 2**16
"""group_size."""
MAX_SAMPLED_TOKENS = 2**31
"""batch_size * group_size * max_new_tokens: the sampler holds a [rows, max_new_tokens] token buffer and a KV cache as long."""


def whole(lo: int, hi: Optional[int] = None) -> Callable[[Any], bool]:
    """An int (never a bool) in [lo, hi]."""
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and lo <= x and (hi is None or x <= hi)


def real(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], bool]:
    """A finite number (never a bool) between lo and hi; NaN and infinities fail every test."""

    def ok(x: Any) -> bool:
        if not (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)):
            return False
        return (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)

    return ok


def names_in(*names: str) -> Callable[[Any], bool]:
    """A list of `names`, or a comma-separated string of them; none or empty for no name."""
    return lambda v: all(
        isinstance(s, str) and s.strip() in ("", "none", *names)
        for s in (v.split(",") if isinstance(v, str) else v if isinstance(v, list) else [None])
    )


def holds_non_finite(value: Any, limit: int = 100_000) -> bool:
    """Whether a list, tuple, set or dict holds a NaN or infinite float anywhere (looking at most at `limit` values; the
    YAML bounds in config/io.py keep a setting far smaller)."""
    stack, seen = [value], 0
    while stack and seen < limit:
        item, seen = stack.pop(), seen + 1
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return False


def setting(default: Any, test: Callable[[Any], bool], rule: str, label: Optional[str] = None) -> Any:
    """A numeric field's default with its range: `test(value)` must hold (or the value be None where the default is), else
    the run is refused with "NAME must be RULE (got VALUE)". A float rule says "finite": NaN and inf are refused."""
    return dataclasses.field(default=default, metadata={"test": test, "rule": rule, "label": label or ""})


def range_checks(obj: Any) -> list[tuple[bool, str]]:
    """(passes, sentence) for every field of a settings dataclass that declares its range with `setting`."""
    out = []
    for f in dataclasses.fields(obj):
        if "test" in f.metadata:
            value = getattr(obj, f.name)
            label = f.metadata["label"] or f.name
            out.append(
                (
                    f.metadata["test"](value) or (value is None and f.default is None),
                    f"{label} must be {f.metadata['rule']} (got {value!r})",
                )
            )
    return out


def require(checks: list[tuple[bool, str]]) -> None:
    """Refuse the first failing check in one sentence: "Invalid setting: RULE." (the one loop every validate uses)."""
    for ok, msg in checks:
        if not ok:
            raise GcfError(f"Invalid setting: {msg}.")
