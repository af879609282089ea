"""A calculator tool: the policy may write a call, the environment answers with its result (for the chained task).

A turn that holds a call (the model's own format where its chat template renders tools, Hermes / Qwen style

    <tool_call>{"name": "calculator", "arguments": {"expression": "(3 + 4) * 2"}}</tool_call>

or the plain form the system prompt teaches, `<calc>(3 + 4) * 2</calc>`) ends there (the closing tag is a stop string)
and the environment answers with the value, as a "tool" message. A turn without a call is the final answer: the episode
ends and the run's reward (the task's) scores that turn. Expressions are integers with + - * // ( ) and unary minus,
evaluated on their syntax tree (never eval), at most MAX_CHARS characters and MAX_DIGITS digits in every value.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from gcfamily.envs.base import Environment, Step

MAX_CHARS = 200
MAX_DIGITS = 30
_PLAIN = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expression: str) -> int:
    """The integer value of an arithmetic expression; ValueError for anything else (said to the policy)."""
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("the expression does not parse") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
            right = value(node.right)
            if right == 0:
                raise ValueError("division by zero")
            out = value(node.left) // right
        else:
            raise ValueError("only integers, + - * // and parentheses are allowed")
        if len(str(abs(out))) > MAX_DIGITS:
            raise ValueError(f"a value has more than {MAX_DIGITS} digits")
        return out

    return value(tree.body)


def find_call(turn: str) -> str | None:
    """The expression of the turn's last calculator call, or None when it makes none."""
    calls: list[tuple[int, str]] = [(m.start(), m.group(1)) for m in _PLAIN.finditer(turn)]
    for m in _HERMES.finditer(turn):
        try:
            call = json.loads(m.group(1))
            args = call.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            calls.append((m.start(), str(args["expression"])))
        except (ValueError, KeyError, TypeError, AttributeError):
            calls.append((m.start(), ""))  # a malformed call is still a call: the answer says why it failed
    return max(calls)[1] if calls else None


class Calculator(Environment):
    """A calculator tool for arithmetic tasks (module docstring)."""

    role = "tool"
    system = (
        "You may use a calculator: write <calc>EXPRESSION</calc> (integers, + - * and parentheses) and stop; its "
        "result comes back to you. End with a line 'Answer: <number>'."
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "The value of an integer arithmetic expression with + - * // and parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
                    "required": ["expression"],
                },
            },
        }
    ]
    stop = ("</calc>", "</tool_call>")

    def __init__(self, row: dict[str, Any]) -> None:
        super().__init__(row)
        self.calls = 0

    def step(self, turn: str) -> Step:
        expression = find_call(turn)
        if expression is None:
            return Step(done=True)  # the final answer: the task's reward scores it
        self.calls += 1
        try:
            return Step(str(evaluate(expression)))
        except ValueError as e:
            return Step(f"error: {e}")
