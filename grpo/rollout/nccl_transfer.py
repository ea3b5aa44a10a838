"""The trainer's half of vLLM's own `nccl` weight-transfer engine (vLLM 0.33,
`vllm/distributed/weight_transfer/nccl_engine.py`), for GPU servers.

The server half is vLLM's: `--weight-transfer-config '{"backend": "nccl"}'`. This sender is rank 0
of a NCCL group with one server's workers (ranks 1..tp), made by vLLM's own communicator over a
rendezvous, in vLLM's unpacked mode: for each `/update_weights` call, which names the
bucket's tensors, one broadcast per tensor in that order, straight from GPU memory. It plugs into
the same client (grpo/rollout/servers.py) as `grpo_gloo`, so everything but the bytes' path is what
the CPU tests run. Written against vLLM 0.33.0's source, and 0.26.0-0.32.0's where they differ
(grpo/rollout/vllm_api.py: the server's release decides the init and update info's fields); not
yet run on a GPU (docs/gpu.md).

The rendezvous (docs/security.md): where the server's vLLM takes a unique id (`nccl_unique_id_b64`,
0.30+) and the trainer's can join by one (`vllm_api.takes_unique_id`), the trainer mints the NCCL
unique id and the server is told it only inside `init_info`, through its token-guarded init route,
so no TCP store listens at all; a peer without the id cannot find the group. An older vLLM joins
over its own TCP store, bound to the transfer host by vLLM but unauthenticated: a warning says so.
"""

from __future__ import annotations

import base64
import logging
import threading
import time

import torch

from grpo.rollout.gloo_transfer import update_info as bucket_update_info
from grpo.rollout.vllm_api import VllmApi

log = logging.getLogger("grpo")

# The sender broadcasts tensor by tensor (vLLM's unpacked mode). Both ends must agree, so it is said
# explicitly: vLLM's trainer-side default is packed (nccl_engine.py:79 in 0.33), its worker's unpacked.
UNPACKED = {"packed": False}


def init_info(world_size: int, unique_id: bytes | None, host: str, port: int | None, api: VllmApi) -> dict:
    """The server's NCCLWeightTransferInitInfo (`api`: the server's vLLM), field for field: it refuses
    unknown keys (vLLM 0.26-0.27 have no `packed` there). The unique id when there is one (no
    address: nothing listens), else the TCP store's address."""
    where = ({"nccl_unique_id_b64": base64.b64encode(unique_id).decode()} if unique_id is not None
             else {"master_address": host, "master_port": port})
    return {**where, "rank_offset": 1, "world_size": world_size, **(UNPACKED if api.packed_in_init_info else {})}


def update_info(bucket: list[tuple[str, torch.Tensor]], api: VllmApi) -> dict:
    """The server's NCCLWeightTransferUpdateInfo for one bucket: names, dtypes and shapes in order,
    and where the server's vLLM takes the wire mode per update (0.26-0.27), `packed` too."""
    return {**bucket_update_info(bucket), **({} if api.packed_in_init_info else UNPACKED)}


def mint_unique_id() -> bytes:
    """A new NCCL unique id (its bootstrap address and a random magic), through vLLM's NCCL library."""
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary  # vllm: optional, engine installs only

    return bytes(NCCLLibrary().ncclGetUniqueId().internal)


def wait_until_done(done, timeout_s: float, aborted=lambda: False, poll_s: float = 0.01, what: str = "NCCL broadcast") -> None:
    """Poll `done()` (a CUDA event's query) until it is true. A PyNccl broadcast has no timeout of its
    own: if the server never posts its receive (its /update_weights failed), `stream.synchronize()`
    would wait for ever. Raises after `timeout_s`, or once `aborted()` (the server's answer came back
    as an error; the caller raises that one)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if aborted():
            raise RuntimeError(f"{what} aborted: the server refused its half")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not complete within {timeout_s:g} s (rollout.*.request_timeout_s): "
                               "the server's workers never received it")
        time.sleep(poll_s)


class NcclSender:
    """`port` None: the unique-id rendezvous (this sender mints the id); else vLLM's TCP store on it.
    `api`: the server's vLLM, whose init and update info this sender speaks."""

    def __init__(self, host: str, port: int | None, world_size: int, timeout_s: float, api: VllmApi):
        self.host, self.port, self.world_size, self.timeout_s, self.api = host, port, world_size, timeout_s, api
        self.comm = None
        self.aborted = False
        # this rank's GPU, fixed now (the main thread): connect and send run in transfer threads, where
        # the current device would be cuda:0 (REVIEW L1)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.stream = None  # one per sender, so several servers' broadcasts do not queue on one stream (L2)
        # held while broadcasts are enqueued: abort() (another thread) destroys the communicator only
        # between two enqueue loops, never under one (REVIEW Part 5, GPU-only notes)
        self.lock = threading.Lock()
        self.unique_id = None
        if port is None:
            with torch.cuda.device(self.device):
                self.unique_id = mint_unique_id()
        else:
            log.warning("weight transfer over NCCL: this vLLM has no unique-id rendezvous, so the servers join over "
                        "vLLM's TCP store at %s:%d, which has no authentication (docs/security.md)", host, port)

    def init_info(self) -> dict:
        return init_info(self.world_size, self.unique_id, self.host, self.port, self.api)

    def update_info(self, bucket: list[tuple[str, torch.Tensor]]) -> dict:
        return update_info(bucket, self.api)

    def connect(self) -> None:
        """Blocks until every worker joined; call while the server's init request is in flight."""
        with torch.cuda.device(self.device):  # the communicator takes the current device
            if self.unique_id is not None:
                # vllm: optional, engine installs only
                from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

                self.comm = PyNcclCommunicator.from_unique_id_bytes(self.unique_id, rank=0, world_size=self.world_size,
                                                                    device=self.device)
            else:
                # vllm: optional, engine installs only
                from vllm.distributed.weight_transfer.nccl_common import trainer_init

                self.comm = trainer_init({"master_address": self.host, "master_port": self.port,
                                          "world_size": self.world_size})
            self.stream = torch.cuda.Stream()

    def prepare(self, bucket: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The bucket's tensors on this rank's GPU, contiguous (NCCL sends numel elements from data_ptr)."""
        device = torch.device("cuda", self.device)
        return [t.detach().to(device).contiguous() for _, t in bucket]

    def send(self, tensors: list[torch.Tensor]) -> None:
        """One broadcast per tensor on the sender's stream. Each tensor is recorded on that stream
        (`record_stream`): it was allocated on the caller's stream, and without the record the caching
        allocator would hand its memory out again as soon as the caller drops it (after an abort, or
        once this returns) while NCCL may still read it."""
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream())  # the tensors are ready before they go

            def broadcast(comm, t):
                t.record_stream(self.stream)
                comm.broadcast(t, src=0, stream=self.stream)

            self.enqueue(tensors, broadcast)
            done = torch.cuda.Event()
            done.record(self.stream)
        # the caller may change the parameters once this returns; bounded, and ended by abort()
        wait_until_done(done.query, self.timeout_s, lambda: self.aborted)

    def enqueue(self, tensors: list[torch.Tensor], broadcast) -> None:
        """`broadcast(comm, t)` for each tensor, under the lock, checking for an abort before each: an
        abort that lands mid-bucket stops the loop, and the communicator is destroyed after it, so no
        broadcast is enqueued on an aborted or freed communicator."""
        with self.lock:
            for t in tensors:
                if self.comm is None or self.aborted:
                    raise RuntimeError("the NCCL weight-transfer group was aborted (a server refused an update); "
                                       "no broadcast can go through it")
                broadcast(self.comm, t)

    def abort(self) -> None:
        """The server refused its half: stop waiting for the broadcast and destroy the communicator.
        A flag alone left the broadcasts queued on the sender's stream for ever (the server never posts
        its receives); vLLM's `PyNcclCommunicator.destroy` (ncclCommAbort on a thread, joined for 5 s:
        vllm/distributed/device_communicators/pynccl.py, the same in 0.32 and 0.33) ends them, so the
        stream moves on and the tensors recorded on it are freed."""
        self.aborted = True  # read by the enqueue loop between two broadcasts, and by wait_until_done
        self.close()

    def close(self) -> None:
        with self.lock:  # after the enqueue loop in flight, if any, has stopped
            comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()
