"""Reward functions: `fn(completions: list[str], samples: list[Sample]) -> list[float | None]`.

None means the function does not apply to that completion. `reward.funcs` names functions from
`REWARDS` or by dotted path (`mypkg.rewards.my_reward`), each with a weight.
"""

from __future__ import annotations

import importlib
from typing import Callable

from grpo.rewards.exact_match import exact_match

RewardFn = Callable[..., list]

REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
}


def resolve_reward(name: str) -> RewardFn:
    from grpo.config import ConfigError

    if name in REWARDS:
        return REWARDS[name]
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ConfigError(f"reward {name!r} is not one of {sorted(REWARDS)} nor a dotted path 'module.function'.")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward {name!r} could not be imported ({e}); check the dotted path.") from e
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable.")
    return fn


def build_rewards(cfg) -> list[tuple[str, RewardFn, float]]:
    return [(f.name, resolve_reward(f.name), float(f.weight)) for f in cfg.funcs]


def score(reward_fns, completions: list[str], samples: list) -> tuple[list[list[float | None]], dict[str, float]]:
    """Run every reward function -> (rewards_FB, per-function mean for logging)."""
    rewards_FB, means = [], {}
    for name, fn, _ in reward_fns:
        values = list(fn(completions, samples))
        if len(values) != len(completions):
            raise RuntimeError(f"reward {name!r} returned {len(values)} values for {len(completions)} completions.")
        rewards_FB.append(values)
        scored = [v for v in values if v is not None]
        means[f"reward/{name}"] = sum(scored) / len(scored) if scored else float("nan")
    return rewards_FB, means
