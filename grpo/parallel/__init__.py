"""Parallel strategies, chosen by `parallel.strategy` from this registry."""

from __future__ import annotations

from grpo.parallel.base import Strategy
from grpo.parallel.ddp import DDPStrategy
from grpo.parallel.single import SingleStrategy
from grpo.parallel.zero import Zero2Strategy, Zero3Strategy

STRATEGIES = {
    "single": SingleStrategy,
    "ddp": DDPStrategy,
    "zero2": Zero2Strategy,
    "zero3": Zero3Strategy,
}


def build_strategy(cfg, model, algo, total_steps: int) -> Strategy:
    return STRATEGIES[cfg.strategy](cfg, model, algo, total_steps)


__all__ = ["STRATEGIES", "Strategy", "build_strategy"]
