"""vLLM servers driven together, shared by `dedicated` (engines this trainer starts), `remote`
(servers by URL), `grpo.serve` and `grpo.launch`: free ports, health polling, the load split, weight
pushes over the grpo_gloo transport.

- Before use, every server's /health is polled until a deadline; one that never answers is an
  error naming it.
- The whole batch is split across the servers by load: each server gets a contiguous share of the
  prompts proportional to the throughput it showed on earlier batches (equal at first), and all
  G completions of a prompt go to the same server. The shares are requested in parallel.
- Weights go to every server through vLLM's RL routes with the `grpo_gloo` transport (see
  gloo_transfer.py): one /update_weights call and one gloo broadcast per bucket.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from grpo import dist, lora
from grpo.errors import ServerError
from grpo.rollout.base import Rollouts, Sampling
from grpo.rollout.gloo_transfer import GlooSender, pack
from grpo.weights import WeightBuckets


def wait_until(check, timeout_s: float, poll_s: float = 1.0, what: str = "it"):
    """Call `check()` until it returns without raising, or raise the last error after `timeout_s`."""
    deadline, last = time.time() + timeout_s, None
    while True:
        try:
            return check()
        except (ServerError, OSError) as e:
            last = e
        if time.time() >= deadline:
            raise ServerError(f"{what} did not become healthy in time: {last}")
        time.sleep(poll_s)


def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_by_load(num_prompts: int, speeds: list[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) prompt ranges, sized in proportion to each server's speed."""
    total = sum(speeds)
    bounds, acc = [0], 0.0
    for s in speeds[:-1]:
        acc += s
        bounds.append(round(num_prompts * acc / total))
    bounds.append(num_prompts)
    return list(zip(bounds[:-1], bounds[1:]))


def adapter_name(version: int) -> str:
    """The name a LoRA adapter version is loaded and asked for under."""
    return f"policy-v{version}"


class Server:
    def __init__(self, url: str, token: str | None, timeout_s: float):
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self.adapter = None  # with LoRA: the adapter's name, asked for as the model
        self.speed = 1.0  # completion tokens per second, an EMA over batches (equal until measured)
        self.batches = 0
        self.model = None

    def request(self, path: str, body: dict | None = None, timeout: float | None = None, text: bool = False):
        """POST `body` (GET without one) and return the JSON answer, or the plain text with text=True
        (vLLM's adapter routes answer in words)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.url}{path} answered {e.code}: {e.read()[:500].decode(errors='replace')}") from e
        except (urllib.error.URLError, OSError) as e:
            raise ServerError(f"{self.url}{path} is unreachable ({e}); is `python -m grpo.serve` running there?") from e
        if text:
            return raw.decode(errors="replace")
        return json.loads(raw) if raw else {}

    def wait_healthy(self, deadline: float) -> None:
        def ready():
            self.request("/health", timeout=5)
            self.model = self.request("/v1/models")["data"][0]["id"]

        wait_until(ready, deadline - time.time(), what=f"rollout server {self.url}")


class ServerPool:
    """vLLM servers driven together: health checks, weight-transfer setup, load-split generation,
    weight pushes. Shared by the remote and dedicated backends."""

    def __init__(self, urls: list[str], token: str | None, health_timeout_s: float, request_timeout_s: float,
                 tensor_parallel_size: int = 1, transfer_host: str | None = None, can_push: bool = True):
        self.servers = [Server(u, token, request_timeout_s) for u in urls]
        deadline = time.time() + health_timeout_s
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda s: s.wait_healthy(deadline), self.servers))
        self.senders: list[GlooSender] = []
        if can_push:
            host = transfer_host or self._reachable_host()
            for server in self.servers:
                sender = GlooSender(host, free_port(), world_size=1 + tensor_parallel_size, timeout_s=request_timeout_s)
                self._alongside(server, "/init_weight_transfer_engine", {"init_info": sender.init_info()}, sender.connect)
                self.senders.append(sender)

    def _reachable_host(self) -> str:
        """127.0.0.1 when every server is local, else this machine's address as others see it."""
        hosts = {urlparse(s.url).hostname for s in self.servers}
        if hosts <= {"127.0.0.1", "localhost", "::1"}:
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())

    @staticmethod
    def _alongside(server: Server, path: str, body: dict, fn) -> None:
        """POST `path` (which blocks server-side until the gloo peer acts) while `fn` runs here."""
        error: list[BaseException] = []

        def post():
            try:
                server.request(path, body)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                error.append(e)

        t = threading.Thread(target=post, daemon=True)
        t.start()
        fn()
        t.join()
        if error:
            raise error[0]

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling, version: int) -> Rollouts:
        ranges = split_by_load(len(prompt_ids), [s.speed for s in self.servers])

        def call(i: int):
            server, (a, b) = self.servers[i], ranges[i]
            if a == b:
                return []
            body = {
                "model": server.adapter or server.model, "prompt": prompt_ids[a:b], "n": n, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "logprobs": 0, "return_token_ids": True,
            }
            if sampling.seed is not None:
                body["seed"] = sampling.seed + i
            t0 = time.perf_counter()
            choices = sorted(server.request("/v1/completions", body)["choices"], key=lambda c: c["index"])
            rate = sum(len(c["token_ids"]) for c in choices) / max(time.perf_counter() - t0, 1e-6)
            server.speed = rate if server.batches == 0 else 0.7 * server.speed + 0.3 * rate
            server.batches += 1
            return choices

        with ThreadPoolExecutor(len(self.servers)) as pool:
            parts = list(pool.map(call, range(len(self.servers))))
        ids, logprobs, reasons = [], [], []
        for choice in (c for part in parts for c in part):
            ids.append(list(choice["token_ids"]))
            logprobs.append([float(x) for x in choice["logprobs"]["token_logprobs"]])
            reasons.append("length" if choice["finish_reason"] == "length" else "stop")
        if len(ids) != len(prompt_ids) * n:
            raise ServerError(f"asked for {len(prompt_ids) * n} completions, the servers returned {len(ids)}")
        return Rollouts(ids, logprobs, reasons, version)

    def push(self, buckets: WeightBuckets, version: int) -> None:
        """Every bucket to every server: one /update_weights call and one gloo broadcast each, to all
        servers concurrently (one after another, a sync took n_servers times as long)."""
        for server in self.servers:
            server.request("/start_weight_update", {})
        def send(pair, flat, info):
            server, sender = pair
            self._alongside(server, "/update_weights", {"update_info": info}, lambda: sender.send(flat))

        with ThreadPoolExecutor(len(self.servers)) as pool:  # all servers at once, bucket by bucket
            for bucket in buckets:
                flat, info = pack(bucket)
                list(pool.map(lambda pair: send(pair, flat, info), zip(self.servers, self.senders)))
        for server in self.servers:
            server.request("/finish_weight_update", {"weight_version": str(version)})
            server.request("/reset_prefix_cache", {})  # cached KV belongs to the old weights

    def load_adapter(self, folder: str, version: int) -> None:
        """LoRA: every server loads the adapter in `folder` (a path it can read: the same machine, or a
        file system both see) under a new name through vLLM's /v1/load_lora_adapter, generates with it
        from then on, and unloads the previous version."""
        name = adapter_name(version)

        def load(server: Server) -> None:
            old = server.adapter  # in place: a name an earlier run left loaded is replaced, not refused
            server.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder, "load_inplace": True}, text=True)
            server.adapter = name
            if old is not None and old != name:
                server.request("/v1/unload_lora_adapter", {"lora_name": old}, text=True)
            server.request("/reset_prefix_cache", {})

        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(load, self.servers))

    def use_adapter(self, version: int) -> None:
        """Generate with the adapter another rank's pool loaded (remote: every rank asks the servers itself)."""
        for server in self.servers:
            server.adapter = adapter_name(version)

    def close(self) -> None:
        for server, sender in zip(self.servers, self.senders):
            try:
                server.request("/shutdown_weight_transfer_engine", {}, timeout=10)
            except ServerError:
                pass  # the server may already be gone; nothing to release then
            sender.close()
        self.senders = []


def push_adapter_from_one_rank(pool: ServerPool | None, model, buckets: WeightBuckets, version: int, folder: str) -> None:
    """LoRA: the buckets hold the adapter alone. The rank holding `pool` writes it into
    `folder/v<version>` and has every server load it (then deletes the previous version's folder);
    the others walk the buckets (collectives under ZeRO-3) and all wait until it is loaded."""
    import os
    import shutil

    tensors = [(n, t.detach().to("cpu", copy=True)) for bucket in buckets for n, t in bucket]
    if pool is not None:
        path = lora.write_adapter(model, tensors, os.path.join(folder, f"v{version}"))
        pool.load_adapter(path, version)
        for old in os.listdir(folder):
            if old != f"v{version}" and old.startswith("v"):
                shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    dist.barrier()


def push_from_one_rank(pool: ServerPool | None, buckets: WeightBuckets, version: int) -> None:
    """Replicas are identical: the rank holding `pool` pushes; the others walk the buckets (under
    ZeRO-3 each is gathered by a collective every rank joins) and all wait until the push is done."""
    if pool is not None:
        pool.push(buckets, version)
    else:
        for _ in buckets:
            pass
    dist.barrier()


