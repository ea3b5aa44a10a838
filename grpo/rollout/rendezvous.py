"""The weight-transfer join, authenticated: who may become a member of a trainer's group with one
server's workers, and where its rendezvous listens.

torch's TCPStore is the rendezvous both halves of `grpo_gloo` meet at. It has no authentication,
any client may list its keys (`list_keys`), and its libuv server binds every interface whatever
host it is given. Left as it was, whoever reached the trainer's node during a server's
`/init_weight_transfer_engine` could write the keys first or join as the missing rank, and then
receive every weight push. Here:

- **Where it listens.** The store listens on a socket bound here to the transfer host (`bound_store`:
  loopback for `dedicated`, the trainer's route to the server for `remote`), passed to torch as
  `master_listen_fd`, and it is closed once the group has formed (`Join.close_store`): the port is
  open only while a server joins. The gloo pairs listen on the same host (`gloo_device`).
- **Who may write.** Each sender has its own `secret` (32 random bytes), handed to the server inside
  `init_info` through the server's token-guarded control route and nowhere else. `SignedStore`
  writes every key under a name derived from the secret and signs every value with it, so a peer
  without it can neither write a key a member reads nor forge a value; a key nobody signed is an
  intrusion, reported once (`foreign_keys`).
- **Who is a member.** Values are readable by anyone who lists the keys (they are addresses, not
  secrets), so a peer could still race a member to its gloo pair. Once the group forms, each member
  proves it holds the secret over the group itself (`prove`: one broadcast of HMAC(secret, rank) per
  member) before any weight moves; a wrong proof ends the join on both sides.

docs/security.md has the threat model this answers to.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time

import torch
import torch.distributed as dist

from grpo.dist import listening_socket, route_address

log = logging.getLogger("grpo")

SECRET_HEX = 64  # 32 bytes
NAME_MAC_HEX = 32  # 16 bytes of HMAC in each key's name
POLL_S = 0.05  # a join's waits poll the store (a timed-out wait of torch's logs a warning each time)


class JoinRefused(RuntimeError):
    """A would-be member of a weight-transfer group did not prove it holds the run's secret."""


def new_secret() -> str:
    return secrets.token_hex(SECRET_HEX // 2)


def _mac(secret: str, *parts: bytes) -> bytes:
    return hmac.new(bytes.fromhex(secret), b"\0".join(parts), hashlib.sha256).digest()


def signed_name(secret: str, key: str) -> str:
    """`key` under a name only a holder of `secret` can make: `key/<hmac>`."""
    return f"{key}/{_mac(secret, b'key', key.encode()).hex()[:NAME_MAC_HEX]}"


def is_signed_name(secret: str, name: str) -> bool:
    key = name.rpartition("/")[0]
    return bool(key) and hmac.compare_digest(signed_name(secret, key), name)


def bound_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous's master, listening on `host` only: torch's own bind takes the wildcard
    address whatever host it is given, so it gets a socket bound here (`master_listen_fd`, which the
    store then owns and closes with itself). Its port is read back from `.port`."""
    sock = listening_socket(host)
    fd = sock.detach()
    try:
        return dist.TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        socket.close(fd)
        raise


def gloo_device(host: str):
    """A gloo device whose pairs listen on `host` (the default device resolves the machine's
    hostname, often a cluster-wide address, whatever interface the rendezvous is on)."""
    return dist.ProcessGroupGloo.create_device(hostname=host)


def gloo_group(store, rank: int, world_size: int, host: str, timeout_s: float):
    options = dist.ProcessGroupGloo._Options()
    options._devices = [gloo_device(host)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, world_size, options)


class SignedStore(dist.Store):
    """A store seen through a secret: each key under `signed_name`, each value signed with the key's
    name, a forged value refused with the store's address (`where`). What gloo's rendezvous calls
    (set, get, wait, check; add for counters, whose values stay plain)."""

    def __init__(self, store: dist.Store, secret: str, where: str, aborted: threading.Event | None = None):
        """`aborted`: set by another thread to end a wait for a member that will never come (`wait`)."""
        super().__init__()
        self.store, self.secret, self.where = store, secret, where
        self.aborted = aborted or threading.Event()

    def _store(self) -> dist.Store:
        if self.store is None:
            raise JoinRefused(f"the weight-transfer rendezvous at {self.where} is closed: the group has formed")
        return self.store

    def set(self, key, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        name = signed_name(self.secret, key)
        self._store().set(name, _mac(self.secret, b"value", name.encode(), value) + value)

    def get(self, key) -> bytes:
        self.wait([key])  # abortable, where the store's own get waits its whole timeout
        name = signed_name(self.secret, key)
        raw = bytes(self._store().get(name))
        tag, value = raw[:32], raw[32:]
        if not hmac.compare_digest(tag, _mac(self.secret, b"value", name.encode(), value)):
            raise JoinRefused(f"the weight-transfer rendezvous at {self.where} holds a forged value for {key!r}: "
                              "another process wrote a member's key (docs/security.md); the join is refused")
        return value

    def wait(self, keys, timeout=None) -> None:
        """Until every key is set, polled (`check`) so that `aborted` ends the wait at once: a trainer
        whose server refused its init stops listening then, not after the store's timeout (10 min).
        Past the timeout, the store's own wait raises its own error."""
        names = [signed_name(self.secret, k) for k in keys]
        store = self._store()
        deadline = time.monotonic() + (timeout or store.timeout).total_seconds()
        while not store.check(names):
            if self.aborted.wait(POLL_S):
                raise JoinRefused(f"the weight-transfer join at {self.where} was abandoned: its server refused its "
                                  "half, or the run is ending")
            if time.monotonic() > deadline:
                store.wait(names, datetime.timedelta(milliseconds=1))

    def check(self, keys) -> bool:
        return self._store().check([signed_name(self.secret, k) for k in keys])

    def add(self, key, amount) -> int:
        return self._store().add(signed_name(self.secret, key), amount)


def foreign_keys(store: dist.TCPStore, secret: str) -> list[str]:
    """The keys in `store` that no holder of `secret` wrote: another process connected and wrote them."""
    return sorted(k for k in store.list_keys() if not is_signed_name(secret, k))


def proof(secret: str, rank: int, world_size: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(_mac(secret, b"member", f"{rank} of {world_size}".encode())), dtype=torch.uint8)


def prove(group, rank: int, world_size: int, secret: str, where: str) -> None:
    """Every member shows every other that it holds `secret`, over the group itself: member r
    broadcasts HMAC(secret, r); each checks each. A peer that took a member's place in a gloo pair
    cannot make the proof, so the join ends before any weight is sent to it."""
    received = []
    for root in range(world_size):  # every broadcast first, so no member leaves the group while another waits
        tensor = proof(secret, rank, world_size) if root == rank else torch.zeros(32, dtype=torch.uint8)
        options = dist.BroadcastOptions()
        options.rootRank = root
        group.broadcast([tensor], options).wait()
        received.append(tensor)
    for root, tensor in enumerate(received):
        if root != rank and not torch.equal(tensor, proof(secret, root, world_size)):
            raise JoinRefused(f"member {root} of the weight-transfer group at {where} does not hold this run's secret: "
                              "another process joined in its place (docs/security.md); the join is refused")


class Join:
    """One member's side of an authenticated join: the signed view of the store, the gloo group on
    `host`, the proofs. The trainer (rank 0) owns the store's master; `close_store` ends the
    listener once the group has formed."""

    def __init__(self, store: dist.Store, secret: str, rank: int, world_size: int, host: str, timeout_s: float,
                 where: str, aborted: threading.Event | None = None):
        self.store = SignedStore(store, secret, where, aborted)
        self.secret, self.rank, self.world_size, self.where = secret, rank, world_size, where
        self.group = gloo_group(self.store, rank, world_size, host, timeout_s)
        prove(self.group, rank, world_size, secret, where)

    def intruders(self) -> list[str]:
        return foreign_keys(self.store.store, self.secret) if self.store.store is not None else []

    def close_store(self) -> None:
        """Drop this member's store: on the trainer, the master's listener closes (the pairs are
        connected; gloo reads the store only while the group forms)."""
        self.store.store = None


def report_intruders(keys: list[str], where: str) -> None:
    """One warning per join that found keys nobody signed (they were ignored)."""
    if keys:
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        log.warning("weight-transfer rendezvous at %s: %d key(s) not written by a member (%s): another process "
                    "connected and wrote them; they were ignored and the members proved the run's secret "
                    "(docs/security.md)", where, len(keys), shown)
