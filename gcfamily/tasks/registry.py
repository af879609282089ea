"""The task table and the one way to build a task by name: TASKS, task_options, get_task."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.rewards.calling import _import_file
from gcfamily.tasks.arithmetic import ArithmeticTask
from gcfamily.tasks.base import Task
from gcfamily.tasks.chained import ChainedTask
from gcfamily.tasks.countdown import CountdownTask
from gcfamily.tasks.gsm8k import GSM8KTask
from gcfamily.tasks.guess import GuessTask
from gcfamily.tasks.gym import ReasoningGymTask
from gcfamily.tasks.sorting import SortingTask

DEFAULT_TASK = "arithmetic"

TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "sorting": SortingTask,
    "chained": ChainedTask,
    "gsm8k": GSM8KTask,
    "guess": GuessTask,
    "reasoning-gym": ReasoningGymTask,
}


def task_options(name: str | type[Task]) -> list[str]:
    """The option names a task accepts (its constructor's keywords besides ``seed``)."""
    params = inspect.signature((TASKS[name] if isinstance(name, str) else name).__init__).parameters
    return [p for p in params if p not in ("self", "seed")]


def task_class(name: str) -> type[Task]:
    """The task class `name` names: a built-in name, `module:Class` or `path/file.py:Class` (a Task subclass)."""
    if name in TASKS:
        return TASKS[name]
    where, _, attr = name.rpartition(":")
    if not where or not attr:
        raise GcfError(
            f"unknown task '{name}'; choose one of {', '.join(TASKS)}, or give module:Class or file.py:Class."
        )
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(Path(where), None, "task")
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise GcfError(
                f"could not import task module '{where}' ({type(e).__name__}: {e}); install it or pass its .py file."
            ) from None
    cls = getattr(module, attr, None)
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        raise GcfError(f"'{name}' is not a subclass of gcfamily.tasks.Task; subclass it (split_rows and reward).")
    return cls


def get_task(name: str, seed: int = 0, **options: Any) -> Task:
    """Build the task called ``name`` (task_class); unknown names or options raise GcfError listing what exists."""
    cls = task_class(name)
    known = task_options(cls)
    unknown = sorted(set(options) - set(known))
    if unknown:
        listed = ", ".join(map(repr, unknown))
        raise GcfError(f"task '{name}' has no option {listed}; its options are {', '.join(known)}.")
    try:
        return cls(seed=seed, **options)
    # an option of the wrong type ("3" for a number) fails inside the task's checks
    except (
        TypeError,
        ValueError,
    ) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise GcfError(
            f"task '{name}' cannot take the options {given} ({e}); give numbers as numbers, e.g. {{min_len: 2}}."
        ) from e
