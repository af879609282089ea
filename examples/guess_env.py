"""A user's environment (docs/environments.md): a number-guessing game told "higher" or "lower" after each guess.

gcf run --method grpo --model smollm2-135m --task guess --env examples/guess_env.py:Higher --max-steps 2
"""

from __future__ import annotations

import re

from gcfamily.envs import Environment, Step


class Higher(Environment):
    role = "user"  # the game speaks as the user: a dialogue, not a tool

    def __init__(self, row: dict) -> None:  # one per episode, from the dataset row
        super().__init__(row)
        self.secret, self.turns, self.found = int(row["answer"]), 0, False

    def step(self, turn: str) -> Step:  # the policy's turn as text
        self.turns += 1
        numbers = re.findall(r"-?\d+", turn)
        if not numbers:
            return Step("Say one number.", reward=-0.1)  # a step reward on this turn's last token
        guess = int(numbers[-1])
        if guess == self.secret:
            self.found = True
            return Step(done=True)
        return Step("Higher." if guess < self.secret else "Lower.")

    def reward(self) -> float:  # the final reward; None would let the task's reward score the last turn
        return 1.0 / self.turns if self.found else 0.0
