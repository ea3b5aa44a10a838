"""The one interface every parallel strategy implements: wrap, backward, step, weight buckets for
sync, save, load. The loop never asks which strategy it has."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

import torch

from grpo.dist import all_reduce_sum
from grpo.rollout.base import WeightBuckets


def build_optimizer(model: torch.nn.Module, algo, total_steps: int):
    """AdamW with linear warmup, then linear decay to 0 at the last optimizer step (or constant).
    A high learning rate without warmup collapses a small policy on its first update."""
    opt = torch.optim.AdamW(model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay)

    def factor(step: int) -> float:
        if step < algo.warmup_steps:
            return (step + 1) / (algo.warmup_steps + 1)
        if algo.lr_schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(1, total_steps - algo.warmup_steps))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def bucket_tensors(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> WeightBuckets:
    """Group (name, tensor) pairs into buckets of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class Strategy(ABC):
    model: torch.nn.Module  # the unwrapped module: forward passes and rollout backends use it
    lockstep = False  # True: every rank must make the same forward/backward calls (sharded parameters)

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

    @abstractmethod
    def save(self, folder: str) -> None: ...

    @abstractmethod
    def load(self, folder: str) -> None: ...

    @property
    @abstractmethod
    def lr(self) -> float: ...
