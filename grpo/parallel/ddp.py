"""Data parallel: a full replica on every rank; gradients summed across ranks in one flattened
all-reduce per optimizer step.

torch's DistributedDataParallel overlaps the reduce with backward, but needs every rank to run the
same forward/backward calls; here a rank's minibatch can be empty after zero-variance groups are
dropped, and micro-batch counts differ between ranks. Reducing once in `step()` keeps every rank
in lockstep with exactly one collective per optimizer step, whatever each rank computed.

Gradients are summed, not averaged: the loss on each rank is already divided by counts over the
whole optimizer batch on all ranks (see `reduce_counts`), so the sum is the full batch's gradient.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from grpo.parallel.base import Strategy, bucket_tensors, build_optimizer


class DDPStrategy(Strategy):
    def __init__(self, cfg, model: torch.nn.Module, algo, total_steps: int):
        if not dist.is_initialized():
            raise RuntimeError(
                "parallel=ddp needs several processes: launch with `torchrun --nproc_per_node N -m grpo.train "
                "parallel=ddp` (or srun), or use parallel=single."
            )
        self.model = model
        self.world_size = dist.get_world_size()
        self.max_grad_norm = algo.max_grad_norm
        self.optimizer, self.scheduler = build_optimizer(model, algo, total_steps)
        with torch.no_grad():  # every rank starts from rank 0's weights
            for p in model.parameters():
                dist.broadcast(p.data, src=0)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def reduce_counts(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            p.grad = g
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def weight_buckets(self, bucket_bytes: int):
        named = self.model.named_parameters(remove_duplicate=False)
        return bucket_tensors(((n, p.detach()) for n, p in named), bucket_bytes)

    def save(self, folder: str) -> None:
        if dist.get_rank() == 0:  # replicas are identical
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict()}
            torch.save(state, os.path.join(folder, "trainer.pt"))

    def load(self, folder: str) -> None:
        state = torch.load(os.path.join(folder, "trainer.pt"), map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]
