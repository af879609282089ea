"""reasoning-gym's procedural datasets as a task (the optional extra `gym`), scored by the gym's own verifiers.

    gcf run --method grpo --task reasoning-gym --set task_options="{dataset: basic_arithmetic}"

`dataset` is any name reasoning_gym.create_dataset knows, `config` its own keyword arguments (difficulty and so on),
`size` the problems drawn (seeded by the run's task seed), split into train and test by a stable hash of the question.
Each row keeps its gym entry as JSON in the `entry` column, which the reward and the `reasoning-gym` environment read.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any, Optional

from gcfamily.envs.gym import INSTRUCTION, extract_answer, gym_module, score
from gcfamily.errors import GcfError
from gcfamily.rewards.verifiable import require_column
from gcfamily.tasks.base import Task, check_fraction, hash_split


def gym_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """The gym's own score of each completion's answer on its row's entry."""
    entries = require_column(columns, "entry", "reasoning-gym", len(completions))
    return [score(str(c), str(e)) for c, e in zip(completions, entries)]


class ReasoningGymTask(Task):
    """One reasoning-gym dataset (module docstring)."""

    name = "reasoning-gym"
    description = "A reasoning-gym dataset (needs reasoning-gym): {dataset: NAME, size: N, config: {...}}."

    def __init__(
        self,
        seed: int = 0,
        dataset: str = "basic_arithmetic",
        size: int = 500,
        config: Optional[dict] = None,
        test_fraction: float = 0.2,
    ) -> None:
        super().__init__(seed)
        rg = gym_module()
        check_fraction(test_fraction)
        if not (isinstance(size, int) and size >= 2):
            raise GcfError(f"reasoning-gym size={size!r} must be an integer >= 2.")
        self.dataset = dataset
        try:
            data = rg.create_dataset(dataset, size=size, seed=seed, **(config or {}))
        except Exception as e:  # an unknown name or option: the gym's own reason
            raise GcfError(f"reasoning-gym could not make dataset {dataset!r} ({str(e)[:160]}).") from None
        entries = [data[i] for i in range(size)]
        self._splits = hash_split(entries, lambda e: e["question"], self._row, test_fraction, self.name, dataset, seed)

    @staticmethod
    def _row(entry: dict[str, Any]) -> dict:
        return {
            "prompt": f"{entry['question']}\n{INSTRUCTION}",
            "completion": f"Answer: {entry['answer']}",
            "answer": str(entry["answer"]),
            "entry": json.dumps(entry, default=str),
        }

    def split_rows(self, split: str) -> list[dict]:
        return self._splits[split]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return gym_reward(prompts, completions, **columns)

    def answer(self, completion: str) -> Hashable | None:
        return extract_answer(completion) or None

    def __repr__(self) -> str:
        return f"ReasoningGymTask(seed={self.seed}, dataset={self.dataset!r})"
