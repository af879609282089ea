"""Verifiable rewards: answer extraction, reward functions, and a safe way to call them.

Every reward function has the TRL signature

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

where each extra column (e.g. ``answer``) is a list aligned with ``prompts``.
``score`` is the only way the trainer calls one: it never lets a raising or
NaN-returning sample be scored silently, it returns a ``valid`` mask instead.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gcfamily.errors import GcfError

RewardFn = Callable[..., list[float]]
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

# A number as written in text: optional sign (not when glued to a word or a
# closing bracket, so "5-3" gives 5 and 3, not 5 and -3), then "1,234.5",
# "12", "2.50", "3/4" or ".5". ASCII digits only: \d would accept other
# scripts' digits, which float() then reads in surprising ways.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])[-+\u2212])?(?<![0-9.])"
    r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])(?:\.[0-9]+)?"
    r"|[0-9]+(?:\.[0-9]+)?(?:/[0-9]+)?"
    r"|\.[0-9]+)"
)
_ANSWER_CUE = re.compile(r"\banswer\b\s*(?:is\b\s*:?|:|=)", re.IGNORECASE)
_DECIMAL = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+"
_PLAIN = re.compile(rf"[-+]?(?:{_DECIMAL})")
_FRACTION = re.compile(rf"([-+]?)({_DECIMAL})/({_DECIMAL})")
_LATEX_FRAC = re.compile(r"([-+]?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


class RewardFailure(GcfError):
    """Raised by ``score`` when a reward function fails on every sample of a batch."""


# --------------------------------------------------------------------------- extraction


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, matching nested braces; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    # A few tries only: a degenerate, repeating completion full of unclosed
    # \boxed{ would otherwise make this quadratic in its length.
    for _ in range(8):
        if start == -1:
            break
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j].strip()
        # Unclosed: an earlier, complete \boxed may still be the answer.
        start = text.rfind("\\boxed{", 0, start)
    return None


def _clean_text_answer(s: str) -> str | None:
    """Strip markdown and punctuation around a non-numeric answer such as 'Paris.'."""
    s = s.strip().strip("*`$ \t").rstrip(".").strip()
    return s or None


def _answer_after(tail: str) -> str | None:
    """The number on the line after a cue ('Answer:', '####'), else that line's text.

    The first number after the line's last '=' ("Answer: 7 + 5 = 12" gives 12),
    or the line's first number ("answer is 12 apples, 2 more than 10" gives 12).
    """
    line = tail.split("\n", 1)[0]
    match = _NUMBER.search(line.rsplit("=", 1)[-1]) or _NUMBER.search(line)
    return match.group(0) if match else _clean_text_answer(line)


def extract_answer(text: str) -> str | None:
    """Extract the final answer from a completion, as a string.

    In order of preference: the last ``\\boxed{...}`` (nested braces allowed),
    the last GSM8K ``#### N``, the last "Answer: N" / "the answer is N", else
    the last number in the text. Numbers keep their written form ("1,234",
    "-3", "2.50", "3/4"); use ``parse_number`` to get a float. Nothing is
    evaluated. Returns None when the text holds no answer.
    """
    if not isinstance(text, str):
        return None
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    hashes = text.rfind("####")
    if hashes != -1:
        found = _answer_after(text[hashes + 4 :])
        if found:
            return found
    cues = list(_ANSWER_CUE.finditer(text))
    if cues:
        found = _answer_after(text[cues[-1].end() :])
        if found:
            return found
    numbers_found = _NUMBER.findall(text)
    return numbers_found[-1] if numbers_found else None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def parse_number(s: Any) -> float | None:
    """Read a number written as text: "1,234", "-3", "2.50", "3/4", "$18", "\\frac{3}{4}".

    Returns None for anything else (including non-finite values); never evaluates.
    """
    if isinstance(s, numbers.Real):
        return _finite(float(s))
    if not isinstance(s, str):
        return None
    t = s.strip().replace("\u2212", "-").replace("\\$", "").replace("$", "").strip()
    if _PLAIN.fullmatch(t):
        return _finite(float(t.replace(",", "")))
    parts = _FRACTION.fullmatch(t) or _LATEX_FRAC.fullmatch(t)
    if parts:
        sign, num, den = parts.groups()
        p, q = parse_number(num), parse_number(den)
        if p is None or not q:  # q is None or a zero denominator
            return None
        return _finite((-p if sign == "-" else p) / q)
    return None


# --------------------------------------------------------------------------- reward functions


def _numeric_value(completion: str) -> float | None:
    """The completion's answer as a number: the extracted answer, or the last number inside it ("\\boxed{x = 5}")."""
    answer = extract_answer(completion)
    if answer is None:
        return None
    value = parse_number(answer)
    if value is None:
        inner = _NUMBER.findall(answer)
        value = parse_number(inner[-1]) if inner else None
    return value


def require_column(columns: dict[str, Any], name: str, reward: str, n: int) -> Sequence[Any]:
    """Column ``name`` for the reward called ``reward``, checked to be present and of length n."""
    if name not in columns:
        raise GcfError(
            f"the reward '{reward}' needs a column '{name}' with the reference for each prompt; "
            f"add it to the dataset (got columns: {sorted(columns) or 'none'})."
        )
    col = columns[name]
    if len(col) != n:
        raise GcfError(f"column '{name}' has {len(col)} values for {n} completions; align it with the prompts.")
    return col


def _reference_number(ref: Any) -> float:
    """The reference as a number; raises (so ``score`` masks the sample) when it is not one."""
    value = parse_number(ref)
    if value is None and isinstance(ref, str):
        value = parse_number(extract_answer(ref))
    if value is None:
        raise ValueError(f"reference answer {ref!r} is not a number")
    return value


def numeric_match(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 where the completion's extracted number equals the ``answer`` column within 1e-6 relative."""
    refs = require_column(columns, "answer", "numeric", len(completions))
    out = []
    for completion, ref in zip(completions, refs):
        target = _reference_number(ref)
        got = _numeric_value(completion)
        out.append(float(got is not None and math.isclose(got, target, rel_tol=1e-6, abs_tol=0.0)))
    return out


def exact_match(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 where the extracted answer (or, if none extracts, the whole completion) equals ``answer``, both stripped."""
    refs = require_column(columns, "answer", "exact", len(completions))
    out = []
    for completion, ref in zip(completions, refs):
        got = extract_answer(completion)
        got = completion if got is None else got
        out.append(float(str(got).strip() == str(ref).strip()))
    return out


def format_reward(pattern: str, fullmatch: bool = False) -> RewardFn:
    """A reward of 1.0 where the completion matches ``pattern``.

    By default ``re.search`` anywhere in the completion; with ``fullmatch=True``
    the whole completion, stripped of surrounding whitespace, must match. Put
    flags inline, e.g. ``(?s)`` so that ``.`` crosses lines.
    """
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise GcfError(f"format pattern {pattern!r} is not a valid regular expression ({err}); fix it.") from None
    match = regex.fullmatch if fullmatch else regex.search

    def fn(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return [float(match(c.strip() if fullmatch else c) is not None) for c in completions]

    fn.__name__ = fn.__qualname__ = f"format({pattern!r})"
    return fn


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def weighted_sum(terms: Sequence[tuple[RewardFn, float]]) -> RewardFn:
    """A reward function returning sum_k weight_k * fn_k(...) per completion."""
    terms = list(terms)
    if not terms:
        raise GcfError("weighted_sum got no terms; pass a list of (reward_function, weight) pairs.")
    for term, weight in terms:
        if not callable(term) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise GcfError(f"weighted_sum term ({term!r}, {weight!r}) is not a (function, finite weight) pair; fix it.")

    def fn(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        total = [0.0] * len(completions)
        for term, weight in terms:
            values = list(term(prompts, completions, **columns))
            if len(values) != len(completions):
                raise GcfError(
                    f"reward function '{_name(term)}' returned {len(values)} values for {len(completions)} "
                    "completions; it must return one value per completion."
                )
            # A None or NaN term propagates as NaN, so score() masks the sample.
            total = [t + weight * (math.nan if v is None else float(v)) for t, v in zip(total, values)]
        return total

    fn.__name__ = fn.__qualname__ = "weighted_sum(" + ", ".join(f"{w}*{_name(f)}" for f, w in terms) + ")"
    return fn


REWARDS: dict[str, RewardFn] = {
    "numeric": numeric_match,
    "exact": exact_match,
    "boxed": format_reward(r"\\boxed\{"),
}


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
