"""The one interface every parallel strategy implements: wrap, backward, step, weight buckets for
sync, save, load. The loop never asks which strategy it has."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch

from grpo.dist import all_reduce_sum
from grpo.errors import ConfigError
from grpo.weights import WeightBuckets


def fused_adamw(params: list[torch.Tensor]) -> bool:
    """Whether AdamW runs torch's fused kernel: one pass over each parameter instead of foreach's
    several, the same update to float rounding (fp32: 3e-8 after 5 steps). On 2 CPU cores a step of
    SmolLM2-135M's AdamW took 0.09 s fused against 0.48 s foreach, a fifth of that model's update
    (docs/results/mfu.md). Where torch has the kernel: floating-point parameters on CPU or CUDA."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def build_optimizer(model: torch.nn.Module, algo, total_steps: int):
    """AdamW with linear warmup, then linear decay to 0 at the last optimizer step (or constant).
    A high learning rate without warmup collapses a small policy on its first update."""
    # only what trains: with LoRA (model.lora.rank > 0) the adapter's parameters, not the frozen base
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=algo.lr, weight_decay=algo.weight_decay, fused=fused_adamw(params))

    def factor(step: int) -> float:
        if step < algo.warmup_steps:
            return (step + 1) / (algo.warmup_steps + 1)
        if algo.lr_schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(1, total_steps - algo.warmup_steps))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def resume_schedule(scheduler, algo) -> None:
    """After a resume's load: this run's own algo.lr and algo.weight_decay, and its schedule at the
    optimizer step the checkpoint reached. torch's `load_state_dict` puts back the saved param groups'
    lr and weight_decay and LambdaLR's base_lrs, so a resume asked for a lower lr trained on at the
    old one, and a finished run continued to more steps took the old schedule's last lr (0 under the
    linear decay) for its next step. LambdaLR saves no function: its factor is already this run's
    (`build_optimizer`, over this run's optimizer steps); its last_epoch, the steps taken, is the
    checkpoint's. `scheduler.optimizer` is the torch optimizer DeepSpeed's ZeRO wraps too."""
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [float(algo.lr) for _ in groups]
    lrs = [float(algo.lr) * factor(scheduler.last_epoch) for factor in scheduler.lr_lambdas]
    for group, lr in zip(groups, lrs, strict=True):
        group.update(initial_lr=float(algo.lr), weight_decay=float(algo.weight_decay), lr=lr)
    scheduler._last_lr = lrs  # what get_last_lr() (the logged lr) reads


# parallel.* settings only some strategies read: (the schema's default, the strategies that read it)
OWN_SETTINGS = {
    "offload_optimizer": (False, "parallel=zero2|zero3|zero3_offload"),
    "deepspeed_config": (None, "parallel=zero2|zero3|zero3_offload"),
    "cpu_shm_allreduce": (False, "parallel=zero2|zero3|zero3_offload"),
    "allreduce_bucket_mb": (25.0, "parallel=ddp"),
}


class Strategy(ABC):
    model: torch.nn.Module  # the unwrapped module: forward passes and rollout backends use it
    lockstep = False  # True: every rank must make the same forward/backward calls (sharded parameters)
    replicated = False  # True: each rank steps a full copy of its own, which can drift apart (grpo/guards.py's rank check)
    sequence = None  # parallel.sequence_parallel > 1: this rank's group sharing rows (grpo/parallel/sequence.py)
    scheduler: torch.optim.lr_scheduler.LambdaLR  # build_optimizer's schedule (ZeRO: the engine's)

    reads: tuple[str, ...] = ()  # the keys of `OWN_SETTINGS` this strategy reads

    @classmethod
    def check(cls, cfg, world: int) -> None:
        """Raise ConfigError for parallel.* settings this strategy cannot honour with `world` processes
        (called by grpo.config.validate), and for one that only other strategies read, set away from
        its default (it would change nothing: `parallel.cpu_shm_allreduce=true` under ddp)."""
        for key, (default, where) in OWN_SETTINGS.items():
            if key not in cls.reads and cfg[key] != default:
                raise ConfigError(f"parallel.{key}={cfg[key]} is read by {where} only; parallel={cfg.strategy} "
                                  f"ignores it. Use {where}, or drop the setting.")
        if cfg.check_ranks_every < 0:
            raise ConfigError(f"parallel.check_ranks_every={cfg.check_ranks_every} must be >= 0 (steps between the ranks' "
                              f"weight comparisons; 0: never).")
        if not cfg.sync_bucket_mb > 0:
            raise ConfigError(f"parallel.sync_bucket_mb={cfg.sync_bucket_mb:g} must be > 0 (MB of weights sent to the engines "
                              f"per bucket; the default is 64).")

    @classmethod
    def check_lora(cls, cfg, lora, world: int) -> None:
        """Raise ConfigError if this strategy cannot train a LoRA adapter (`model.lora`, rank > 0);
        called by grpo.config.validate only when LoRA is on."""

    @classmethod
    def loading(cls, cfg, algo, dtype: torch.dtype) -> contextlib.AbstractContextManager:
        """The context the policy and the reference are loaded in (`from_pretrained`): nothing by
        default; ZeRO-3 builds them partitioned, so no rank ever holds a whole model."""
        return contextlib.nullcontext()

    def prepare_reference(self, ref: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference model (algo.beta > 0), as loaded, made to run its forward passes
        exactly as the policy's do (device, weight dtype, autocast, sharding): at the first update,
        before any step, the reference and the policy then give the same logprobs and the KL is 0."""
        return ref

    @property
    def forward_model(self) -> torch.nn.Module:
        """What training forward passes call: the module, or a wrapper that must see each forward."""
        return self.model

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    def reduce_counts(self, values: list[float]) -> list[float]:
        """Sum over ranks of per-rank counts (tokens, sequences): loss normalisers are global."""
        return all_reduce_sum(values)

    @abstractmethod
    def step(self) -> float:
        """Clip, optimizer step, scheduler step, zero grads; returns the gradient norm."""

    @abstractmethod
    def weight_buckets(self, bucket_bytes: int) -> WeightBuckets:
        """Full (unsharded) weights in buckets, gathered lazily bucket by bucket."""

    def export_buckets(self, bucket_bytes: int) -> WeightBuckets:
        """Full weights for the exported model: the sync's buckets, except that with LoRA those hold
        the adapter alone and the export wants it merged into the base."""
        return self.weight_buckets(bucket_bytes)

    @abstractmethod
    def save(self, folder: str) -> None: ...

    @abstractmethod
    def load(self, folder: str) -> None: ...

    @property
    @abstractmethod
    def lr(self) -> float: ...
