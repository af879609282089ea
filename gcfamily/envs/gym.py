"""reasoning-gym's tasks as environments, verified by their own scorers (the optional extra `gym`: pip install
reasoning-gym).

A row of the `reasoning-gym` task (gcfamily/tasks/gym.py) carries its gym entry (question, answer, metadata) as JSON in
the `entry` column. The policy's answer is what follows its last "Answer:" (else its last line), scored by the gym's
own `score_answer` for that entry's dataset (1.0 right, partial credit where the gym gives it). With `tries` > 1 the
episode is multi-turn: a wrong answer is told so and the policy tries again, up to `tries` turns; the final reward is
the last answer's score.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from gcfamily.envs.base import Environment, Step
from gcfamily.errors import GcfError

INSTRUCTION = "Give your final answer on a last line as 'Answer: <answer>'."


def gym_module() -> Any:
    """The reasoning_gym package, or one sentence saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise GcfError(
            "reasoning-gym tasks need the reasoning-gym package; install it with pip install reasoning-gym "
            "(or gcfamily[gym])."
        ) from None
    return reasoning_gym


def extract_answer(text: str) -> str:
    """The answer a completion gives: what follows its last 'Answer:', else its last non-empty line."""
    at = text.rfind("Answer:")
    if at >= 0:
        return text[at + len("Answer:") :].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def scorer(entry: dict[str, Any]) -> Callable[[str, dict[str, Any]], float]:
    """The gym's score_answer for the entry's dataset."""
    return gym_module().get_score_answer_fn(entry["metadata"]["source_dataset"])


def score(completion: str, entry_json: str) -> float:
    """The gym's score of a completion's answer on the entry (JSON, as the row carries it)."""
    entry = json.loads(entry_json)
    return float(scorer(entry)(extract_answer(completion), entry))


class ReasoningGymEnv(Environment):
    """A reasoning-gym entry as an episode: answer, be told whether it is right, try again (module docstring)."""

    role = "user"

    def __init__(self, row: dict[str, Any], tries: int = 1) -> None:
        super().__init__(row)
        if not (isinstance(tries, int) and tries >= 1):
            raise ValueError(f"tries={tries!r} must be an integer >= 1")
        self.entry_json, self.tries, self.turns, self.last = row["entry"], tries, 0, 0.0

    def step(self, turn: str) -> Step:
        self.turns += 1
        self.last = score(turn, self.entry_json)
        if self.last >= 1.0 or self.turns >= self.tries:
            return Step(done=True)
        return Step("That is not right. Check your work and try again. " + INSTRUCTION)

    def reward(self) -> Optional[float]:
        return self.last
