"""Tool use: `ToolEnv` turns a policy turn into a call of a plain Python function and its result (or
error) into the observation; a turn that is not a call is the final answer and ends the episode.

A call is one line `name: argument` (e.g. `calc: 123+456`); the observation is ` = result` or
` error: what went wrong`. Subclass and override `parse_call` / `format_result` for another syntax
(JSON, XML tags), and pass any callables as `tools`.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Callable

from grpo.dotted import import_dotted
from grpo.envs.base import Step, TextEnv
from grpo.errors import ConfigError
from grpo.timeouts import call_with_timeout

CALL = re.compile(r"^\s*([A-Za-z_][\w]*)\s*:\s*(.*?)\s*$", re.DOTALL)
TOOL_NAME = re.compile(r"[A-Za-z_]\w*")  # the names CALL can match

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
       ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Integer arithmetic (+ - * // %) on literals, by walking the syntax tree: never `eval`."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**30:
                raise ValueError("result too large")
            return OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported expression {ast.dump(node)[:40]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return str(walk(ast.parse(expression.strip(), mode="eval")))


class ToolEnv(TextEnv):
    def __init__(self, tools: dict[str, Callable] | None = None, tool_timeout_s: float = 5.0):
        self.tools = {name: self.resolve(name, tool) for name, tool in dict(tools or {}).items()}
        self.tool_timeout_s = tool_timeout_s

    def resolve(self, name, tool) -> Callable:
        """A tool as given (a callable, or from the config its dotted path `module.function`), checked now:
        a name the call syntax cannot match made every call of it a final answer, and a tool that is not
        callable failed every call (both without a word to the user)."""
        if type(self).parse_call is ToolEnv.parse_call and not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            raise ConfigError(f"tool name {name!r}: a call is `name: argument` with a name of letters, digits and _ "
                              f"(not starting with a digit), so no turn could ever call it; rename it.")
        if isinstance(tool, str) and "." in tool:
            tool = import_dotted(tool, f"tool {name!r}={tool!r}")
        if not callable(tool):
            raise ConfigError(f"tool {name!r} is {type(tool).__name__} {str(tool)[:40]!r}, not a function: pass a "
                              f"callable, or its dotted path (module.function).")
        return tool

    def parse_call(self, action: str) -> tuple[str, str] | None:
        """(tool name, argument) when the turn is a call of a known tool, else None (a final answer)."""
        m = CALL.match(action)
        return (m.group(1), m.group(2)) if m and m.group(1) in self.tools else None

    def format_result(self, result: str | None, error: str | None) -> str:
        return f" = {result}" if error is None else f" error: {error}"

    def step(self, action: str) -> Step:
        call = self.parse_call(action)
        if call is None:
            return Step(None, None, True, {"tool_call": False})
        name, arg = call
        result, error = call_with_timeout(lambda: str(self.tools[name](arg)), self.tool_timeout_s, "tool_timeout_s",
                                            stop_if_hung=False)
        return Step(self.format_result(result, error), None, False, {"tool_call": True, "tool_error": error})


class CalcEnv(ToolEnv):
    """A calculator tool (`calc: 123+456` -> ` = 579`); the final answer is scored by the task's rewards."""

    def __init__(self, tool_timeout_s: float = 5.0):
        super().__init__({"calc": calculator}, tool_timeout_s)
