"""Guess the number: the prompts of the `guess` environment's game (gcfamily/envs/guess.py).

Each row's secret is a number in [1, max_value]; the prompt says the range and the rules. Alone (one turn) the task's
reward is 1.0 where the completion's last integer is the secret; with `--env guess` the environment answers
"higher" / "lower" and its own reward (1 / turns taken) is the episode's.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.rewards.verifiable import require_column
from gcfamily.tasks.base import Task, check_fraction, hash_split

_INT = re.compile(r"-?\d{1,12}")


def _last_int(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def guess_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 where the completion's last integer is the ``answer`` column."""
    refs = require_column(columns, "answer", "guess", len(completions))
    return [float(_last_int(str(c)) == int(ref)) for c, ref in zip(completions, refs)]


class GuessTask(Task):
    """Find a secret number in [1, max_value] (module docstring)."""

    name = "guess"
    description = "Guess a secret number in [1, N]; with --env guess, told higher or lower after each guess."

    def __init__(self, seed: int = 0, max_value: int = 20, copies: int = 40, test_fraction: float = 0.2) -> None:
        super().__init__(seed)
        if not (isinstance(max_value, int) and 2 <= max_value <= 10**6):
            raise GcfError(f"guess max_value={max_value!r} must be an integer in [2, 1000000].")
        if not (isinstance(copies, int) and copies >= 1):
            raise GcfError(f"guess copies={copies!r} must be an integer >= 1.")
        check_fraction(test_fraction)
        self.max_value = max_value
        # a problem is (secret, phrasing): the split is by problem, so held-out prompts are worded apart from training
        problems = [(s, k) for s in range(1, max_value + 1) for k in range(copies)]
        self._splits = hash_split(problems, lambda p: p, self._row, test_fraction, self.name, seed, max_value)

    def _row(self, problem: tuple[int, int]) -> dict:
        secret, k = problem
        return {
            "prompt": (
                f"I am thinking of a whole number from 1 to {self.max_value} (game {k}). Guess it: reply with one number. "
                "After each guess I say 'Higher.' or 'Lower.' until you find it."
            ),
            "completion": str(secret),
            "answer": str(secret),
        }

    def split_rows(self, split: str) -> list[dict]:
        return self._splits[split]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return guess_reward(prompts, completions, **columns)

    def answer(self, completion: str) -> Hashable | None:
        return _last_int(completion)
