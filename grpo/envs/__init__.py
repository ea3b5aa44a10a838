"""Environments for multi-turn episodes, chosen by `env.name` from this registry or by dotted path
(`mypkg.envs.MyEnv`: a class or factory called with `env.kwargs`, and `task=` if it takes one).
`env=none` (the default) is the single-turn loop. See grpo/envs/base.py for the protocol and
docs/environments.md for writing one."""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

from grpo.envs.base import Env, Step, TextEnv
from grpo.envs.guess import GuessEnv
from grpo.envs.retry import RetryEnv
from grpo.envs.tools import CalcEnv, ToolEnv, calculator

ENVS: dict[str, Callable] = {
    "guess": GuessEnv,
    "calc": CalcEnv,
    "retry": lambda task, **kw: RetryEnv(task.is_correct, **kw),
}


def resolve_env(name: str) -> Callable:
    from grpo.errors import ConfigError

    if name in ENVS:
        return ENVS[name]
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ConfigError(f"env.name={name!r} is not none, one of {sorted(ENVS)}, nor a dotted path 'module.Class'.")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"env.name={name!r} could not be imported ({e}); check the dotted path.") from e
    if not callable(factory):
        raise ConfigError(f"env.name={name!r} is not a class or function.")
    return factory


def env_factory(cfg, task) -> Callable[[], Env]:
    """A function that builds one fresh environment (one per trajectory) from `env.kwargs`; the task
    is passed to factories that take a `task` argument (retry: its `is_correct`)."""
    factory = resolve_env(cfg.name)
    kwargs = dict(cfg.kwargs or {})
    try:
        wants_task = "task" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        wants_task = False
    if wants_task:
        kwargs["task"] = task
    return lambda: factory(**kwargs)


__all__ = ["ENVS", "CalcEnv", "Env", "GuessEnv", "RetryEnv", "Step", "TextEnv", "ToolEnv", "calculator",
           "env_factory", "resolve_env"]
