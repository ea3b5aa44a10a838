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
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.request

from grpo.errors import ServerError
from grpo.progress import WaitProgress, say


REFUSED = {401: "the token is not the server's: give the client the token the server was started with "
                "(rollout servers: GRPO_SERVE_TOKEN or rollout.remote.token_file; judges: GRPO_JUDGE_TOKEN or "
                "reward.judge.token_file; reward model servers: GRPO_RM_TOKEN or reward.rm.token_file)",
           403: "the server refuses this client"}


class NotJson(ServerError):
    """A server answered, but not with JSON: a proxy's page, or not the server the URL should name.
    Waiting for it cannot change that (`wait_until` fails at once)."""


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
    A server that answers but refuses us (401, 403) or redirects us (3xx) fails at once: waiting
    cannot change that; so does one whose process is gone (`exited()`: None while it runs, else what
    it left in its log)."""
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
            if is_redirect(e.status) or isinstance(e, NotJson):
                raise
            last = e
        except OSError as e:
            last = e
        if time.time() >= deadline:
            raise ServerError(f"{what} did not become healthy in time: {last}")
        progress()
        time.sleep(poll_s)


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

    def request(self, path: str, body: dict | None = None, timeout: float | None = None, text: bool = False,
                send_token: bool = True):
        """POST `body` (GET without one) and return the JSON answer, or the plain text with text=True
        (vLLM's adapter routes answer in words); `send_token=False`: no Authorization header (the open
        probe /health). Whatever goes wrong is a ServerError naming the URL and the path: an error
        status, no connection, an answer cut off (http.client's IncompleteRead: a server stopped
        mid-answer, a proxy's idle timeout), a body that is not JSON (`NotJson`)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Content-Type", "application/json")
        if self.token and send_token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with OPENER.open(req, timeout=timeout or self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            if is_redirect(e.code):
                raise ServerError(f"{self.url}{path} answered {e.code} to {e.headers.get('Location')!r}; point the URL at "
                                  f"the server itself (a redirect is not followed: it would carry the token to another "
                                  f"host).", e.code) from e
            raise ServerError(f"{self.url}{path} answered {e.code}: {e.read()[:500].decode(errors='replace')}", e.code) from e
        except (urllib.error.URLError, OSError) as e:
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
            self.request("/health", timeout=5, send_token=False)  # open to all (grpo/serve.py OPEN_ROUTES)
            card = self.request("/v1/models")["data"][0]
            self.model, self.max_model_len = card["id"], card.get("max_model_len")

        wait_until(ready, deadline - time.time(), what=f"{kind} {self.url}", log=log, note=note, exited=exited)

    def world_size(self) -> int:
        """The server's own engine world (tensor x pipeline x data parallel): the ranks its transfer
        group needs beside the trainer's (vLLM's RL route /get_world_size, mounted with the others)."""
        return int(self.request("/get_world_size")["world_size"])
