"""Arithmetic: single operations on small integers, the default offline task.

A 135M instruct model answers about 90% of single-digit sums, 77% of
single-digit products and 19% of two-digit sums greedily, so the default
"mixed" level starts well above zero reward yet leaves room to improve.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.rewards.verifiable import _numeric_value, numeric_match
from gcfamily.tasks.base import SPLITS, Task, check_fraction, check_split, lowest_hash_keys, shuffled

# level -> (operator, operand range); each space is every ordered pair.
LEVELS: dict[str, tuple[str, range]] = {
    "1d-add": ("+", range(10)),
    "1d-mul": ("*", range(10)),
    "2d-add": ("+", range(10, 100)),
}
_APPLY = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


def _level_problems(level: str) -> list[dict]:
    """Every problem of a level, as rows, in a fixed order."""
    op, operands = LEVELS[level]
    rows = []
    for a in operands:
        for b in operands:
            result = str(_APPLY[op](a, b))
            rows.append(
                {
                    "prompt": f"What is {a} {op} {b}? Reply with just the number.",
                    "completion": result,
                    "answer": result,
                    "level": level,
                    # Both orders of a pair share a key, so "3 + 5" is never
                    # trained on while "5 + 3" is tested.
                    "_key": ("arithmetic", op, min(a, b), max(a, b)),
                }
            )
    return rows


def _without_key(problem: dict) -> dict:
    return {k: v for k, v in problem.items() if k != "_key"}


class ArithmeticTask(Task):
    """Single +/* operations on small integers; reward: the number matches (``numeric_match``)."""

    name = "arithmetic"
    description = "What is a + b / a * b? Levels: 1d-add, 1d-mul, 2d-add, mixed (default)."

    def __init__(self, seed: int = 0, level: str = "mixed", test_fraction: float = 0.2) -> None:
        super().__init__(seed)
        if level != "mixed" and level not in LEVELS:
            raise GcfError(f"unknown arithmetic level '{level}'; use one of mixed, {', '.join(LEVELS)}.")
        check_fraction(test_fraction)
        self.level = level
        self.levels = list(LEVELS) if level == "mixed" else [level]
        # level -> split -> rows in seeded order
        self._rows: dict[str, dict[str, list[dict]]] = {}
        for lvl in self.levels:
            problems = _level_problems(lvl)
            test = lowest_hash_keys([p["_key"] for p in problems], test_fraction)
            self._rows[lvl] = {}
            for split in SPLITS:
                chosen = [_without_key(p) for p in problems if (p["_key"] in test) == (split == "test")]
                self._rows[lvl][split] = shuffled(chosen, self.name, seed, lvl, split)

    def rows(self, split: str, n: int | None = None) -> list[dict]:
        """Rows of ``split``; with several levels they take turns, one row each.

        Each level cycles through its own rows, so ``n=None`` gives every level
        an equal share (as many rows as the smallest level has) and a larger
        ``n`` keeps adding fresh problems from the big levels.
        """
        check_split(split, n)
        per_level = [self._rows[lvl][split] for lvl in self.levels]
        L = len(per_level)
        if n is None:
            n = L * min(len(rows) for rows in per_level)
        return [dict(per_level[i % L][(i // L) % len(per_level[i % L])]) for i in range(n)]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """1.0 where the completion's final number equals the ``answer`` column."""
        return numeric_match(prompts, completions, **columns)

    def answer(self, completion: str) -> Hashable | None:
        """The number ``numeric_match`` reads (a float: "12" and "12.0" vote together); None where it reads none.

        The reward depends on the completion only through this number, so equal answers score alike. Two numbers
        equal within the reward's 1e-6 relative tolerance but not exactly equal vote apart.
        """
        return _numeric_value(completion)

    def __repr__(self) -> str:
        return f"ArithmeticTask(seed={self.seed}, level={self.level!r})"
