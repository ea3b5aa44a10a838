"""Countdown (TinyZero style): reach `target` using each of `numbers` exactly once with + - * /.

The equation is parsed with `ast` and evaluated by walking the tree: only numbers, the four
operators, unary minus and parentheses are accepted, so nothing in a completion can execute.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter

from grpo.rewards.format import extract_answer

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
OPERATOR = re.compile(r"[-+*/]")


class NotAnEquation(ValueError):
    pass


def evaluate(expr: str) -> tuple[float, list[float]]:
    """Value of an arithmetic expression and the numbers it uses; NotAnEquation for anything else."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise NotAnEquation(f"not an expression: {expr!r}") from e
    used: list[float] = []

    def walk(node) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            used.append(node.value)
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise NotAnEquation(f"{type(node).__name__} is not allowed in an equation")

    return walk(tree.body), used


def countdown(completions: list[str], samples: list, **_) -> list[float]:
    """1.0 when the answer (inside <answer> tags, else the whole completion) uses exactly the
    sample's `numbers` and equals its `target`; 0.0 otherwise (division by zero included)."""
    out = []
    for completion, sample in zip(completions, samples):
        expr = extract_answer(completion)
        expr = completion if expr is None else expr
        out.append(float(any(solves(side, sample.meta["numbers"], sample.meta["target"]) for side in expr.split("="))))
    return out


def solves(expr: str, numbers: list, target) -> bool:
    """Whether one side of the answer (`3 * 5 + 7 = 22` and `22 = 3 * 5 + 7` alike: either side may be
    the equation) uses exactly `numbers` and equals `target`."""
    if len(OPERATOR.findall(expr)) > most_operators(len(numbers)):
        return False
    try:
        value, used = evaluate(expr)
    except (NotAnEquation, ZeroDivisionError, OverflowError):
        return False
    return Counter(used) == Counter(numbers) and abs(value - target) < 1e-6


def most_operators(n: int) -> int:
    """The operators an answer that uses each of n numbers once needs at most: n - 1 operations, and a minus
    sign on each of the 2n - 1 terms they make (the numbers and each operation's result; a second sign on
    one only undoes the first). An answer with more scores 0 unread: `evaluate`'s walk recurses once per
    operator, and 1000 chained terms raised RecursionError, which failed the batch (its completions
    retried one at a time, that one excluded) where a wrong answer scores 0."""
    return (n - 1) + (2 * n - 1)
