"""Environments: the worlds a multi-turn episode's policy turns are answered by (docs/environments.md).

    base.py         the API a user's environment implements: Environment, Step (torch-free)
    registry.py     the built-in environments by name (BUILTIN)
    serve.py        the worker's side: loading a class, one instance per episode, each call under a timer
    worker.py       the run's side: the worker process (EnvWorker) or, for a class passed from Python, this process
    calculator.py   a calculator tool for the chained task
    guess.py        a guessing game whose reward depends on every turn
    gym.py          reasoning-gym's tasks, verified by their own scorers (the optional extra `gym`)

This face imports no torch, so a user's environment file (`from gcfamily.envs import Environment, Step`) loads in
the worker process in a bare interpreter's time.
"""

from __future__ import annotations

from gcfamily.envs.base import Environment, Step
from gcfamily.envs.registry import BUILTIN

__all__ = ["BUILTIN", "Environment", "Step"]
