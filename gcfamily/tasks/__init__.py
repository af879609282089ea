"""Built-in tasks: offline problem generators with references and rewards (plus GSM8K from the hub).

base.py                 Task, what every task gives: train and held-out rows, a reward
registry.py             TASKS, the table of built-in tasks by name, and get_task
arithmetic.py, countdown.py, sorting.py, chained.py, gsm8k.py   one task each, with its rewards
"""

from __future__ import annotations

from gcfamily.tasks.arithmetic import ArithmeticTask
from gcfamily.tasks.base import Task
from gcfamily.tasks.chained import ChainedTask, chained_process_reward, chained_reward
from gcfamily.tasks.countdown import CountdownTask, countdown_reward, parse_expression
from gcfamily.tasks.gsm8k import GSM8KTask, gsm8k_row
from gcfamily.tasks.registry import DEFAULT_TASK, TASKS, get_task, task_options
from gcfamily.tasks.sorting import SortingTask, sorting_partial_reward, sorting_reward

__all__ = [
    "DEFAULT_TASK",
    "TASKS",
    "ArithmeticTask",
    "ChainedTask",
    "CountdownTask",
    "GSM8KTask",
    "SortingTask",
    "Task",
    "chained_process_reward",
    "chained_reward",
    "countdown_reward",
    "get_task",
    "gsm8k_row",
    "parse_expression",
    "sorting_partial_reward",
    "sorting_reward",
    "task_options",
]
