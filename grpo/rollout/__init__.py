"""Rollout backends, chosen by `rollout.backend` from this registry."""

from __future__ import annotations

from grpo.rollout.base import RolloutBackend, Rollouts, Sampling
from grpo.rollout.colocated import ColocatedBackend
from grpo.rollout.dedicated import DedicatedBackend
from grpo.rollout.hf import HFBackend
from grpo.rollout.remote import RemoteBackend

BACKENDS = {
    "hf": HFBackend,
    "colocated": ColocatedBackend,
    "dedicated": DedicatedBackend,
    "remote": RemoteBackend,
}


def build_rollout(cfg, model, tokenizer, model_path: str, dtype: str = "float32", seed: int = 0, run_dir: str = ".") -> RolloutBackend:
    """`model` is the trainer's module (hf shares it); `model_path` the HF folder engines load."""
    return BACKENDS[cfg.backend](cfg, model, tokenizer, model_path, dtype=dtype, seed=seed, run_dir=run_dir)


def sampling_from(cfg, greedy: bool = False) -> Sampling:
    return Sampling(
        max_new_tokens=cfg.max_new_tokens,
        temperature=0.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
    )


__all__ = ["BACKENDS", "RolloutBackend", "Rollouts", "Sampling", "build_rollout", "sampling_from"]
