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

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback

from grpo.errors import ClusterError, ConfigError, DeviceError

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
    """`gpu:8`, `gpu:a100:4(S:0-1)`, `gpu:a100:4,gpu:v100:2` -> 8, 4, 6; `(null)` -> 0. The socket
    list in parentheses is dropped before splitting on commas: it has commas of its own when the GPUs
    sit on sockets that are not adjacent (`gpu:mi250:8(S:0,2)` -> 8)."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        item = item.strip()
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


SIZE_MINIMUMS = {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1, "gpus_per_node": 0}  # mem_gb: > 0, or null


def check_size(key: str, value: float | None) -> None:
    """One of a request's sizes (grpo.launch's `key=`, a sweep's hydra.launcher.<key>): nodes=0 was
    taken as 1 process by validate, fit any cluster, and cpus_per_task=0 became 1 on the way to SLURM."""
    if key == "mem_gb":
        if value is not None and not value > 0:
            raise ConfigError(f"mem_gb={value:g}: give the memory per node in GB, more than 0 (or leave it out: the "
                              f"partition's default).")
    elif key in SIZE_MINIMUMS and not value >= SIZE_MINIMUMS[key]:
        raise ConfigError(f"{key}={value:g}: give {SIZE_MINIMUMS[key]} or more ({key}=... for grpo.launch, "
                          f"hydra.launcher.{key}=... for a sweep).")


def check_request(req: Request, nodes: list[Node] | None = None) -> str:
    """Raise ClusterError unless `req` fits the cluster; returns the partition it will run in. Its sizes
    are checked first (`check_size`), before SLURM is asked."""
    for key in (*SIZE_MINIMUMS, "mem_gb"):
        check_size(key, getattr(req, key))
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
            f"{largest.mem_mb // 1024} GB).{short_of(req, members)} Ask for fewer nodes, tasks, CPUs or GPUs"
            f"{', less memory (mem_gb)' if req.mem_gb else ''}, or another partition."
        )
    if problem := gpu_task_cpus_problem(req):
        raise ClusterError(problem)
    return partition


def short_of(req: Request, members: list[Node]) -> str:
    """What no node of the partition has (` No node has 600 GB of memory (mem_gb).`), so the message
    names the setting to lower; '' when each alone fits some node (their combination does not)."""
    cpus = req.tasks_per_node * req.cpus_per_task
    short = []
    if all(n.cpus < cpus for n in members):
        short.append(f"{cpus} CPUs (tasks_per_node x cpus_per_task)")
    if all(n.gpus < req.gpus_per_node for n in members):
        short.append(f"{req.gpus_per_node} GPUs (gpus_per_node)")
    if req.mem_gb and all(n.mem_mb < req.mem_gb * 1024 for n in members):
        short.append(f"{req.mem_gb:g} GB of memory (mem_gb)")
    return f" No node has {' or '.join(short)}." if short else ""


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
        cpus_per_task=1 if launcher.cpus_per_task is None else int(launcher.cpus_per_task),  # 0 stays 0: refused
        gpus_per_node=int(launcher.gpus_per_node or 0),
        mem_gb=launcher.mem_gb, partition=launcher.partition,
    )


def sweep_jobs(overrides: list[str]) -> list[list[str]] | None:
    """Each job's overrides in a multirun, expanded as Hydra's basic sweeper does: the product of each
    key's values, a later override of a key replacing an earlier one (`algo.lr=1e-3,3e-3 parallel=ddp,zero2`:
    4 jobs). None when a sweep is not a list of values (an Optuna `interval`), which only its sweeper expands."""
    axes: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():
            axes[key] = [override.input_line]
        elif override.is_discrete_sweep():
            axes[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            return None
    return [list(job) for job in itertools.product(*axes.values())]


def check_sweep_jobs(config, slurm: bool = True) -> None:
    """`validate` each job of a sweep before any runs: on SLURM for the processes its job will have (nodes x
    tasks_per_node; 2-task jobs with parallel=single fit the cluster (`check_request`) and then every one
    is refused on its node), on another launcher for this process's. The callback's config holds no
    swept value (Hydra composes it without them), so each job's config is composed from its own
    overrides, as the sweeper will."""
    # grpo.config: Hydra's schema and the checks of every part (torch, the tasks), already loaded in the
    # grpo.train process this callback runs in; a top-level import would weigh on `python -m grpo.slurm`
    from grpo.config import check_sweep_folder, compose_config, validate

    check_sweep_folder(config, multirun=True)  # one run_dir for every job: refused here, not on each node
    launcher = config.hydra.launcher
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    jobs = sweep_jobs([*params, *config.hydra.overrides.task])
    world = int(launcher.nodes) * int(launcher.tasks_per_node) if slurm else None
    where = f", run as {launcher.nodes} node(s) x {launcher.tasks_per_node} task(s)" if slurm else ""
    for number, job in enumerate(jobs or []):
        try:
            # inside `grpo.train -m` Hydra's app is initialized (its search path is ours): compose through it,
            # since a second initialization is refused; called on its own (tests), compose as grpo.launch does
            cfg = compose(config.hydra.job.config_name, job) if GlobalHydra.instance().is_initialized() else compose_config(job)
            validate(cfg, world_size=world, cuda=(bool(launcher.gpus_per_node) or None) if slurm else None)
        except (ConfigError, HydraException) as e:
            message = " ".join(str(e).split())  # Hydra's messages run over several lines
            raise ConfigError(f"job {number} of the sweep ({' '.join(job) or 'no overrides'}){where}: {message}") from None


class SlurmCheck(Callback):
    """Hydra callback (conf/config.yaml): before a multirun goes to SLURM, check that it can run there:
    the cluster can hold a job of this size, and each job's config validates for the processes it will
    have. On another launcher (Hydra's basic one, jobs one after another) each job's config validates
    before the first runs: a batch size that does not divide in job 2 stopped the sweep after job 0
    trained, and the jobs after it never ran."""

    def on_multirun_start(self, config, **kwargs) -> None:
        launcher = config.hydra.launcher
        slurm = str(launcher.get("_target_", "")).endswith("SlurmLauncher")
        # SystemExit, not the error: Hydra turns any Exception a callback raises into a warning and submits
        try:
            if slurm:
                check_request(request_from(launcher))
            check_sweep_jobs(config, slurm)
        except (ClusterError, ConfigError) as e:
            raise SystemExit(f"error: {e}") from None
        except Exception as e:  # anything else a check raised (a cut-off config.json): Hydra would warn and submit
            raise SystemExit(f"error: the sweep could not be checked before submitting it: {type(e).__name__}: {e}") from None


def check_tensor_parallel(setting: str, tp: int, gpus_text: str, gpus: int, heads: int | None, kv_heads: int | None,
                          fix: str) -> None:
    """ConfigError unless vLLM accepts a server of `tp` GPUs (of the `gpus` it may use) for a model of
    `heads` attention heads (`kv_heads` KV heads): the one message for the sbatch's SERVER_TP_OVERRIDE
    and grpo.launch's rollout.remote.tensor_parallel_size and judge_gpus, before anything starts, not
    a vLLM error on a compute node after the job waited in the queue. Unknown heads: any size."""
    # torch via grpo.rollout: slurm stays light (Hydra's callback, sbatch scripts)
    from grpo.rollout.dedicated import vllm_tensor_parallel_sizes

    accepted = vllm_tensor_parallel_sizes(heads, kv_heads, gpus)
    if tp not in accepted:
        raise ConfigError(f"{setting}={tp}: the server may use {gpus_text} and the model has {heads} attention heads "
                          f"({kv_heads} KV heads); vLLM accepts a tensor-parallel size in {accepted}. {fix}")


def server_groups(free: list[int], heads: int | None, kv_heads: int | None, tp: int = 0) -> list[list[int]]:
    """The GPUs (logical ids of the job step) of each server on a node, from the GPUs it may use:
    the dedicated backend's planner (`plan_engines`), so every server's tensor-parallel size is one
    vLLM accepts for the model's heads, and as many servers as fill the GPUs (8 GPUs and Qwen2.5-7B's
    28 heads: two servers of TP 4; 8 can split neither 28 heads nor 4 KV heads). `tp` > 0 (the
    sbatch's SERVER_TP_OVERRIDE): servers of that size, as many as fit, checked against the heads.
    Unknown heads: powers of two, the sizes common models' head counts take."""
    # torch via grpo.rollout: slurm stays light (Hydra's callback, sbatch scripts)
    from grpo.rollout.dedicated import plan_engines

    if heads is None and not tp:
        heads = kv_heads = 1 << (len(free) - 1).bit_length()  # the smallest power of two >= the GPUs
    devices = [f"cuda:{i}" for i in free]
    if tp:
        check_tensor_parallel("SERVER_TP_OVERRIDE", tp, f"{len(free)} GPU(s) ({free})", len(free), heads, kv_heads,
                              "Unset it to let the layout choose.")
        devices = devices[: len(devices) // tp * tp]
        shares = plan_engines(devices, len(devices) // tp, heads, kv_heads)
    else:
        shares = plan_engines(devices, 0, heads, kv_heads)
    return [[int(d.split(":")[1]) for d in share] for share in shares]


def remote_server_layout(gpus: int, train_tasks: int, shared: bool, heads: int | None = None,
                         kv_heads: int | None = None, tp: int = 0, judge_gpus: int = 0) -> dict[str, str]:
    """How slurm/train_remote.sbatch starts `grpo.serve` on a node (`python -m grpo.slurm server-layout`):
    - a server node (`shared` false): its GPUs, split into servers by `server_groups` (the model's
      heads decide the tensor-parallel size; unknown heads: powers of two, 8 GPUs one server of TP 8);
    - the one-node mode (`shared`: trainer ranks on cuda:0..train_tasks-1): the GPUs the trainers do
      not use, split the same way (none left idle: 7 free GPUs and 28 heads make 7 servers of one GPU),
      or, with none left, one server sharing cuda:0 at a fraction of its memory with the weights over
      grpo_gloo (NCCL refuses two ranks of one communicator on one GPU);
    - no GPUs: a CPU server, grpo_gloo.
    `judge_gpus` > 0 (a judge on this node in the one-node mode, JUDGE_TP): the last free GPUs are the
    judge's, before the servers take the rest; a judge left to vLLM's default would take cuda:0 at 90% of
    its memory beside trainer rank 0 (REVIEW Part 5 finding 10). Too few free GPUs for it: refused.
    Keys: SERVER_GROUPS (each server's CUDA_VISIBLE_DEVICES as logical ids of the step, space-separated;
    empty: one server that leaves it alone), SERVERS_PER_NODE, SERVER_TP, SERVER_MEMORY (empty:
    grpo.serve's default), TRANSFER (for both sides), JUDGE_GROUP (the judge's GPUs; empty: none
    reserved, the judge has its node to itself or there are no GPUs)."""
    if gpus <= 0:
        return layout_keys([], 1, "", "grpo_gloo")
    free = list(range(train_tasks, gpus)) if shared else list(range(gpus))
    judge: list[int] = []
    if shared and judge_gpus > 0:
        if len(free) < judge_gpus:
            raise ConfigError(
                f"one node of {gpus} GPU(s) with {train_tasks} trainer task(s) leaves {len(free)} GPU(s), and the judge "
                f"needs {judge_gpus} of its own (JUDGE_TP={judge_gpus}): vLLM's default would take cuda:0 beside trainer "
                f"rank 0. Give the judge its own node (sbatch --nodes=SERVERS+JUDGES+1), or fewer --ntasks-per-node.")
        free, judge = free[: len(free) - judge_gpus], free[len(free) - judge_gpus :]
    if not free:
        return layout_keys([], 1, "0.4", "grpo_gloo", judge)
    groups = server_groups(free, heads, kv_heads, tp)
    return layout_keys(groups, len(groups[0]), "", "auto", judge)


def layout_keys(groups: list[list[int]], tp: int, memory: str, transfer: str, judge: list[int] = ()) -> dict[str, str]:
    return {"SERVER_GROUPS": " ".join(",".join(map(str, g)) for g in groups), "SERVERS_PER_NODE": str(max(1, len(groups))),
            "SERVER_TP": str(tp), "SERVER_MEMORY": memory, "TRANSFER": transfer, "JUDGE_GROUP": ",".join(map(str, judge))}


def model_heads_of(model: str) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) of the sbatch's MODEL: a config dict as JSON ('{"num_attention_heads":
    28, "num_key_value_heads": 4}'), an HF folder, a hub id transformers has cached, or `tiny` / a
    packaged name (resolved into the cache as grpo.serve resolves it). (None, None) when unknown."""
    # torch via grpo.rollout: slurm stays light (Hydra's callback, sbatch scripts)
    from grpo.rollout.dedicated import config_heads

    if model.lstrip().startswith("{"):
        return config_heads(json.loads(model))
    # torch via grpo.rollout: slurm stays light (Hydra's callback, sbatch scripts)
    from grpo.rollout.engine_memory import model_config_of
    from grpo.serve import resolve_model

    return config_heads(model_config_of(resolve_model(model)))


def serve_node(groups: list[str], serve_argv: list[str], command: list[str] | None = None, grace_s: float = 60) -> int:
    """One node's servers (`python -m grpo.slurm serve-node`, a single task of the sbatch's server step):
    each `grpo.serve` on its own GPUs, CUDA_VISIBLE_DEVICES mapped through this task's own list (SLURM
    may give 4,5,6,7 or UUIDs). One server (or none named: a CPU or shared-GPU server): this process
    becomes it (exec), as the step ran it before. Several: they run as children, each ended with this
    process (--parent-pid); SIGINT/SIGTERM reach each of them (vLLM takes a repeated signal as one),
    and when one fails the others are stopped and its exit code is this one's. `command`: what runs a
    server (tests)."""
    # torch via grpo.rollout: slurm stays light (Hydra's callback, sbatch scripts)
    from grpo.rollout.dedicated import child_visible_devices

    command = command or [sys.executable, "-m", "grpo.serve"]
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    envs = [{**os.environ, "CUDA_VISIBLE_DEVICES": child_visible_devices([f"cuda:{i}" for i in g.split(",")], parent)}
            for g in groups]
    if len(envs) <= 1:
        sys.stdout.flush()
        os.execve(command[0], [*command, *serve_argv], envs[0] if envs else dict(os.environ))
    children = [subprocess.Popen([*command, *serve_argv, "--parent-pid", str(os.getpid())], env=env) for env in envs]

    def forward(sig, _frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    status, deadline = 0, None
    while True:
        codes = [c.poll() for c in children]
        failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
        if failed is not None and deadline is None:  # the first to fail: stop the rest, then report it
            code = codes[failed]
            status = code if code > 0 else 128 - code
            print(f"grpo.slurm serve-node: the server on CUDA_VISIBLE_DEVICES={envs[failed]['CUDA_VISIBLE_DEVICES']} "
                  f"exited with {code}; stopping this node's other servers", file=sys.stderr, flush=True)
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + grace_s
        if all(code is not None for code in codes):
            return status
        if deadline is not None and time.monotonic() > deadline:
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    """`python -m grpo.slurm server-layout GPUS TRAIN_TASKS SHARED [--model M] [--tp K]`: shell assignments
    for slurm/train_remote.sbatch. `python -m grpo.slurm serve-node --groups "0,1 2,3" -- ARGS`: this
    node's servers, `grpo.serve ARGS` each."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-node"]:
        p = argparse.ArgumentParser(prog="python -m grpo.slurm serve-node", description=serve_node.__doc__)
        p.add_argument("--groups", default="", help="SERVER_GROUPS of the layout: each server's GPUs, space-separated")
        split = argv.index("--") if "--" in argv else len(argv)
        args = p.parse_args(argv[1:split])
        raise SystemExit(serve_node(args.groups.split(), argv[split + 1 :]))
    p = argparse.ArgumentParser(prog="python -m grpo.slurm", description=main.__doc__)
    p.add_argument("command", choices=["server-layout"])
    p.add_argument("gpus", help="GPUs on this node (SLURM_GPUS_ON_NODE; empty or 0: none)")
    p.add_argument("train_tasks", type=int, help="training tasks on a node (SLURM_NTASKS_PER_NODE)")
    p.add_argument("shared", choices=["0", "1"], help="1: the server shares its node with the trainers")
    p.add_argument("--model", help="the served model, whose heads decide each server's tensor-parallel size: an HF "
                   "folder, a hub id, tiny, or a config as JSON with num_attention_heads and num_key_value_heads")
    p.add_argument("--tp", type=int, default=0, help="> 0: servers of this many GPUs (SERVER_TP_OVERRIDE)")
    p.add_argument("--judge-gpus", type=int, default=0, help="> 0: a judge shares this node and needs this many GPUs "
                   "of its own (JUDGE_TP), taken before the servers'")
    args = p.parse_args(argv)
    gpus, shared = int(args.gpus or 0), args.shared == "1"
    free = (gpus - args.train_tasks - args.judge_gpus) if shared else gpus
    heads = kv_heads = None
    if free > 1 and args.model:  # the heads decide only where a server could span several GPUs
        heads, kv_heads = model_heads_of(args.model)
        if heads is None:
            print(f"grpo.slurm server-layout: the heads of {args.model} are unknown here (no config.json): servers of a "
                  f"power of two GPUs. If vLLM refuses that size, set SERVER_TP_OVERRIDE.", file=sys.stderr)
    try:
        layout = remote_server_layout(gpus, args.train_tasks, shared, heads, kv_heads, args.tp, args.judge_gpus)
    except (ConfigError, DeviceError) as e:
        raise SystemExit(f"error: {e}") from None
    print("\n".join(f"{k}={shlex.quote(v)}" for k, v in layout.items()))


if __name__ == "__main__":
    main()
