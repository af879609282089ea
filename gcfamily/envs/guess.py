"""A guessing game whose reward depends on every turn: find the secret number, told "higher" or "lower" each time.

Each episode's secret is its row's `answer` (the `guess` task's rows); the policy's turn is read for its last integer.
The episode ends when the guess is right (reward 1 / turns taken: the fewer turns, the more reward), or at the run's
max_turns (reward 0). A turn with no number is told so and counts as a turn.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from gcfamily.envs.base import Environment, Step

_INT = re.compile(r"-?\d{1,12}")


class GuessNumber(Environment):
    """Binary search by dialogue (module docstring)."""

    role = "user"

    def __init__(self, row: dict[str, Any]) -> None:
        super().__init__(row)
        self.secret = int(row["answer"])
        self.turns = 0
        self.found = False

    def step(self, turn: str) -> Step:
        self.turns += 1
        numbers = _INT.findall(turn)
        if not numbers:
            return Step("Say one number.")
        guess = int(numbers[-1])
        if guess == self.secret:
            self.found = True
            return Step(done=True)
        return Step("Higher." if guess < self.secret else "Lower.")

    def reward(self) -> Optional[float]:
        return 1.0 / self.turns if self.found else 0.0
