"""Multi-turn episodes scheduled per trajectory on servers (`rollout.schedule=trajectories`, the default
on `dedicated` and `remote`): each trajectory sends its next turn as soon as its environment has
answered, so the engines see a continuous stream instead of one wave per turn that waits for the
batch's slowest trajectory and slowest environment call.

    group p:       its n environments reset; turn 1: one request (prompt p, n, seed + p * n) to p's server
    trajectory i:  env.step -> observation -> turn t: (prompt + span, 1, turn_seed(seed, t) + i) to the
                   same server (its prefix stays in that server's cache) ... until its episode ends

These are the turn-synchronous driver's own requests (grpo/rollout/episodes.py through StickyRoutes:
the same server, ids and seed per trajectory and turn; vLLM seeds each request's sampler by itself),
so under the same seeds and weights the trained tokens are the same; what changes is when each is
sent. Budgets, masks, the echoed-prompt check and the environments' timeouts are the episode
runner's own (`EpisodeRunner`: room, take_turn, take_step). A trajectory whose request fails ends as
"error" (reward None, like an environment that failed), with one warning per batch; the others go on.
If every trajectory failed that way, a server echoes other prompt ids than it was sent, or a request
finds its server dead (`ServerGone`: its engine exited; no later turn could be answered), the batch
fails. An environment's ConfigError stops the batch (the run's setup is wrong).

Concurrency: up to `MAX_REQUESTS_IN_FLIGHT` requests per server and `env.max_concurrency`
environment calls at once, each trajectory on a thread of its own while it waits for either. The
threads are daemons, and `ServerPool.close` (a stop, preemption or error) stops the batch: no
trajectory sends another turn, the batch fails with `PoolClosed`, and the process's exit never waits
for the episodes in flight to play out.

Weights: without partial rollouts a push waits for the batch (`ServerPool.drain`) and the servers'
versions are checked before and after it, as for a turn-synchronous batch. With partial rollouts
(`ServerPool.gate`, grpo/rollout/servers.py `TurnGate`) a push waits only for the turns in flight;
each turn records the version that sampled it (`Rollouts.token_versions`), and the batch's
`weight_version` is its oldest. One batch spans at most `algo.max_staleness` + 1 versions: the
trainer takes it before it pushes more than that (grpo/algorithm.py `batches_to_submit`).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Optional

from grpo.endpoints import ServerGone, parallel_map, split_by_load
from grpo.errors import ServerError
from grpo.rollout.base import Rollouts, Sampling
from grpo.rollout.episodes import EnvCalls, EpisodeRunner, Trajectory, turn_seed
from grpo.rollout.servers import (MAX_REQUESTS_IN_FLIGHT, DaemonWorker, EchoMismatch, PoolClosed, ServerRestarted,
                                  StickyRoutes, generation_timeout)


def episode_driver(schedule: str, runner: EpisodeRunner, pool, version: int):
    """`f(prompt_ids, samples, n, sampling) -> Rollouts`: an episode batch on `pool` (a ServerPool), each
    trajectory at its own pace (rollout.schedule auto or trajectories: `TrajectoryDriver`) or turn by
    turn (turns: the runner's own driver, each trajectory kept on its server by `StickyRoutes`)."""
    if schedule == "turns":
        return lambda prompt_ids, samples, n, sampling: runner.run(StickyRoutes(pool, version), prompt_ids, samples, n, sampling,
                                                                   version=version)
    return lambda prompt_ids, samples, n, sampling: TrajectoryDriver(runner, pool, version).run(prompt_ids, samples, n, sampling)


OVERLAP_LOCK = threading.Lock()  # guards every pool's `episode_batches` (the drivers' threads)


def batch_started(pool) -> float:
    """An episode batch starts on `pool`: the seconds its engines stood idle before it (`time/engine_wait_s`).
    With partial rollouts a pool's episode batches overlap (each on a thread of its own, `in_thread`), so
    the engines are idle only while none is in flight: a batch that starts while another runs waited 0 s,
    and `idle_since` is set when the last one in flight ends (`batch_ended`), not when each does."""
    with OVERLAP_LOCK:
        others, pool.episode_batches = pool.episode_batches, pool.episode_batches + 1
        return 0.0 if others or pool.idle_since is None else time.perf_counter() - pool.idle_since


def batch_ended(pool) -> None:
    with OVERLAP_LOCK:
        pool.episode_batches -= 1
        if pool.episode_batches == 0:
            pool.idle_since = time.perf_counter()


class Stop(Exception):
    """Another trajectory's error ended the batch."""


class TrajectoryDriver:
    """One episode batch on a `ServerPool`, each trajectory at its own pace (module docstring)."""

    def __init__(self, runner: EpisodeRunner, pool, version: int):
        self.runner, self.pool, self.version = runner, pool, version
        self.lock = threading.Lock()  # the trajectories' bookkeeping (tokenizer calls, warnings) one at a time
        self.envs = threading.Semaphore(max(1, runner.max_concurrency))
        self.slots = [threading.Semaphore(MAX_REQUESTS_IN_FLIGHT) for _ in pool.servers]
        self.errors: list[BaseException] = []  # what stops the batch
        self.failed: list[tuple[Trajectory, str]] = []  # trajectories whose request failed
        self.tokens = [0] * len(pool.servers)
        self.wait_s = 0.0

    def run(self, prompt_ids: list[list[int]], samples: list, n: int, sampling: Sampling) -> Rollouts:
        return self.runner.drive(prompt_ids, samples, n, sampling,
                                 lambda calls, trajectories, sampling: self.episodes(calls, trajectories, prompt_ids, n, sampling))

    def episodes(self, calls: EnvCalls, trajectories: list[Trajectory], prompt_ids: list[list[int]], n: int,
                 sampling: Sampling) -> Rollouts:
        pool, servers = self.pool, self.pool.servers
        self.calls = calls  # the resets go through the runner's pool of environment calls
        shares = split_by_load(len(prompt_ids), [s.speed for s in servers])
        self.server_of = [i for i, (a, b) in enumerate(shares) for _ in range(a, b)]  # per prompt
        per_server = [(b - a) * n for a, b in shares]
        self.timeout = [generation_timeout(s.timeout_s, sampling.max_new_tokens,
                                           min(c, MAX_REQUESTS_IN_FLIGHT * n) * pool.clients)
                        for s, c in zip(servers, per_server)]
        t_start = time.perf_counter()
        used = [i for i, c in enumerate(per_server) if c]
        before = None if pool.gate else self.served_versions(used)
        if before:  # what the servers hold (the trainer's last push, or an earlier trainer's), as a turn-synchronous batch says
            self.version = next(iter(before.values()))
        threads = min(len(trajectories), MAX_REQUESTS_IN_FLIGHT * len(servers) + max(1, self.runner.max_concurrency))
        self.workers = DaemonWorker("grpo-trajectory", max(1, threads))
        self.pending, self.done = 0, threading.Condition()
        self.wait_s = batch_started(pool)
        try:
            for p in range(len(prompt_ids)):
                self.spawn(self.group, trajectories[p * n:(p + 1) * n], p, n, sampling)
            with self.done:
                self.done.wait_for(lambda: self.pending == 0)
        finally:
            self.workers.shutdown()
            batch_ended(pool)
        if self.errors:
            raise self.errors[0]
        elapsed = max(time.perf_counter() - t_start, 1e-6)
        for i in used:  # completion tokens per second, as a turn-synchronous batch measures them
            server = servers[i]
            rate = self.tokens[i] / elapsed
            server.speed = rate if server.batches == 0 else 0.7 * server.speed + 0.3 * rate
            server.batches += 1
        if before is not None:
            after = self.served_versions(list(before))
            if any(before[i] != after.get(i, before[i]) for i in before):
                raise ServerError(f"the servers' weight versions went from {before} to {after} during an episode batch; "
                                  "weights change only between batches without partial rollouts (ServerPool.drain)")
            if len(set(before.values())) > 1:
                raise ServerError(f"the servers hold different weight versions {sorted(set(before.values()))}; a push "
                                  "reached only some")
        self.report_failures(len(trajectories))
        versions = [v for t in trajectories for v in t.versions if v >= 0]
        version = min(versions) if versions else self.version
        out = self.runner.rollouts(trajectories, version, self.wait_s)
        out.token_versions = [list(t.versions) for t in trajectories]
        return out

    def served_versions(self, used: list[int]) -> dict[int, int]:
        """Server index -> the weight version it holds, for the servers that answer (one that does not
        fails its trajectories' requests, each ending as "error"). A server that restarted and lost the
        pushed weights stops the batch (ServerRestarted: the run must join it again), as `generate` does."""
        def ask(i):
            try:
                return self.pool.served_version(self.pool.servers[i], self.version)
            except (ServerRestarted, ServerGone):
                raise
            except ServerError:
                return None

        return {i: v for i, v in zip(used, parallel_map(ask, used)) if v is not None}

    def spawn(self, fn, *args) -> None:
        with self.done:
            self.pending += 1
        self.workers.submit(self.task, fn, *args)

    def task(self, fn, *args) -> None:
        try:
            if not self.errors:
                fn(*args)
        except Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - raised by `episodes` once every task has ended
            with self.lock:
                self.errors.append(e)
        finally:
            with self.done:
                self.pending -= 1
                self.done.notify_all()

    def group(self, group: list[Trajectory], p: int, n: int, sampling: Sampling) -> None:
        """Prompt p's n trajectories: their resets (concurrently, on the runner's pool of environment
        calls), then turn 1 as one request where none of them opened with an observation (the prompt's
        prefix shared, as `generate(prompts, n)`), else one each."""
        r, opened = self.runner, False
        for t, (text, error) in zip(group, self.calls.map(lambda t: r.env_reset(t, sampling.seed), group)):
            with self.lock:
                if error:
                    r.fail(t, error, "reset")
                elif text:
                    r.open(t, text)
                opened |= bool(text) or bool(error)
        if not opened and all(r.room(t) for t in group):
            turn = self.request(self.server_of[p], [group[0].prompt_ids], n, sampling.seed if sampling.seed is None
                                else sampling.seed + p * n, sampling, group)
            if turn is not None:
                for t, (ids, lps, reason, version) in zip(group, turn):
                    self.take(t, ids, lps, reason, version)
        for t in group:
            self.spawn(self.follow, t, p, sampling)

    def follow(self, t: Trajectory, p: int, sampling: Sampling) -> None:
        """One trajectory's turns, each sent as soon as the one before has been answered."""
        r = self.runner
        while t.active:
            self.check_stop()
            with self.lock:
                if not r.room(t):
                    return
            turn = t.episode.turns + 1
            seed = None if sampling.seed is None else turn_seed(sampling.seed, turn) + t.index
            answer = self.request(self.server_of[p], [t.prompt_ids + t.span], 1, seed, sampling, [t])
            if answer is None:
                return
            self.take(t, *answer[0])

    def take(self, t: Trajectory, ids: list[int], lps: list[float], reason: str, version: int) -> None:
        """A sampled turn into its trajectory, then the environment's answer to it."""
        r = self.runner
        with self.lock:
            t.version = version
            text = r.take_turn(t, ids, lps, reason)
        if text is None:
            return
        with self.envs:
            self.check_stop()  # here, not before the wait: a close during the wait for a slot starts no step
            step, error, seconds = r.env_step((t, text))
        with self.lock:
            r.take_step(t, step, error, seconds)

    def request(self, i: int, prompts: list[list[int]], n: int, seed: Optional[int], sampling: Sampling,
                owners: list[Trajectory]) -> Optional[list[tuple]]:
        """One /v1/completions request to server i: (ids, logprobs, finish reason, weight version) per
        completion, or None where it failed (its trajectories end as "error")."""
        server, gate = self.pool.servers[i], self.pool.gate
        with self.slots[i]:
            self.check_stop()  # once it holds a slot: a close during the wait for one sends no request
            try:
                if gate is None:
                    choices, version = self.pool.complete(server, prompts, n, sampling, seed, self.timeout[i]), self.version
                else:
                    with gate.turn() as version:
                        self.check_stop()
                        choices = self.pool.complete(server, prompts, n, sampling, seed, self.timeout[i])
            except (EchoMismatch, PoolClosed, ServerGone):  # a dead engine answers no trajectory: the batch stops
                raise
            except ServerError as e:
                with self.lock:
                    for t in owners:
                        self.failed.append((t, str(e)))
                        t.episode.error, t.episode.env_reward = str(e), None
                        t.end("error")
                return None
        if len(choices) != len(prompts) * n:
            raise ServerError(f"asked {server.url} for {len(prompts) * n} completions, it returned {len(choices)}")
        with self.lock:
            self.tokens[i] += sum(len(c["token_ids"]) for c in choices)
        return [(list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]],
                 "length" if c["finish_reason"] == "length" else "stop", version) for c in choices]

    def check_stop(self) -> None:
        """Before a turn: another trajectory's error ends this one (`Stop`), a closed pool the batch."""
        if self.pool.stopped.is_set():
            raise PoolClosed("the server pool was closed (the run is stopping): the episode batch ends unfinished")
        if self.errors:
            raise Stop

    def report_failures(self, total: int) -> None:
        if not self.failed:
            return
        first = self.failed[0][1]
        if len(self.failed) == total:
            raise ServerError(f"every trajectory of the episode batch ({total}) failed on its server's request; "
                              f"the first: {first}")
        warnings.warn(f"{len(self.failed)} of {total} trajectories ended as 'error' when their server request failed "
                      f"(excluded from the rewards); the first: {first}", stacklevel=2)
