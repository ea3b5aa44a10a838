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
- LoRA (`model.lora.rank` > 0): servers started with `grpo.serve --lora-rank R`; rank 0 writes each
  adapter version into `RUN_DIR/adapters/remote/v<version>` and every server loads it from there
  through vLLM's /v1/load_lora_adapter, so the servers must see the run folder at the same path (a
  shared file system, as multi-node runs need for checkpoints anyway).
- The servers may run any vLLM from 0.26.0 to 0.33.x, each its own: what differs between releases is
  decided from each server's /version (grpo/rollout/vllm_api.py, servers.py `ServerPool.vllm`).
- Every request carries `Authorization: Bearer <token>` when a token is set ($GRPO_SERVE_TOKEN or
  rollout.remote.token_file); plain http to a host other than loopback carries it only with
  `rollout.remote.allow_plain_http=true` (grpo/auth.py).
"""

from __future__ import annotations

import ipaddress
import os
from concurrent.futures import Future

import torch

from grpo import dist, lora, vision
from grpo.endpoints import check_distinct, check_urls
from grpo.errors import ConfigError, ServerError
from grpo.progress import say
from grpo.auth import TOKEN_ENV, client_token
from grpo.moe import routing
from grpo.rollout.base import RolloutBackend, Rollouts, Sampling, queued
from grpo.rollout_config import VLLM_READERS
from grpo.rollout.trajectories import episode_driver
from grpo.rollout.push import TRANSFERS, push_adapter_from_one_rank, push_from_one_rank, transfer_backend
from grpo.rollout.servers import ServerPool, TurnGate, in_thread
from grpo.weights import WeightBuckets


def servers_token(rc) -> str | None:
    """The rollout servers' token (rollout.remote.token_file, else $GRPO_SERVE_TOKEN), once their URLs may carry it."""
    return client_token(rc.token_file, TOKEN_ENV, rc.urls, rc.allow_plain_http, "rollout.remote")


def check_transfer_host(host: str | None) -> None:
    """rollout.remote.transfer_host is the address the servers reach the trainer's weight-transfer
    rendezvous at, and the one it listens on: a wildcard (0.0.0.0, ::) would listen on every interface
    of the trainer's node, open to anyone who can reach it, and tell the servers no address they can use."""
    if not host:  # unset: the route to the first server (servers.py ServerPool)
        return
    try:
        wildcard = ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:  # a host name: resolved where it is used
        wildcard = False
    if wildcard:
        raise ConfigError(f"rollout.remote.transfer_host={host!r} is a wildcard: give the trainer's own address as the "
                          f"servers reach it (e.g. its IP on the cluster's network), or leave it unset to use the "
                          f"route to the first server.")


def check_positive(rc) -> None:
    """rollout.remote's size and timeouts: a tensor-parallel size of 0 divided by zero in grpo.launch
    (`servers_per_node`); a timeout <= 0 gives a server no time to answer."""
    if rc.tensor_parallel_size < 1:
        raise ConfigError(f"rollout.remote.tensor_parallel_size={rc.tensor_parallel_size} must be >= 1 (GPUs per server).")
    for key in ("health_timeout_s", "request_timeout_s"):
        if not rc[key] > 0:
            raise ConfigError(f"rollout.remote.{key}={rc[key]} must be > 0 seconds.")


class RemoteBackend(RolloutBackend):
    reads_vllm = VLLM_READERS["remote"]
    overlaps_training = True  # the servers generate while the trainer updates (algo.max_staleness)
    returns_routes = True  # servers started with --routed-experts, on GPUs (grpo/moe/served_routes.py; not yet run)
    schedules_trajectories = True  # generation is no collective: episodes can run per trajectory

    @classmethod
    def check(cls, cfg, world: int) -> None:
        if cfg.vllm.weight_transfer not in TRANSFERS:
            raise ConfigError(f"rollout.vllm.weight_transfer={cfg.vllm.weight_transfer!r}: choose one of {', '.join(TRANSFERS)}.")
        if not cfg.remote.urls:
            raise ConfigError("rollout=remote needs rollout.remote.urls=[http://host:port,...]: start them with `python -m grpo.serve`.")
        check_urls(cfg.remote.urls, "rollout.remote.urls")
        # twice in the pool, one server would be asked to join the weight transfer twice (a second group over its first)
        check_distinct(cfg.remote.urls, "rollout.remote.urls", "each server joins the trainer's weight transfer once")
        check_positive(cfg.remote)
        servers_token(cfg.remote)
        check_transfer_host(cfg.remote.transfer_host)

    def __init__(self, cfg, model, tokenizer, model_path: str | None = None, run_dir: str = ".",
                 partial_rollouts: bool = False, **_):
        rc = cfg.remote
        self.schedule = cfg.schedule
        if not rc.urls:
            raise ServerError("rollout=remote needs rollout.remote.urls=[http://host:port,...] (see `python -m grpo.serve`).")
        routing.check_policy(model, cfg)  # before the servers are waited for and joined: a config error at once
        # each server's transfer group is sized by the server's own world (/get_world_size), not by
        # rc.tensor_parallel_size (grpo.launch's placement of the servers it starts)
        self.pool = ServerPool(list(rc.urls), servers_token(rc), rc.health_timeout_s, rc.request_timeout_s,
                               rc.transfer_host, can_push=dist.rank() == 0,
                               transfer=transfer_backend(cfg.vllm.weight_transfer, torch.cuda.is_available()),
                               log=say if dist.rank() == 0 else None,  # every rank waits; rank 0 says so
                               clients=dist.world_size())  # every rank sends its own batch to the same servers
        self.pool.images = vision.is_vision_model(getattr(model, "config", None))
        self.pool.routes = routing.wants_routes(cfg)  # each choice's routed experts (grpo/moe/served_routes.py)
        self.weight_version = 0
        self.lora_model = model if lora.is_lora(model) else None
        self.adapter_dir = os.path.join(os.path.abspath(run_dir), "adapters", "remote")
        self.max_context = self.pool.max_context
        if partial_rollouts:
            self.pool.gate = TurnGate(self.weight_version)

    def submit_episodes(self, prompt_ids, samples, n, sampling, runner) -> Future:
        """The episodes run as one batch, per trajectory or turn by turn (rollout.schedule; `episode_driver`):
        on the pool's generator thread after the batches before it, or with partial rollouts on a thread of
        their own at once, so the batches in flight overlap on the servers."""
        drive = episode_driver(self.schedule, runner, self.pool, self.weight_version)
        if self.pool.gate is not None:
            return in_thread(drive, prompt_ids, samples, n, sampling)
        return queued(self.pool.generator, drive, prompt_ids, samples, n, sampling)

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        return self.submit_completions(prompt_ids, n, sampling).result()

    def submit_completions(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Future:
        return self.pool.submit(prompt_ids, n, sampling, self.weight_version)

    def engine_busy_s(self) -> float | None:
        """This rank's requests (every rank sends its own batch to the same servers)."""
        return sum(s.occupancy.busy_s() for s in self.pool.servers)

    def update_weights(self, buckets: WeightBuckets, version: int) -> None:
        if self.lora_model is not None:
            push_adapter_from_one_rank(self.pool if dist.rank() == 0 else None, self.lora_model, buckets, version,
                                       self.adapter_dir, own=self.pool)  # every rank's pool asks for the new adapter
        else:
            push_from_one_rank(self.pool if dist.rank() == 0 else None, buckets, version, own=self.pool)
        self.weight_version = version

    def close(self) -> None:
        self.pool.close()
