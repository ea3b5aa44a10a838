"""The trainer's half of vLLM's own `nccl` weight-transfer engine (vLLM 0.33,
`vllm/distributed/weight_transfer/nccl_engine.py`), for GPU servers.

The server half is vLLM's: `--weight-transfer-config '{"backend": "nccl"}'`. This sender is rank 0
of a NCCL group with one server's workers (ranks 1..tp), made by vLLM's own `trainer_init` over a
TCP-store rendezvous, in vLLM's unpacked mode: for each `/update_weights` call, which names the
bucket's tensors, one broadcast per tensor in that order, straight from GPU memory. It plugs into
the same client (grpo/rollout/servers.py) as `grpo_gloo`, so everything but the bytes' path is what
the CPU tests run. Written against vLLM 0.33.0's source; not yet run on a GPU (docs/gpu.md).
"""

from __future__ import annotations

import torch


class NcclSender:
    def __init__(self, host: str, port: int, world_size: int, timeout_s: float):
        self.host, self.port, self.world_size = host, port, world_size
        self.comm = None

    def init_info(self) -> dict:
        """vLLM's NCCLWeightTransferInitInfo, field for field (it rejects unknown keys)."""
        return {"master_address": self.host, "master_port": self.port, "rank_offset": 1,
                "world_size": self.world_size, "packed": False}

    def connect(self) -> None:
        """Blocks until every worker joined; call while the server's init request is in flight."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": self.host, "master_port": self.port, "world_size": self.world_size})

    @staticmethod
    def prepare(bucket: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The bucket's tensors on this rank's GPU, contiguous (NCCL sends numel elements from data_ptr)."""
        device = torch.device("cuda", torch.cuda.current_device())
        return [t.detach().to(device).contiguous() for _, t in bucket]

    def send(self, tensors: list[torch.Tensor]) -> None:
        stream = torch.cuda.current_stream()
        for t in tensors:
            self.comm.broadcast(t, src=0, stream=stream)
        stream.synchronize()  # the caller may change the parameters as soon as this returns

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
