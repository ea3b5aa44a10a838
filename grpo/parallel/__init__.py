"""Parallel strategies, chosen by `parallel.strategy` from this registry. Entries are imported when
used, so importing the package does not load DeepSpeed."""

from __future__ import annotations

import importlib

from grpo.parallel.base import Strategy

STRATEGIES = {
    "single": "grpo.parallel.single:SingleStrategy",
    "ddp": "grpo.parallel.ddp:DDPStrategy",
    "zero2": "grpo.parallel.zero:Zero2Strategy",
    "zero3": "grpo.parallel.zero:Zero3Strategy",
}


def strategy_class(name: str) -> type[Strategy]:
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_strategy(cfg, model, algo, total_steps: int) -> Strategy:
    return strategy_class(cfg.strategy)(cfg, model, algo, total_steps)


__all__ = ["STRATEGIES", "Strategy", "build_strategy", "strategy_class"]
