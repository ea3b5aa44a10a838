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
import importlib.metadata
import os
import threading
from dataclasses import dataclass, field

import torch

from grpo import listeners
from grpo.library_logs import explain_engine_logs
from grpo.moe import vllm_reload
from grpo.rollout import no_torchvision, rendezvous

BACKEND = "grpo_gloo"


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def joined(group):
    """The weight-transfer group a server's worker joined, or an error saying why it has none: vLLM
    answers an /update_weights before any /init_weight_transfer_engine (a server restarted under a
    running trainer) with this message and a 500."""
    if group is None:
        raise RuntimeError(f"this server has no {BACKEND} weight-transfer group: no trainer joined it since it started "
                           "(/init_weight_transfer_engine), or it was released. A server that restarted under a running "
                           "trainer lost the group and the pushed weights: restart the run, which resumes from its last "
                           "checkpoint and joins the servers again.")
    return group


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
    """Trainer side: the rendezvous's master and rank 0 of a group with one server's workers. The
    store listens from construction on `host` only, on a port the kernel picks (read back as `port`),
    so the port the server is told is already ours; the join is authenticated by this sender's own
    secret, which only the server's token-guarded init route is told (grpo/rollout/rendezvous.py),
    and the store stops listening once the group has formed."""

    def __init__(self, host: str, world_size: int, timeout_s: float):
        self.host, self.world_size, self.timeout_s = host, world_size, timeout_s
        self.secret = rendezvous.new_secret()
        self.store = rendezvous.bound_store(host, world_size, timeout_s)
        self.port = self.store.port
        self.where = f"{host}:{self.port}"
        self.join = self.group = None
        self.aborted = threading.Event()  # ends a join still waiting for the server's workers (`abort`)
        listeners.expect(host, self.port, "weight-transfer rendezvous (open until the group forms)")
        listeners.expect_process(os.getpid(), host, "gloo pairs of a weight-transfer group")

    def init_info(self) -> dict:
        return {"master_address": self.host, "master_port": self.port, "rank_offset": 1,
                "world_size": self.world_size, "timeout_s": self.timeout_s, "secret": self.secret}

    def connect(self) -> None:
        """Blocks until every worker joined and proved the secret; call while the server's init
        request is in flight. Keys another process wrote are reported once, then the store closes."""
        try:
            self.join = rendezvous.Join(self.store, self.secret, 0, self.world_size, self.host, self.timeout_s, self.where,
                                        self.aborted)
        except Exception as e:
            if self.store is not None and (keys := rendezvous.foreign_keys(self.store, self.secret)):
                raise rendezvous.JoinRefused(
                    f"no server worker joined the weight-transfer group at {self.where} with this run's secret; "
                    f"{len(keys)} key(s) there were written by a process without it ({', '.join(keys[:5])}): "
                    "another process reached the rendezvous (docs/security.md)") from e
            raise
        self.group = self.join.group
        rendezvous.report_intruders(self.join.intruders(), self.where)
        self.join.close_store()
        self.store = None
        listeners.forget(port=self.port)

    @staticmethod
    def prepare(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """The bucket's bytes, packed once and sent to every server."""
        return flatten(bucket)

    @staticmethod
    def update_info(bucket: list[tuple[str, torch.Tensor]]) -> dict:
        """What the server's /update_weights is told about the bucket (the same in every vLLM release)."""
        return update_info(bucket)

    def send(self, flat: torch.Tensor) -> None:
        _broadcast(self.group, flat)

    def abort(self) -> None:
        """The server refused its half: end a join or a broadcast that waits for it (the group is
        unusable after); the rendezvous stops listening once the join has ended."""
        self.aborted.set()
        if self.group is not None:
            self.group.abort()

    def close(self) -> None:
        self.aborted.set()  # a join still waiting ends, and with it the store's listener
        self.group = self.store = self.join = None


def _engine_classes():
    """The worker-side engine, defined only where vLLM is importable (inside a server)."""
    # vllm: only inside a server (the engine side)
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
        secret: str = field(default="", repr=False)  # the sender's (rendezvous.py); never logged

        def __post_init__(self):
            if len(self.secret) != rendezvous.SECRET_HEX:
                raise ValueError("grpo_gloo init_info has no valid `secret`: this server's grpo is newer than the "
                                 "trainer's; run both from one checkout")

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list
        dtype_names: list
        shapes: list

    class GlooWeightTransferEngine(WeightTransferEngine):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        group = join = None  # until a trainer joins (init_transfer_engine)

        def init_transfer_engine(self, init_info) -> None:
            """Join the trainer's group from this worker, on the address this node reaches it from,
            proving the secret the init route was told; the store is dropped once the group formed."""
            worker = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            host, port = init_info.master_address, init_info.master_port
            store = torch.distributed.TCPStore(host, port, is_master=False,
                                               timeout=datetime.timedelta(seconds=init_info.timeout_s))
            self.join = rendezvous.Join(store, init_info.secret, init_info.rank_offset + worker, init_info.world_size,
                                        rendezvous.route_address(host), init_info.timeout_s, f"{host}:{port}")
            self.group = self.join.group
            self.join.close_store()

        def start_weight_update(self) -> None:
            # vllm: only inside a server
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # vllm: only inside a server

            finalize_layerwise_reload(self.model, self.model_config)
            vllm_reload.repack_cpu_experts(self.model)  # a MoE on a CPU server: its experts back in the kernel's layout

        def receive_weights(self, update_info) -> None:
            group = joined(self.group)
            nbytes = sum(
                torch.Size(s).numel() * torch.empty((), dtype=getattr(torch, d)).element_size()
                for d, s in zip(update_info.dtype_names, update_info.shapes)
            )
            flat = torch.empty(nbytes, dtype=torch.uint8)
            _broadcast(group, flat)
            weights = unpack(flat, update_info.names, update_info.dtype_names, update_info.shapes)
            self.model.load_weights([(n, t.to(self.device)) for n, t in weights])

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.cuda.is_available():  # as vLLM's base class: the copies onto the GPU are done before the
                torch.cuda.synchronize(self.device)  # answer says "applied" (on CPU there is nothing to wait for)

        def shutdown(self) -> None:
            self.group = self.join = None

        @staticmethod
        def trainer_send_weights(iterator, trainer_args) -> None:
            """Abstract on vLLM 0.26-0.27's engine base (distributed/weight_transfer/base.py:321-326 in 0.26;
            gone from 0.28), so defined in every release: grpo_gloo's trainer half is GlooSender."""
            raise NotImplementedError("grpo_gloo sends from the trainer through grpo.rollout.gloo_transfer.GlooSender")

    return GlooWeightTransferEngine


ENTRY_POINT = ("vllm.general_plugins", "grpo_gloo", "grpo.rollout.gloo_transfer:register")  # setup.cfg's


def not_installed() -> str | None:
    """Why a vLLM server's engine process would not know `grpo_gloo` (None: it would). vLLM starts its engine
    core in a new process that loads plugins from installed entry points only, so grpo must be installed
    (`make setup`, `pip install -e .`), not only importable from a folder on PYTHONPATH: run that way, the
    first GPU run's server failed at start with vLLM's "Invalid weight transfer backend: grpo_gloo"."""
    group, name, value = ENTRY_POINT
    if any(ep.name == name and ep.value == value for ep in importlib.metadata.entry_points(group=group)):
        return None
    return (f"no {group} entry point {name} = {value} is installed in this environment, so vLLM's engine process "
            f"cannot load the {BACKEND} weight transfer (grpo runs from a folder on PYTHONPATH?). Install grpo "
            f"(make setup, or pip install --no-deps -e <checkout>), or use --weight-transfer nccl between two GPUs.")


def register() -> None:
    """vLLM plugin entry point: make `grpo_gloo` a weight-transfer backend in this process (and let
    Qwen2-VL load where torchvision cannot: grpo/rollout/no_torchvision.py; the engine's expected log lines
    explained once)."""
    no_torchvision.install()
    explain_engine_logs()  # the engine's expected lines once, with what they mean (grpo/library_logs.py)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # vllm: only inside a server
    except ImportError:  # vLLM without the RL API: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_classes())
