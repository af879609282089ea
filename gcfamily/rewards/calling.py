"""How a reward function is loaded and called: TRL's keyword convention, the old positional one, and the worker loop.

A function that names a ``completions`` parameter (or takes only ``**kwargs``) is called TRL's way,

    fn(prompts=[...], completions=[...], completion_ids=[[int, ...], ...], **columns)

with every other dataset column by name; one that takes no ``**kwargs`` is passed only the
arguments it names. Any other function (``lambda p, c, **k: ...``) is called the old way,
``fn(prompts, completions, **columns)``. ``None`` in the returned list means "no reward for this
sample" (TRL's convention): the sample fails and is counted.

This module imports neither torch nor the rest of gcfamily (only errors.py): the reward worker
process (guard.py) loads it by path, so starting one costs a bare Python start (~0.1 s), not
torch's import (~3 s).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError

Values = tuple[list[Any], dict[int, str]]  # one raw value per sample, and why each failed sample failed


def shorten(text: str, limit: int = 200) -> str:
    """Error text cut to a loggable length (a reward may echo a whole completion)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- loading user code


def _import_file(path: Path, loaded: dict[str, Any] | None = None, what: str = "reward") -> Any:
    """Import a .py file as a module under a unique name, so two files called rewards.py do not clash.

    With ``loaded`` (the worker's), a file already imported there is not imported again: two rewards
    from one file share one module and its state, as two functions of an installed module do.
    """
    if not path.is_file():
        attr = "function" if what == "reward" else "Class"
        raise GcfError(f"{what} file '{path}' does not exist; give an existing .py file as path/file.py:{attr}.")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"gcf_{what}_{path.stem}_{digest}"
    if loaded is not None and name in loaded:
        return loaded[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, so dataclasses and pickling inside it work
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:  # a file that calls sys.exit() at import is as broken as one that raises
        del sys.modules[name]
        why = shorten(f"{type(err).__name__}: {err}")
        raise GcfError(f"{what} file '{path}' failed to import ({why}); fix the file.") from None
    if loaded is not None:
        loaded[name] = module
    return module


def split_spec(spec: str) -> tuple[str, str]:
    """``module:function`` or ``path/file.py:function`` as (module, function); a malformed spec is one sentence."""
    module_name, _, attr = spec.rpartition(":")  # the last ':': a Windows path has one of its own
    if not module_name or not attr:
        raise GcfError(f"reward '{spec}' is not of the form module:function; write e.g. rewards.py:my_reward.")
    return module_name, attr


def load_user_reward(spec: str, loaded: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The function a ``module:function`` or ``path/file.py:function`` spec names (``loaded``: see _import_file)."""
    module_name, attr = split_spec(spec)
    # rewards.txt:fn, my_reward:fn (a file, no suffix)
    if not module_name.endswith(".py") and Path(module_name).is_file():
        raise GcfError(
            f"reward '{spec}' names the file '{module_name}', which is not a .py file; "
            "give a Python file as path/file.py:function (rename it to .py) or an importable module:function."
        )
    if module_name.endswith(".py") and Path(module_name).is_dir():
        raise GcfError(
            f"reward '{spec}' names the folder '{module_name}'; give a Python file as path/file.py:function."
        )
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        module = _import_file(Path(module_name), loaded)
    else:
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit) as err:
            raise GcfError(
                f"could not import reward module '{module_name}' ({type(err).__name__}: {err}); "
                "install it or pass the path to its .py file instead."
            ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise GcfError(f"reward module '{module_name}' has no attribute '{attr}'; check the function name.")
    if not callable(fn):
        raise GcfError(f"'{spec}' is a {type(fn).__name__}, not a function; point at a reward function.")
    return fn


# --------------------------------------------------------------------------- calling


def _keyword_params(fn: Callable[..., Any]) -> tuple[bool, frozenset[str], frozenset[str]] | None:
    """(takes **kwargs, names it takes, names it needs) for a keyword-convention function; None for a positional one."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the old convention
        return None
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    only_kwargs = bool(params) and all(
        p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) for p in params.values()
    )
    named = "completions" in params and params["completions"].kind in by_name
    if not (named or (only_kwargs and var_kw)):
        return None
    names = frozenset(k for k, p in params.items() if p.kind in by_name)
    needed = frozenset(k for k, p in params.items() if p.kind in by_name and p.default is inspect.Parameter.empty)
    return var_kw, names, needed


def call_reward(
    fn: Callable[..., Any],
    name: str,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]] | None,
    columns: dict[str, Sequence[Any]],
) -> Any:
    """One call of ``fn`` on aligned lists, by keyword (TRL) or positionally, whichever ``fn`` is written for."""
    style = _keyword_params(fn)
    if style is None:
        return fn(prompts, completions, **columns)
    var_kw, names, needed = style
    given: dict[str, Any] = {**columns, "prompts": prompts, "completions": completions}
    if completion_ids is not None:
        given["completion_ids"] = completion_ids
    missing = sorted(needed - given.keys())
    if missing:
        raise GcfError(
            f"reward function '{name}' needs an argument '{missing[0]}', which is neither prompts, completions, "
            f"completion_ids nor a column of the data (columns: {', '.join(sorted(columns)) or 'none'}); "
            "add the column or give the parameter a default."
        )
    return fn(**(given if var_kw else {k: v for k, v in given.items() if k in names}))


def _no_overflow(value: Any) -> Any:
    """A number too large for a float (an int of 10**400, a Fraction) as +-inf, which fails its sample as any non-finite
    reward does; in a step list [(end, score), ...], each number. Anything else is returned as it is."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, float)):
        try:
            float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
        return value
    if (
        isinstance(value, (list, tuple))
        and 0 < len(value) <= MAX_STEPS
        and all(isinstance(v, (list, tuple)) for v in value)
    ):
        return [tuple(_no_overflow(x) for x in item) for item in value]  # a step list
    return value


def as_values(out: Any, n: int, name: str) -> list[Any]:
    """The function's output as a list of n raw values; a wrong shape is the user's bug, so GcfError.

    A number too large for a float (10**400) becomes +-inf, an invalid reward that fails its sample (reward/failed)."""
    if hasattr(out, "tolist"):  # torch tensors and numpy arrays
        out = out.tolist()
    if isinstance(out, (str, bytes, dict)) or not isinstance(out, Sequence):
        raise GcfError(
            f"reward function '{name}' returned a {type(out).__name__}; "
            "it must return a list with one float (or None) per completion."
        )
    if len(out) != n:
        raise GcfError(
            f"reward function '{name}' returned {len(out)} values for {n} completions; "
            "it must return one per completion."
        )
    return [_no_overflow(v) for v in out]


def call_values(
    fn: Callable[..., Any],
    name: str,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]] | None,
    columns: dict[str, Sequence[Any]],
    catch: tuple[type[BaseException], ...] = (Exception, SystemExit),
) -> Values:
    """Call fn on the batch; if that raises, once per sample, so that one bad sample cannot sink the batch.

    Returns the raw values (None where a sample raised) and, per failed sample, what it raised.
    Exceptions of the types in ``catch`` fail samples; a GcfError (the user's setup) passes through.
    In this process SystemExit is caught too; the worker process catches every BaseException.
    """
    n = len(completions)
    try:
        return as_values(call_reward(fn, name, prompts, completions, completion_ids, columns), n, name), {}
    except GcfError:
        raise
    except catch:
        pass
    values: list[Any] = []
    errors: dict[int, str] = {}
    for i in range(n):
        ids = None if completion_ids is None else [completion_ids[i]]
        try:
            out = call_reward(fn, name, [prompts[i]], [completions[i]], ids, {k: [v[i]] for k, v in columns.items()})
        except GcfError:
            raise
        except catch as err:
            values.append(None)
            errors[i] = shorten(f"raised {type(err).__name__}: {err}")
            continue
        values.extend(as_values(out, 1, name))
    return values, errors


# --------------------------------------------------------------------------- the worker process's side


def _plain(value: Any) -> Any:
    """A value that pickles and means the same to the trainer: a float, None, or a short repr (an invalid reward)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, numbers.Real):  # numpy scalars
        return float(value)
    if hasattr(value, "item"):  # a one-element tensor or array
        try:
            item = value.item()
            if isinstance(item, numbers.Real):
                return float(item)
        except Exception:
            pass
    steps = _plain_steps(value)
    return steps if steps is not None else shorten(repr(value))


MAX_STEPS = 100_000
"""Step scores one completion may carry back from the worker (process supervision); past it the value is invalid."""


def _plain_steps(value: Any) -> list[tuple[Any, Any]] | None:
    """A step list [(end, score), ...] (rewards/scoring.py) with plain numbers, or None when the value is not one."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence) or len(value) > MAX_STEPS:
        return None
    out = []
    for item in value:
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            return None
        end, score = (_plain(x) for x in item)
        if isinstance(end, str) or isinstance(score, str) or isinstance(end, list) or isinstance(score, list):
            return None
        out.append((end, score))
    return out


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when the trainer dies, even mid-reward (no orphan left hanging)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the worker still ends on EOF once the reward returns
        pass
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(0)


def serve(fd: int, parent: int) -> None:
    """The reward worker's loop: load the user's rewards, then answer calls until the trainer closes the pipe.

    Ctrl-C and SIGTERM are the trainer's to handle (it stops at a checkpoint and ends this process),
    so they are ignored here; a reward's SystemExit, KeyboardInterrupt or other exception fails its
    samples, and os._exit or a crash ends this process, which the trainer sees as the pipe closing.
    """
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent)
    conn = Connection(fd)
    fns: dict[str, Callable[..., Any]] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if msg[0] == "load":
                loaded: dict[str, Any] = {}
                fns = {spec: load_user_reward(spec, loaded) for spec in msg[1]}
                reply: tuple = ("ready",)
            else:  # ("call", spec, name, prompts, completions, completion_ids, columns)
                _, spec, name, prompts, completions, completion_ids, columns = msg
                values, errors = call_values(
                    fns[spec], name, prompts, completions, completion_ids, columns, catch=(BaseException,)
                )
                reply = ("ok", [_plain(v) for v in values], errors)
        except GcfError as err:
            reply = ("gcf_error", str(err))
        except BaseException as err:  # the reward's output could not be read (an odd sequence type)
            why = shorten(f"{type(err).__name__}: {err}")
            what = (
                f"reward function '{msg[2]}' returned a value that could not be read"
                if msg[0] == "call"
                else "the reward worker failed"
            )
            reply = ("gcf_error", f"{what} ({why}); return a list of floats.")
        conn.send(reply)
