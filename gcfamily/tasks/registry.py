"""The task table and the one way to build a task by name: TASKS, task_options, get_task."""

from __future__ import annotations

import inspect
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.tasks.arithmetic import ArithmeticTask
from gcfamily.tasks.base import Task
from gcfamily.tasks.chained import ChainedTask
from gcfamily.tasks.countdown import CountdownTask
from gcfamily.tasks.gsm8k import GSM8KTask
from gcfamily.tasks.sorting import SortingTask

DEFAULT_TASK = "arithmetic"

TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "sorting": SortingTask,
    "chained": ChainedTask,
    "gsm8k": GSM8KTask,
}


def task_options(name: str) -> list[str]:
    """The option names a task accepts (its constructor's keywords besides ``seed``)."""
    params = inspect.signature(TASKS[name].__init__).parameters
    return [p for p in params if p not in ("self", "seed")]


def get_task(name: str, seed: int = 0, **options: Any) -> Task:
    """Build the task called ``name``; unknown names or options raise GcfError listing what exists."""
    if name not in TASKS:
        raise GcfError(f"unknown task '{name}'; choose one of {', '.join(TASKS)}.")
    known = task_options(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        listed = ", ".join(map(repr, unknown))
        raise GcfError(f"task '{name}' has no option {listed}; its options are {', '.join(known)}.")
    try:
        return TASKS[name](seed=seed, **options)
    # an option of the wrong type ("3" for a number) fails inside the task's checks
    except (
        TypeError,
        ValueError,
    ) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise GcfError(
            f"task '{name}' cannot take the options {given} ({e}); give numbers as numbers, e.g. {{min_len: 2}}."
        ) from e
