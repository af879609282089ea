"""The environment API: what a multi-turn episode's world implements (torch-free: it runs in the worker process too).

An environment is created for each episode from its dataset row, answers each policy turn, and gives a final reward:

    class Guess(Environment):
        role = "user"                              # the chat role of what the environment says
        def __init__(self, row):                   # one per episode, from the row's columns
            self.secret, self.turns = int(row["answer"]), 0
        def step(self, turn):                      # the policy's turn as text
            self.turns += 1
            said = last_number(turn)
            if said == self.secret:
                return Step(done=True)             # no observation: the episode ends here
            return Step("Higher." if said < self.secret else "Lower.")
        def reward(self):                          # the final reward; None: the run's reward scores the last turn
            return 1.0 / self.turns if self.solved else 0.0

`step` may return a `Step`, or a tuple (observation, reward, done) as a gym environment does; anything else fails the
episode. A step's reward is a process-supervision step on the last token of that turn (methods that read steps, such as
grpo-ps, train on it); for every other method the episode's reward is its final reward plus the sum of its step rewards.
Class attributes describe the environment to the run (read once, in the worker): `role`, `system` (instructions for
the system prompt, where the run sets none), `tools` (JSON schemas for chat templates that render tools), `stop`
(strings that end a policy turn, such as the end of a tool call) and `max_turns` (a cap of its own).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Optional


@dataclass
class Step:
    """What the environment answers to one policy turn."""

    observation: Optional[str] = None
    """Text the policy sees before its next turn (a tool's result, a game's state, a user's reply); None or "": none."""
    reward: Optional[float] = None
    """This turn's step reward (process supervision), or None."""
    done: bool = False
    """True: the episode ends after this turn (an observation given with it is not shown)."""


class Environment:
    """One episode's world (module docstring): subclass, write `__init__(row)`, `step(turn)` and maybe `reward()`."""

    role: ClassVar[str] = "tool"
    """The chat role the observations are rendered with ("tool" for a tool's output, "user" for a dialogue)."""
    system: ClassVar[Optional[str]] = None
    """Instructions for the system prompt (used where the run's system_prompt is not set)."""
    tools: ClassVar[Optional[list[dict[str, Any]]]] = None
    """JSON schemas of the tools, passed to chat templates that render them (tools=...)."""
    stop: ClassVar[tuple[str, ...]] = ()
    """Strings that end a policy turn when written (the end of a tool call), besides the run's stop_strings."""
    max_turns: ClassVar[Optional[int]] = None
    """The most policy turns an episode of this environment takes; None: the run's max_turns."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row

    def step(self, turn: str) -> Any:
        """The environment's answer to the policy's turn: a Step, or (observation, reward, done)."""
        raise NotImplementedError(f"{type(self).__name__} must define step(turn)")

    def reward(self) -> Optional[float]:
        """The episode's final reward; None: the run's reward (the task's, or --reward) scores the last policy turn."""
        return None


class BadAnswer(ValueError):
    """An environment's answer that is not one (a wrong type, a NaN reward): its episode fails with this sentence."""


DESCRIPTION = ("role", "system", "tools", "stop", "max_turns")
"""The class attributes the worker reads once and sends to the run."""


def describe(cls: type) -> dict[str, Any]:
    """The class's description for the run; a wrong type is the user's one-sentence error (ValueError here)."""
    out = {k: getattr(cls, k, getattr(Environment, k)) for k in DESCRIPTION}
    if not isinstance(out["role"], str) or not out["role"]:
        raise ValueError(f"role must be a non-empty string (got {out['role']!r})")
    if out["system"] is not None and not isinstance(out["system"], str):
        raise ValueError(f"system must be a string or None (got {type(out['system']).__name__})")
    if isinstance(out["stop"], str) or not all(isinstance(s, str) and s for s in out["stop"]):
        raise ValueError(f"stop must be a tuple of non-empty strings (got {out['stop']!r})")
    out["stop"] = tuple(out["stop"])
    if out["max_turns"] is not None and not (isinstance(out["max_turns"], int) and out["max_turns"] >= 1):
        raise ValueError(f"max_turns must be an integer >= 1 or None (got {out['max_turns']!r})")
    if out["tools"] is not None and not (
        isinstance(out["tools"], list) and all(isinstance(t, dict) for t in out["tools"])
    ):
        raise ValueError("tools must be a list of JSON-schema dicts or None")
    return out


def as_step(value: Any) -> Step:
    """A step's answer as a Step; ValueError (the episode fails) for anything that is not one."""
    if isinstance(value, Step):
        step = Step(value.observation, value.reward, value.done)
    elif isinstance(value, tuple) and len(value) == 3:
        step = Step(*value)
    else:
        raise BadAnswer(f"step returned a {type(value).__name__}, not a Step or (observation, reward, done)")
    if step.observation is not None and not isinstance(step.observation, str):
        raise BadAnswer(f"step returned an observation of type {type(step.observation).__name__}, not a string")
    step.reward = reward_value(step.reward, "step returned a reward that")
    if not isinstance(step.done, (bool, numbers.Integral)):
        raise BadAnswer(f"step returned done of type {type(step.done).__name__}, not a bool")
    step.done = bool(step.done)
    return step


def reward_value(value: Any, what: str) -> Optional[float]:
    """A reward as a finite float or None; ValueError for anything else (a string, NaN, an infinity)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if hasattr(value, "item"):  # a one-element array or tensor
            return reward_value(value.item(), what)
        raise BadAnswer(f"{what} is a {type(value).__name__}, not a number")
    v = float(value)
    if not math.isfinite(v):
        raise BadAnswer(f"{what} is {v}, not a finite number")
    return v
