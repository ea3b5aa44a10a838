"""Weights from the trainer to the vLLM servers it generates through (`dedicated`, `remote`): which
weight-transfer engine a server runs and its trainer drives (`transfer_backend`), and the push from
the one rank that holds the servers while every other rank walks the same buckets (`push_from_one_rank`;
`push_adapter_from_one_rank` for LoRA's adapter alone). The per-bucket calls, the senders and the
versions are the pool's (servers.py, `ServerPool.push`)."""

from __future__ import annotations

import os
import shutil
from urllib.parse import urlparse

from grpo import dist, lora
from grpo.errors import ConfigError
from grpo.rollout.gloo_transfer import BACKEND as GLOO
from grpo.rollout.servers import ServerPool
from grpo.weights import WeightBuckets

TRANSFERS = ("auto", GLOO, "nccl")


def transfer_backend(setting: str, cuda: bool) -> str:
    """The weight-transfer engine a server runs and its trainer drives (`rollout.vllm.weight_transfer`,
    `grpo.serve --weight-transfer`): auto = vLLM's `nccl` where CUDA is, else `grpo_gloo`."""
    if setting not in TRANSFERS:
        raise ConfigError(f"weight_transfer={setting!r}: choose one of {', '.join(TRANSFERS)}.")
    if setting == "nccl" and not cuda:
        raise ConfigError("weight_transfer=nccl needs a CUDA device here; use auto or grpo_gloo on CPU.")
    if setting == "auto":
        return "nccl" if cuda else GLOO
    return setting


def nccl_peers(rollout_cfg, cuda: bool) -> tuple[str, ...]:
    """The hosts a run's trainer pushes weights to over NCCL: rollout=remote's servers, when their
    transfer is `nccl` (grpo.dist.process_group keeps NCCL on loopback when these and MASTER_ADDR are
    all on this node). Dedicated engines are on this node, colocated ones in the process."""
    if rollout_cfg.backend != "remote" or transfer_backend(rollout_cfg.vllm.weight_transfer, cuda) != "nccl":
        return ()
    return tuple(urlparse(url).hostname or url for url in rollout_cfg.remote.urls)


def push_adapter_from_one_rank(pool: ServerPool | None, model, buckets: WeightBuckets, version: int, folder: str,
                               own: ServerPool | None = None) -> None:
    """LoRA: the buckets hold the adapter alone. The rank holding `pool` writes it into
    `folder/v<version>` and has every server load it (then deletes the previous version's folder);
    the others walk the buckets (collectives under ZeRO-3) and all wait until it is loaded. Batches
    in flight finish first, as for full weights (`push_from_one_rank`). Every rank names the new
    adapter in its own pool (`use_adapter`) before its turns resume: a turn sent earlier would ask
    for the adapter rank 0 has just unloaded (a 404, its trajectory ended as "error")."""
    if own is not None:
        own.drain()
    dist.barrier()
    tensors = [(n, t.detach().to("cpu", copy=True)) for bucket in buckets for n, t in bucket]
    if pool is not None:
        path = lora.write_adapter(model, tensors, os.path.join(folder, f"v{version}"))
        pool.load_adapter(path, version)
        for old in os.listdir(folder):
            if old != f"v{version}" and old.startswith("v"):
                shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    dist.barrier()
    if own is not None:
        own.use_adapter(version)
        own.resume(version)


def push_from_one_rank(pool: ServerPool | None, buckets: WeightBuckets, version: int, own: ServerPool | None = None) -> None:
    """Replicas are identical: the rank holding `pool` pushes; the others walk the buckets (under
    ZeRO-3 each is gathered by a collective every rank joins) and all wait until the push is done.
    First every rank lets its own batches in flight finish (`own`: the pool it generates through)
    and all meet, so no server is generating for any rank while its weights change."""
    if own is not None:
        own.drain()
    dist.barrier()
    try:
        if pool is not None:
            pool.push(buckets, version)
        else:
            for _ in buckets:
                pass
        dist.barrier()
        if own is not None:  # every rank's pool: what the servers hold now (ServerPool.served_version)
            own.pushed = version
    finally:
        if own is not None:
            own.resume(version)


