"""Countdown: reach a target with 3-4 given numbers, + - * and parentheses, each number at most once.

The reward checks the completion's expression with a tiny recursive-descent
parser over exact fractions. Nothing is ever passed to ``eval``: a character
that is not a digit, an operator, a parenthesis or a space rejects the whole
expression before any arithmetic happens.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Hashable
from fractions import Fraction
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.rewards.verifiable import parse_number, require_column
from gcfamily.tasks.base import Task, check_fraction, generate_problems, hash_split

MAX_EXPRESSION_CHARS = 120  # bounds parser recursion (3 frames per parenthesis) and big-integer work
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")
_UNICODE_OPS = str.maketrans({"\u00d7": "*", "\u00f7": "/", "\u2212": "-", "\u2013": "-"})


def _tokenize(expr: str) -> list[str] | None:
    """Numbers and the six allowed symbols, or None if anything else appears."""
    tokens, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            return None
        tokens.append(match.group(1) or match.group(2))
        pos = match.end()
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := INT | '(' expr ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.numbers = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            value = value + self.term() if op == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.factor()
            value = value * rhs if op == "*" else value / rhs  # ZeroDivisionError -> rejected
        return value

    def factor(self) -> Fraction:
        token = self.peek()
        self.pos += 1
        if token == "(":
            value = self.expr()
            if self.peek() != ")":
                raise ValueError("unclosed parenthesis")
            self.pos += 1
            return value
        if token is not None and token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise ValueError(f"unexpected token {token!r}")


def parse_expression(expr: str) -> tuple[Fraction, list[int]] | None:
    """Value and numbers used of an arithmetic expression over integers with + - * / ( ).

    Returns None for anything else (names, calls, unary minus, decimals,
    division by zero, over-long input). Never evaluates Python code.
    """
    if not isinstance(expr, str) or len(expr) > MAX_EXPRESSION_CHARS:
        return None
    tokens = _tokenize(expr.translate(_UNICODE_OPS))
    if not tokens:
        return None
    parser = _Parser(tokens)
    try:
        value = parser.expr()
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    if parser.pos != len(tokens):
        return None
    return value, parser.numbers


def final_expression(completion: str) -> str:
    """The expression on the completion's last non-empty line: after any 'Answer:' label, before any '='."""
    lines = [line for line in completion.splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1].rsplit(":", 1)[-1].split("=", 1)[0]
    return line.strip().strip("`*$").rstrip(".").strip()


def _ints(value: Any) -> list[int]:
    """Allowed numbers from a column cell: a list of ints, or text like '3, 5, 2'."""
    if isinstance(value, str):
        return [int(x) for x in re.findall(r"[0-9]{1,9}", value)]
    return [int(x) for x in value]


def countdown_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 where the final expression uses only the ``numbers`` column (each at most once) and equals ``answer``."""
    allowed_col = require_column(columns, "numbers", "countdown", len(completions))
    targets = require_column(columns, "answer", "countdown", len(completions))
    out = []
    for completion, allowed, target in zip(completions, allowed_col, targets):
        goal = parse_number(target)
        if goal is None:
            raise ValueError(f"countdown target {target!r} is not a number")
        parsed = parse_expression(final_expression(completion))
        ok = parsed is not None and parsed[0] == goal and Counter(parsed[1]) <= Counter(_ints(allowed))
        out.append(float(ok))
    return out


# --------------------------------------------------------------------------- problem generation

_PREC = {"+": 1, "-": 1, "*": 2}
_ATOM = 3


def _combine(left: tuple[str, int, int], right: tuple[str, int, int], op: str) -> tuple[str, int, int]:
    """Join two (text, value, precedence) items with minimal parentheses."""
    p = _PREC[op]
    lt = f"({left[0]})" if left[2] < p else left[0]
    # a - (b + c) and a - (b - c) need their parentheses; a + (b - c) does not.
    rt = f"({right[0]})" if right[2] < p or (op == "-" and right[2] == p) else right[0]
    value = {"+": left[1] + right[1], "-": left[1] - right[1], "*": left[1] * right[1]}[op]
    return f"{lt} {op} {rt}", value, p


def _make_problem(rng: random.Random, min_count: int, max_count: int, max_number: int, max_target: int) -> dict:
    """A random expression tree over all the drawn numbers, with a positive target in range."""
    for _ in range(1000):
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_count, max_count))]
        items = [(str(x), x, _ATOM) for x in numbers]
        while len(items) > 1:
            left, right = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
            op = rng.choice("+-*")
            if op == "-" and left[1] < right[1]:
                left, right = right, left  # keep intermediate values non-negative, as people play it
            items.append(_combine(left, right, op))
        text, target, _ = items[0]
        if 1 <= target <= max_target and target not in numbers:
            return {"numbers": numbers, "target": target, "expression": text}
    raise GcfError("countdown options leave almost no reachable targets; raise max_target or max_number.")


def _row(problem: dict) -> dict:
    listed = ", ".join(map(str, problem["numbers"]))
    target = problem["target"]
    return {
        "prompt": (
            f"Using the numbers {listed}, make {target}. You may use +, -, * and parentheses, "
            "and each number at most once. Reply with just the expression, like (1 + 2) * 3 = 9."
        ),
        "completion": f"{problem['expression']} = {target}",
        "answer": str(target),
        "numbers": list(problem["numbers"]),
    }


class CountdownTask(Task):
    """Countdown numbers game; reward: ``countdown_reward``.

    The problems are fixed by the options (the same for every seed, so results
    across seeds compare on one test set); ``seed`` orders them. ``size`` is the
    number of distinct problems drawn, about ``test_fraction`` of them for test.
    """

    name = "countdown"
    description = "Reach a target with 3-4 given numbers and + - * (each at most once)."

    def __init__(
        self,
        seed: int = 0,
        size: int = 5000,
        min_count: int = 3,
        max_count: int = 4,
        max_number: int = 10,
        max_target: int = 100,
        test_fraction: float = 0.2,
    ) -> None:
        super().__init__(seed)
        if not (2 <= min_count <= max_count <= 6 and max_number >= 2 and max_target >= 1 and size >= 1):
            raise GcfError(
                "countdown options need 2 <= min_count <= max_count <= 6, max_number >= 2, max_target >= 1 "
                "and size >= 1; fix the task options."
            )
        check_fraction(test_fraction)
        make = lambda rng: _make_problem(rng, min_count, max_count, max_number, max_target)  # noqa: E731
        key = lambda p: ("countdown", tuple(sorted(p["numbers"])), p["target"])  # noqa: E731
        # The generator's seed depends on the options only, so every training seed sees one problem set.
        problems = generate_problems(make, key, size, f"countdown/{min_count}/{max_count}/{max_number}/{max_target}")
        self._splits = hash_split(problems, key, _row, test_fraction, self.name, seed)

    def split_rows(self, split: str) -> list[dict]:
        """Every row of ``split``, in seeded order."""
        return self._splits[split]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """1.0 for a valid expression reaching the target (``countdown_reward``)."""
        return countdown_reward(prompts, completions, **columns)

    def answer(self, completion: str) -> Hashable | None:
        """(value, sorted numbers used) of the final expression, what ``countdown_reward`` checks; None if it does not parse.

        Neither the expression's text nor its value alone. The value alone says little, as the target is in the
        prompt, and the reward also checks the numbers used: a value vote would pool "(2 + 3) * 4" with "20", which
        uses a number that was not given, and their common answer would be right for one and wrong for the other.
        The text would split spellings of one solution ("(2 + 3) * 4", "4 * (3 + 2)") into separate votes. The
        reward depends on the completion only through this pair, so equal answers score alike.
        """
        parsed = parse_expression(final_expression(completion))
        return None if parsed is None else (parsed[0], tuple(sorted(parsed[1])))
