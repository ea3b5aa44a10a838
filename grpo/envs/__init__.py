"""Environments for multi-turn episodes, chosen by `env.name` from this registry or by dotted path
(`mypkg.envs.MyEnv`: a class or factory called with `env.kwargs`, and `task=` if it takes one).
`env=none` (the default) is the single-turn loop. See grpo/envs/base.py for the protocol and
docs/environments.md for writing one."""

from __future__ import annotations

import dataclasses
from typing import Callable

from omegaconf import OmegaConf

from grpo.envs.base import Env, Step, TextEnv
from grpo.envs.guess import GuessEnv
from grpo.envs.openenv import OpenEnvAdapter
from grpo.envs.retry import RetryEnv
from grpo.envs.tools import CalcEnv, ToolEnv, calculator
from grpo.dotted import bind_or_refuse, import_dotted, signature_of
from grpo.errors import ConfigError


def retry_env(task, message: str = " wrong, try again: ") -> Env:
    """env=retry: the task's own answer check (`task.is_correct`), another turn after a wrong answer."""
    return RetryEnv(task.is_correct, message)


ENVS: dict[str, Callable] = {
    "guess": GuessEnv,
    "calc": CalcEnv,
    "retry": retry_env,
    "openenv": OpenEnvAdapter,  # imports openenv-core only when an environment is built
}
# env -> the one task whose samples it plays: guess reads each sample's answer as its secret 1..15
# (task=guess's); on another task's prompts and answers (addition's "85") it plays no game the prompt asks for
ENV_TASKS: dict[str, str] = {"guess": "guess"}


def resolve_env(name: str) -> Callable:
    if name in ENVS:
        return ENVS[name]
    if "." not in name:
        raise ConfigError(f"env.name={name!r} is not none, one of {sorted(ENVS)}, nor a dotted path 'module.Class'.")
    factory = import_dotted(name, f"env.name={name!r}")
    if not callable(factory):
        raise ConfigError(f"env.name={name!r} is not a class or function.")
    return factory


def check(cfg) -> None:
    """env.* (validate's part; `cfg`: the run config; env.render's choice is validate's own): the
    environment can be found, and the budgets leave room for a turn."""
    e = cfg.env
    if e.name == "none":
        if any(f.name == "env" for f in cfg.reward.funcs):
            raise ConfigError("reward `env` scores an environment's episodes, but env=none; pick an env (env=guess) "
                              "or drop the env reward.")
        if e.kwargs:
            raise ConfigError(f"env.kwargs={dict(e.kwargs)} with env=none: no environment takes them; pick an env "
                              f"(env=guess) or drop them.")
        if inert := inert_settings(e, OmegaConf.get_type(e)()):
            raise ConfigError(f"{'; '.join(inert)} with env=none: single completions play no episode, so the setting has "
                              f"no effect. Pick an environment (env=guess, or env.name=<module.Class>), or remove the setting.")
        return
    check_kwargs(e.name, resolve_env(e.name), dict(e.kwargs or {}))
    check_tool_timeout(e, resolve_env(e.name))
    if e.name in ENV_TASKS and cfg.task.name != ENV_TASKS[e.name]:
        raise ConfigError(f"env={e.name} plays only task={ENV_TASKS[e.name]}'s samples, not task={cfg.task.name}'s "
                          f"(see grpo/envs/{e.name}.py): use task={ENV_TASKS[e.name]}, or an env that takes any task "
                          f"(env=retry).")
    if e.max_turns < 1 or e.max_observation_tokens < 1 or e.step_timeout_s <= 0:
        raise ConfigError("env.max_turns and env.max_observation_tokens must be >= 1 and env.step_timeout_s > 0.")
    if e.max_concurrency < 1:
        raise ConfigError(f"env.max_concurrency={e.max_concurrency}: the environments called at once must be >= 1 "
                          "(1 calls them one after another; the default 32).")
    if e.max_total_tokens and e.max_total_tokens < cfg.rollout.max_new_tokens:
        raise ConfigError(f"env.max_total_tokens={e.max_total_tokens} leaves no room for one turn of "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}; raise it (or 0 for max_turns x "
                          f"(max_new_tokens + max_observation_tokens)).")


def inert_settings(env_cfg, defaults) -> list[str]:
    """The env.* settings given (other than `defaults`', the schema's) with env=none, which reads none of
    them (env.max_turns=8 would change nothing, without a word); name and kwargs are `check`'s own."""
    keys = [f.name for f in dataclasses.fields(defaults) if f.name not in ("name", "kwargs")]
    return [f"env.{key}={getattr(env_cfg, key)!r}" for key in keys if getattr(env_cfg, key) != getattr(defaults, key)]


def check_tool_timeout(e, factory) -> None:
    """A ToolEnv's `tool_timeout_s` below `env.step_timeout_s`: the step runs the tool, so a tool past the step's
    timeout ended the whole episode as "error" (excluded from the rewards) instead of the tool error the policy
    reads and retries after, and tool_timeout_s did nothing."""
    if not (isinstance(factory, type) and issubclass(factory, ToolEnv)):
        return
    signature = signature_of(factory)
    parameter = signature.parameters.get("tool_timeout_s") if signature is not None else None
    tool_timeout_s = dict(e.kwargs or {}).get("tool_timeout_s", None if parameter is None else parameter.default)
    if isinstance(tool_timeout_s, (int, float)) and tool_timeout_s >= e.step_timeout_s:
        raise ConfigError(f"env.kwargs.tool_timeout_s={tool_timeout_s:g} is not below env.step_timeout_s="
                          f"{e.step_timeout_s:g}: a tool call that runs past the step's timeout ends its episode as "
                          f"'error' (excluded from the rewards) instead of a tool error the policy reads. Lower "
                          f"env.kwargs.tool_timeout_s or raise env.step_timeout_s.")


def check_kwargs(name: str, factory, kwargs: dict) -> None:
    """env.kwargs bound to the factory's signature now (a misspelt one failed at the first episode, after
    the model and the engines were built); `task` is the driver's to pass."""
    signature = signature_of(factory)
    if signature is not None and "task" in kwargs and "task" in signature.parameters:
        raise ConfigError(f"env.kwargs.task: the environment {name!r} is given the run's task; drop it from env.kwargs.")
    bind_or_refuse(factory, (), kwargs, partial=True, refusal=lambda signature, e: (
        f"env.kwargs={kwargs} do not fit env.name={name!r}{signature}: {e}. Fix the names."))


def env_factory(cfg, task) -> Callable[[], Env]:
    """A function that builds one fresh environment (one per trajectory) from `env.kwargs`; the task
    is passed to factories that take a `task` argument (retry: its `is_correct`)."""
    factory = resolve_env(cfg.name)
    kwargs = dict(cfg.kwargs or {})
    signature = signature_of(factory)
    if signature is not None and "task" in signature.parameters:
        kwargs["task"] = task
    return lambda: build_env(cfg.name, factory, kwargs)


def build_env(name: str, factory: Callable, kwargs: dict) -> Env:
    """One environment, or a ConfigError naming env.name and its kwargs: a constructor that raised was a bare
    traceback, and a factory that returned None failed every episode's reset with an AttributeError."""
    shown = {k: v for k, v in kwargs.items() if k != "task"}
    try:
        env = factory(**kwargs)
    except Exception as e:  # noqa: BLE001 - any failure to build is the same stop, with its cause
        raise ConfigError(f"env.name={name!r} with env.kwargs={shown} raised when built: {type(e).__name__}: {e}. Check "
                          f"env.kwargs and what the environment connects to (docs/environments.md).") from e
    missing = [m for m in ("reset", "step", "close") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"env.name={name!r} built {type(env).__name__} {str(env)[:40]!r}, which has no "
                          f"{', '.join(missing)}: an environment's factory returns an object with reset(sample, seed), "
                          f"step(action) and close() (docs/environments.md).")
    return env


__all__ = ["ENVS", "CalcEnv", "Env", "GuessEnv", "RetryEnv", "Step", "TextEnv", "ToolEnv", "calculator", "check",
           "env_factory", "resolve_env"]
