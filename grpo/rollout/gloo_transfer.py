"""Weight transfer from the trainer to vLLM servers over gloo: both halves.

vLLM ships NCCL and CUDA-IPC weight-transfer engines and a registry for more. On a machine without
a GPU neither runs, so this registers `grpo_gloo`: the same protocol (the server's
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`
routes) carried by a gloo process group of the trainer (rank 0) and the server's workers. Each
`/update_weights` call moves one packed bucket: the trainer broadcasts the bucket's bytes while the
worker, told the names, dtypes and shapes, unpacks them and loads them layer by layer.

The worker half reaches the server through vLLM's plugin entry point (`vllm.general_plugins`,
declared in setup.cfg), so `grpo.serve` and a plain vLLM server started from this environment both
know the backend.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

BACKEND = "grpo_gloo"


def _group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    from torch.distributed import ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return store, ProcessGroupGloo(store, rank, world_size, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def update_info(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    """What a server's /update_weights is told about one bucket: names, dtypes and shapes in order,
    the fields of both `grpo_gloo`'s and vLLM's `nccl` update info."""
    return {
        "names": [n for n, _ in bucket],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


def flatten(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One bucket's bytes as one flat uint8 tensor, in order (`unpack` with its update_info reverses it)."""
    tensors = [t.detach().contiguous().cpu() for _, t in bucket]
    return torch.cat([t.view(-1).view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)


def pack(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, dict]:
    """One bucket -> (a flat uint8 tensor, the update_info the worker needs to unpack it)."""
    return flatten(bucket), update_info(bucket)


def unpack(flat: torch.Tensor, names, dtype_names, shapes) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for name, dtype_name, shape in zip(names, dtype_names, shapes):
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
        offset += nbytes
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes but its metadata describes {offset}")
    return out


class GlooSender:
    """Trainer side: the TCP store's master and rank 0 of a group with one server's workers. The
    store listens from construction on a port the kernel picks (port 0, read back as `port`), so the
    port the server is told is already ours."""

    def __init__(self, host: str, world_size: int, timeout_s: float):
        from torch.distributed import TCPStore

        self.host, self.world_size, self.timeout_s = host, world_size, timeout_s
        self.store = TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        self.port = self.store.port
        self.group = None

    def init_info(self) -> dict:
        return {"master_address": self.host, "master_port": self.port, "rank_offset": 1,
                "world_size": self.world_size, "timeout_s": self.timeout_s}

    def connect(self) -> None:
        """Blocks until every worker joined; call while the server's init request is in flight."""
        from torch.distributed import ProcessGroupGloo

        self.group = ProcessGroupGloo(self.store, 0, self.world_size, datetime.timedelta(seconds=self.timeout_s))

    @staticmethod
    def prepare(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The bucket's bytes, packed once and sent to every server."""
        return flatten(bucket)

    def send(self, flat: torch.Tensor) -> None:
        _broadcast(self.group, flat)

    def abort(self) -> None:
        """The server refused its half: end a broadcast that waits for it (the group is unusable after)."""
        if self.group is not None:
            self.group.abort()

    def close(self) -> None:
        self.group = self.store = None


def _engine_classes():
    """The worker-side engine, defined only where vLLM is importable (inside a server)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 600.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list
        dtype_names: list
        shapes: list

    class GlooWeightTransferEngine(WeightTransferEngine):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def init_transfer_engine(self, init_info) -> None:
            worker = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.store, self.group = _group(
                init_info.master_address, init_info.master_port, init_info.rank_offset + worker,
                init_info.world_size, init_info.timeout_s,
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info) -> None:
            nbytes = sum(
                torch.Size(s).numel() * torch.empty((), dtype=getattr(torch, d)).element_size()
                for d, s in zip(update_info.dtype_names, update_info.shapes)
            )
            flat = torch.empty(nbytes, dtype=torch.uint8)
            _broadcast(self.group, flat)
            weights = unpack(flat, update_info.names, update_info.dtype_names, update_info.shapes)
            self.model.load_weights([(n, t.to(self.device)) for n, t in weights])

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.cuda.is_available():  # as vLLM's base class: the copies onto the GPU are done before the
                torch.cuda.synchronize(self.device)  # answer says "applied" (on CPU there is nothing to wait for)

        def shutdown(self) -> None:
            self.group = self.store = None

    return GlooWeightTransferEngine


def register() -> None:
    """vLLM plugin entry point: make `grpo_gloo` a weight-transfer backend in this process (and let
    Qwen2-VL load where torchvision cannot: grpo/rollout/no_torchvision.py; the engine's expected log lines
    explained once)."""
    from grpo.library_logs import explain_engine_logs
    from grpo.rollout import no_torchvision

    no_torchvision.install()
    explain_engine_logs()  # the engine's expected lines once, with what they mean (grpo/library_logs.py)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # vLLM without the RL API: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_classes())
