"""Rollout backends, chosen by `rollout.backend` from this registry. Entries are imported when used,
so importing the package (or a strategy, or the config) does not load every backend."""

from __future__ import annotations

import importlib

from grpo.rollout.base import RolloutBackend, Rollouts, Sampling, finished_at  # noqa: F401 - train.py imports it from here
from grpo.rollout.episodes import build_episodes
from grpo.rollout.hf import folder_stop_ids

BACKENDS = {
    "hf": "grpo.rollout.hf:HFBackend",
    "colocated": "grpo.rollout.colocated:ColocatedBackend",
    "dedicated": "grpo.rollout.dedicated:DedicatedBackend",
    "remote": "grpo.rollout.remote:RemoteBackend",
}


def backend_class(name: str) -> type[RolloutBackend]:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_rollout(cfg, model, tokenizer, model_path: str, dtype: str = "float32", seed: int = 0, run_dir: str = ".",
                  lockstep: bool = False, partial_rollouts: bool = False, env=None, task=None) -> RolloutBackend:
    """`model` is the trainer's module (hf shares it); `model_path` the HF folder engines load;
    `lockstep`: the strategy's forward passes are collectives every rank must join (ZeRO-3);
    `partial_rollouts`: algo.partial_rollouts (servers only: weights change between turns); `env` (the
    env config) and `task`: with an environment, `submit` plays whole episodes."""
    backend = backend_class(cfg.backend)(cfg, model, tokenizer, model_path, dtype=dtype, seed=seed, run_dir=run_dir,
                                         lockstep=lockstep, partial_rollouts=partial_rollouts)
    if env is not None:  # the engine's context bounds an episode's budget: known once the engines run
        try:
            # a turn ends on any of the ids the engines stop on (Qwen2.5-Instruct's <|endoftext|> too): the chat
            # renderer writes the template's separator after it
            backend.episodes = build_episodes(env, cfg.max_new_tokens, task, tokenizer, backend.max_context,
                                              folder_stop_ids(tokenizer.eos_token_id, model_path))
        except BaseException:  # an environment that cannot start leaves no engine running
            backend.close()
            raise
    return backend


def sampling_from(cfg, greedy: bool = False) -> Sampling:
    return Sampling(
        max_new_tokens=cfg.max_new_tokens,
        temperature=0.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
    )


__all__ = ["BACKENDS", "RolloutBackend", "Rollouts", "Sampling", "backend_class", "build_rollout", "sampling_from"]
