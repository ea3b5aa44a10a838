"""Which token goes where (grpo/auth.py) and how (grpo/endpoints.py): each client its own token, never
the rollout servers' by fallback; plain http to another host only where the config says so; no
redirect followed, against real local HTTP servers, so the Authorization header reaches no host that
was not configured."""

import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo import endpoints
from grpo.auth import (JUDGE_TOKEN_ENV, RM_TOKEN_ENV, TOKEN_ENV, check_token_transport, client_token, load_token,
                       read_token_file, sends_in_clear, token_ok)
from grpo.config import validate
from grpo.endpoints import Server
from grpo.errors import ConfigError, RewardStop, ServerError, TokenError
from grpo.rewards.judge import Judge, judge_token
from grpo.rewards.served_rm import rm_token
from grpo.rollout.remote import servers_token
from tests.conftest import compose_cfg

TOKEN = "auth-test-secret"


@pytest.mark.parametrize("url, clear", [
    ("http://127.0.0.1:8000", False), ("http://127.9.8.7:8000", False),  # all of 127.0.0.0/8
    ("http://[::1]:8000", False), ("http://localhost:8000", False), ("http://LocalHost:8000", False),
    ("https://node7:8000", False), ("https://203.0.113.5", False),  # encrypted, whatever the host
    ("http://node7:8000", True), ("http://10.0.0.4:8000", True), ("http://[2001:db8::1]:80", True),
    ("http://localhost.example.com:8000", True),  # a name that merely starts like loopback
    ("http://0.0.0.0:8000", True),  # a bind address, not a destination that is loopback by definition
])
def test_sends_in_clear_by_value(url, clear):
    assert sends_in_clear(url) is clear


def test_a_token_in_the_clear_is_refused_unless_the_config_says_so():
    with pytest.raises(TokenError, match=re.escape("reward.judge.urls: http://node7:8000 is plain http to another host")
                       + ".*Use https://, or.*set reward.judge.allow_plain_http=true"):
        check_token_transport(["http://127.0.0.1:1", "http://node7:8000"], TOKEN, False, "reward.judge")
    check_token_transport(["http://node7:8000"], TOKEN, True, "reward.judge")  # said so
    check_token_transport(["http://node7:8000"], None, False, "reward.judge")  # no token: no header to read
    check_token_transport(["https://node7:8000", "http://localhost:1"], TOKEN, False, "reward.judge")


def test_each_client_reads_its_own_token_and_never_the_servers(monkeypatch, tmp_path):
    """Only $GRPO_SERVE_TOKEN set: the rollout servers get it; the judge and the served reward model
    send no token at all (a judge URL may be anyone's endpoint). Each reads its own variable or file."""
    cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://127.0.0.1:1]", "rollout=remote",
                      "rollout.remote.urls=[http://127.0.0.1:2]", "reward.rm.urls=[http://127.0.0.1:3]")
    for var in (TOKEN_ENV, JUDGE_TOKEN_ENV, RM_TOKEN_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(TOKEN_ENV, "servers")
    assert (servers_token(cfg.rollout.remote), judge_token(cfg.reward.judge), rm_token(cfg.reward.rm)) == ("servers", None, None)
    monkeypatch.setenv(JUDGE_TOKEN_ENV, "judge")
    monkeypatch.setenv(RM_TOKEN_ENV, "rm")
    assert (servers_token(cfg.rollout.remote), judge_token(cfg.reward.judge), rm_token(cfg.reward.rm)) == ("servers", "judge", "rm")
    path = tmp_path / "judge-token"
    path.write_text("from-file\n")
    path.chmod(0o600)
    cfg.reward.judge.token_file = str(path)
    assert judge_token(cfg.reward.judge) == "from-file"  # the file before the variable
    path.chmod(0o644)
    with pytest.raises(TokenError, match=re.escape(f"reward.judge.token_file: token file {path} is readable by other users")):
        judge_token(cfg.reward.judge)
    assert load_token(None, JUDGE_TOKEN_ENV, env={TOKEN_ENV: "servers"}) is None


@pytest.mark.parametrize("overrides, var, key", [
    (["reward=judge", "reward.judge.urls=[http://judge7:8100]"], JUDGE_TOKEN_ENV, "reward.judge"),
    (["reward=rm", "reward.rm.path=tiny_rm", "task=addition", "reward.rm.urls=[http://rm7:8001]"], RM_TOKEN_ENV, "reward.rm"),
    (["rollout=remote", "rollout.remote.urls=[http://node7:8000]"], TOKEN_ENV, "rollout.remote"),
])
def test_validate_refuses_a_token_over_plain_http_to_another_host(overrides, var, key, monkeypatch):
    """At config time, with the token the run would send: refused naming the key; the key lets it through;
    without a token nothing is sent and nothing refused."""
    for v in (TOKEN_ENV, JUDGE_TOKEN_ENV, RM_TOKEN_ENV):
        monkeypatch.delenv(v, raising=False)
    validate(compose_cfg(*overrides))
    monkeypatch.setenv(var, TOKEN)
    with pytest.raises(ConfigError, match=re.escape(f"set {key}.allow_plain_http=true")):
        validate(compose_cfg(*overrides))
    validate(compose_cfg(*overrides, f"{key}.allow_plain_http=true"))


class Recorder(BaseHTTPRequestHandler):
    """Answers every request 200 with a model list, and records each request's path and headers."""

    seen: list

    def do_GET(self):
        self.seen.append((self.path, dict(self.headers)))
        body = b'{"data": [{"id": "m"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


class Redirector(BaseHTTPRequestHandler):
    """Answers /<status>/<rest> with that status and Location: `target` + /<rest>."""

    target: str

    def do_GET(self):
        status, _, rest = self.path.lstrip("/").partition("/")
        self.send_response(int(status) if status.isdigit() else 302)
        self.send_header("Location", f"{self.target}/{rest}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


def serve(handler) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def redirect_to_recorder():
    """A real server that redirects every request to a second real server, which records what reaches it."""
    seen = []
    other = serve(type("Handler", (Recorder,), {"seen": seen}))
    target = f"http://127.0.0.1:{other.server_port}"
    front = serve(type("Handler", (Redirector,), {"target": target}))
    yield f"http://127.0.0.1:{front.server_port}", target, seen
    for httpd in (front, other):
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("status, body", [(301, None), (302, None), (303, None), (307, None), (308, None),
                                          (302, {"prompt": "x"})])  # urllib resends a POST's 301-303 as a GET
def test_no_client_follows_a_redirect_with_the_token(redirect_to_recorder, status, body):
    """(urllib itself refuses a POST's 307/308, so those are asked as GETs, which it would follow.)"""
    front, target, seen = redirect_to_recorder
    server = Server(f"{front}/{status}", TOKEN, 5.0)
    with pytest.raises(ServerError) as e:
        server.request("/v1/models", body)
    assert str(e.value) == (f"{front}/{status}/v1/models answered {status} to '{target}/v1/models'; point the "
                            f"URL at the server itself (a redirect is not followed: it would carry the token to another host).")
    assert e.value.status == status
    assert seen == [], f"the redirect was followed: {seen}"
    # the recorder does answer a direct request, with the header: the assertion above can fail
    Server(target, TOKEN, 5.0).request("/v1/models")
    assert seen and seen[0][1].get("Authorization") == f"Bearer {TOKEN}"


def test_localhost_goes_to_127_0_0_1_not_to_whoever_holds_ipv6_loopback(monkeypatch):
    """`localhost` resolves to ::1 first on Debian, RHEL and systemd hosts; `grpo.serve --host
    localhost` holds 127.0.0.1 only, so any user of the machine could bind [::1]:port and receive
    every request with its Authorization header (urllib tried ::1 first). The resolver is made to answer
    as such a host's does; another user holds [::1]:port, the real server 127.0.0.1:port."""
    import socket

    seen = []
    real = serve(type("Handler", (Recorder,), {"seen": seen}))
    port = real.server_address[1]
    squatter = socket.socket(socket.AF_INET6)
    try:
        squatter.bind(("::1", port))
    except OSError as e:  # no IPv6 loopback here: nobody can squat it; the address chosen is still checked
        squatter.close()
        squatter = None
        print(f"no [::1] on this machine ({e})")
    if squatter is not None:
        squatter.listen(1)
        squatter.settimeout(0.5)
    resolve = socket.getaddrinfo

    def ipv6_first(host, *args, **kwargs):
        if str(host).lower() == "localhost":
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    try:
        server = Server(f"http://localhost:{port}", TOKEN, 5.0)
        assert server.request("/v1/models") == {"data": [{"id": "m"}]}
        assert seen and seen[0][1]["Authorization"] == f"Bearer {TOKEN}"  # the real server got it
        if squatter is not None:
            with pytest.raises(socket.timeout):
                squatter.accept()[0].close()  # and nobody else
    finally:
        real.shutdown()
        real.server_close()
        if squatter is not None:
            squatter.close()
    assert endpoints.connect_url("http://LocalHost:8000/v1") == "http://127.0.0.1:8000/v1"
    assert endpoints.connect_url("https://localhost:8000") == "https://localhost:8000"  # TLS checks the name
    assert endpoints.connect_url("http://node7:8000") == "http://node7:8000"


def test_a_url_written_with_a_trailing_slash_asks_the_routes_themselves():
    """`http://host:port/` (as a browser writes it) asks /v1/models, not //v1/models (which a route for
    /v1/models does not match: 404). The request line as sent is checked: http.server folds a leading //
    in `path` itself."""
    lines = []
    httpd = serve(type("Handler", (Recorder,), {"seen": [], "log_request": lambda self, *a: lines.append(self.requestline)}))
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/"
        Server(url, TOKEN, 5.0).request("/v1/models")
        Server(url, TOKEN, 5.0).request("/health", send_token=False)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert lines == ["GET /v1/models HTTP/1.1", "GET /health HTTP/1.1"]


def test_a_redirecting_server_fails_the_health_wait_at_once_and_stops_the_judge(redirect_to_recorder):
    """Waiting cannot change a redirect: the health wait ends at the first 3xx, not after its timeout,
    and a judge whose server starts redirecting stops the run (no retries to the same answer)."""
    front, target, seen = redirect_to_recorder
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=re.escape(f"answered 302 to '{target}/health'; point the URL at the server itself")):
        Server(f"{front}/302", TOKEN, 5.0).wait_healthy(time.time() + 120, log=None, kind="judge server")
    assert time.monotonic() - t0 < 10
    cfg = compose_cfg("task=addition", "reward=judge", f"reward.judge.urls=[{front}/302]", "reward.judge.model=m",
                      "reward.judge.api=completions", "reward.judge.retries=2")
    from grpo.tasks import Sample

    with pytest.raises(RewardStop, match=re.escape("answered 302 to")):
        Judge(cfg.reward.judge, TOKEN)(["7"], [Sample("3+4=", "7")])
    assert seen == []


def test_build_refuses_a_token_in_the_clear_before_contacting_anything(monkeypatch):
    """The check runs again where the token is read for use (a build outside validate, e.g. grpo.doctor)."""
    from grpo.rewards.judge import build

    monkeypatch.setenv(JUDGE_TOKEN_ENV, TOKEN)
    cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://judge7:8100]", "reward.judge.health_timeout_s=3")
    t0 = time.monotonic()
    with pytest.raises(TokenError, match="reward.judge.allow_plain_http=true"):
        build(cfg)
    assert time.monotonic() - t0 < 5
    assert client_token(None, JUDGE_TOKEN_ENV, ["http://judge7:8100"], True, "reward.judge") == TOKEN


@pytest.mark.parametrize("text", ["t\u00f6ken-123", "t\u20acken-123", "abc 123", "abc\r123"])
def test_a_token_no_bearer_header_can_carry_is_refused_where_it_is_read(tmp_path, text):
    """Non-ASCII, a space, a CRLF's \\r: accepted at start before, and then no request could ever pass,
    with the same token on both sides. The error names where it came from, never the token."""
    path = tmp_path / "token"
    path.write_text(text + "\n")
    path.chmod(0o600)
    for read, where in [(lambda: read_token_file(str(path)), f"token file {path}"),
                        (lambda: load_token(None, env={TOKEN_ENV: text}), f"${TOKEN_ENV}")]:
        with pytest.raises(TokenError) as e:
            read()
        assert str(e.value).startswith(f"the token in {where} has characters an 'Authorization: Bearer' header cannot carry")
        assert text not in str(e.value)
    with pytest.raises(TokenError, match=re.escape(f"the token in ${TOKEN_ENV} has characters")):
        load_token(None, env={TOKEN_ENV: "abc123 "})  # export GRPO_SERVE_TOKEN="$(cat f) "
    assert load_token(None, env={TOKEN_ENV: "aZ09-._~+/x=="}) == "aZ09-._~+/x=="  # RFC 6750's b64token, all of it


def test_a_non_ascii_header_is_a_wrong_token_not_an_error():
    """hmac.compare_digest raises a TypeError on a non-ASCII str: a header any client can send."""
    assert token_ok("Bearer r\u00e9ght", "right") is False
    assert token_ok("Bearer \udce9", "right") is False
    assert token_ok("Bearer right", "right") is True


def test_a_header_that_only_starts_with_the_token_is_a_wrong_token():
    """The whole header is the token: one that merely begins with it (the token plus anything) is refused."""
    assert token_ok("Bearer right-token", "right-token") is True
    assert token_ok("Bearer right-token-and-more", "right-token") is False
    assert token_ok("Bearer right-tokenX", "right-token") is False
    assert token_ok("Bearer right-toke", "right-token") is False


def test_the_token_is_compared_in_constant_time(monkeypatch):
    """hmac.compare_digest, not ==, whose time leaks how many leading bytes of a guess are right."""
    import hmac

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    assert token_ok("Bearer right-token", "right-token") is True
    assert token_ok("Bearer wrong-token", "right-token") is False
    assert compared == [(b"right-token", b"right-token"), (b"wrong-token", b"right-token")]


@pytest.mark.parametrize("mode", [0o640, 0o620, 0o604, 0o602], ids=oct)
def test_a_token_file_others_of_its_group_or_the_machine_can_use_is_refused(tmp_path, mode):
    """chmod 600 or stricter: group read or write is as open as world read (a lab's shared group)."""
    path = tmp_path / "token"
    path.write_text("a-token\n")
    path.chmod(mode)
    with pytest.raises(TokenError, match=re.escape(f"token file {path} is readable by other users (mode {mode:o})")):
        read_token_file(str(path))
    path.chmod(0o400)
    assert read_token_file(str(path)) == "a-token"


def test_a_token_file_that_is_binary_or_a_folder_is_a_token_error(tmp_path):
    """Bytes that are not UTF-8 raised a bare UnicodeDecodeError, a folder an IsADirectoryError: neither a
    TokenError, so both escaped every caller's `except TokenError` (grpo.serve's, client_token's naming
    of the config key). Never the file's bytes in the message."""
    binary = tmp_path / "token"
    binary.write_bytes(b"\xff\xfe\x00")
    binary.chmod(0o600)
    with pytest.raises(TokenError, match=re.escape(f"the token in token file {binary} has characters")):
        read_token_file(str(binary))
    with pytest.raises(TokenError, match=re.escape("reward.judge.token_file: the token in token file")):
        client_token(str(binary), JUDGE_TOKEN_ENV, ["http://127.0.0.1:8100"], False, "reward.judge")
    folder = tmp_path / "tokens"
    folder.mkdir()
    folder.chmod(0o700)
    with pytest.raises(TokenError, match=re.escape(f"token file {folder} cannot be read (")):
        read_token_file(str(folder))


def test_health_is_asked_without_the_token():
    """/health is open on every server (grpo/serve.py OPEN_ROUTES): the health wait, the first request
    to a URL, sends no token; /v1/models, which the token guards, does."""
    seen = []
    httpd = serve(type("Handler", (Recorder,), {"seen": seen}))
    Server(f"http://127.0.0.1:{httpd.server_port}", TOKEN, 5.0).wait_healthy(time.time() + 10, log=None)
    httpd.shutdown()
    httpd.server_close()
    assert [(path, headers.get("Authorization")) for path, headers in seen] == [
        ("/health", None), ("/v1/models", f"Bearer {TOKEN}")]


def test_no_request_goes_through_a_proxy_from_the_environment_but_https_tunnels(monkeypatch):
    """urllib's default ProxyHandler sent every http:// request through $http_proxy (clusters set it for
    pip), loopback included, and the proxy read its Authorization header. Plain http now goes straight
    to the server; https goes through $https_proxy as a CONNECT tunnel, whose TLS the proxy cannot read."""
    seen, reached = [], []
    proxy = serve(type("Proxy", (Recorder,), {"seen": seen, "do_CONNECT": Recorder.do_GET}))
    target = serve(type("Handler", (Recorder,), {"seen": reached}))
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{proxy.server_port}")
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(endpoints, "OPENER", endpoints.build_opener())  # as a process started with them builds it
    Server(f"http://127.0.0.1:{target.server_port}", TOKEN, 5.0).request("/update_weights", {})
    assert seen == [] and [(p, h.get("Authorization")) for p, h in reached] == [("/update_weights", f"Bearer {TOKEN}")]
    with pytest.raises(ServerError):  # the stand-in proxy answers the CONNECT, then no TLS follows
        Server("https://judge.example:8443", TOKEN, 5.0).request("/v1/models")
    assert [(p, h.get("Authorization")) for p, h in seen] == [("judge.example:8443", None)]
    for httpd in (proxy, target):
        httpd.shutdown()
        httpd.server_close()
