"""Rollout backends, chosen by `rollout.backend` from this registry."""

from __future__ import annotations

from grpo.rollout.base import RolloutBackend, Rollouts, Sampling
from grpo.rollout.hf import HFBackend

BACKENDS = {
    "hf": HFBackend,
}


def build_rollout(cfg, model, tokenizer) -> RolloutBackend:
    return BACKENDS[cfg.backend](cfg, model, tokenizer)


def sampling_from(cfg, greedy: bool = False) -> Sampling:
    return Sampling(
        max_new_tokens=cfg.max_new_tokens,
        temperature=0.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
    )


__all__ = ["BACKENDS", "RolloutBackend", "Rollouts", "Sampling", "build_rollout", "sampling_from"]
