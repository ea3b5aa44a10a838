"""Rank, local rank and world size from torchrun or SLURM; the process group; small collectives.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT); under `srun` without
torchrun, SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID say the same, and MASTER_ADDR / MASTER_PORT
must be exported by the job script (slurm/*.sbatch and `grpo.launch` do: the first node, a port
found free there). A single process without a launcher is rank 0 of 1.
"""

from __future__ import annotations

import _thread
import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from grpo import listeners
from grpo.auth import is_loopback
from grpo.errors import DeviceError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # processes of this run on this node

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed tasks-per-node list, one entry per node of the step or job, in SLURM_NODEID
    order: `2(x3),1` -> [2, 2, 2, 1], `3,2` -> [3, 2]; [] for anything else (unset, malformed)."""
    counts = []
    for item in value.split(","):
        count, bracket, repeat = item.strip().partition("(x")
        if bracket:  # `2(x3)`: 2 on each of 3 nodes
            if not (repeat.endswith(")") and repeat[:-1].isdigit()):
                return []
            repeat = repeat[:-1]
        if not count.isdigit():
            return []
        counts += [int(count)] * int(repeat or 1)
    return counts


def slurm_tasks_on_node(env) -> int | None:
    """The tasks SLURM runs on this node: the SLURM_NODEID-th entry of srun's SLURM_STEP_TASKS_PER_NODE
    (falling back to the job's SLURM_TASKS_PER_NODE, then the uniform SLURM_NTASKS_PER_NODE). Nodes
    may differ (sbatch --ntasks=5 --nodes=2: `3,2`), so never the first node's entry for every node.
    None outside SLURM. The one reading, for the ranks (`dist_info`) and the threads (grpo/cpus.py)."""
    node = int(env["SLURM_NODEID"]) if env.get("SLURM_NODEID", "").isdigit() else 0
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = expand_tasks_per_node(env.get(key, ""))
        if node < len(counts) and counts[node] > 0:
            return counts[node]
    uniform = env.get("SLURM_NTASKS_PER_NODE", "")  # --ntasks-per-node: every node's
    return int(uniform) if uniform.isdigit() and int(uniform) > 0 else None


def dist_info(env: dict | None = None) -> DistInfo:
    """From torchrun's variables, else SLURM's (srun sets no LOCAL_WORLD_SIZE: its tasks on this node
    come from `slurm_tasks_on_node`), else one process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistInfo(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world)))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        world = int(env["SLURM_NTASKS"])
        per_node = slurm_tasks_on_node(env) or world
        return DistInfo(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), per_node)
    return DistInfo()


def rank_env(info: DistInfo) -> dict[str, str]:
    """torchrun's variables for this rank. Exported for every strategy under any launcher: vLLM's
    external_launcher (colocated with several ranks) reads RANK and LOCAL_RANK, DeepSpeed reads
    them too, and the dedicated backend and the thread count read LOCAL_WORLD_SIZE; srun sets none."""
    return {"RANK": str(info.rank), "WORLD_SIZE": str(info.world_size), "LOCAL_RANK": str(info.local_rank),
            "LOCAL_WORLD_SIZE": str(info.local_world_size)}


def process_group_backend(cuda: bool) -> str:
    """gloo on CPU; on GPU a group with both devices, so the CPU float64 tensors of the small
    collectives below (counts, metrics, stop flags) go through gloo and CUDA tensors through NCCL,
    whose backend has no CPU device."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The GPU ordinal a rank uses. torchrun and a SLURM task that sees the node's GPUs: its local rank.
    A SLURM task bound to one GPU (--gpus-per-task=1, --gpu-bind=single:1) sees only that one, as
    cuda:0, whatever its local rank: cuda:{local_rank} would be an invalid ordinal there (and vLLM's
    worker asserts LOCAL_RANK < device_count). Any other shortfall is an error naming both numbers."""
    if local_rank < device_count:
        return local_rank
    if device_count == 1:
        return 0
    raise DeviceError(f"local rank {local_rank} sees {device_count} GPU(s) (CUDA_VISIBLE_DEVICES="
                      f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give each task either all of its node's "
                      "GPUs (one per local rank) or exactly one.")


def master_addr(info: DistInfo) -> str:
    """Where this process's groups meet: MASTER_ADDR under a launcher, this node for one process."""
    return "127.0.0.1" if info.world_size == 1 else os.environ.get("MASTER_ADDR", "127.0.0.1")


def init_distributed(info: DistInfo, timeout_s: float = 600, force: bool = False) -> None:
    """gloo on CPU, NCCL on GPU. A peer that never arrives fails after `timeout_s` with its rank.
    One process gets no group unless `force` (DeepSpeed needs one even then). Every gloo group this
    process makes (the run's, vLLM's, DeepSpeed's) listens on this node's address towards MASTER_ADDR
    (loopback for one process: `bind_gloo`), and a store this process hosts on MASTER_ADDR only."""
    if (info.world_size == 1 and not force) or dist.is_initialized():
        bind_gloo(master_addr(info))
        return
    if info.world_size == 1 and "MASTER_PORT" not in os.environ:  # one process (DeepSpeed's group): its own
        # store on a port bound here (0: the kernel's choice), not one picked free and bound later
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    elif "MASTER_PORT" not in os.environ or "MASTER_ADDR" not in os.environ:
        key = "MASTER_ADDR" if "MASTER_ADDR" not in os.environ else "MASTER_PORT"
        raise RuntimeError(f"rank {info.rank}: {key} is not set; launch with torchrun, or export it in the job script "
                           "(under SLURM: slurm/train.sbatch or python -m grpo.launch do).")
    bind_gloo(os.environ["MASTER_ADDR"])
    store = rendezvous_store(info, timeout_s)
    os.environ.update(rank_env(info))
    backend = process_group_backend(torch.cuda.is_available())
    if torch.cuda.is_available():
        device = cuda_device_index(info.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(device)
        # vLLM's external launcher and DeepSpeed take LOCAL_RANK as the device ordinal
        os.environ["LOCAL_RANK"] = str(device)
    dist.init_process_group(
        backend, rank=info.rank, world_size=info.world_size, timeout=datetime.timedelta(seconds=timeout_s), store=store
    )


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `host` only and listening (port 0: the kernel's choice)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def rendezvous_store(info: DistInfo, timeout_s: float) -> dist.TCPStore | None:
    """The store the ranks meet at; None where torchrun's agent hosts it (its own process, ranks are
    clients). Otherwise rank 0 hosts it on MASTER_ADDR only: torch's libuv store binds every interface
    (0.0.0.0 / ::) whatever host it is given, so it gets a socket bound here (`master_listen_fd`, which
    it then owns). Every rank passes the store to init_process_group, so all use its keys unprefixed.
    One process without MASTER_PORT: port 0, read back into MASTER_PORT (the watchdog and DeepSpeed read it)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.rank != 0:
        return dist.TCPStore(host, port, info.world_size, is_master=False, timeout=timeout)
    fd = listening_socket(host, port).detach()
    try:
        store = dist.TCPStore(host, port, info.world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=fd)
    except BaseException:
        socket.close(fd)
        raise
    os.environ["MASTER_PORT"] = str(store.port)
    listeners.expect(host, store.port, "torch.distributed rendezvous store (rank 0)")
    return store


def route_address(host: str) -> str:
    """This machine's address on its route to `host` (connecting a UDP socket sends nothing): the
    address peers reach it at; the host's own address on the node that holds it."""
    family, _, _, _, addr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface holding `address` (lo for 127.0.0.1), None if none does."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def loopback_interface() -> str:
    """The interface holding 127.0.0.1 (lo on Linux)."""
    return interface_of("127.0.0.1") or "lo"


def expect_on_interfaces(names: str, purpose: str) -> None:
    """This process's listeners of `purpose` on the IP addresses of the interfaces `names` (a
    comma-separated *_SOCKET_IFNAME value), for the listener audit."""
    interfaces = psutil.net_if_addrs()
    for interface in names.split(","):
        for a in interfaces.get(interface, []):
            if a.family in (socket.AF_INET, socket.AF_INET6):
                listeners.expect_process(os.getpid(), a.address.split("%")[0], f"{purpose} ({interface})")


def loopback_env() -> dict[str, str]:
    """For a process that talks to this node only (a dedicated engine, a grpo.serve's vLLM internals):
    vLLM's own address (VLLM_HOST_IP, its get_ip()) and the interface of every gloo group it makes
    (GLOO_SOCKET_IFNAME; the default resolves the machine's hostname) are loopback."""
    return {"VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": loopback_interface()}


def bind_gloo(master_addr: str) -> None:
    """Every gloo group made in this process (torch's default device resolves the machine's hostname,
    often a cluster-wide address, whatever the run needs) listens on this node's route to
    `master_addr` instead: GLOO_SOCKET_IFNAME, read by each ProcessGroupGloo built without devices
    (init_process_group, new_group, vLLM's and DeepSpeed's groups). A GLOO_SOCKET_IFNAME the user
    set is kept."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        address = route_address(master_addr)
        if (interface := interface_of(address)) is None:
            return
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    expect_on_interfaces(os.environ["GLOO_SOCKET_IFNAME"], "gloo pairs of this process's groups")


NCCL_IFNAME = "NCCL_SOCKET_IFNAME"


def nccl_on_loopback(peer_hosts: list[str], route=None) -> bool:
    """Whether every NCCL peer of this process is on this node (`peer_hosts`: MASTER_ADDR and the hosts
    of the servers it transfers weights to over NCCL), reached through loopback. NCCL picks one
    interface per process for its bootstrap and proxy sockets, at its first use, and listens there for
    the run: by default a non-loopback one (the host's address, reachable from the cluster), which
    only a peer on another node needs."""
    route = route_address if route is None else route
    try:
        return all(is_loopback(route(host)) for host in peer_hosts)
    except OSError:  # a host this node cannot resolve or route to: not known to be here (its own error comes later)
        return False


def bind_nccl(peer_hosts: list[str], cuda: bool) -> None:
    """NCCL's sockets on loopback (NCCL_SOCKET_IFNAME) where every peer is on this node: a one-node run
    with colocated or dedicated engines, remote servers at a loopback URL. A peer on another node
    leaves NCCL its own choice (it must be reachable there; NCCL prefers InfiniBand's IP interfaces,
    which forcing the route to MASTER_ADDR could trade for a slower one). A NCCL_SOCKET_IFNAME the
    user set is kept."""
    if NCCL_IFNAME in os.environ or not nccl_on_loopback(peer_hosts):
        return
    os.environ[NCCL_IFNAME] = loopback_interface()
    if cuda:
        expect_on_interfaces(os.environ[NCCL_IFNAME], "NCCL bootstrap and proxy sockets")


def server_nccl_env(host: str) -> dict[str, str]:
    """A `grpo.serve` bound to loopback (`host`) has its NCCL peers on this node (the trainer pushing
    weights, its own tensor-parallel workers): NCCL's sockets there too. One reached from other nodes
    leaves NCCL its own choice."""
    return {NCCL_IFNAME: loopback_interface()} if is_loopback(host) else {}


def node_name() -> str:
    """This process's node: SLURM's name for it inside a job (the one the cluster resolves, and
    distinct for each node of the dev cluster, whose nodes share one machine), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def node_names() -> list[str]:
    """Every rank's node, in rank order (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [node_name()]
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, node_name())
    return names


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s value on every rank (e.g. the run folder each rank resolved from `${now:}`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather(obj) -> list:
    """Every rank's `obj`, in rank order (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: list[float]) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:  # one rank: also vLLM's own one-rank NCCL group
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def shutdown() -> None:
    """Leave the process group together, once all work is written."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def abort() -> None:
    """Leave the process group alone, on an error: a barrier here could wait for a dead peer."""
    if dist.is_initialized():
        dist.destroy_process_group()


class PeerWatchdog:
    """Heartbeats through the rendezvous store, so a rank that dies or hangs is named, not waited for.

    Every `interval_s` each rank bumps its counter `grpo/heartbeat/<rank>` in the store the process
    group met at (torchrun's agent, or rank 0 under SLURM), and reads the others'. A peer whose
    counter has not moved for `timeout_s` is reported by rank, host and pid, and this rank is
    interrupted (KeyboardInterrupt in the main thread, so the run's exit path closes engines and
    servers); if the main thread is stuck in a collective and cannot take it, the process exits
    `grace_s` later. A rank that finished marks itself done and is never reported.
    """

    def __init__(self, info: DistInfo, timeout_s: float = 60.0, interval_s: float = 1.0, grace_s: float = 30.0):
        self.info, self.timeout_s, self.interval_s, self.grace_s = info, timeout_s, interval_s, grace_s
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=datetime.timedelta(seconds=max(30.0, timeout_s)))
        self.beat = 0
        self.seen: dict[int, tuple[str, float]] = {}  # peer -> (last counter, when it last changed)
        self.stopped = threading.Event()
        self.reported = False  # it found a silent peer and interrupted this rank
        self.store.set(self._key("where", info.rank), f"node {node_name()} pid {os.getpid()}")
        self.store.set(self._key("heartbeat", info.rank), "0")
        self.thread = threading.Thread(target=self._run, name="grpo-peer-watchdog", daemon=True)
        self.thread.start()

    @staticmethod
    def _key(kind: str, rank: int) -> str:
        return f"grpo/{kind}/{rank}"

    def _read(self, kind: str, rank: int) -> str | None:
        key = self._key(kind, rank)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def silent_peers(self) -> dict[int, float]:
        """Peers whose heartbeat has not moved for `timeout_s`: {rank: seconds silent}."""
        now, silent = time.monotonic(), {}
        for peer in range(self.info.world_size):
            if peer == self.info.rank:
                continue
            value = self._read("heartbeat", peer)
            last, since = self.seen.get(peer, (None, now))
            if value != last:
                self.seen[peer] = (value, now)
            elif value != "done" and now - since >= self.timeout_s:
                silent[peer] = now - since
        return silent

    def describe(self, silent: dict[int, float]) -> str:
        names = [f"rank {peer} ({self._read('where', peer) or 'unknown host'}) silent for {s:.0f} s"
                 for peer, s in sorted(silent.items())]
        return (f"rank {self.info.rank}: {', '.join(names)}: killed, crashed or hung. Stopping this rank too; "
                f"the cause is in that rank's own log.")

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.beat += 1
                self.store.set(self._key("heartbeat", self.info.rank), str(self.beat))
                silent = self.silent_peers()
            except Exception as e:  # noqa: BLE001 - the store itself is gone: its host (rank 0) died
                silent, lost = {0: 0.0}, e
                print(f"rank {self.info.rank}: the rendezvous store at {os.environ.get('MASTER_ADDR')}:"
                      f"{os.environ.get('MASTER_PORT')} stopped answering ({lost}); rank 0 or its launcher is gone. "
                      "Stopping this rank too.", file=sys.stderr, flush=True)
            else:
                if silent:
                    print(self.describe(silent), file=sys.stderr, flush=True)
            if silent:
                self.reported = True
                _thread.interrupt_main()
                if not self.stopped.wait(self.grace_s):
                    print(f"rank {self.info.rank}: still blocked {self.grace_s:.0f} s later (a collective waiting "
                          "for the lost peer); exiting.", file=sys.stderr, flush=True)
                    os._exit(1)
                return

    def stalled_peers(self, wait_s: float) -> list[int]:
        """Peers whose heartbeat does not move within `wait_s` (after an error: which peer is gone?)."""
        before = {p: self._read("heartbeat", p) for p in range(self.info.world_size) if p != self.info.rank}
        time.sleep(wait_s)
        return [p for p, v in before.items() if v != "done" and self._read("heartbeat", p) == v]

    def close(self, done: bool) -> None:
        """Stop beating; `done`: this rank finished, so peers still working never report it."""
        self.stopped.set()
        self.thread.join(timeout=5)
        if done:
            with contextlib.suppress(Exception):
                self.store.set(self._key("heartbeat", self.info.rank), "done")


@contextlib.contextmanager
def process_group(info: DistInfo, timeout_s: float = 600, peer_timeout_s: float = 60, nccl_peers: tuple[str, ...] = ()):
    """The run's process group, left on every way out: together (a barrier) when the run ends,
    alone when it fails, so no rank waits on a dead one; a `PeerWatchdog` names a lost peer.
    NCCL listens on loopback where MASTER_ADDR and `nccl_peers` (the hosts of the servers the run
    pushes weights to over NCCL) are all on this node (`bind_nccl`): set before NCCL's first use, which
    reads it once for the process (the training group's, vLLM's, a weight-transfer group's)."""
    bind_nccl([master_addr(info), *nccl_peers], torch.cuda.is_available())
    init_distributed(info, timeout_s)
    watchdog = PeerWatchdog(info, peer_timeout_s) if dist.is_initialized() and info.world_size > 1 else None
    try:
        yield
    except BaseException:
        if watchdog is not None:
            watchdog.close(done=False)
            with contextlib.suppress(Exception):
                lost = [] if watchdog.reported else watchdog.stalled_peers(3 * watchdog.interval_s)
                for peer in lost:
                    print(f"rank {info.rank}: rank {peer} ({watchdog._read('where', peer) or 'unknown host'}) stopped "
                          "answering: the error below follows from its loss; its own log says why it stopped.",
                          file=sys.stderr, flush=True)
        abort()
        raise
    if watchdog is not None:
        watchdog.close(done=True)
    shutdown()
