"""Every listening socket of a process tree, and what it is for.

On a shared cluster other users' jobs can reach the node, so each listener must be on the address
its purpose needs (loopback for what stays on the node, the configured host for what must be
reached) and nowhere else. The components that open a listener say so here:

  - `expect(address, port, purpose)`: a port they chose or read back (a store bound to port 0,
    a server's --port);
  - `expect_process(pid, address, purpose)`: listeners of one process whose ports nobody picks
    (gloo's pair listener, a vLLM engine's internal torch.distributed store), on one address.

`listeners(root_pid)` lists the TCP/UDP listeners of a process and its children (psutil), and
`classify` names each one's purpose and what is wrong with it: any wildcard address (0.0.0.0, ::),
an address other than the one registered, or a listener nobody accounted for.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace

import psutil

from grpo.progress import say

WILDCARDS = ("0.0.0.0", "::", "")
UNREGISTERED = "no component registered it"  # on an address of its own, but nobody said what it is for


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str  # the process's name and the start of its command line
    kind: str  # "tcp" (listening) or "udp" (bound, unconnected)
    address: str
    port: int
    purpose: str = ""  # "" nobody accounted for it
    problem: str = ""  # "" where it is bound as intended
    ancestors: tuple[int, ...] = ()  # its parent's pid, its grandparent's, ...

    def __str__(self) -> str:
        return self.text(str(self.port))

    def text(self, ports: str) -> str:
        what = self.purpose or "unaccounted"
        where = f"{self.kind} {self.address}:{ports}" if ":" not in self.address else f"{self.kind} [{self.address}]:{ports}"
        return f"{where} pid {self.pid} ({self.process}): {what}" + (f": {self.problem}" if self.problem else "")


# port -> (address, purpose); pid -> [(address, purpose, tree)]. A process keeps its own registry: what it
# started (engines, stores, servers) it registers here, and an audit of its tree reads it.
_ports: dict[int, tuple[str, str]] = {}
_processes: dict[int, list[tuple[str, str, bool]]] = {}


def expect(address: str, port: int, purpose: str) -> None:
    _ports[port] = (address, purpose)


def expect_process(pid: int, address: str, purpose: str, tree: bool = False) -> None:
    """Listeners of `pid` (`tree`: and of its descendants) on ports nobody picks (gloo pairs, vLLM's
    internals), expected on `address`."""
    rules = _processes.setdefault(pid, [])
    if (address, purpose, tree) not in rules:
        rules.append((address, purpose, tree))


def expect_served(pid: int, url: str, name: str = "grpo.serve") -> None:
    """What a loopback `grpo.serve` this process started (pid `pid`, at `url`) listens on: its API, and
    its vLLM processes' internals (gloo groups, the weight-transfer pairs) on loopback."""
    expect("127.0.0.1", int(url.rsplit(":", 1)[1]), f"{name} API")
    expect_process(pid, "127.0.0.1", f"{name}'s vLLM internals: gloo groups, weight-transfer pairs, NCCL's sockets", tree=True)


def forget(port: int | None = None, pid: int | None = None) -> None:
    """A listener that closed (its port may be someone else's next)."""
    _ports.pop(port, None)
    _processes.pop(pid, None)


def registry() -> tuple[dict, dict]:
    """This process's registrations, to hand to an audit run elsewhere (a test's watcher)."""
    return dict(_ports), {pid: list(rules) for pid, rules in _processes.items()}


def describe(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(" ".join(proc.cmdline()[:4]).split())  # one line, however the title was set
        return f"{proc.name()}: {cmd}"[:100]
    except psutil.Error:
        return "gone"


def ancestors(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.parents()
    except psutil.Error:
        return []


def listeners(root_pid: int) -> list[Listener]:
    """The listening TCP and bound, unconnected UDP sockets of `root_pid` and all its descendants."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    found = []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:  # gone meanwhile
            continue
        for c in conns:
            tcp = c.type == socket.SOCK_STREAM
            if (c.status != psutil.CONN_LISTEN) if tcp else bool(c.raddr):
                continue
            found.append(Listener(proc.pid, describe(proc), "tcp" if tcp else "udp", c.laddr.ip, c.laddr.port,
                                  ancestors=tuple(p.pid for p in ancestors(proc))))
    return found


def classify(found: list[Listener], ports: dict | None = None, processes: dict | None = None) -> list[Listener]:
    """Each listener with its purpose and problem, from `ports` / `processes` (default: this process's
    registry). A port registration wins over its process's (or its ancestors' `tree` ones)."""
    ports = _ports if ports is None else ports
    processes = _processes if processes is None else processes
    out = []
    for item in found:
        address, purpose = ports.get(item.port, (None, ""))
        options = [(a, p) for pid in (item.pid, *item.ancestors) for a, p, tree in processes.get(pid, [])
                   if pid == item.pid or tree]
        if not purpose and options:  # every purpose registered for its address (a process's gloo groups
            # and its transfer pairs share one), else the first, to name what it was for
            here = [p for a, p in options if a == item.address]
            address, purpose = (item.address, " or ".join(dict.fromkeys(here))) if here else options[0]
        if item.address in WILDCARDS:
            problem = f"on the wildcard address {item.address or '*'}" + (f" (configured: {address})" if address else "")
        elif not purpose:
            problem = UNREGISTERED
        elif item.address != address:
            problem = f"on {item.address}, configured for {address}"
        else:
            problem = ""
        out.append(replace(item, purpose=purpose, problem=problem))
    return out


def violations(found: list[Listener]) -> list[Listener]:
    return [item for item in found if item.problem]


def audit(root_pid: int, ports: dict | None = None, processes: dict | None = None) -> list[Listener]:
    """The listeners of `root_pid`'s tree, classified."""
    return classify(listeners(root_pid), ports, processes)


def log_listeners(root_pid: int, log=say) -> None:
    """The listeners of the run's process tree with their purpose, one line per process, address and
    purpose (a vLLM worker's dozen gloo ports are one line); a misbound one says what is wrong."""
    groups: dict[tuple, list[Listener]] = {}
    for item in sorted(audit(root_pid), key=lambda i: (i.pid, i.port)):
        groups.setdefault((item.pid, item.kind, item.address, item.purpose, item.problem), []).append(item)
    for items in groups.values():
        first = items[0]
        label = "" if not first.problem else " (unregistered)" if first.problem == UNREGISTERED else " MISBOUND"
        log(f"listener{label}: {first.text(','.join(str(i.port) for i in items))}")
