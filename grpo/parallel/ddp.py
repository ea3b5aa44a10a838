"""Data parallel: a full replica on every rank; gradients summed across ranks once per optimizer step,
in buckets of `parallel.allreduce_bucket_mb`.

torch's DistributedDataParallel overlaps the reduce with backward, but needs every rank to run the
same forward/backward calls; here a rank's minibatch can be empty after zero-variance groups are
dropped, and micro-batch counts differ between ranks. Reducing once in `step()` keeps every rank
in lockstep with exactly one collective per optimizer step, whatever each rank computed.

Each bucket of gradients is flattened, all-reduced and copied back into the gradients it came
from, so the reduction holds one bucket's extra copy at a time (one flat copy of every gradient, and
a second from unflattening, held two full extra copies: 2 x 28 GB of fp32 gradients for a 7B model).

Gradients are summed, not averaged: the loss on each rank is already divided by counts over the
whole optimizer batch on all ranks (`Strategy.reduce_counts`), so their sum is the batch gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from grpo.errors import ConfigError
from grpo.parallel import sequence
from grpo.parallel.single import SingleStrategy
from grpo.parallel.zero import init_deepspeed_comm
from grpo.weights import group_by_size


def gradient_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters in groups of at most `bucket_bytes` of gradient, by dtype (one flat
    buffer holds one dtype); a larger parameter goes alone."""
    out = []
    for dtype in dict.fromkeys(p.dtype for p in params):
        same = [(str(i), p) for i, p in enumerate(params) if p.dtype == dtype]
        out += [[p for _, p in bucket] for bucket in group_by_size(same, bucket_bytes, lambda p: p.numel() * p.element_size())]
    return out


class DDPStrategy(SingleStrategy):
    reads = ("allreduce_bucket_mb",)

    @classmethod
    def check(cls, cfg, world: int) -> None:
        super().check(cfg, world)
        if not cfg.allreduce_bucket_mb > 0:  # 0: one bucket per parameter, silently slow
            raise ConfigError(f"parallel.allreduce_bucket_mb={cfg.allreduce_bucket_mb:g} must be > 0 (MB of gradients "
                              f"all-reduced at once; the default is 25).")

    def __init__(self, cfg, model: torch.nn.Module, algo, total_steps: int):
        if not tdist.is_initialized():
            raise ConfigError(
                "parallel=ddp needs several processes: launch with `torchrun --nproc_per_node N -m grpo.train "
                "parallel=ddp` (or srun), or use parallel=single."
            )
        super().__init__(cfg, model, algo, total_steps)
        if cfg.sequence_parallel > 1:
            init_deepspeed_comm(False)  # DeepSpeed's all-to-all carries the split rows' attention
        self.sequence = sequence.build(cfg.sequence_parallel, model)
        self.buckets = gradient_buckets([p for p in model.parameters() if p.requires_grad], int(cfg.allreduce_bucket_mb * 2**20))
        with torch.no_grad():  # every rank starts from rank 0's weights
            for p in model.parameters():
                tdist.broadcast(p.data, src=0)

    def reduce_gradients(self) -> None:
        for bucket in self.buckets:
            for p in bucket:
                if p.grad is None:  # this rank's micro-batches did not reach it; the others' may have
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            tdist.all_reduce(flat)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
