"""Sorting: put a short list of integers in ascending order."""

from __future__ import annotations

import random
import re
from collections.abc import Hashable
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.rewards.verifiable import require_column
from gcfamily.tasks.base import Task, check_fraction, generate_problems, hash_split

# An optional minus not glued to a digit ("1-3" is 1 and -3 either way), then digits.
_INT = re.compile(r"-?[0-9]+")
_MAX_DIGITS = 30  # int() of a huge digit run is slow (and capped by Python); no answer here is that long


def parse_ints(text: str) -> list[int | None]:
    """Every integer in the text, in order; an absurdly long digit run becomes None (never equal to anything)."""
    return [int(t) if len(t) <= _MAX_DIGITS else None for t in _INT.findall(text)]


def _credit(got: list[int | None], want: list[int | None], partial: bool) -> float:
    if got == want:
        return 1.0
    if not partial or not got:
        return 0.0
    # Partial credit: the share of positions right, over the longer of the two lists.
    return sum(g == w for g, w in zip(got, want)) / max(len(got), len(want))


def sorting_reward(prompts: list[str], completions: list[str], partial: bool = False, **columns: Any) -> list[float]:
    """1.0 where the integers in the completion are exactly the ``answer`` list (the sorted input)."""
    refs = require_column(columns, "answer", "sorting", len(completions))
    return [_credit(parse_ints(c), parse_ints(str(ref)), partial) for c, ref in zip(completions, refs)]


def sorting_partial_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """``sorting_reward`` with partial credit: the share of positions holding the right number."""
    return sorting_reward(prompts, completions, partial=True, **columns)


def _make_problem(rng: random.Random, min_len: int, max_len: int, max_value: int) -> list[int]:
    return [rng.randint(0, max_value) for _ in range(rng.randint(min_len, max_len))]


def _row(values: list[int]) -> dict:
    answer = ", ".join(map(str, sorted(values)))
    return {
        "prompt": (
            f"Sort these numbers in ascending order: {', '.join(map(str, values))}. "
            "Reply with just the sorted numbers, separated by commas."
        ),
        "completion": answer,
        "answer": answer,
    }


class SortingTask(Task):
    """Sort a short list of integers; reward: exact sorted order (``partial=True`` for per-position credit).

    The problems are fixed by the options, the same for every seed; ``seed`` orders them.
    ``size`` is the number of distinct problems drawn, about ``test_fraction`` of them for test.
    """

    name = "sorting"
    description = "Sort a short list of integers in ascending order."

    def __init__(
        self,
        seed: int = 0,
        size: int = 5000,
        min_len: int = 3,
        max_len: int = 6,
        max_value: int = 99,
        partial: bool = False,
        test_fraction: float = 0.2,
    ) -> None:
        super().__init__(seed)
        if not (1 <= min_len <= max_len and max_value >= 1 and size >= 1):
            raise GcfError("sorting options need 1 <= min_len <= max_len, max_value >= 1 and size >= 1; fix them.")
        check_fraction(test_fraction)
        self.partial = partial
        # The sorted multiset is the problem: "3, 1, 2" is never tested while "2, 1, 3" is trained on.
        key = lambda values: ("sorting", tuple(sorted(values)))  # noqa: E731
        make = lambda rng: _make_problem(rng, min_len, max_len, max_value)  # noqa: E731
        problems = generate_problems(make, key, size, f"sorting/{min_len}/{max_len}/{max_value}")
        self._splits = hash_split(problems, key, _row, test_fraction, self.name, seed)

    def split_rows(self, split: str) -> list[dict]:
        """Every row of ``split``, in seeded order."""
        return self._splits[split]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """1.0 on the exact sorted list; per-position partial credit when the task has ``partial=True``."""
        return sorting_reward(prompts, completions, partial=self.partial, **columns)

    def answer(self, completion: str) -> Hashable | None:
        """The integers the reward reads, as a tuple; None where there are none or one is an over-long digit run.

        The reward depends on the completion only through ``parse_ints``, so equal tuples score alike (with
        ``partial=True`` too; Maj@K counts only a full score as right). An over-long run (more than 30 digits) reads
        as None, which would make two different huge numbers one answer: such a completion does not vote instead
        (it scores 0 unless the reference holds such a run too, i.e. max_value >= 10**30).
        """
        got = parse_ints(completion)
        return tuple(got) if got and None not in got else None
