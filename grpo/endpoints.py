"""HTTP endpoints by URL, shared by the rollout servers (grpo/rollout/servers.py) and the rewards that
run on servers (a served reward model, a judge): one client per server (`Server`: JSON requests with
the token, errors that name the server and its answer), health waits, the load split and a parallel
map whose first error is raised at once. It knows nothing of rollouts or rewards.

Every request goes through `OPENER`, which follows no redirect: urllib's default opener would resend
the Authorization header to whatever host a 301/302/303/307/308 names, so a 3xx is an error naming
the server, its status and where it pointed (grpo/auth.py says which token goes where). Nor does it
send plain http through a proxy: urllib's default takes $http_proxy (clusters set it for pip) for
every http:// URL, loopback included, and the proxy would read each request's Authorization header.
https goes through $https_proxy where one is set: a CONNECT tunnel, whose TLS the proxy cannot read.

A server can stop answering without closing its connections: vLLM whose engine core died (an OOM kill, a
crash) keeps the API process up, holding every request in flight unanswered. A client that knows how to
tell (`Server.watch`: the rollout pool's, grpo/rollout/server_watch.py engine_dead) asks it every WATCH_EVERY_S
while a request waits, and after a failed request, and fails within seconds naming why (`ServerGone`),
not after the request's timeout.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit, urlunsplit
from concurrent.futures import Future, TimeoutError as FutureTimeout

from grpo.errors import ConfigError, ServerError
from grpo.progress import WaitProgress, say


REFUSED = {401: "the token is not the server's: give the client the token the server was started with "
                "(rollout servers: GRPO_SERVE_TOKEN or rollout.remote.token_file; judges: GRPO_JUDGE_TOKEN or "
                "reward.judge.token_file; reward model servers: GRPO_RM_TOKEN or reward.rm.token_file)",
           403: "the server refuses this client"}


# How long a short control request (a version, a weight update's start or end, a cache reset) may take: its
# own bound, not request_timeout_s, which is sized for generation (600 s by default).
CONTROL_TIMEOUT_S = 60.0
WATCH_EVERY_S = 3.0  # while a watched request waits (`Server.watch`): how often to ask whether the server died


class ServerGone(ServerError):
    """A server that will never answer: its process exited, or its engine died behind an API that is
    still up (`Server.watch` says which)."""


class NotJson(ServerError):
    """A server answered, but not with JSON: a proxy's page, or not the server the URL should name.
    Waiting for it cannot change that (`wait_until` fails at once)."""


class NoModelList(NotJson):
    """A server answered /v1/models with JSON, but no list of served models as OpenAI's API (and vLLM) has
    it: not the server the URL should name."""


class NotRoot(ServerError):
    """A server answered, but its URL was given as the OpenAI base (http://host:8000/v1), so /health is
    asked at /v1/health, which it never has. Waiting cannot change that (`wait_until` fails at once)."""


def model_card(url: str, answer) -> dict:
    """The first served model of a /v1/models `answer` (vLLM: {"data": [{"id": ..., "max_model_len": ...}]})."""
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict) or "id" not in cards[0]:
        raise NoModelList(f"{url}/v1/models answered {json.dumps(answer)[:200]}, not a list of served models "
                          f'({{"data": [{{"id": ...}}]}}): is {url} an OpenAI-compatible server (`python -m grpo.serve`, '
                          f'`vllm serve`)?')
    return cards[0]


def is_redirect(status: int | None) -> bool:
    return status is not None and 300 <= status < 400


def build_opener() -> urllib.request.OpenerDirector:
    """urllib's default handlers but HTTPRedirectHandler: a 3xx reaches HTTPDefaultErrorHandler and is
    raised as an HTTPError, its Location unvisited and the Authorization header sent to no one else.
    Proxies from the environment for https only (the module docstring says why)."""
    https_only = {scheme: url for scheme, url in urllib.request.getproxies().items() if scheme == "https"}
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(https_only), urllib.request.UnknownHandler(), urllib.request.HTTPHandler(),
                    urllib.request.HTTPSHandler(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


OPENER = build_opener()


def wait_until(check, timeout_s: float, poll_s: float = 1.0, what: str = "it", log=say, note: str = "", exited=None):
    """Call `check()` until it returns without raising, or raise the last error after `timeout_s`;
    every 15 s, `log` says what it is waiting for and for how long (grpo/progress.py; None: silent).
    A server that answers but refuses us (401, 403), redirects us (3xx), answers no JSON (`NotJson`) or
    was given as its /v1 base (`NotRoot`) fails at once: waiting cannot change that; so does one whose
    process is gone (`exited()`: None while it runs, else what it left in its log)."""
    deadline, last = time.time() + timeout_s, None
    progress = WaitProgress(f"{what} to answer /health", timeout_s, log, note=note)
    while True:
        if exited is not None and (gone := exited()):
            raise ServerError(f"{what} exited before it became healthy: {gone}")
        try:
            return check()
        except ServerError as e:
            if e.status in REFUSED:
                raise ServerError(f"{what} is up but refused the request: {e} ({REFUSED[e.status]}).", e.status) from e
            if is_redirect(e.status) or isinstance(e, (NotJson, NotRoot)):
                raise
            last = e
        except OSError as e:
            last = e
        if time.time() >= deadline:
            raise ServerError(f"{what} did not become healthy in time: {last}")
        progress()
        time.sleep(poll_s)


def settle(future: Future, fn, *args) -> None:
    """Run `fn(*args)` into a running `future`: its result, or what it raised."""
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - delivered through the future
        future.set_exception(e)


def parallel_map(fn, items, workers: int | None = None) -> list:
    """`[fn(x) for x in items]` on up to `workers` daemon threads (all by default), results in order.
    The first error is raised as soon as it happens, not once every item in flight has returned (a
    generation request can run for minutes); items not started by then never start, and those in
    flight finish on their own. Daemon threads, so an HTTP request in flight never holds the
    process's exit (see DaemonWorker)."""
    items = list(items)
    results, errors, todo = [None] * len(items), [], iter(range(len(items)))
    changed = threading.Condition()
    workers = min(workers or len(items), len(items))
    running = [workers]

    def work() -> None:
        try:
            while True:
                with changed:
                    i = None if errors else next(todo, None)
                if i is None:
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as e:  # noqa: BLE001 - raised in the caller
                    with changed:
                        errors.append(e)
                    return
        finally:
            with changed:
                running[0] -= 1
                changed.notify_all()

    for _ in range(workers):
        threading.Thread(target=work, daemon=True, name="grpo-request").start()
    with changed:
        changed.wait_for(lambda: errors or not running[0])
        if errors:
            raise errors[0]
    return results


def split_by_load(num_prompts: int, speeds: list[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) prompt ranges, sized in proportion to each server's speed."""
    total = sum(speeds)
    bounds, acc = [0], 0.0
    for s in speeds[:-1]:
        acc += s
        bounds.append(round(num_prompts * acc / total))
    bounds.append(num_prompts)
    return list(zip(bounds[:-1], bounds[1:]))


class Occupancy:
    """The seconds a server had at least one of this client's requests in flight (`with occupancy.request():`):
    its engine busy, as far as this client can tell (the engine idle fraction of grpo.bench episodes)."""

    def __init__(self):
        self.lock, self.in_flight, self.busy, self.since = threading.Lock(), 0, 0.0, 0.0

    @contextlib.contextmanager
    def request(self):
        with self.lock:
            if self.in_flight == 0:
                self.since = time.perf_counter()
            self.in_flight += 1
        try:
            yield
        finally:
            with self.lock:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.busy += time.perf_counter() - self.since

    def busy_s(self) -> float:
        with self.lock:
            return self.busy + (time.perf_counter() - self.since if self.in_flight else 0.0)


def connect_url(url: str) -> str:
    """Where a request to `url` goes: `localhost` in a plain http:// URL as 127.0.0.1, which is what
    `grpo.serve --host localhost` holds. The name resolves to ::1 first on Debian, RHEL and systemd
    hosts, and [::1]:port, which nothing of ours holds, can be bound by any user of the machine: it got
    every request, Authorization header included, while urllib fell back to 127.0.0.1 silently where
    nobody had bound it. (https keeps the name: its certificate is checked against it.)"""
    parts = urlsplit(url)
    if parts.scheme != "http" or (parts.hostname or "").lower() != "localhost":
        return url
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"127.0.0.1{port}"))


class Server:
    def __init__(self, url: str, token: str | None, timeout_s: float):
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self.adapter = None  # with LoRA: the adapter's name, asked for as the model
        self.speed = 1.0  # completion tokens per second, an EMA over batches (equal until measured)
        self.batches = 0
        self.model = None
        self.max_model_len = None  # as the server reports it (/v1/models)
        self.vllm = None  # a vLLM server's release, what its API takes (grpo/rollout/vllm_api.py): asked once
        self.prompt_checks = 0  # choices whose echoed prompt ids were compared with the ids sent
        self.occupancy = Occupancy()  # generation requests in flight (grpo/rollout/servers.py ServerPool.complete)
        self.lost = None  # why a pool sends it no more requests: it restarted (grpo/rollout/servers.py served_version)
        # a function saying why this server will never answer, or None while it may (`watched`); None: not asked
        self.watch = None
        self.dead = None  # what `watch` said once it said something: it stays dead
        self.watch_lock, self.watched_at = threading.Lock(), 0.0

    @property
    def address(self) -> str:
        """Where the requests go (`connect_url`); errors name `url`, as given."""
        return connect_url(self.url)

    def request(self, path: str, body: dict | None = None, timeout: float | None = None, text: bool = False,
                send_token: bool = True):
        """POST `body` (GET without one) and return the JSON answer, or the plain text with text=True
        (vLLM's adapter routes answer in words); `send_token=False`: no Authorization header (the open
        probe /health). `timeout`: how long the answer may take (default the server's request timeout;
        CONTROL_TIMEOUT_S for a short control route). Whatever goes wrong is a ServerError naming the URL
        and the path (`send`). With a `watch`, a ServerGone as soon as it says the server died (`watched`)."""
        timeout = timeout or self.timeout_s
        if self.watch is None:
            return self.send(path, body, timeout, text, send_token)
        return self.watched(path, lambda: self.send(path, body, timeout, text, send_token))

    def watched(self, path: str, call):
        """`call()` (one request to `path`) on a daemon thread, asking `why_dead` every WATCH_EVERY_S while
        it waits, and once more if it fails: a request to a server whose engine died is not answered
        until its timeout (vLLM holds it open), nor does a refused or broken one say why. The request
        left waiting ends with the connection (the daemon thread never holds the exit)."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        threading.Thread(target=settle, args=(future, call), daemon=True, name="grpo-watched").start()
        while True:
            try:
                return future.result(timeout=WATCH_EVERY_S)
            except FutureTimeout:
                if why := self.why_dead():
                    raise ServerGone(f"{self.url}{path} will never be answered: {why}") from None
            except ServerError as e:
                if e.status is not None and e.status < 500:  # the server answered: alive, the request was wrong
                    raise
                if why := self.why_dead(now=True):
                    raise ServerGone(f"{self.url}{path} failed ({e}): {why}") from e
                raise

    def why_dead(self, now: bool = False) -> str | None:
        """What `watch` says, asked at most every WATCH_EVERY_S whatever the requests in flight (`now`:
        at once, after a failure), and remembered once it says the server died."""
        with self.watch_lock:
            if self.dead is None and (now or time.monotonic() - self.watched_at >= WATCH_EVERY_S):
                self.watched_at = time.monotonic()
                self.dead = self.watch()
            return self.dead

    def send(self, path: str, body: dict | None, timeout: float, text: bool = False, send_token: bool = True):
        """One request, unwatched: an error status, no connection, no answer within `timeout`, an answer
        cut off (http.client's IncompleteRead: a server stopped mid-answer, a proxy's idle timeout), a body
        that is not JSON (`NotJson`) are ServerErrors naming the URL and the path."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.address + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Content-Type", "application/json")
        if self.token and send_token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with OPENER.open(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            with e:  # the error holds the answer's connection: closed here, not left to the garbage collector
                if is_redirect(e.code):
                    raise ServerError(f"{self.url}{path} answered {e.code} to {e.headers.get('Location')!r}; point the URL "
                                      f"at the server itself (a redirect is not followed: it would carry the token to "
                                      f"another host).", e.code) from e
                raise ServerError(f"{self.url}{path} answered {e.code}: {e.read()[:500].decode(errors='replace')}", e.code) from e
        except (urllib.error.URLError, OSError) as e:
            if isinstance(e, socket.timeout) or isinstance(getattr(e, "reason", None), socket.timeout):
                raise ServerError(f"{self.url}{path} did not answer within {timeout:g} s: the server (or the network "
                                  "to it) is busy or stuck; its log says which") from e
            raise ServerError(f"{self.url}{path} is unreachable ({e}); is `python -m grpo.serve` running there?") from e
        except http.client.HTTPException as e:  # IncompleteRead, BadStatusLine: the answer broke off or is no HTTP
            raise ServerError(f"{self.url}{path} broke off its answer ({e!r}); was the server stopped while answering?") from e
        if text:
            return raw.decode(errors="replace")
        try:
            return json.loads(raw) if raw else {}
        except ValueError as e:  # json's error (JSONDecodeError), or bytes that are not UTF-8
            raise NotJson(f"{self.url}{path} answered with no JSON ({e}): {raw[:200]!r}") from e

    def wait_healthy(self, deadline: float, log=say, note: str = "", exited=None, kind: str = "rollout server") -> None:
        def ready():
            try:
                self.request("/health", timeout=5, send_token=False)  # open to all (grpo/serve.py OPEN_ROUTES)
            except ServerError as e:
                # .../v1/health: vLLM answers 404, grpo.serve 401 (not an open route). Only under a /v1 URL: a 404
                # at the root is waited out, as a proxy (Ray Serve's) answers 404 until the server behind it is up
                path = urlsplit(self.url).path.split("/")
                if e.status in (401, 404) and "v1" in path:
                    root = urlunsplit(urlsplit(self.url)._replace(path="/".join(path[:path.index("v1")])))
                    raise NotRoot(f"{e}: give the server's root URL ({root}), without /v1 (the client adds /v1 "
                                  f"itself where a route has it; /health has not).") from e
                raise
            card = model_card(self.url, self.request("/v1/models", timeout=CONTROL_TIMEOUT_S))
            self.model, self.max_model_len = card["id"], card.get("max_model_len")

        wait_until(ready, deadline - time.time(), what=f"{kind} {self.url}", log=log, note=note, exited=exited)

    def world_size(self) -> int:
        """The server's own engine world (tensor x pipeline x data parallel): the ranks its transfer
        group needs beside the trainer's (vLLM's RL route /get_world_size, mounted with the others)."""
        return int(self.request("/get_world_size", timeout=CONTROL_TIMEOUT_S)["world_size"])


def same_server(url: str) -> tuple:
    """What names one server in a URL (after `check_urls`): the scheme, the host as urllib lowers it (localhost
    as 127.0.0.1, which it names wherever a server runs), the port (the scheme's default where none is given)
    and the path without its trailing slash."""
    parts = urlsplit(str(url))
    scheme = parts.scheme.lower()
    host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
    return scheme, host, parts.port or {"http": 80, "https": 443}[scheme], parts.path.rstrip("/")


def check_distinct(urls, key: str, why: str) -> None:
    """ConfigError if two of `urls` (checked by `check_urls`) name one server; `why`: what that breaks."""
    seen: dict[tuple, str] = {}
    for url in map(str, urls):
        server = same_server(url)
        if server in seen:
            raise ConfigError(f"{key}: {seen[server]!r} and {url!r} are one server ({why}); list each server once.")
        seen[server] = url


def check_urls(urls, key: str, hint: str = "") -> None:
    """validate's part for a list of server URLs (`key`: rollout.remote.urls, reward.judge.urls,
    reward.rm.urls; nothing is contacted): each is http(s)://host[:port][/path]. `localhost:8000` (no
    scheme) waited out the health timeout, then failed with urllib's "unknown url type"; a port beyond
    65535 failed only when contacted. `hint`: what the key's servers are, said after the fix."""
    for url in map(str, urls):
        try:
            parts = urlsplit(url)
            parts.port  # a port that is not a number, or beyond 65535: ValueError
            ok = parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in url)
        except ValueError:
            ok = False
        if not ok:
            fix = f"write http://{url} (https:// for TLS)" if "://" not in url else "give http(s)://, a host and a port from 0 to 65535"
            raise ConfigError(f"{key}: {url!r} is not an http(s)://host:port URL; {fix}.{' ' + hint if hint else ''}")
        if "@" in parts.netloc:  # user:password@: no client sends basic auth, and each error would print the password
            shown = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
            raise ConfigError(f"{key}: {shown!r} is written with a user (and password) before its host, which no client "
                              f"sends (they send a Bearer token): give the URL without it, and the server's token in "
                              f"{key.removesuffix('.urls')}.token_file (chmod 600).")
