"""The built-in environments by name (torch-free: the worker reads it): `--env calculator` is `--env` of its spec."""

from __future__ import annotations

BUILTIN: dict[str, str] = {
    "calculator": "gcfamily.envs.calculator:Calculator",
    "guess": "gcfamily.envs.guess:GuessNumber",
    "reasoning-gym": "gcfamily.envs.gym:ReasoningGymEnv",
}
"""name -> module:Class of each built-in environment (docs/environments.md describes each)."""
