"""grpo.listeners by value, on sockets opened here; and where the run's own stores and gloo groups listen.

Each backend's end-to-end run is watched too (tests/listener_watch.py): test_train (hf),
test_train_colocated, test_dedicated, test_remote, test_reward_model_served."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import psutil
import pytest

from grpo import listeners
from tests.conftest import ROOT


@pytest.fixture
def registry():
    """A clean registry for the test, the process's own given back after."""
    ports, processes = dict(listeners._ports), {pid: list(r) for pid, r in listeners._processes.items()}
    listeners._ports.clear(), listeners._processes.clear()
    yield
    listeners._ports.clear(), listeners._processes.clear()
    listeners._ports.update(ports), listeners._processes.update(processes)


def listening(host: str, kind=socket.SOCK_STREAM) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind)
    s.bind((host, 0))
    if kind == socket.SOCK_STREAM:
        s.listen()
    return s


def found(sock: socket.socket) -> listeners.Listener:
    port = sock.getsockname()[1]
    mine = [item for item in listeners.audit(os.getpid()) if item.port == port]
    assert len(mine) == 1, mine
    return mine[0]


def test_a_wildcard_listener_is_reported_with_its_process_and_port_even_when_registered(registry):
    with listening("0.0.0.0") as s, listening("0.0.0.0", socket.SOCK_DGRAM) as u:
        listeners.expect("127.0.0.1", s.getsockname()[1], "DDP rendezvous store")
        item = found(s)
        assert (item.pid, item.kind, item.address, item.purpose) == (os.getpid(), "tcp", "0.0.0.0", "DDP rendezvous store")
        assert item.problem == "on the wildcard address 0.0.0.0 (configured: 127.0.0.1)"
        assert f"0.0.0.0:{s.getsockname()[1]} pid {os.getpid()}" in str(item)
        udp = found(u)  # a bound UDP socket receives from anyone too
        assert (udp.kind, udp.purpose, udp.problem) == ("udp", "", "on the wildcard address 0.0.0.0")
        assert listeners.violations([item, udp]) == [item, udp]


def test_a_registered_loopback_listener_passes_with_its_purpose(registry):
    with listening("127.0.0.1") as s:
        listeners.expect("127.0.0.1", s.getsockname()[1], "grpo.serve API")
        item = found(s)
        assert (item.address, item.purpose, item.problem) == ("127.0.0.1", "grpo.serve API", "")
        assert listeners.violations([item]) == []


def test_an_unregistered_or_misplaced_listener_is_a_violation(registry):
    with listening("127.0.0.1") as loose, listening("127.0.0.2") as elsewhere:
        listeners.expect("127.0.0.1", elsewhere.getsockname()[1], "vLLM engine API (dedicated engine 0)")
        assert found(loose).problem == "no component registered it"
        assert found(elsewhere).problem == "on 127.0.0.2, configured for 127.0.0.1"
        listeners.forget(elsewhere.getsockname()[1])
        assert found(elsewhere).problem == "no component registered it"


@pytest.mark.starts_process
def test_a_process_rule_covers_its_tree_and_only_on_its_address(registry):
    """Ports nobody picks (a vLLM engine's gloo groups) are matched by process and address."""
    child = subprocess.Popen([sys.executable, "-c", "import socket, time\nfor h in ('127.0.0.1', '127.0.0.2'):\n"
                              "    s = socket.socket(); s.bind((h, 0)); s.listen(); globals()[h] = s\nprint('up', flush=True)\n"
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        listeners.expect_process(child.pid, "127.0.0.1", "the child's own")  # not a tree rule: only its own pid
        listeners.expect_process(os.getpid(), "127.0.0.1", "vLLM engine internals (dedicated engine 0)", tree=True)
        theirs = sorted((i.address, i.purpose, i.problem) for i in listeners.audit(os.getpid()) if i.pid == child.pid)
        # every purpose registered for its address, its own and its parent's tree rule; elsewhere the first
        assert theirs == [("127.0.0.1", "the child's own or vLLM engine internals (dedicated engine 0)", ""),
                          ("127.0.0.2", "the child's own", "on 127.0.0.2, configured for 127.0.0.1")]
        listeners.forget(pid=child.pid)
        theirs = sorted((i.address, i.purpose) for i in listeners.audit(os.getpid()) if i.pid == child.pid)
        assert theirs == [("127.0.0.1", "vLLM engine internals (dedicated engine 0)"),
                          ("127.0.0.2", "vLLM engine internals (dedicated engine 0)")]
    finally:
        child.kill()
        child.wait()


def test_log_lists_each_listener_once_with_its_purpose(registry):
    with listening("127.0.0.1") as s, listening("0.0.0.0") as w:
        listeners.expect("127.0.0.1", s.getsockname()[1], "grpo.serve API")
        lines = []
        listeners.log_listeners(os.getpid(), log=lines.append)
        assert f"listener: tcp 127.0.0.1:{s.getsockname()[1]} pid {os.getpid()}" in "\n".join(lines)
        assert any(line.startswith(f"listener MISBOUND: tcp 0.0.0.0:{w.getsockname()[1]}") for line in lines), lines
        with listening("127.0.0.1") as a, listening("127.0.0.1") as b:  # one process's ports of one purpose: one line
            listeners.expect_process(os.getpid(), "127.0.0.1", "gloo pairs")
            lines = []
            listeners.log_listeners(os.getpid(), log=lines.append)
            # one line holds both ports; it may hold more: a loopback listener an earlier test left open in
            # this process (unregistered, so the process's rule names it) joins their group (CI, 2026-11-29)
            ours = {a.getsockname()[1], b.getsockname()[1]}
            grouped = [set(map(int, m.group(1).split(","))) for line in lines if "gloo pairs" in line
                       for m in [re.search(rf"tcp 127\.0\.0\.1:([\d,]+) pid {os.getpid()} ", line)] if m]
            assert sum(ours <= ports for ports in grouped) == 1 and not any(ours & ports and not ours <= ports
                                                                            for ports in grouped), lines


AUDIT_AFTER_INIT = """
import json, os, sys
from grpo import dist, listeners
dist.init_distributed(dist.DistInfo(), timeout_s=30, force=True)
import torch.distributed as td
td.barrier()
print(json.dumps([[i.address, i.port, i.purpose, i.problem] for i in listeners.audit(os.getpid())]))
"""


def other_address() -> str | None:
    """An IPv4 address of this machine outside loopback, where one exists."""
    return next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")), None)


@pytest.mark.starts_process
@pytest.mark.parametrize("master", ["127.0.0.1", "other"])
def test_the_process_groups_store_and_gloo_pairs_listen_on_master_addr_only(master):
    """grpo.dist's own store (one process, DeepSpeed's group) and the gloo pairs of its group: torch's
    store binds every interface, gloo's default device the hostname's address (127.0.0.1 on this
    machine, so only a MASTER_ADDR elsewhere shows a gloo group that ignores it)."""
    host = other_address() if master == "other" else master
    # not a skip: without an address outside loopback the "other" case cannot be shown, and a green
    # skip would hide it (every machine this project tests on has one)
    assert host is not None, "this test needs an IPv4 address outside loopback (psutil.net_if_addrs() lists none)"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", AUDIT_AFTER_INIT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**env, "MASTER_ADDR": host})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert [problem for *_, problem in seen if problem] == [], seen
    purposes = sorted(purpose.split(" (")[0] for address, _, purpose, _ in seen if address == host)
    assert purposes == ["gloo pairs of this process's groups", "torch.distributed rendezvous store"], seen


def test_nccl_listens_on_loopback_only_where_every_peer_is_on_this_node(monkeypatch):
    """On the H200 (docs/results/gpu_vllm.md) every colocated run left 4 NCCL bootstrap and proxy
    listeners on the host's address, reachable from the cluster, where loopback was all it needed.
    NCCL reads NCCL_SOCKET_IFNAME once a process, so the process group sets it before any NCCL use:
    loopback where MASTER_ADDR and the servers the run pushes to over NCCL are all on this node, NCCL's
    own choice otherwise (a peer elsewhere must reach it), and a user's value untouched."""
    from omegaconf import OmegaConf

    from grpo import dist
    from grpo.rollout.push import nccl_peers

    routes = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1", "node7": "10.0.0.7", "10.0.0.1": "10.0.0.1"}
    assert dist.nccl_on_loopback(["127.0.0.1"], routes.get) and dist.nccl_on_loopback(["127.0.0.1", "localhost"], routes.get)
    assert not dist.nccl_on_loopback(["127.0.0.1", "node7"], routes.get)  # a remote server on another node
    assert not dist.nccl_on_loopback(["10.0.0.1"], routes.get)  # a multi-node run's MASTER_ADDR
    assert not dist.nccl_on_loopback(["127.0.0.1", "no-such-host.invalid"])  # unresolvable: not known to be here

    def rollout(backend, transfer="auto", urls=()):
        return OmegaConf.create({"backend": backend, "vllm": {"weight_transfer": transfer}, "remote": {"urls": list(urls)}})

    urls = ["http://node7:8000", "https://10.0.0.8:8443"]
    assert nccl_peers(rollout("remote", "auto", urls), cuda=True) == ("node7", "10.0.0.8")
    assert nccl_peers(rollout("remote", "grpo_gloo", urls), cuda=True) == ()  # gloo pairs bind as rendezvous.py says
    assert nccl_peers(rollout("remote", "auto", urls), cuda=False) == ()  # auto is grpo_gloo on CPU
    assert nccl_peers(rollout("colocated"), cuda=True) == nccl_peers(rollout("dedicated"), cuda=True) == ()
    # remote.urls left in a colocated or dedicated run: its engines are here, not at those urls
    assert nccl_peers(rollout("colocated", "auto", urls), cuda=True) == nccl_peers(rollout("dedicated", "nccl", urls), cuda=True) == ()

    lo = dist.interface_of("127.0.0.1")
    monkeypatch.delenv(dist.NCCL_IFNAME, raising=False)
    monkeypatch.setattr(dist, "route_address", lambda host: routes.get(host, host))
    dist.bind_nccl(["10.0.0.1", "127.0.0.1"], cuda=False)
    assert dist.NCCL_IFNAME not in os.environ
    # the process group binds NCCL before its init (here none: its gloo binding would outlive the test)
    monkeypatch.setattr(dist, "init_distributed", lambda *a, **k: None)
    with dist.process_group(dist.DistInfo(), nccl_peers=("localhost",)):
        assert os.environ[dist.NCCL_IFNAME] == lo
    monkeypatch.setenv(dist.NCCL_IFNAME, "ib0")
    dist.bind_nccl(["127.0.0.1"], cuda=False)
    assert os.environ[dist.NCCL_IFNAME] == "ib0"
    assert dist.server_nccl_env("127.0.0.1") == {dist.NCCL_IFNAME: lo} and dist.server_nccl_env("10.0.0.5") == {}
