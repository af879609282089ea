"""GSM8K: grade-school maths word problems from the Hugging Face hub (needs the network or a local cache).

The row conversion, ``gsm8k_row``, is a pure function tested offline; only
``GSM8KTask.rows`` touches the hub, and a failure there is a GcfError that
points at the offline tasks.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.rewards.verifiable import _numeric_value, numeric_match
from gcfamily.tasks.base import Task, shuffled

INSTRUCTION = "Solve the problem step by step, then write the final answer on the last line as 'Answer: <number>'."
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's "<<48/2=24>>" calculator annotations


def gsm8k_row(example: dict) -> dict:
    """Turn a GSM8K example ``{"question", "answer": "...reasoning...\\n#### 72"}`` into a task row."""
    question, solution = example.get("question"), example.get("answer")
    if not isinstance(question, str) or not isinstance(solution, str) or "####" not in solution:
        raise GcfError("a GSM8K example lacks a 'question' or an 'answer' ending in '#### <number>'; check the data.")
    reasoning, final = solution.rsplit("####", 1)
    final = final.strip().replace(",", "")
    reasoning = _CALCULATOR.sub("", reasoning).strip()
    return {
        "prompt": f"{question.strip()}\n{INSTRUCTION}",
        "completion": f"{reasoning}\nAnswer: {final}",
        "answer": final,
    }


def _load_split(dataset: str, config: str | None, split: str) -> list[dict]:
    """The raw examples of one split; any failure becomes a GcfError naming the offline tasks."""
    try:
        from datasets import load_dataset  # imported here: datasets is slow to import and only this task needs it

        return list(load_dataset(dataset, config, split=split))
    except Exception as err:
        raise GcfError(
            f"could not load '{dataset}' from the Hugging Face hub ({type(err).__name__}); it needs network "
            "access or a local cache. Offline, use a built-in task: arithmetic, countdown or sorting."
        ) from None


class GSM8KTask(Task):
    """GSM8K word problems (official train/test splits); reward: ``numeric_match`` on the final number."""

    name = "gsm8k"
    description = "Grade-school maths word problems (openai/gsm8k; needs the hub or a local cache)."

    def __init__(self, seed: int = 0, dataset: str = "openai/gsm8k", config: str | None = "main") -> None:
        super().__init__(seed)
        self.dataset, self.config = dataset, config
        self._splits: dict[str, list[dict]] = {}

    def split_rows(self, split: str) -> list[dict]:
        """Every row of the dataset's own ``split`` (already disjoint upstream), in seeded order; loaded once."""
        if split not in self._splits:
            rows = [gsm8k_row(example) for example in _load_split(self.dataset, self.config, split)]
            self._splits[split] = shuffled(rows, self.name, self.seed, split)
        return self._splits[split]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """1.0 where the completion's final number equals the ``answer`` column."""
        return numeric_match(prompts, completions, **columns)

    def answer(self, completion: str) -> Hashable | None:
        """The number ``numeric_match`` reads (a float: "12" and "12.0" vote together); None where it reads none.

        The reward depends on the completion only through this number, so equal answers score alike. Two numbers
        equal within the reward's 1e-6 relative tolerance but not exactly equal vote apart.
        """
        return _numeric_value(completion)
