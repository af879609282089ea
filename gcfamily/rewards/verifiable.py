"""Verifiable rewards: answer extraction and the built-in reward functions.

A reward function is called TRL's way (calling.py has the rules):

    fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]

where each extra column (e.g. ``answer``) is a list aligned with ``prompts``; the old positional
``fn(prompts, completions, **columns)`` works too. A completion is a string, or a message list
``[{"role": "assistant", "content": text}]`` for conversational prompts: the built-ins read both.
``scoring.Rewards`` is the only way the trainer calls one: it never lets a raising or
NaN-returning sample be scored silently, it returns a ``valid`` mask instead.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gcfamily.errors import GcfError
from gcfamily.rewards.calling import call_reward

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

CORRECTNESS = "correctness_reward"
"""The attribute that marks a reward function as a correctness check (`correctness_reward`)."""


def correctness_reward(fn: RewardFn) -> RewardFn:
    """Mark `fn` as a correctness check: it returns 1 for a completion whose answer is right and 0 otherwise.

    Held-out evaluation on your own rows (gcfamily/run/heldout.py) reports eval/accuracy only where some reward is
    one: the fraction of samples that every correctness reward scored exactly 1. The built-in ``numeric`` and
    ``exact`` are marked; mark your own with ``@correctness_reward`` (or ``fn.correctness_reward = True``) and pass
    the function from Python. A ``module:function`` reward runs in the reward worker, so its mark is not seen.
    """
    setattr(fn, CORRECTNESS, True)
    return fn


def is_correctness(fn: object) -> bool:
    """Whether `fn` is marked as a correctness check (`correctness_reward`)."""
    return getattr(fn, CORRECTNESS, False) is True


def completion_text(completion: Any) -> Any:
    """The text of a completion: itself, or the contents of a message list ([{"role": "assistant", "content": ...}]) joined."""
    if isinstance(completion, list) and all(isinstance(m, dict) for m in completion):
        return "".join(str(m.get("content", "")) for m in completion)
    return completion


def _numeric_value(completion: str) -> float | None:
    """The completion's answer as a number: the extracted answer, or the last number inside it ("\\boxed{x = 5}")."""
    answer = extract_answer(completion_text(completion))
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
            f"add it to the dataset (got columns: {sorted(k for k in columns if k != 'completion_ids') or 'none'})."
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


@correctness_reward
def numeric_match(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 where the completion's extracted number equals the ``answer`` column within 1e-6 relative."""
    refs = require_column(columns, "answer", "numeric", len(completions))
    out = []
    for completion, ref in zip(completions, refs):
        target = _reference_number(ref)
        got = _numeric_value(completion)
        out.append(float(got is not None and math.isclose(got, target, rel_tol=1e-6, abs_tol=0.0)))
    return out


@correctness_reward
def exact_match(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 where the extracted answer (or, if none extracts, the whole completion) equals ``answer``, both stripped."""
    refs = require_column(columns, "answer", "exact", len(completions))
    out = []
    for completion, ref in zip(completions, refs):
        text = completion_text(completion)
        got = extract_answer(text)
        got = text if got is None else got
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
        texts = [completion_text(c) for c in completions]
        return [float(match(c.strip() if fullmatch else c) is not None) for c in texts]

    fn.__name__ = fn.__qualname__ = f"format({pattern!r})"
    return fn


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or getattr(fn, "__qualname__", None) or type(fn).__name__


def weighted_sum(terms: Sequence[tuple[RewardFn, float]]) -> RewardFn:
    """A reward function returning sum_k weight_k * fn_k(...) per completion, each fn_k called by calling.call_reward's rules.

    (The trainer's ``reward=[a, b]`` with ``reward_weights`` sums the same way and logs each reward apart.)
    """
    terms = list(terms)
    if not terms:
        raise GcfError("weighted_sum got no terms; pass a list of (reward_function, weight) pairs.")
    for term, weight in terms:
        if not callable(term) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise GcfError(f"weighted_sum term ({term!r}, {weight!r}) is not a (function, finite weight) pair; fix it.")

    def fn(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        ids = columns.pop("completion_ids", None)
        total = [0.0] * len(completions)
        for term, weight in terms:
            values = list(call_reward(term, _name(term), prompts, completions, ids, columns))
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
