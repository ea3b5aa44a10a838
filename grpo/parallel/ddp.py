"""Data parallel: a full replica on every rank; gradients summed across ranks in one flattened
all-reduce per optimizer step.

torch's DistributedDataParallel overlaps the reduce with backward, but needs every rank to run the
same forward/backward calls; here a rank's minibatch can be empty after zero-variance groups are
dropped, and micro-batch counts differ between ranks. Reducing once in `step()` keeps every rank
in lockstep with exactly one collective per optimizer step, whatever each rank computed.

Gradients are summed, not averaged: the loss on each rank is already divided by counts over the
whole optimizer batch on all ranks (`Strategy.reduce_counts`), so their sum is the batch gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from grpo.parallel.single import SingleStrategy


class DDPStrategy(SingleStrategy):
    def __init__(self, cfg, model: torch.nn.Module, algo, total_steps: int):
        if not tdist.is_initialized():
            raise RuntimeError(
                "parallel=ddp needs several processes: launch with `torchrun --nproc_per_node N -m grpo.train "
                "parallel=ddp` (or srun), or use parallel=single."
            )
        super().__init__(cfg, model, algo, total_steps)
        with torch.no_grad():  # every rank starts from rank 0's weights
            for p in model.parameters():
                tdist.broadcast(p.data, src=0)

    def reduce_gradients(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        tdist.all_reduce(flat)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            p.grad = g
