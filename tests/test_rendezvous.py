"""The weight-transfer join (grpo/rollout/rendezvous.py): where it listens, and that a process without
the sender's secret can neither join nor be joined. The trainer's half is the real GlooSender; the
worker's half is the same `Join` the grpo_gloo engine runs inside a vLLM server, here on a thread (the
end-to-end join through a real server is test_remote.py's)."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from grpo import listeners
from grpo.rollout import rendezvous
from grpo.rollout.gloo_transfer import GlooSender, _broadcast


def listening_ports() -> dict[int, str]:
    return {c.laddr.port: c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"}


def worker(info: dict, secret: str | None = None, out: dict | None = None):
    """A server worker's side of the join (what GlooWeightTransferEngine.init_transfer_engine does),
    on a thread; `secret` other than the sender's: a process that does not hold it."""

    def run():
        try:
            store = dist.TCPStore(info["master_address"], info["master_port"], is_master=False,
                                  timeout=datetime.timedelta(seconds=info["timeout_s"]))
            join = rendezvous.Join(store, secret or info["secret"], 1, 2, info["master_address"], info["timeout_s"], "test")
            join.close_store()
            flat = torch.zeros(4, dtype=torch.uint8)
            _broadcast(join.group, flat)
            out["received"] = flat.tolist()
        except Exception as e:  # noqa: BLE001 - read by the test
            out["error"] = e

    out = {} if out is None else out
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def outside_address() -> str:
    """This machine's address on a non-loopback route; else 127.0.0.2, a loopback address other than
    the hostname's 127.0.0.1 (what gloo's default device and a wildcard-free join would use)."""
    try:
        address = rendezvous.route_address("192.0.2.1")  # TEST-NET-1: routed, never sent to
    except OSError:
        return "127.0.0.2"
    return "127.0.0.2" if address.startswith("127.") else address


@pytest.mark.parametrize("where", ["loopback", "outside"])
def test_the_rendezvous_listens_on_its_host_only_and_closes_once_the_group_formed(where):
    """`dedicated` joins on loopback, `remote` on the trainer's route to the server: the store and the
    gloo pairs listen there and nowhere else (torch would bind the store to every interface, and gloo's
    default device the hostname's address), and the store stops listening once the group formed."""
    host = "127.0.0.1" if where == "loopback" else outside_address()
    other = outside_address() if where == "loopback" else "127.0.0.1"
    before = set(listening_ports())
    sender = GlooSender(host, 2, 30)
    port = sender.port
    assert listening_ports()[port] == host  # torch's own bind would be 0.0.0.0 / ::
    named = {item.port: item for item in listeners.audit(os.getpid())}
    assert "weight-transfer rendezvous" in named[port].purpose and not named[port].problem, named[port]
    with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
        pass
    thread, out = worker(sender.init_info())
    sender.connect()
    sender.send(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    thread.join(30)
    assert out == {"received": [1, 2, 3, 4]}
    opened = {p: ip for p, ip in listening_ports().items() if p not in before}
    assert port not in opened, "the rendezvous still listens after the group formed"
    assert opened and set(opened.values()) == {host}, opened  # the gloo pairs, on the join's host only
    named = {item.port: item for item in listeners.audit(os.getpid())}
    assert all("weight-transfer group" in named[p].purpose and not named[p].problem for p in opened), named


def test_a_rogue_that_writes_the_keys_first_is_ignored_and_reported_once(caplog):
    """A process that reached the port before the server's worker writes the keys gloo's rendezvous
    would read (rank 1's address, rank 0's) and lists what is there: the real worker still joins, the
    weights go to it, and the intrusion is one warning."""
    sender = GlooSender("127.0.0.1", 2, 30)
    rogue = dist.TCPStore("127.0.0.1", sender.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    for key in ("0/1", "0/0", "rank_1"):
        rogue.set(key, b"\x00" * 64)
    assert rogue.list_keys()  # it can read every key name: names are not what keeps it out
    thread, out = worker(sender.init_info())
    with caplog.at_level(logging.WARNING, logger="grpo"):
        sender.connect()
    sender.send(torch.tensor([5, 6, 7, 8], dtype=torch.uint8))
    thread.join(30)
    assert out == {"received": [5, 6, 7, 8]}
    warnings = [r.getMessage() for r in caplog.records if "not written by a member" in r.getMessage()]
    assert len(warnings) == 1 and "3 key(s)" in warnings[0] and "0/1" in warnings[0], warnings


def test_a_worker_without_the_secret_never_joins():
    """The only worker that comes knows the address but not the secret: its keys are not the ones the
    sender reads, so the join fails at the timeout with what was found, and nothing is sent."""
    sender = GlooSender("127.0.0.1", 2, 3)
    thread, out = worker(sender.init_info(), secret=rendezvous.new_secret())
    deadline = time.monotonic() + 30  # its keys are in the store before the sender's 3 s wait starts
    while not rendezvous.foreign_keys(sender.store, sender.secret) and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(rendezvous.JoinRefused, match="written by a process without it"):
        sender.connect()
    thread.join(30)
    assert "received" not in out


def test_an_abort_before_the_group_forms_ends_the_join_and_the_listener_at_once():
    """The server refused its init (a 400, a 401), so no worker will come: the sender's abort ends its
    join and the rendezvous stops listening then, not when the store's timeout (here 10 min) runs out,
    as ServerPool's failed init used to leave it."""
    sender = GlooSender("127.0.0.1", 2, 600)
    port, out = sender.port, {}

    def connect():
        try:
            sender.connect()
        except Exception as e:  # noqa: BLE001 - read by the test (its message only: a traceback holds the store)
            out["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(1)
    assert thread.is_alive() and port in listening_ports()  # waiting for the worker that will not come
    sender.abort()
    thread.join(60)
    assert not thread.is_alive(), "the join still waits after abort"
    assert out["error"].startswith("JoinRefused") and "abandoned" in out["error"], out
    sender.close()
    assert port not in listening_ports()


def test_a_member_that_cannot_prove_the_secret_is_refused_on_both_sides():
    """The group formed (here over a plain store, as if a peer had raced a member to its gloo pair),
    but one member does not hold the secret: each side names the other, before any weight moves."""
    port_store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10))
    errors = {}

    def member(rank, store, secret):
        try:
            group = rendezvous.gloo_group(store, rank, 2, "127.0.0.1", 10)
            rendezvous.prove(group, rank, 2, secret, "test")
        except rendezvous.JoinRefused as e:
            errors[rank] = str(e)

    client = dist.TCPStore("127.0.0.1", port_store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    other = threading.Thread(target=member, args=(1, client, rendezvous.new_secret()))
    other.start()
    member(0, port_store, rendezvous.new_secret())
    other.join(30)
    assert "member 1 " in errors[0] and "member 0 " in errors[1], errors


def test_a_peer_that_replays_another_members_proof_is_refused():
    """The proofs go round in rank order, so a peer in rank 1's place has seen rank 0's before it must
    send its own: each proof names its rank, so sending rank 0's back proves nothing."""
    port_store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10))
    errors = {}

    def replaying_peer():
        store = dist.TCPStore("127.0.0.1", port_store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        group = rendezvous.gloo_group(store, 1, 2, "127.0.0.1", 10)
        seen = torch.zeros(32, dtype=torch.uint8)
        for root, tensor in ((0, seen), (1, seen)):  # receive member 0's proof, then send it as its own
            options = dist.BroadcastOptions()
            options.rootRank = root
            group.broadcast([tensor], options).wait()

    peer = threading.Thread(target=replaying_peer, daemon=True)
    peer.start()
    group = rendezvous.gloo_group(port_store, 0, 2, "127.0.0.1", 10)
    with pytest.raises(rendezvous.JoinRefused, match="member 1 of the weight-transfer group at test does not hold"):
        rendezvous.prove(group, 0, 2, rendezvous.new_secret(), "test")
    peer.join(30)


def test_signed_names_and_values():
    secret = rendezvous.new_secret()
    name = rendezvous.signed_name(secret, "0/1")
    assert name.startswith("0/1/") and rendezvous.is_signed_name(secret, name)
    assert not rendezvous.is_signed_name(rendezvous.new_secret(), name)
    assert not rendezvous.is_signed_name(secret, "0/1") and not rendezvous.is_signed_name(secret, name + "0")
    store = dist.HashStore()
    signed = rendezvous.SignedStore(store, secret, "here")
    signed.set("0/1", b"address")
    assert signed.get("0/1") == b"address" and store.list_keys() == [name]
    store.set(name, store.get(name)[:-1] + b"X")  # the value changed by someone without the secret
    with pytest.raises(rendezvous.JoinRefused, match="forged value for '0/1'"):
        signed.get("0/1")


@pytest.mark.parametrize("count,shown", [(5, "k0, k1, k2, k3, k4)"), (6, "k0, k1, k2, k3, k4 and 1 more)"),
                                         (8, "k0, k1, k2, k3, k4 and 3 more)")])
def test_the_intrusion_warning_names_five_keys_and_counts_the_rest(caplog, count, shown):
    with caplog.at_level(logging.WARNING, logger="grpo"):
        rendezvous.report_intruders([f"k{i}" for i in range(count)], "127.0.0.1:9")
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"{count} key(s) not written by a member ({shown}:" in message, message
