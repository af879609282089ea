"""Loading user reward functions and calling any reward function safely.

A sample whose reward raises, or is not a finite number, is masked (valid=False) and
counted, never silently scored 0; a batch where every sample fails raises RewardFailure.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gcfamily.errors import GcfError
from gcfamily.rewards.verifiable import _FLOAT32_MAX, REWARDS, RewardFn, _name


class RewardFailure(GcfError):
    """Raised by ``score`` when a reward function fails on every sample of a batch."""


# --------------------------------------------------------------------------- loading


def _import_file(path: Path) -> Any:
    """Import a .py file as a module under a unique name, so two files called rewards.py do not clash."""
    if not path.is_file():
        raise GcfError(f"reward file '{path}' does not exist; give an existing .py file as path/file.py:function.")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"gcf_reward_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, so dataclasses and pickling inside it work
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        why = _shorten(f"{type(err).__name__}: {err}")
        raise GcfError(f"reward file '{path}' failed to import ({why}); fix the file.") from None
    return module


def load_reward(spec: str) -> RewardFn:
    """Resolve a reward: a built-in name (see ``REWARDS``) or ``module:function``.

    ``module`` is a dotted module name or a path to a .py file, e.g.
    ``my_rewards.py:length_penalty``.
    """
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise GcfError(f"unknown reward '{spec}'; use one of {', '.join(REWARDS)} or module:function.")
    module_name, attr = spec.rsplit(":", 1)  # rsplit: a Windows path has a ':' of its own
    if not module_name or not attr:
        raise GcfError(f"reward '{spec}' is not of the form module:function; write e.g. rewards.py:my_reward.")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        module = _import_file(Path(module_name))
    else:
        try:
            module = importlib.import_module(module_name)
        except Exception as err:
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


# --------------------------------------------------------------------------- scoring


def _as_values(out: Any, n: int, name: str) -> list[Any]:
    """The function's output as a list of n raw values; a wrong shape is the user's bug, so GcfError."""
    if hasattr(out, "tolist"):  # torch tensors and numpy arrays
        out = out.tolist()
    if isinstance(out, (str, bytes, dict)) or not isinstance(out, Sequence):
        raise GcfError(
            f"reward function '{name}' returned a {type(out).__name__}; "
            "it must return a list with one float per completion."
        )
    if len(out) != n:
        raise GcfError(
            f"reward function '{name}' returned {len(out)} values for {n} completions; "
            "it must return one per completion."
        )
    return list(out)


def _shorten(text: str, limit: int = 200) -> str:
    """Error text cut to a loggable length (a reward may echo a whole completion)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_reward(value: Any) -> float | None:
    """A finite float, or None when the value is missing, non-numeric or non-finite."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    # Beyond float32's range the reward tensor would hold inf: as unusable as NaN.
    return value if math.isfinite(value) and abs(value) <= _FLOAT32_MAX else None


def _call_each(
    fn: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, Sequence[Any]], name: str
) -> list[Any]:
    """Call fn one sample at a time; a raising sample yields its exception instead of a value."""
    values: list[Any] = []
    for i in range(len(completions)):
        try:
            out = fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in columns.items()})
        except GcfError:
            raise
        except Exception as err:
            values.append(err)
            continue
        values.extend(_as_values(out, 1, name))
    return values


def score(
    fn: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, Sequence[Any]]
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Call a reward function so that one bad sample cannot sink, or silently pollute, a batch.

    Returns ``rewards`` [N] float32, ``valid`` [N] bool and one error message per
    invalid sample. If the batch call raises, each sample is retried alone. A
    sample whose call raises, or whose value is None, non-numeric or non-finite,
    gets valid=False and reward 0; callers must mask it. Raises ``RewardFailure``
    when every sample is invalid, and ``GcfError`` when the function returns the
    wrong number of values.
    """
    n, name = len(completions), _name(fn)
    if len(prompts) != n:
        raise GcfError(f"got {len(prompts)} prompts for {n} completions; pass one prompt per completion.")
    for key, col in columns.items():
        if len(col) != n:
            raise GcfError(f"column '{key}' has {len(col)} values for {n} completions; align it with the prompts.")
    try:
        values = _as_values(fn(prompts, completions, **columns), n, name)
    except GcfError:
        raise
    except Exception:
        values = _call_each(fn, prompts, completions, columns, name)

    rewards = torch.zeros(n, dtype=torch.float32)  # [N]
    valid = torch.zeros(n, dtype=torch.bool)  # [N]
    errors: list[str] = []
    for i, value in enumerate(values):
        reward = None if isinstance(value, Exception) else _as_reward(value)
        if reward is None:
            why = f"raised {type(value).__name__}: {value}" if isinstance(value, Exception) else f"returned {value!r}"
            errors.append(f"reward function '{name}' {_shorten(why)} on sample {i}")
        else:
            rewards[i], valid[i] = reward, True
    if n and not valid.any():
        raise RewardFailure(
            f"reward function '{name}' failed on all {n} samples (first: {errors[0]}); "
            "fix the function or its input columns."
        )
    return rewards, valid, errors
