"""The run's side of the environments: one worker process per run (or this process, for a class passed from Python).

    envs = open_envs("calculator", options={}, timeout=10.0)   # starts the worker and loads the class
    envs.description                       # role, system, tools, stop, max_turns (envs/base.py)
    errors = envs.open({eid: row, ...})     # one environment per episode; {eid: why} for those that failed
    answers, errors = envs.step({eid: turn_text, ...})     # {eid: (observation, reward, done)}
    finals, errors = envs.final([eid, ...])                # {eid: final reward or None}, closing them
    envs.close()

An environment given as a spec (a built-in name, module:Class, file.py:Class) runs in a worker process (the reward
worker's machinery, gcfamily/rewards/guard.py): each call on an episode has env_timeout seconds (serve.py's timer), and
a worker that stops answering (a hang in C code, a crash, os._exit) is killed after env_timeout times the call's
episodes plus POLL_GRACE_S; the episodes it held fail, with the reason, and a fresh worker takes the next call. A class
object passed from Python (gcfamily.train(env=MyEnv)) runs in this process, where its exceptions fail its episode but
no timer runs (a Python class defined in a script cannot be imported by a worker).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from gcfamily.envs import serve
from gcfamily.errors import GcfError
from gcfamily.rewards.guard import RewardWorker

POLL_GRACE_S = 5.0
"""Seconds a worker may take beyond its episodes' timers before it is taken for hung and killed."""


class EnvWorker(RewardWorker):
    """The worker process, serving envs/serve.py."""

    served = str(Path(serve.__file__).resolve())
    what = "environment"
    timeout_name = "env_timeout"

    def __init__(self, spec: str, options: dict[str, Any], timeout: float) -> None:
        self.spec_options = (spec, dict(options))
        super().__init__([spec], timeout)

    def load_message(self) -> tuple:
        spec, options = self.spec_options
        return ("load", spec, options, self.timeout)

    def request(self, message: tuple, n: int, should_stop: Optional[Callable[[], bool]] = None) -> tuple:
        """The worker's reply to `message` about n episodes: ("ok", answers, errors), ("gcf_error", why), or
        ("lost", why) when the worker crashed, hung past its grace or was stopped (it is then killed)."""
        if self.proc is None and not self.start(should_stop):
            return ("lost", "was abandoned because the run is stopping")
        deadline = time.monotonic() + self.timeout * max(n, 1) + POLL_GRACE_S if self.timeout > 0 else None
        reply = self._send(message, deadline, should_stop)
        ok = reply[0] == "ok" and len(reply) == 3 and isinstance(reply[1], dict) and isinstance(reply[2], dict)
        if ok or reply[0] == "gcf_error":
            return reply
        self._kill()  # hung, crashed, stopping or garbled: the next call gets a fresh process
        return (
            "lost",
            reply[1] if len(reply) == 2 and isinstance(reply[1], str) else "sent a reply of the wrong shape",
        )


class Envs:
    """The run's environments (module docstring): a worker's, or this process's for a class passed from Python."""

    def __init__(self, env: Any, options: Optional[dict[str, Any]] = None, timeout: float = 10.0) -> None:
        self.options = dict(options or {})
        self.worker: Optional[EnvWorker] = None
        self.local: Optional[dict[str, Any]] = None
        self.lost_episodes = 0  # episodes failed because the worker was lost (counted for the step's metrics)
        if isinstance(env, str):
            self.name = env
            self.worker = EnvWorker(env, self.options, timeout)
            self.description: dict[str, Any] = self.worker.loaded[1]
        else:
            if not (isinstance(env, type) and issubclass(env, serve.Environment)):
                raise GcfError(
                    f"env must be a built-in name, module:Class, file.py:Class or an Environment subclass (got {type(env).__name__})."
                )
            self.name = env.__name__
            self.local = {"episodes": serve.Episodes(env, self.options, 0.0)}
            self.description = serve.checked_description(env, env.__name__)

    def _ask(self, message: tuple, eids: list[int], should_stop: Optional[Callable[[], bool]]) -> tuple[dict, dict]:
        if self.local is not None:
            reply = serve.answer(self.local, message)
        else:
            assert self.worker is not None
            reply = self.worker.request(message, len(eids), should_stop)
        if reply[0] == "gcf_error":
            raise GcfError(reply[1])
        if reply[0] != "ok":  # the worker was lost: every episode it held fails (a fresh one has none of them)
            self.lost_episodes += len(eids)
            return {}, {e: f"the environment worker {reply[1]}" for e in eids}
        return reply[1], reply[2]

    def open(self, rows: dict[int, dict[str, Any]], should_stop: Optional[Callable[[], bool]] = None) -> dict[int, str]:
        return self._ask(("open", rows), list(rows), should_stop)[1]

    def step(self, turns: dict[int, str], should_stop: Optional[Callable[[], bool]] = None) -> tuple[dict, dict]:
        return self._ask(("step", turns), list(turns), should_stop)

    def final(self, eids: list[int], should_stop: Optional[Callable[[], bool]] = None) -> tuple[dict, dict]:
        return self._ask(("final", list(eids)), list(eids), should_stop)

    def drop(self, eids: list[int]) -> None:
        if eids:
            self._ask(("drop", list(eids)), list(eids), None)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def open_envs(env: Any, options: Optional[dict[str, Any]] = None, timeout: float = 10.0) -> Envs:
    """The run's environments (`env`: a built-in name, module:Class, file.py:Class, or an Environment subclass)."""
    return Envs(env, options, timeout)
