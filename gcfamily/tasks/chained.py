"""Chained arithmetic: ``((a + b) * c) - d`` solved one operation per line, for outcome vs process supervision.

DeepSeekMath (Shao et al., 2024, section 5.2) compares GRPO with outcome supervision (one reward at the end
of a completion) against process supervision (a reward at the end of each reasoning step). This task makes
the comparison possible offline: every problem is a left-to-right chain of ``steps`` operations, the
demonstration writes one operation per line, and both rewards are rules, so neither needs a reward model::

    prompt:     Compute ((3 + 4) * 2) - 5 step by step ...
    completion: 3 + 4 = 7
                7 * 2 = 14
                14 - 5 = 9
                Answer: 9

``reward`` (outcome) is 1.0 when the final answer equals ``answer``. ``process_reward`` returns, per
completion, one ``(end, score)`` pair per step line, ``end`` being the offset just after that line's text;
``chained_process_reward`` says exactly when a step scores 1.0.

The default difficulty (3 steps, operands 1..19) was measured (docs/chained-task.md has the commands):
SmolLM2-135M-Instruct answers 2 of 200 held-out prompts greedily, and 99 of 200 after 100 SFT steps of 8 rows.
"""

from __future__ import annotations

import random
import re
from collections.abc import Hashable
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.rewards.verifiable import completion_text, extract_answer, require_column
from gcfamily.tasks.base import Task, check_fraction, generate_problems, hash_split

_MAX_DIGITS = 30  # int() of a huge digit run is slow; no number of this task is that long (as in sorting.py)
_MAX_LINE = 200  # a longer line is no step of this task: scored 0.0 without parsing, so work stays linear
_NUM = rf"-?[0-9]{{1,{_MAX_DIGITS}}}"
_OP_LINE = re.compile(rf"({_NUM})\s*([-+*])\s*({_NUM})\s*=\s*({_NUM})")
_ANSWER_LINE = re.compile(rf"answer\s*:\s*({_NUM})", re.IGNORECASE)
_UNICODE_OPS = str.maketrans({"\u00d7": "*", "\u2212": "-", "\u2013": "-"})  # x sign, minus sign, en dash
_APPLY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
_COMMUTATIVE = ("+", "*")

Chain = tuple[int, list[tuple[str, int]]]  # (first operand, [(operator, right operand), ...])


# --------------------------------------------------------------------------- the chain and its text


def expression_text(start: int, chain: list[tuple[str, int]]) -> str:
    """``((3 + 4) * 2) - 5``: every operation but the last in parentheses, so the text reads left to right."""
    text = str(start)
    for i, (op, y) in enumerate(chain):
        text = f"{text} {op} {y}" if i == len(chain) - 1 else f"({text} {op} {y})"
    return text


def parse_chain(expression: Any) -> Chain:
    """The chain of an ``expression`` column cell; raises ValueError (the sample is then masked) when it is not one."""
    tokens = re.findall(r"[0-9]+|[-+*]|\S", str(expression).translate(_UNICODE_OPS).replace("(", " ").replace(")", " "))
    numbers, ops = tokens[0::2], tokens[1::2]
    well_formed = len(tokens) % 2 == 1 and all(n.isascii() and n.isdigit() and len(n) <= _MAX_DIGITS for n in numbers)
    if not (well_formed and all(op in _APPLY for op in ops)):
        raise ValueError(f"expression {expression!r} is not a chain like '((3 + 4) * 2) - 5'")
    return int(numbers[0]), list(zip(ops, map(int, numbers[1:])))


def solution_lines(start: int, chain: list[tuple[str, int]]) -> list[str]:
    """The demonstration: one ``x op y = z`` line per operation, each from the previous result, then the answer."""
    lines, value = [], start
    for op, y in chain:
        result = _APPLY[op](value, y)
        lines.append(f"{value} {op} {y} = {result}")
        value = result
    return lines + [f"Answer: {value}"]


# --------------------------------------------------------------------------- rewards


def _integer(text: Any) -> int | None:
    """An integer written as text ("1458", "-3", "1,458"), exactly; None for anything else or over 30 digits."""
    t = str(text).strip().replace(",", "").translate(_UNICODE_OPS)
    return int(t) if re.fullmatch(_NUM, t) else None


def chained_reward(prompts: list[str], completions: list[Any], **columns: Any) -> list[float]:
    """Outcome reward: 1.0 where the completion's final answer is the ``answer`` column's integer, else 0.0.

    The final answer is read as for every numeric task (``extract_answer``): the number after the last
    "Answer:", else the last number of the completion; it must equal the reference exactly, as an integer
    ("9.5" or "9.0" is not 9; ``numeric_match``'s relative tolerance would let a 7-digit answer be off by one).
    The steps are not looked at. A reference that is not an integer raises ValueError (the sample is masked).
    """
    refs = require_column(columns, "answer", "chained", len(completions))
    out = []
    for completion, ref in zip(completions, refs):
        want = _integer(ref)
        if want is None:
            raise ValueError(f"chained reference answer {ref!r} is not an integer")
        got = extract_answer(completion_text(completion))
        out.append(float(got is not None and _integer(got) == want))
    return out


def _step_score(line: str, chain: list[tuple[str, int]], done: int, value: int) -> tuple[float, int]:
    """(score, result) of one operation line, given ``done`` correct steps so far that ended at ``value``."""
    match = _OP_LINE.fullmatch(line)
    if match is None or done >= len(chain):
        return 0.0, value
    x, op, y, z = int(match[1]), match[2], int(match[3]), int(match[4])
    want_op, want_y = chain[done]
    operands_ok = (x, y) == (value, want_y) or (op in _COMMUTATIVE and (y, x) == (value, want_y))
    right = op == want_op and operands_ok and z == _APPLY[op](x, y)
    return (1.0, z) if right else (0.0, value)


def step_scores(completion: str, start: int, chain: list[tuple[str, int]], answer: int) -> list[tuple[int, float]]:
    """The ``(end, score)`` pairs of one completion; see ``chained_process_reward`` for the rules."""
    out: list[tuple[int, float]] = []
    done, value, answered, pos = 0, start, False, 0
    for raw in completion.split("\n"):
        end, pos = pos + len(raw), pos + len(raw) + 1
        line = raw.strip()
        if not line:
            continue
        score = 0.0
        if len(line) <= _MAX_LINE and not answered:
            line = line.translate(_UNICODE_OPS).removesuffix(".").rstrip()
            is_answer = _ANSWER_LINE.fullmatch(line)
            if is_answer:
                answered, score = True, float(int(is_answer[1]) == answer)
            else:
                score, value = _step_score(line, chain, done, value)
                done += score == 1.0
        out.append((end, score))
    return out


def chained_process_reward(prompts: list[str], completions: list[Any], **columns: Any) -> list[list[tuple[int, float]]]:
    """Process reward: per completion, a list of ``(end, score)`` pairs, one per step line, in order.

    A step is a non-blank line of the completion (split on "\\n" only); ``end`` is the offset in the
    completion string just after the line's text (the index of its "\\n", or the length of the string for
    the last line), so ``completion[:end]`` is everything up to and including the step. A completion with
    no non-blank line gets ``[]``. Each step scores 1.0 or 0.0, judged on the line alone (stripped of
    surrounding spaces and one final "."; "\u00d7" reads as "*", "\u2212" as "-"):

    - an operation line ``x op y = z`` scores 1.0 when it is the chain's next step: ``x`` is the result
      of the last step that scored 1.0 (the problem's first number before any), ``op`` and ``y`` are the
      chain's next operator and operand (for + and *, ``y op x`` counts too), and ``z == x op y``. Any
      other line, a correct step repeated, or a step past the end of the chain, scores 0.0. After a line
      scores 0.0 the chain does not move, so the lines that build on a wrong result score 0.0 too, until a
      line redoes the missed step correctly.
    - the first ``Answer: N`` line scores 1.0 when N is the ``answer`` column, whatever came before; it
      ends the solution, and every non-blank line after it is a step that scores 0.0 (so repeating a right
      answer or a right step cannot add reward).

    Needs the columns ``expression`` (the chain, as in the prompt) and ``answer``; a malformed cell raises
    ValueError, as in the outcome reward (``score`` masks such a sample). Numbers of more than 30 digits and
    lines over 200 characters score 0.0 without being parsed, so any text is scored in time linear in its length.
    """
    expressions = require_column(columns, "expression", "chained_process", len(completions))
    answers = require_column(columns, "answer", "chained_process", len(completions))
    out = []
    for completion, expression, answer in zip(completions, expressions, answers):
        start, chain = parse_chain(expression)
        want = _integer(answer)
        if want is None:
            raise ValueError(f"chained reference answer {answer!r} is not an integer")
        text = completion_text(completion)
        out.append(step_scores(text, start, chain, want) if isinstance(text, str) else [])
    return out


# --------------------------------------------------------------------------- problems


def _make_problem(rng: random.Random, steps: int, max_operand: int) -> Chain:
    """A chain of operands in 1..max_operand; a subtraction never goes below 0, so every number is a plain integer."""
    start = value = rng.randint(1, max_operand)
    chain = []
    for _ in range(steps):
        op = rng.choice("+-*") if value >= 1 else rng.choice("+*")
        y = rng.randint(1, min(value, max_operand)) if op == "-" else rng.randint(1, max_operand)
        chain.append((op, y))
        value = _APPLY[op](value, y)
    return start, chain


def _key(problem: Chain) -> tuple:
    """The problem's identity: ``3 + 4`` and ``4 + 3`` as first operation are one problem (never one of each split)."""
    start, chain = problem
    (op, y), rest = chain[0], tuple(chain[1:])
    first = (min(start, y), max(start, y)) if op in _COMMUTATIVE else (start, y)
    return ("chained", op, first, rest)


def _row(problem: Chain) -> dict:
    start, chain = problem
    expression = expression_text(start, chain)
    lines = solution_lines(start, chain)
    return {
        "prompt": (
            f"Compute {expression} step by step. Write one operation per line as 'x op y = z', each line "
            "starting from the previous line's result, then a last line 'Answer: <number>'."
        ),
        "completion": "\n".join(lines),
        "answer": lines[-1].removeprefix("Answer: "),
        "expression": expression,
    }


class ChainedTask(Task):
    """Chains of ``steps`` operations (+ - *) on 1..``max_operand``, solved one operation per line.

    ``reward`` is the outcome reward (``chained_reward``), ``process_reward`` the per-step one
    (``chained_process_reward``). The problems are fixed by the options, the same for every seed; ``seed``
    orders them. ``size`` is the number of distinct problems drawn, about ``test_fraction`` of them for test.
    """

    name = "chained"
    description = "Chained arithmetic ((a + b) * c) - d, one operation per line; outcome and process rewards."

    def __init__(
        self, seed: int = 0, steps: int = 3, max_operand: int = 19, size: int = 5000, test_fraction: float = 0.2
    ) -> None:
        super().__init__(seed)
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (steps, max_operand, size))
        # 999 ** 9 has 27 digits: within these bounds every number of a problem is under the 30-digit cap.
        if not (ints and 1 <= steps <= 8 and 1 <= max_operand <= 999 and size >= 1):
            raise GcfError(
                "chained options need whole numbers 1 <= steps <= 8, 1 <= max_operand <= 999 and size >= 1; "
                "fix the task options."
            )
        check_fraction(test_fraction)
        self.steps, self.max_operand = steps, max_operand

        def make(rng):
            return _make_problem(rng, steps, max_operand)

        # The generator's seed depends on the options only, so every training seed sees one problem set.
        problems = generate_problems(make, _key, size, f"chained/{steps}/{max_operand}")
        self._splits = hash_split(problems, _key, _row, test_fraction, self.name, seed)

    def split_rows(self, split: str) -> list[dict]:
        """Every row of ``split``, in seeded order."""
        return self._splits[split]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """Outcome: 1.0 where the final answer is right (``chained_reward``)."""
        return chained_reward(prompts, completions, **columns)

    def answer(self, completion: str) -> Hashable | None:
        """The integer the outcome reward compares (the final answer, exactly); None where it reads none. The reward
        depends on the completion only through it, so Maj@K's vote over it is exact."""
        got = extract_answer(completion_text(completion))
        return None if got is None else _integer(got)

    def process_reward(
        self, prompts: list[str], completions: list[Any], **columns: Any
    ) -> list[list[tuple[int, float]]]:
        """Process: one ``(end, score)`` pair per step line of each completion (``chained_process_reward``)."""
        return chained_process_reward(prompts, completions, **columns)

    def __repr__(self) -> str:
        return f"ChainedTask(seed={self.seed}, steps={self.steps}, max_operand={self.max_operand})"
