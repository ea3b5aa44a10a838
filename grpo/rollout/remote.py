"""vLLM servers by URL (started by `python -m grpo.serve`), usually on other nodes.

- Before training, every server's /health is checked until `health_timeout_s`; an unreachable
  one is an error naming it.
- The whole batch is split across the servers by load: each server gets a contiguous share of the
  prompts proportional to the throughput it showed on earlier batches (equal at first), and all
  G completions of a prompt go to the same server. The shares are requested in parallel.
- Weights go to every server through vLLM's RL routes (servers.py): one /update_weights call per
  bucket, carried by `grpo_gloo` on CPU or vLLM's `nccl` between GPUs
  (`rollout.vllm.weight_transfer`, matching the servers' `--weight-transfer`). With several
  trainer ranks only rank 0 pushes (replicas are identical); the others wait at a barrier.
- Every request carries `Authorization: Bearer <token>` when a token is set ($GRPO_SERVE_TOKEN or
  rollout.remote.token_file; grpo/rollout/auth.py).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from grpo import dist
from grpo.errors import ConfigError, ServerError, TokenError
from grpo.rollout.auth import load_token, read_token_file
from grpo.rollout.base import RolloutBackend, Rollouts, Sampling
from grpo.rollout.servers import TRANSFERS, ServerPool, push_from_one_rank, transfer_backend
from grpo.weights import WeightBuckets


class RemoteBackend(RolloutBackend):
    overlaps_training = True  # the servers generate while the trainer updates (algo.max_staleness)

    @classmethod
    def check(cls, cfg, world: int) -> None:
        if cfg.vllm.weight_transfer not in TRANSFERS:
            raise ConfigError(f"rollout.vllm.weight_transfer={cfg.vllm.weight_transfer!r}: choose one of {', '.join(TRANSFERS)}.")
        if not cfg.remote.urls:
            raise ConfigError("rollout=remote needs rollout.remote.urls=[http://host:port,...]: start them with `python -m grpo.serve`.")
        if cfg.remote.token_file:
            try:
                read_token_file(cfg.remote.token_file)
            except TokenError as e:
                raise ConfigError(f"rollout.remote.token_file: {e}") from e

    def __init__(self, cfg, model, tokenizer, model_path: str | None = None, **_):
        rc = cfg.remote
        if not rc.urls:
            raise ServerError("rollout=remote needs rollout.remote.urls=[http://host:port,...] (see `python -m grpo.serve`).")
        self.pool = ServerPool(list(rc.urls), load_token(rc.token_file), rc.health_timeout_s, rc.request_timeout_s,
                               rc.tensor_parallel_size, rc.transfer_host, can_push=dist.rank() == 0,
                               transfer=transfer_backend(cfg.vllm.weight_transfer, torch.cuda.is_available()))
        self.weight_version = 0

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        return self.submit(prompt_ids, n, sampling).result()

    def submit(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Future:
        return self.pool.submit(prompt_ids, n, sampling, self.weight_version)

    def update_weights(self, buckets: WeightBuckets, version: int) -> None:
        push_from_one_rank(self.pool if dist.rank() == 0 else None, buckets, version, own=self.pool)
        self.weight_version = version

    def close(self) -> None:
        self.pool.close()
