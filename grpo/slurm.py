"""What a SLURM cluster offers, checked before anything is submitted, and how a job's ranks meet.

A request that cannot run should fail on the login node with a message saying what to change, not sit
in the queue forever or die on a compute node: `check_request` asks `sinfo` about the partition's
nodes and raises `ClusterError` when SLURM is absent, the partition does not exist, or no set of
nodes in it can hold the job.

Rendezvous: every task of a job reads its rank from SLURM (grpo/dist.py); the job script exports
MASTER_ADDR (the job's first node, where rank 0 runs) and MASTER_PORT, a port the batch script
found free on that node rather than a fixed one. The sbatch templates in
slurm/ and conf/hydra/launcher/slurm.yaml carry those two lines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from hydra.experimental.callback import Callback

from grpo.errors import ClusterError

@dataclass(frozen=True)
class Request:
    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    mem_gb: float | None = None
    partition: str | None = None  # None: the cluster's default partition


@dataclass(frozen=True)
class Node:
    name: str
    partition: str
    cpus: int
    mem_mb: int
    gpus: int
    default: bool  # its partition is the default one
    state: str = "idle"  # sinfo's %T: "idle", "mixed", "down*" (* = its slurmd does not answer), "drained", ...

    @property
    def usable(self) -> bool:
        """Can take a job now or later: its slurmd answers and it is not down, drained or failing."""
        return not self.state.endswith("*") and not self.state.startswith(("down", "drain", "fail", "inval", "future"))


def gpu_count(gres: str) -> int:
    """`gpu:8`, `gpu:a100:4(S:0-1)`, `gpu:a100:4,gpu:v100:2` -> 8, 4, 6; `(null)` -> 0."""
    total = 0
    for item in gres.split(","):
        item = re.sub(r"\(.*?\)", "", item).strip()
        if item.startswith("gpu"):
            last = item.split(":")[-1]
            total += int(last) if last.isdigit() else 0
    return total


def slurm_nodes() -> list[Node]:
    """Every (node, partition) pair `sinfo` reports; raises ClusterError when SLURM cannot be reached."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        raise ClusterError(
            "SLURM is not installed here: no `sbatch`/`sinfo` on PATH. Submit from a cluster's login node, or "
            "start the local one-node cluster: slurm/dev-cluster.sh install && slurm/dev-cluster.sh up, "
            "then export SLURM_CONF as it says."
        )
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G|%T"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise ClusterError("SLURM's controller did not answer `sinfo` within 60 s.") from e
    if out.returncode:
        hint = "" if os.environ.get("SLURM_CONF") else " SLURM_CONF is not set; the dev cluster needs export SLURM_CONF=/tmp/grpo-slurm/slurm.conf."
        raise ClusterError(f"SLURM does not answer: `sinfo` failed ({out.stderr.strip() or out.returncode}).{hint}")
    nodes = []
    for line in out.stdout.splitlines():
        name, part, cpus, mem, gres, state = line.strip().split("|")
        nodes.append(Node(name, part.rstrip("*"), int(cpus), int(re.sub(r"\D", "", mem) or 0), gpu_count(gres),
                          part.endswith("*"), state))
    return nodes


def check_request(req: Request, nodes: list[Node] | None = None) -> str:
    """Raise ClusterError unless `req` fits the cluster; returns the partition it will run in."""
    nodes = slurm_nodes() if nodes is None else nodes
    partitions = sorted({n.partition for n in nodes})
    partition = req.partition or next((n.partition for n in nodes if n.default), None)
    if partition is None:
        raise ClusterError(f"this cluster has no default partition; name one (partition=... for grpo.launch, hydra.launcher.partition=... for a sweep): one of {partitions}.")
    if partition not in partitions:
        raise ClusterError(f"partition {partition!r} does not exist on this cluster; pick one of {partitions} (partition=... for grpo.launch, hydra.launcher.partition=... for a sweep).")
    members = [n for n in nodes if n.partition == partition]
    cpus = req.tasks_per_node * req.cpus_per_task
    big = [
        n for n in members
        if n.cpus >= cpus and n.gpus >= req.gpus_per_node and (req.mem_gb is None or n.mem_mb >= req.mem_gb * 1024)
    ]
    fits = [n for n in big if n.usable]
    if len(big) >= req.nodes > len(fits):  # big enough, but some are down: the job would wait for them
        down = ", ".join(f"{n.name} ({n.state})" for n in big if not n.usable)
        raise ClusterError(
            f"the job needs {req.nodes} node(s) of partition {partition!r}, but only {len(fits)} can take it now: "
            f"{down} {'is' if len(big) - len(fits) == 1 else 'are'} not usable ('*': its slurmd does not answer). "
            "Ask for fewer nodes, or bring the node back (start its slurmd; then scontrol update nodename=<node> "
            "state=resume), and check with sinfo -N."
        )
    if len(fits) < req.nodes:
        largest = max(members, key=lambda n: (n.gpus, n.cpus, n.mem_mb))
        want = f"{req.nodes} node(s) with {req.tasks_per_node} task(s) x {req.cpus_per_task} CPU(s)"
        want += f", {req.gpus_per_node} GPU(s)" if req.gpus_per_node else ""
        want += f", {req.mem_gb:g} GB" if req.mem_gb else ""
        raise ClusterError(
            f"the job asks for {want} each, but partition {partition!r} has {len(members)} node(s), "
            f"{len(fits)} of them big enough (the largest: {largest.cpus} CPUs, {largest.gpus} GPUs, "
            f"{largest.mem_mb // 1024} GB). Ask for fewer nodes, tasks, CPUs or GPUs, or another partition."
        )
    if problem := gpu_task_cpus_problem(req):
        raise ClusterError(problem)
    return partition


MIN_GPU_TASK_CPUS = 4


def gpu_task_cpus_problem(req: Request) -> str | None:
    """A GPU job whose tasks get a CPU or two: vLLM's API server, engine core and scheduler (and a
    colocated engine's detokenizer) share the task's CPUs with the trainer, and the GPU waits on them."""
    if req.gpus_per_node and req.cpus_per_task < MIN_GPU_TASK_CPUS:
        return (f"cpus_per_task={req.cpus_per_task} with gpus_per_node={req.gpus_per_node}: each task's vLLM server, "
                f"engine core and scheduler share its CPUs with the trainer, and the GPUs would wait on them. Ask for "
                f"cpus_per_task=8 or more (up to the node's CPUs / tasks_per_node; grpo.launch cpus_per_task=..., "
                f"hydra.launcher.cpus_per_task=... for a sweep); at least {MIN_GPU_TASK_CPUS}.")
    return None


def request_from(launcher) -> Request:
    """The `Request` of a `hydra.launcher` node (conf/hydra/launcher/slurm.yaml's keys)."""
    return Request(
        nodes=int(launcher.nodes), tasks_per_node=int(launcher.tasks_per_node),
        cpus_per_task=int(launcher.cpus_per_task or 1), gpus_per_node=int(launcher.gpus_per_node or 0),
        mem_gb=launcher.mem_gb, partition=launcher.partition,
    )


class SlurmCheck(Callback):
    """Hydra callback (conf/config.yaml): before a multirun goes to SLURM, check that it can run there.
    Other launchers pass untouched."""

    def on_multirun_start(self, config, **kwargs) -> None:
        launcher = config.hydra.launcher
        if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
            return
        try:
            check_request(request_from(launcher))
        except ClusterError as e:
            raise SystemExit(f"error: {e}") from None


def remote_server_layout(gpus: int, train_tasks: int, shared: bool) -> dict[str, str]:
    """How slurm/train_remote.sbatch starts `grpo.serve` on a node (`python -m grpo.slurm server-layout`):
    - a server node (`shared` false): one engine on all its GPUs, tensor parallel over them;
    - the one-node mode (`shared`: trainer ranks on cuda:0..train_tasks-1): the server takes the GPUs
      the trainers do not use, or, with none left, shares cuda:0 at a fraction of its memory with
      the weights over grpo_gloo (NCCL refuses two ranks of one communicator on one GPU);
    - no GPUs: a CPU server, grpo_gloo.
    Keys: SERVER_DEVICES (CUDA_VISIBLE_DEVICES, logical ids of the step; empty: leave it), SERVER_TP,
    SERVER_MEMORY (empty: grpo.serve's default), TRANSFER (for both sides)."""
    if gpus <= 0:
        return {"SERVER_DEVICES": "", "SERVER_TP": "1", "SERVER_MEMORY": "", "TRANSFER": "grpo_gloo"}
    if not shared:
        return {"SERVER_DEVICES": "", "SERVER_TP": str(gpus), "SERVER_MEMORY": "", "TRANSFER": "auto"}
    free = list(range(train_tasks, gpus))
    if free:  # a power of two of them: the tensor-parallel sizes common models' head counts take
        tp = 1 << (len(free).bit_length() - 1)
        return {"SERVER_DEVICES": ",".join(map(str, free[:tp])), "SERVER_TP": str(tp), "SERVER_MEMORY": "",
                "TRANSFER": "auto"}
    return {"SERVER_DEVICES": "", "SERVER_TP": "1", "SERVER_MEMORY": "0.4", "TRANSFER": "grpo_gloo"}


def main(argv: list[str] | None = None) -> None:
    """`python -m grpo.slurm server-layout GPUS TRAIN_TASKS SHARED`: shell assignments for slurm/train_remote.sbatch."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m grpo.slurm", description=main.__doc__)
    p.add_argument("command", choices=["server-layout"])
    p.add_argument("gpus", help="GPUs on this node (SLURM_GPUS_ON_NODE; empty or 0: none)")
    p.add_argument("train_tasks", type=int, help="training tasks on a node (SLURM_NTASKS_PER_NODE)")
    p.add_argument("shared", choices=["0", "1"], help="1: the server shares its node with the trainers")
    args = p.parse_args(argv)
    layout = remote_server_layout(int(args.gpus or 0), args.train_tasks, args.shared == "1")
    print("\n".join(f"{k}={v}" for k, v in layout.items()))


if __name__ == "__main__":
    main()
