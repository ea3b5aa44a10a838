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
    sample's `numbers` and equals its `target`; 0.0 otherwise (division by zero included).

    Either side of an `=` may be the equation (`3 * 5 + 7 = 22` and `22 = 3 * 5 + 7` alike), and every side
    must equal the target: a false one (`3 * 5 + 7 = 21`) scored 1, and so did guesses joined by `=`
    (`(3 + 5) * 7 = 3 * 5 + 7 = 3 * 7 + 5`), which one answer can list by the dozen."""
    out = []
    for completion, sample in zip(completions, samples):
        expr = extract_answer(completion)
        expr = completion if expr is None else expr
        numbers, target = sample.meta["numbers"], sample.meta["target"]
        sides = [read(side, len(numbers)) for side in expr.split("=")]
        out.append(float(all(side is not None and abs(side[0] - target) < 1e-6 for side in sides)
                         and any(Counter(side[1]) == Counter(numbers) for side in sides)))
    return out


def read(expr: str, n: int) -> tuple[float, list[float]] | None:
    """`evaluate(expr)`, or None for anything but arithmetic, a division by zero, or more operators than an
    answer with n numbers takes (`most_operators`)."""
    if len(OPERATOR.findall(expr)) > most_operators(n):
        return None
    try:
        return evaluate(expr)
    except (NotAnEquation, ZeroDivisionError, OverflowError):
        return None


def most_operators(n: int) -> int:
    """The operators an answer that uses each of n numbers once needs at most: n - 1 operations, and a minus
    sign on each of the 2n - 1 terms they make (the numbers and each operation's result; a second sign on
    one only undoes the first). An answer with more scores 0 unread: `evaluate`'s walk recurses once per
    operator, and 1000 chained terms raised RecursionError, which failed the batch (its completions
    retried one at a time, that one excluded) where a wrong answer scores 0."""
    return (n - 1) + (2 * n - 1)
