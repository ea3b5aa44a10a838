"""grpo/rollout/servers.py against fake servers: a server that restarted under the trainer (its pushed
weights and transfer group gone) is an error naming it, on every path that reads its version, never a
batch sampled from its base weights under the trainer's version; the server's side of the same event
(grpo/rollout/gloo_transfer.py: a push with no transfer group) says so too. grpo/rollout/server_watch.py:
a dead engine fails a request in seconds; a started server's URL is read from its own folder, and
one that exits first, or never writes, is an error saying so."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from grpo import endpoints
from grpo.endpoints import CONTROL_TIMEOUT_S, Server, ServerGone
from grpo.errors import ServerError
from grpo.rollout import gloo_transfer
from grpo.rollout.base import Rollouts, Sampling, queued
from grpo.rollout.dedicated import engine_exit
from grpo.rollout.push import push_from_one_rank
from grpo.rollout.server_watch import engine_dead, wait_for_url
from grpo.rollout.servers import DaemonWorker, ServerPool, ServerRestarted
from grpo.rollout.vllm_api import vllm_api
from tests.conftest import ROOT, server_scratch

BUCKET = [("w", torch.zeros(2))]


class Restartable(Server):
    """A vLLM 0.32 server answering at once: /weight_info says `version` (what the test sets: "default"
    after a restart, as vLLM says before any push), each completion is token 5."""

    def __init__(self, url: str):
        super().__init__(url, None, 5.0)
        self.vllm, self.version, self.generated = vllm_api("0.32.0"), "default", 0

    def request(self, path, body=None, timeout=None, text=False):
        if path == "/weight_info":
            return {"weight_version": self.version}
        if path == "/finish_weight_update":
            self.version = body["weight_version"]
        if path == "/v1/completions":
            self.generated += 1
            return {"choices": [{"index": k, "token_ids": [5], "logprobs": {"token_logprobs": [-0.1]},
                                 "finish_reason": "length", "prompt_token_ids": body["prompt"][k // body["n"]]}
                                for k in range(len(body["prompt"]) * body["n"])]}
        return {}


class NoBytes:
    """A transfer sender whose bytes go nowhere (the routes are what is tested)."""

    prepare = update_info = staticmethod(lambda bucket: {})
    send = abort = close = staticmethod(lambda *_: None)


def pool_of(*servers: Server) -> ServerPool:
    pool = ServerPool.__new__(ServerPool)  # no health checks, no rendezvous
    pool.servers, pool.clients, pool.idle_since, pool.gate, pool.images = list(servers), 1, None, None, False
    pool.generator, pool.stopped, pool.senders = DaemonWorker("test-generate"), threading.Event(), [NoBytes()] * len(servers)
    return pool


def test_a_restarted_server_is_an_error_naming_it_not_its_base_weights_under_the_trainers_version():
    """The restarted server says "default" (or an older version than pushed). Before, `served_version`
    read "default" as the trainer's own version, the before/after check passed, and the batch came from
    the base weights labelled as version 1. Before any push, "default" is what every server says."""
    server = Restartable("http://127.0.0.1:1")
    pool = pool_of(server)
    greedy = Sampling(max_new_tokens=1, temperature=0.0)
    assert pool.generate([[1, 2]], 1, greedy, version=0).weight_version == 0  # no push yet: "default" is fine
    pool.push([BUCKET], version=1)
    assert pool.generate([[1, 2]], 1, greedy, version=1).weight_version == 1
    for restarted in ("default", "0"):  # vLLM's own word after a restart; a version below the last push
        server.version, server.lost = restarted, None
        with pytest.raises(ServerRestarted, match=r"http://127\.0\.0\.1:1 reports weight version .* pushed version 1 "
                                                  r"into it: the server restarted.*Restart the run.*resumes from"):
            pool.generate([[1, 2]], 1, greedy, version=1)
    generated = server.generated
    # an episode batch reads versions but goes on without a server whose version it cannot read
    # (grpo/rollout/trajectories.py): its requests are refused from then on, none reaches the server
    with pytest.raises(ServerRestarted, match="restarted"):
        pool.complete(server, [[1, 2]], 1, greedy, None)
    assert server.generated == generated
    pool.close()


class PushedMidBatch(Restartable):
    """A server whose weights another trainer pushes while our batch generates: /weight_info says
    `version` before the completion and `version + 1` after it."""

    def request(self, path, body=None, timeout=None, text=False):
        answer = super().request(path, body, timeout, text)
        if path == "/v1/completions":
            self.version = str(int(self.version) + 1)
        return answer


def test_weights_that_change_during_a_batch_or_differ_between_servers_are_an_error():
    """ServerPool.generate reads each server's version before and after its share: a change in between
    means the completions mix two policies; servers at different versions mean a push reached only some.
    Either is an error, never a batch labelled with one version."""
    greedy = Sampling(max_new_tokens=1, temperature=0.0)
    mid = PushedMidBatch("http://127.0.0.1:3")
    mid.version = "1"
    pool = pool_of(mid)
    with pytest.raises(ServerError, match=r"http://127\.0\.0\.1:3 changed weights from version 1 to 2 during a generation"):
        pool.generate([[1, 2]], 1, greedy, version=1)
    pool.close()
    a, b = Restartable("http://127.0.0.1:4"), Restartable("http://127.0.0.1:5")
    a.version, b.version = "1", "2"
    pool = pool_of(a, b)
    with pytest.raises(ServerError, match=r"the servers hold different weight versions \[1, 2\]; a push reached only some"):
        pool.generate([[1, 2], [3, 4]], 1, greedy, version=2)
    b.version = "1"
    assert pool.generate([[1, 2], [3, 4]], 1, greedy, version=1).weight_version == 1
    pool.close()


class FakeVllm(http.server.BaseHTTPRequestHandler):
    """What a pool asks a vLLM 0.32 server of one engine rank as it starts, answered at once."""

    answers = {"/v1/models": {"data": [{"id": "m"}]}, "/version": {"version": "0.32.0"}, "/get_world_size": {"world_size": 1}}

    def do_GET(self):
        body = json.dumps(self.answers.get(self.path, {})).encode()
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_the_transfer_group_joins_on_the_route_to_the_server_or_the_host_given(monkeypatch):
    """The weight-transfer rendezvous and its gloo pairs listen where make_sender is told: the trainer's
    route to the server (here loopback), or rollout.remote.transfer_host; never a wildcard, which would
    open them on every interface of the trainer's node (docs/security.md, Listeners)."""
    from grpo.rollout import servers

    hosts = []
    sender = SimpleNamespace(init_info=lambda: {}, connect=lambda: None, abort=lambda: None, close=lambda: None)
    monkeypatch.setattr(servers, "make_sender", lambda transfer, host, *_: hosts.append(host) or sender)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        for transfer_host in (None, "10.1.2.3"):
            ServerPool([f"http://127.0.0.1:{httpd.server_port}"], None, 10, 10, transfer_host, log=None).close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert hosts == ["127.0.0.1", "10.1.2.3"]


class RefusesInit(FakeVllm):
    """A vLLM 0.32 server that records what it was asked; `refuse`: its init route answers 400."""

    refuse, paths = False, None

    def do_POST(self):
        self.paths.append(self.path)
        if self.refuse and self.path == "/init_weight_transfer_engine":
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_error(400, "weight transfer backend grpo_gloo is not registered")
            return
        super().do_POST()


def test_a_server_that_refuses_its_init_releases_the_groups_the_servers_before_it_formed(monkeypatch):
    """The second of two servers refuses its /init_weight_transfer_engine: the pool is never made, so
    the first server's group (joined) and the generator thread are released there and then, not left
    open to the end of the process; the second's sender is closed."""
    from grpo.rollout import servers

    senders = []

    def make_sender(*_):
        # the first server's peer joins at once; the second's never comes (its server refused the init), so
        # its join waits until aborted, as a real rendezvous does (a join that returned at once raced the
        # server's 400: abort was called or not by which thread answered first)
        aborted = threading.Event()
        joins = not senders
        sender = SimpleNamespace(init_info=lambda: {}, calls=[],
                                 connect=lambda: None if joins or aborted.wait(30) else pytest.fail("never aborted"))
        sender.abort = lambda: sender.calls.append("abort") or aborted.set()
        sender.close = lambda: sender.calls.append("close")
        return senders.append(sender) or sender

    monkeypatch.setattr(servers, "make_sender", make_sender)
    handlers = [type("Joins", (RefusesInit,), {"paths": []}), type("Refuses", (RefusesInit,), {"paths": [], "refuse": True})]
    httpds = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), h) for h in handlers]
    for httpd in httpds:
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
    # by identity: a generator of an earlier test's closed pool may still be on its way out
    before = {t for t in threading.enumerate() if t.name == "grpo-generate"}
    ours = lambda: [t for t in threading.enumerate() if t.name == "grpo-generate" and t not in before]  # noqa: E731
    try:
        with pytest.raises(ServerError, match=r"answered 400(?s:.*)not registered"):
            ServerPool([f"http://127.0.0.1:{h.server_port}" for h in httpds], None, 10, 10, log=None)
    finally:
        for httpd in httpds:
            httpd.shutdown()
            httpd.server_close()
    # the first's transfer had joined: nothing to abort; the second's join is released, then closed
    assert [s.calls for s in senders] == [["close"], ["abort", "close"]]
    assert handlers[0].paths == ["/init_weight_transfer_engine", "/shutdown_weight_transfer_engine"]
    assert handlers[1].paths == ["/init_weight_transfer_engine"]
    for t in ours():  # the generator's thread ends once it reads the shutdown
        t.join(30)
    assert ours() == []


def test_every_ranks_pool_knows_the_push_another_rank_made():
    """rollout=remote: rank 0 pushes; the other ranks' pools learn the version through
    push_from_one_rank, so their batches detect a restarted server too."""
    server = Restartable("http://127.0.0.1:2")
    pool = pool_of(server)
    push_from_one_rank(None, [BUCKET], 3, own=pool)  # this rank holds no pusher: the buckets are walked
    assert pool.pushed == 3
    with pytest.raises(ServerRestarted, match="pushed version 3"):
        pool.served_version(server, fallback=3)
    pool.close()


def test_a_server_with_no_transfer_group_says_it_restarted_not_a_missing_attribute():
    """A server restarted under a running trainer answers its next /update_weights with a 500; its words
    were "'GlooWeightTransferEngine' object has no attribute 'group'"."""
    engine_cls = gloo_transfer._engine_classes()
    engine = engine_cls.__new__(engine_cls)  # as vLLM builds it, before any /init_weight_transfer_engine
    info = SimpleNamespace(names=["w"], dtype_names=["float32"], shapes=[[2]])
    with pytest.raises(RuntimeError, match="no grpo_gloo weight-transfer group.*restarted.*restart the run"):
        engine.receive_weights(info)


class NoLora(Restartable):
    """A server started without --lora-rank: vLLM mounts no adapter routes, FastAPI answers 404."""

    def request(self, path, body=None, timeout=None, text=False):
        if path == "/v1/load_lora_adapter":
            raise ServerError(f'{self.url}{path} answered 404: {{"detail":"Not Found"}}', 404)
        return super().request(path, body, timeout, text)


def test_an_adapter_sync_to_a_server_without_lora_says_to_start_it_with_lora_rank():
    """Before, the first LoRA sync failed on the bare 404 of a route the server never mounted."""
    pool = pool_of(NoLora("http://127.0.0.1:3"))
    with pytest.raises(ServerError, match=r"http://127\.0\.0\.1:3 has no /v1/load_lora_adapter \(404\): the server was "
                                          r"started without --lora-rank.*--lora-rank R"):
        pool.load_adapter("/run/adapters/v1", version=1)
    pool.close()


class Timed(Restartable):
    """Restartable, recording each route's timeout as the pool's requests reach the wire (`send`)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.timeouts = {}

    def send(self, path, body, timeout, text=False, send_token=True):
        self.timeouts[path] = timeout
        return Restartable.request(self, path, body, timeout, text)

    request = Server.request  # the real one: default timeouts, the watch


def test_control_routes_answer_within_their_own_timeout_not_the_generation_timeout():
    """A dead engine held /start_weight_update open for request_timeout_s (600 s, made for generation);
    the control routes now take CONTROL_TIMEOUT_S (60 s), generation its own sized timeout."""
    server = Timed("http://127.0.0.1:4")
    server.timeout_s = 600.0
    pool = pool_of(server)
    pool.generate([[1, 2]], 1, Sampling(max_new_tokens=10, temperature=0.0), version=0)
    pool.push([BUCKET], version=1)
    assert CONTROL_TIMEOUT_S == 60.0
    assert server.timeouts == {"/weight_info": 60.0, "/start_weight_update": 60.0, "/finish_weight_update": 60.0,
                               "/reset_prefix_cache": 60.0,
                               # 600 s + 10 tokens x 1 completion / 100 tokens/s (servers.generation_timeout)
                               "/v1/completions": 600.1,
                               "/update_weights": 600.0}  # blocks while the bytes travel: the transfer's bound
    pool.close()


class Calls(Restartable):
    """A Restartable that lists the routes it was sent."""

    def __init__(self, url: str):
        super().__init__(url)
        self.paths = []

    def request(self, path, body=None, timeout=None, text=False):
        self.paths.append(path)
        return super().request(path, body, timeout, text)


def test_a_vlms_push_resets_the_servers_encoder_cache_whatever_this_pool_sent():
    """rollout=remote: each rank sends its own requests, rank 0's pool alone pushes. The encoder cache
    (the vision tower's outputs under the old weights) was reset only when the pushing pool itself had
    sent an image, so a rank 0 whose prompts had none left the other ranks' stale outputs served. The
    backend sets `images` from the model (a VLM); a text model's pushes send no such reset."""
    for images in (True, False):
        server = Calls("http://127.0.0.1:5")
        pool = pool_of(server)
        pool.images = images  # what RemoteBackend and DedicatedBackend set: vision.is_vision_model(model)
        pool.push([BUCKET], version=1)  # no image request went out through this pool
        assert ("/reset_encoder_cache" in server.paths) == images, server.paths
        pool.close()


@contextlib.contextmanager
def silent_listener(accept_once: bool = False):
    """A port that accepts connections and never answers: `accept_once`, it takes one connection and
    then stops listening while holding it, as vLLM whose engine died does with the request in flight."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    held, taken = [], threading.Event()

    def take():
        held.append(sock.accept()[0])
        if accept_once:
            sock.close()
        taken.set()

    threading.Thread(target=take, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", taken
    finally:
        for s in held + [sock]:
            s.close()


def test_a_server_that_does_not_answer_in_time_is_said_to_be_slow_not_unreachable():
    """Before: "http://...:P/start_weight_update is unreachable (timed out); is `python -m grpo.serve` running
    there?", of a server that was running and had accepted the request."""
    with silent_listener() as (url, _):
        with pytest.raises(ServerError) as e:
            Server(url, None, 0.3).request("/start_weight_update", {})
    assert str(e.value) == (f"{url}/start_weight_update did not answer within 0.3 s: the server (or the network to it) "
                            "is busy or stuck; its log says which")


class AnswersByPath(http.server.BaseHTTPRequestHandler):
    """POST /<status>: answers that status at once (vLLM whose engine died answers a request 500)."""

    def do_POST(self):
        self.send_response(int(self.path.strip("/")))
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_a_request_that_fails_asks_at_once_whether_the_server_died():
    """After a failed request the watch is asked at once, however recently it was last asked, and a 5xx
    from a dead server is a ServerGone naming why; a 4xx is the server's own answer: it is alive, and the
    request's error is raised as it is."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AnswersByPath)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = Server(f"http://127.0.0.1:{httpd.server_port}", None, 5.0)
        why, asked = [None], []
        server.watch = lambda: asked.append(1) or why[0]
        assert server.why_dead() is None and asked == [1]  # alive, asked just now
        why[0] = "its process exited (-9)"
        with pytest.raises(ServerError) as e:
            server.request("/400", {})
        assert not isinstance(e.value, ServerGone) and e.value.status == 400 and asked == [1]
        with pytest.raises(ServerGone, match=r"/500 failed \(.*answered 500.*\): its process exited \(-9\)"):
            server.request("/500", {})
        assert asked == [1, 1]
    finally:
        httpd.shutdown()
        httpd.server_close()


class EngineDead(http.server.BaseHTTPRequestHandler):
    """vLLM 0.32 after its engine core died: /health answers 503; a request sent as it died waits for ever."""

    def do_GET(self):
        if self.path == "/health":
            self.send_response(503)
            self.end_headers()
        else:
            time.sleep(3600)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("death", ["health 503", "stopped listening"])
def test_a_request_to_a_server_whose_engine_died_fails_in_seconds_saying_so(monkeypatch, death):
    """The pool's watch (server_watch.engine_dead) asked while a request waits: a /health of 503, or a server that
    stopped listening while it holds the request (both what vLLM 0.32 does on CPU when its EngineCore is
    killed), fails it within WATCH_EVERY_S, not after its 600 s timeout. tests/test_dedicated.py kills a real
    engine's core."""
    monkeypatch.setattr(endpoints, "WATCH_EVERY_S", 0.2)
    if death == "health 503":
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), EngineDead)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        place = contextlib.nullcontext((f"http://127.0.0.1:{httpd.server_address[1]}", None))
        said = r"it answers /health with 503: its vLLM engine died \(EngineDeadError\); its log says why"
    else:
        place = silent_listener(accept_once=True)
        said = r"it no longer accepts connections \(vLLM stops listening once its engine died\); its log says why"
    with place as (url, taken):
        server = Server(url, None, 600.0)
        # the listener takes one connection, the request's: a /health probe sent before it would be the one taken
        server.watch = lambda: engine_dead(server) if taken is None or taken.is_set() else None
        start = time.monotonic()
        with pytest.raises(ServerGone, match=rf"^{url}/start_weight_update will never be answered: {said}$"):
            server.request("/start_weight_update", {}, timeout=CONTROL_TIMEOUT_S)
        assert time.monotonic() - start < 5
        assert server.dead is not None  # remembered: the next request is not waited on
        with pytest.raises(ServerGone):
            server.request("/v1/completions", {})
    if death == "health 503":
        httpd.shutdown()


def test_each_servers_url_is_read_from_its_own_folder_once_written_and_two_in_one_are_refused(tmp_path):
    """server_watch.wait_for_url against grpo.serve's own write_url, each URL written half a second into
    the wait: each server's folder gives that server's URL, never another's; a folder holding two URL
    files is an error naming them, not a guess."""
    from grpo.serve import write_url

    folders = [tmp_path / "engine0", tmp_path / "engine1"]
    writers = [threading.Timer(0.5, write_url, (str(folder), "127.0.0.1", port)) for folder, port in zip(folders, (4101, 4202))]
    for folder, writer in zip(folders, writers):
        folder.mkdir()
        writer.start()
    assert [wait_for_url(str(f), 30) for f in folders] == ["http://127.0.0.1:4101", "http://127.0.0.1:4202"]
    for writer in writers:
        writer.join()
    write_url(str(folders[0]), "127.0.0.1", 4303)
    with pytest.raises(ServerError, match=rf"^engine 0: {folders[0]} holds 2 URL files \(127.0.0.1-4101.url, "
                                          r"127.0.0.1-4303.url\), where one server writes one"):
        wait_for_url(str(folders[0]), 30, what="engine 0")


def test_a_server_that_never_writes_its_url_is_an_error_after_the_timeout_saying_it_still_runs(tmp_path):
    with pytest.raises(ServerError, match=rf"^engine 0 wrote no URL into {tmp_path} within 0.3 s and still runs: it is "
                                          r"stuck before it listens"):
        wait_for_url(str(tmp_path), 0.3, lambda: None, "engine 0")


def serve_cmd(url_dir, *args: str) -> list[str]:
    return [sys.executable, "-m", "grpo.serve", "--model", "tiny", "--max-model-len", "64", "--port", "0",
            "--url-dir", str(url_dir), *args]


@pytest.mark.starts_process
def test_a_real_servers_url_names_the_port_its_own_process_listens_on(tmp_path):
    """A real `grpo.serve --port 0 --url-dir` (seconds of imports before it writes): the URL read is the
    port that very process listens on, from before its model loads."""
    log = tmp_path / "serve.log"
    with server_scratch() as env, open(log, "w") as out:  # the SIGKILL below leaves its scratch folder
        proc = subprocess.Popen(serve_cmd(tmp_path / "url"), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **env})
        try:
            url = wait_for_url(str(tmp_path / "url"), 300, lambda: engine_exit(proc, str(log)))
            listening = [c.laddr for c in psutil.Process(proc.pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
            assert url in [f"http://{a.ip}:{a.port}" for a in listening], (url, listening)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.starts_process
def test_a_server_that_exits_before_its_url_fails_the_wait_at_once_with_its_log(tmp_path):
    """A real grpo.serve that stops before it listens (here: its token file is not there) fails the wait as
    soon as it has exited, with its exit code and the end of its log, not after the wait's timeout."""
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_cmd(tmp_path / "url", "--token-file", str(tmp_path / "missing")), cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    with pytest.raises(ServerError) as e:
        wait_for_url(str(tmp_path / "url"), 60, lambda: engine_exit(proc, str(log)), "engine 0")
    assert str(e.value).startswith(f"engine 0 exited before it wrote its URL into {tmp_path / 'url'}: exit code 2; "
                                   f"the end of {log}:\n"), e.value
    assert "--token-file: the path given does not exist" in str(e.value)


def test_a_batch_queued_behind_another_counts_its_wait_apart_from_its_generation():
    """algo.max_staleness: the first step hands k + 1 batches to the pool's one generator thread at once,
    and each starts when the one before ends. Its `queued_s` is that wait, which time/batch_generate_s
    leaves out (it read batch 1's generation as batch 2's too: gen_tokens_per_s 1,143 for about 3,100)."""
    worker, gate, running = DaemonWorker("grpo-generate"), threading.Event(), threading.Event()
    empty = lambda: Rollouts([], [], [], 0)  # noqa: E731
    before_first = time.perf_counter()
    first = queued(worker, lambda: (running.set(), gate.wait(), empty())[-1])
    second = queued(worker, empty)
    handed_by = time.perf_counter()  # the second was handed over before this
    assert running.wait(60)
    first_began_by = time.perf_counter()
    released = time.perf_counter()
    gate.set()
    assert first.result(60).queued_s <= first_began_by - before_first  # it began at once
    assert second.result(60).queued_s >= released - handed_by  # it waited at least until the first ended
    worker.shutdown(wait=True)


class LoadsAdapters(Restartable):
    """Records the adapters it is asked to load and unload."""

    def __init__(self, url: str):
        super().__init__(url)
        self.asked: list[tuple[str, dict]] = []

    def request(self, path, body=None, timeout=None, text=False):
        if "lora_adapter" in path:
            self.asked.append((path, body))
        return super().request(path, body, timeout, text)


def test_an_adapter_push_writes_the_new_version_and_every_ranks_pool_asks_for_it(tmp_path):
    """LoRA: the rank with the pool writes `v2`, has its server load it and drops `v1` (only the
    version folders: `notes` stays); a rank without the pool names the new adapter in its own pool."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    from grpo.rollout.push import push_adapter_from_one_rank
    from grpo.rollout.servers import adapter_name

    folder = tmp_path / "adapters"
    (folder / "v1").mkdir(parents=True)
    (folder / "notes").mkdir()
    model = SimpleNamespace(peft_config={"default": LoraConfig(r=2, target_modules=["q_proj"])})
    weight = torch.tensor([[1.0, 2.0]])
    server, other = LoadsAdapters("http://127.0.0.1:2"), LoadsAdapters("http://127.0.0.1:3")
    pool, own = pool_of(server), pool_of(other)  # rank 0's, and another rank's over the same servers
    push_adapter_from_one_rank(pool, model, [[("base_model.model.q_proj.lora_A.weight", weight)]], 2, str(folder))
    assert sorted(os.listdir(folder)) == ["notes", "v2"]
    assert load_file(str(folder / "v2" / "adapter_model.safetensors"))["base_model.model.q_proj.lora_A.weight"].tolist() == [[1.0, 2.0]]
    assert server.asked == [("/v1/load_lora_adapter", {"lora_name": adapter_name(2), "lora_path": str(folder / "v2"),
                                                         "load_inplace": True})]
    push_adapter_from_one_rank(None, model, [[("base_model.model.q_proj.lora_A.weight", weight)]], 2, str(folder), own=own)
    assert other.adapter == adapter_name(2) and other.asked == []
    pool.close()
    own.close()
