"""The environment worker's side: load an environment class, hold one instance per episode, answer its turns.

Loaded by path in a fresh interpreter (gcfamily/envs/worker.py starts it), so it imports neither torch nor the rest of
gcfamily beyond the torch-free envs/base.py, envs/registry.py and rewards/calling.py. Every call on an episode runs under
a timer of env_timeout seconds (SIGALRM, this process's main thread): an environment that raises, hangs in Python code
or returns garbage fails that episode only, with the reason, and the others go on. A hang the timer cannot interrupt
(inside C code) is the trainer's to end: it kills this process, and the episodes it held fail.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from gcfamily.envs.base import BadAnswer, Environment, as_step, describe, reward_value
from gcfamily.envs.registry import BUILTIN
from gcfamily.errors import GcfError


def _load_calling() -> Any:
    """rewards/calling.py by path, as the reward worker loads it: importing it as gcfamily.rewards.calling would run
    that package's face, which imports torch (seconds), and this process needs two small functions of it."""
    name = "gcf_env_worker_calling"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / "rewards" / "calling.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


shorten = _load_calling().shorten


class EpisodeTimeout(BaseException):
    """The timer of one episode's call ran out (a BaseException: an environment's `except Exception` cannot hide it)."""


def load_env_class(spec: str) -> type:
    """The Environment subclass that `spec` names: a built-in name, `module:Class` or `path/file.py:Class`."""
    spec = BUILTIN.get(spec, spec)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise GcfError(
            f"environment '{spec}' is neither a built-in ({', '.join(sorted(BUILTIN))}) nor of the form module:Class; "
            "write e.g. my_env.py:MyEnv."
        )
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        module = _load_calling()._import_file(Path(module_name), None, "environment")
    else:
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit) as err:
            raise GcfError(
                f"could not import environment module '{module_name}' ({type(err).__name__}: {err}); "
                "install it or pass the path to its .py file instead."
            ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise GcfError(f"environment module '{module_name}' has no attribute '{attr}'; check the class name.")
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise GcfError(f"'{spec}' is not a subclass of gcfamily.envs.Environment; subclass it and write step(turn).")
    return cls


def checked_description(cls: type, spec: str) -> dict[str, Any]:
    """describe(cls), its errors as the user's one sentence."""
    try:
        return describe(cls)
    except ValueError as e:
        raise GcfError(f"environment '{spec}': {e}.") from None


class Episodes:
    """The live environments of one worker (or of the trainer's process, for classes passed from Python)."""

    def __init__(self, cls: type, options: dict[str, Any], timeout: float) -> None:
        self.cls, self.options, self.timeout = cls, options, timeout
        self.live: dict[int, Any] = {}

    def _timed(self, fn: Callable[[], Any]) -> Any:
        """fn() under the episode timer where there is one (main thread, timeout > 0)."""
        use_timer = self.timeout > 0 and hasattr(signal, "setitimer") and _main_thread()
        if not use_timer:
            return fn()

        def expire(signum: int, frame: Any) -> None:
            raise EpisodeTimeout()

        old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def _guarded(self, eid: int, fn: Callable[[], Any], what: str) -> tuple[Any, str | None]:
        """(value, None), or (None, why) when fn raised, ran past the timer or returned garbage; the episode is dropped."""
        try:
            return self._timed(fn), None
        except EpisodeTimeout:
            why = f"{what} did not return within env_timeout={self.timeout:g} s"
        except BadAnswer as err:
            why = shorten(str(err))
        except (Exception, SystemExit, KeyboardInterrupt) as err:
            why = shorten(f"{what} raised {type(err).__name__}: {err}")
        self.live.pop(eid, None)
        return None, why

    def open(self, rows: dict[int, dict[str, Any]]) -> dict[int, str]:
        """One environment per episode id; {id: why} for those whose constructor failed."""
        errors = {}
        for eid, row in rows.items():
            env, why = self._guarded(eid, lambda row=row: self.cls(row, **self.options), "the environment's __init__")
            if why is None:
                self.live[eid] = env
            else:
                errors[eid] = why
        return errors

    def step(self, turns: dict[int, str]) -> tuple[dict[int, tuple], dict[int, str]]:
        """Each episode's answer to its turn as (observation, reward, done); {id: why} for those that failed."""
        out, errors = {}, {}
        for eid, text in turns.items():
            env = self.live.get(eid)
            if env is None:
                errors[eid] = "its environment was not open"
                continue
            step, why = self._guarded(eid, lambda env=env, text=text: as_step(env.step(text)), "step")
            if why is None:
                out[eid] = (step.observation, step.reward, step.done)
            else:
                errors[eid] = why
        return out, errors

    def final(self, eids: list[int]) -> tuple[dict[int, float | None], dict[int, str]]:
        """Each episode's final reward (None: the run's reward scores it), closing it; {id: why} for failures."""
        out, errors = {}, {}
        for eid in eids:
            env = self.live.pop(eid, None)
            if env is None:
                errors[eid] = "its environment was not open"
                continue
            value, why = self._guarded(
                eid, lambda env=env: reward_value(env.reward(), "reward() returned a value that"), "reward()"
            )
            if why is None:
                out[eid] = value
            else:
                errors[eid] = why
        return out, errors

    def drop(self, eids: list[int]) -> None:
        for eid in eids:
            self.live.pop(eid, None)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def answer(state: dict[str, Any], msg: tuple) -> tuple:
    """The reply to one message of the trainer (the worker loop's body; also the in-process runner's)."""
    kind = msg[0]
    if kind == "load":  # ("load", spec, options, timeout)
        _, spec, options, timeout = msg
        cls = load_env_class(spec)
        state["episodes"] = Episodes(cls, dict(options), float(timeout))
        return ("ready", checked_description(cls, spec))
    episodes: Episodes = state["episodes"]
    if kind == "open":
        return ("ok", {}, episodes.open(msg[1]))
    if kind == "step":
        return ("ok", *episodes.step(msg[1]))
    if kind == "final":
        return ("ok", *episodes.final(msg[1]))
    episodes.drop(msg[1])  # "drop"
    return ("ok", {}, {})


def serve(fd: int, parent: int) -> None:
    """The environment worker's loop: answer the trainer's messages until it closes the pipe (as calling.serve)."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _load_calling()._die_with_parent(parent)
    conn = Connection(fd)
    state: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = answer(state, msg)
        except GcfError as err:
            reply = ("gcf_error", str(err))
        except BaseException as err:  # a reply that cannot be built: the call's episodes fail
            reply = ("failed", shorten(f"the environment worker failed ({type(err).__name__}: {err})"))
        try:
            conn.send(reply)
        except Exception as err:  # an observation that does not pickle
            conn.send(("failed", shorten(f"the environment's answer could not be sent ({type(err).__name__}: {err})")))


if __name__ == "__main__":  # pragma: no cover (started by envs/worker.py through its boot line)
    serve(int(sys.argv[1]), int(os.getppid()))
