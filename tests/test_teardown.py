"""Nothing left behind on any way out: a run that fails mid-step closes its engines (in-process or
child processes) and their shared memory, and when one rank of a multi-process run is killed the
others stop within a bounded time, naming it, instead of waiting forever."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import faults
from tests.conftest import FAST, ROOT

FAULT = ["reward.funcs=[{name: tests.faults.interrupt_on_second_call, weight: 1.0}]"]


def shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("*")}


def orphaned(names: set[str]) -> set[str]:
    """Those of `names` no live process maps: left behind, not in use by another program that
    happens to run vLLM on this machine at the same time (/dev/shm is shared by all of them). Not
    multiprocessing's named semaphores (`sem.mp-*`): the resource tracker of the program that made
    them unlinks them when it ends, and under `make test-all` the other worker's runs make them
    while this test runs (seen from an hf run, which starts no process)."""
    names = {n for n in names if not n.startswith("sem.mp-")}
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue
    return {n for n in names if n not in mapped and (Path("/dev/shm") / n).exists()}


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.starts_process
@pytest.mark.parametrize("backend", ["hf", "colocated", "dedicated"])
def test_a_run_that_fails_mid_step_leaves_no_engine_behind(make_cfg, backend):
    from grpo.train import train

    faults.CALLS["n"] = 0
    shm_before, children_before = shm_files(), children()
    cfg = make_cfg(f"rollout={backend}", "steps=5", *FAULT)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    assert faults.CALLS["n"] == 2  # it failed in step 2, with the engine up and one sync done
    deadline = time.time() + 30
    while children() - children_before and time.time() < deadline:
        time.sleep(0.5)
    assert children() - children_before == set(), "engine processes outlived the failed run"
    assert orphaned(shm_files() - shm_before) == set(), "shared memory left behind"
    import torch.distributed

    assert not torch.distributed.is_initialized()  # no process group left for the next run either
    if backend == "colocated":  # and the next engine in this process starts and generates
        summary = train(make_cfg("rollout=colocated", "steps=1"))
        assert summary["steps"] == 1


def test_a_rank_that_finished_is_never_reported_silent(monkeypatch):
    """The peer watchdog reports a peer whose heartbeat stopped, but not one that closed as done: rank 1
    finishing first must not interrupt rank 0 while it still exports or evaluates. The checks are called
    by hand (the watchdogs' own threads never beat), so nothing here depends on timing."""
    import torch.distributed as dist

    from grpo.dist import DistInfo, PeerWatchdog

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    rank0, rank1 = (PeerWatchdog(DistInfo(rank, 2), timeout_s=0.0, interval_s=3600.0) for rank in (0, 1))
    try:
        assert rank0.silent_peers() == {}  # first sight of rank 1's heartbeat
        assert list(rank0.silent_peers()) == [1]  # it has not moved since: reported
        rank1.close(done=True)
        assert rank0.silent_peers() == {}  # it changed (to done)
        assert rank0.silent_peers() == {}, "rank 1 finished cleanly, yet rank 0's watchdog reported it silent"
    finally:
        rank0.close(done=True)
        rank1.close(done=True)


def port_below_the_ephemeral_range() -> int:
    """A port free now, below the kernel's ephemeral range (ip_local_port_range): seconds pass before rank
    0 binds it, and in them no other process's port 0 bind or outgoing connection (another xdist
    worker's servers and requests) can be given it, as they could one `free_port` picked."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for port in random.sample(range(low // 2, low), 100):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low // 2}-{low - 1}")


@pytest.mark.starts_process
def test_a_killed_rank_is_named_and_the_other_stops(tmp_path, cache_dir):
    """Two ranks launched as srun would (rank variables, no torchrun agent to clean up after them);
    rank 1 is SIGKILLed mid-run. Rank 0 must exit on its own, naming rank 1, not hang."""
    port = port_below_the_ephemeral_range()
    procs, logs = [], []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = open(tmp_path / f"rank{rank}.log", "w")
        logs.append(tmp_path / f"rank{rank}.log")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "grpo.train", *FAST, "steps=500", "parallel=ddp", "parallel.peer_timeout_s=10",
             f"hydra.run.dir={tmp_path / 'run'}", f"model.cache_dir={cache_dir}"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert procs[0].poll() is None and procs[1].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        killed_at = time.time()
        procs[1].send_signal(signal.SIGKILL)
        code = procs[0].wait(timeout=120)
        took = time.time() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    out = logs[0].read_text()
    print(f"rank 0 exited {took:.1f} s after rank 1 was killed")
    assert code != 0, out[-3000:]
    assert "rank 1" in out and ("silent" in out or "stopped answering" in out), out[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == sorted(set(steps))  # nothing logged twice on the way out
