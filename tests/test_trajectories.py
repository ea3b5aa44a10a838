"""Episodes scheduled per trajectory on a real `python -m grpo.serve` (grpo/rollout/trajectories.py), and
partial rollouts: weights pushed between the turns of an episode batch (grpo/rollout/servers.py TurnGate).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import RolloutConfig, validate
from grpo.envs.guess import GuessEnv
from grpo.errors import ConfigError, ServerError
from grpo.rollout import Sampling
from grpo.rollout.episodes import Budget, EpisodeRunner
from grpo.rollout.render import RawRender
from grpo.rollout.push import push_adapter_from_one_rank
from grpo.rollout.servers import PoolClosed, ServerRestarted, TurnGate, adapter_name, in_thread, prompt_requests
from grpo.rollout.trajectories import episode_driver
from grpo.tasks.base import Sample
from grpo.weights import group_by_size
from tests.conftest import ROOT, compose_cfg, serve_tiny, stop_served

TOKEN = "test-secret-token"
EVENTS: list[tuple] = []  # (secret, step number, start, end) of every SlowGuess step


class SlowGuess(GuessEnv):
    """The guess game whose steps take `slow_s` for secret `slow` and `fast_s` for the others. Given
    `overtaken` (an event), a slow step ends instead once another trajectory's second step starts (which
    sets it), or after `slow_s`."""

    def __init__(self, slow: int = 9, slow_s: float = 1.5, fast_s: float = 0.0, overtaken: threading.Event | None = None):
        super().__init__()
        self.slow, self.slow_s, self.fast_s, self.overtaken, self.steps = slow, slow_s, fast_s, overtaken, 0

    def step(self, action):
        self.steps += 1
        t0 = time.perf_counter()
        if self.secret == self.slow and self.overtaken is not None:
            self.overtaken.wait(self.slow_s)
        else:
            if self.overtaken is not None and self.steps == 2:
                self.overtaken.set()
            time.sleep(self.slow_s if self.secret == self.slow else self.fast_s)
        EVENTS.append((self.secret, self.steps, t0, time.perf_counter()))
        return super().step(action)


@pytest.fixture(scope="module")
def server(learning_policy, tmp_path_factory):
    """The warm-started tiny addition model: its turns are digits ending in the end token, so the
    guess game goes on for several turns (a random model's turns run out of tokens at turn 1)."""
    proc, url = serve_tiny(learning_policy, tmp_path_factory.mktemp("trajectories") / "server.log", TOKEN)
    yield {"url": url, "path": learning_policy}
    stop_served(proc)


@pytest.fixture
def remote(server, monkeypatch):
    """A RemoteBackend on the module's server, and the tiny model it serves, loaded here."""
    from grpo.auth import TOKEN_ENV
    from grpo.models import load_model
    from grpo.rollout.remote import RemoteBackend

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    model, tok = load_model(server["path"])
    made = []

    def make(partial: bool = False):
        cfg = OmegaConf.structured(RolloutConfig(backend="remote"))
        cfg.remote.urls = [server["url"]]
        made.append(RemoteBackend(cfg, model, tok, partial_rollouts=partial))
        return made[-1]

    yield make, model, tok
    for backend in made:
        backend.close()


def batch(tok, secrets=(9, 3, 5, 12)):
    texts = ["12+34=", "7+1=", "99+9=", "5+5="][:len(secrets)]
    return [tok(t).input_ids for t in texts], [Sample(t, str(s)) for t, s in zip(texts, secrets)]


def runner_for(tok, backend, **env_kwargs):
    return EpisodeRunner(lambda: SlowGuess(**env_kwargs), tok, RawRender(tok), Budget(4, 6, 64, 4, backend.max_context),
                         10.0, [tok.eos_token_id], "slow_guess", max_concurrency=8)


def test_a_trajectory_goes_on_while_a_slower_one_waits_and_the_tokens_equal_the_turn_synchronous_driver(remote):
    """Secret 9's two trajectories' first step ends once a fast trajectory's second step starts (or after
    5 s), the other six's steps take no time. Per trajectory, a fast trajectory's second step (so its
    second turn: sent, sampled, answered) starts before the slow ones' first step has returned; turn by
    turn it cannot, since every turn 2 waits for every step 1, and the slow step waits its 5 s. Neither
    rests on how fast the server answers a turn on a loaded machine.
    Under the same seed and weights, both drivers train on the same tokens: the same ids, masks,
    finish reasons and sampler logprobs (1e-5; the engine batches them differently)."""
    make, model, tok = remote
    backend = make()
    prompts, samples = batch(tok)
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=1234)
    outs = {}
    for schedule in ("turns", "trajectories"):
        EVENTS.clear()
        overtaken = threading.Event()
        drive = episode_driver(schedule, runner_for(tok, backend, slow_s=5.0, overtaken=overtaken), backend.pool,
                               backend.weight_version)
        outs[schedule] = drive(prompts, samples, 2, sampling)
        slow_first = min(end for secret, k, _, end in EVENTS if secret == 9 and k == 1)
        fast_second = [start for secret, k, start, _ in EVENTS if secret != 9 and k == 2]
        assert fast_second, f"no fast trajectory reached a second step: {EVENTS}"
        if schedule == "turns":
            assert min(fast_second) >= slow_first
        else:
            assert min(fast_second) < slow_first, (min(fast_second), slow_first)
    turns, free = outs["turns"], outs["trajectories"]
    assert free.completion_ids == turns.completion_ids
    assert free.loss_masks == turns.loss_masks and free.token_turns == turns.token_turns
    assert free.finish_reasons == turns.finish_reasons
    assert [e.turns for e in free.episodes] == [e.turns for e in turns.episodes]
    assert max(e.turns for e in free.episodes) >= 2
    for a, b in zip(free.logprobs, turns.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert free.token_versions == [[0 if m else -1 for m in mask] for mask in free.loss_masks]


def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[k] | ids[:k]) for k >= 1, at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_partial_rollouts_score_each_token_with_the_weights_that_sampled_it(remote):
    """A push while an episode batch runs (every step 0.4 s): the push waits for the turns in flight,
    not for the batch, so trajectories carry tokens of versions 0 and 1. Each token's sampler logprob
    equals the logprob under the weights of its own version (the behaviour logprob the loss uses) to
    1e-3, and differs from the other version's: the versions are told apart, not guessed."""
    make, model, tok = remote
    backend = make(partial=True)
    before = copy.deepcopy(model)
    prompts, samples = batch(tok, secrets=(13, 14, 15, 11))
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=99)
    EVENTS.clear()
    future = backend.submit_episodes(prompts, samples, 2, sampling, runner_for(tok, backend, slow=0, fast_s=0.4))
    deadline = time.time() + 60
    while not EVENTS and time.time() < deadline:  # a first step has returned: turn 2 is coming
        time.sleep(0.01)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    t0 = time.perf_counter()
    named = ((n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False))
    backend.update_weights(group_by_size(named, 256 * 1024), version=1)
    push_s = time.perf_counter() - t0
    out = future.result()
    assert not future.exception() and push_s < 30
    mixed = [i for i, vs in enumerate(out.token_versions) if {0, 1} <= set(vs)]
    assert mixed, out.token_versions
    assert out.weight_version == 0  # the batch's oldest tokens
    assert out.metrics()["episode/versions_max"] == 2
    own, other = [], []
    weights = {0: before, 1: model}
    for i in mixed:
        ids = prompts[i // 2] + out.completion_ids[i]
        at = len(prompts[i // 2]) - 1
        scored = {v: token_logprobs(m, ids)[at:] for v, m in weights.items()}
        sampler = torch.tensor(out.logprobs[i])
        for k, v in enumerate(out.token_versions[i]):
            if v >= 0:
                own.append(abs(scored[v][k] - sampler[k]).item())
                other.append(abs(scored[1 - v][k] - sampler[k]).item())
    assert max(own) <= 1e-3, max(own)
    assert max(other) > 1e-2, max(other)


def test_the_turn_gate_lets_a_push_wait_only_for_the_turns_in_flight():
    gate, log, held_until = TurnGate(version=3), [], []

    def turn(hold: float):
        with gate.turn() as v:
            log.append(("start", v))
            time.sleep(hold)
            held_until.append(time.perf_counter())
        log.append(("end", v))

    first = threading.Thread(target=turn, args=(0.3,))
    first.start()
    while not log:  # the turn is in flight (under load a thread can take long to start)
        time.sleep(0.01)
    gate.pause()  # returns once the turn in flight has ended
    assert held_until and time.perf_counter() >= held_until[0]
    first.join(5)
    assert log == [("start", 3), ("end", 3)]
    second = threading.Thread(target=turn, args=(0.0,))
    second.start()
    time.sleep(0.1)
    assert len(log) == 2  # no turn starts while paused
    gate.resume(4)
    second.join(5)
    assert log[2:] == [("start", 4), ("end", 4)]


class HeldPool:
    """A pool of one fake server for the drivers' bookkeeping, with partial rollouts' gate: a request
    for a prompt in `held` waits until its event is set (the engine busy on it), then guesses 7."""

    def __init__(self, tok, held: dict | None = None):
        self.servers = [SimpleNamespace(url="fake", speed=1.0, timeout_s=60.0, batches=0)]
        self.clients, self.gate, self.idle_since, self.stopped = 1, TurnGate(0), None, threading.Event()
        self.episode_batches = 0  # as ServerPool's
        self.tok, self.held, self.entered = tok, held or {}, set()

    def complete(self, server, prompts, n, sampling, seed, timeout):
        key = tuple(prompts[0][:4])
        self.entered.add(key)
        assert self.held[key].wait(30)
        ids = self.tok("7", add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        return [{"token_ids": ids, "logprobs": {"token_logprobs": [-1.0] * len(ids)}, "finish_reason": "stop"}] * (len(prompts) * n)


def test_partial_rollouts_count_engine_wait_only_while_no_batch_is_in_flight(tiny_lm):
    """Partial rollouts overlap episode batches on the servers (`in_thread`). The engines stood idle
    100 s before batch A; B starts while A's turn is being sampled, so B waited 0 s (it had the wait
    since the batch before A: 100 s). A ends first: the pool is not idle while B runs, so its
    `idle_since` moves only when B, the last batch in flight, ends."""
    _, tok = tiny_lm
    prompt_a, prompt_b = tok("12+34=").input_ids, tok("7+1=").input_ids
    assert prompt_a[:4] != prompt_b[:4]
    release = {tuple(prompt_a[:4]): threading.Event(), tuple(prompt_b[:4]): threading.Event()}
    pool = HeldPool(tok, release)
    runner = EpisodeRunner(GuessEnv, tok, RawRender(tok), Budget(1, 4, 64, 4), 10.0, [tok.eos_token_id], "guess", 4)
    drive = episode_driver("trajectories", runner, pool, 0)
    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=1)
    idle_since = pool.idle_since = time.perf_counter() - 100.0

    def started(prompt):
        while tuple(prompt[:4]) not in pool.entered:
            time.sleep(0.01)

    a = in_thread(drive, [prompt_a], [Sample("12+34=", "3")], 2, sampling)
    started(prompt_a)
    b = in_thread(drive, [prompt_b], [Sample("7+1=", "3")], 2, sampling)
    started(prompt_b)
    release[tuple(prompt_a[:4])].set()
    out_a = a.result(30)
    assert pool.idle_since == idle_since  # B is in flight: the engines are not idle
    release[tuple(prompt_b[:4])].set()
    out_b = b.result(30)
    assert out_a.finish_reasons == out_b.finish_reasons == ["turns"] * 2
    assert out_a.engine_wait_s >= 100.0 and out_b.engine_wait_s == 0.0
    assert pool.idle_since > idle_since + 100.0  # set when B ended


class ResetFails(GuessEnv):
    def reset(self, sample, seed):
        raise RuntimeError("env down")


@pytest.mark.parametrize("schedule", ["trajectories", "turns"])
def test_a_batch_without_a_turn_reports_the_version_the_servers_hold(tiny_lm, schedule):
    """Every reset failed, so no turn was sampled: the batch reports the version the driver was given
    (what the trainer last pushed, 9), not 0, which the loop logged as step - 1 versions stale."""
    _, tok = tiny_lm
    runner = EpisodeRunner(ResetFails, tok, RawRender(tok), Budget(1, 4, 64, 4), 10.0, [tok.eos_token_id], "broken", 4)
    pool = HeldPool(tok)
    with pytest.warns(UserWarning, match="reset failed"):
        out = episode_driver(schedule, runner, pool, 9)([tok("7+1=").input_ids], [Sample("7+1=", "3")], 2, Sampling(4))
    assert out.finish_reasons == ["error"] * 2 and not pool.entered
    assert out.weight_version == 9


def test_a_server_that_restarted_stops_the_episode_batch_before_any_turn(tiny_lm):
    """A server that lost the pushed weights (ServerPool.served_version's ServerRestarted) stops the
    episode batch, as a turn-synchronous batch does: it was read as a server that did not answer, and
    the batch went on (its trajectories ending as errors until the next push failed)."""
    _, tok = tiny_lm
    pool = HeldPool(tok)
    pool.gate = None  # no partial rollouts: the batch reads the servers' versions first

    def restarted(server, fallback):
        raise ServerRestarted(f"{server.url} restarted and lost the pushed weights")

    pool.served_version = restarted
    runner = EpisodeRunner(GuessEnv, tok, RawRender(tok), Budget(1, 4, 64, 4), 10.0, [tok.eos_token_id], "guess", 4)
    with pytest.raises(ServerRestarted, match="fake restarted"):
        episode_driver("trajectories", runner, pool, 3)([tok("7+1=").input_ids], [Sample("7+1=", "8")], 2, Sampling(4))
    assert not pool.entered


def test_later_turn_seeds_follow_the_trajectory_not_its_place_in_the_batch():
    assert prompt_requests([0, 1], 1000, 1, keys=[5, 2]) == [([0], 1005), ([1], 1002)]
    assert prompt_requests([0, 1], 1000, 4) == [([0], 1000), ([1], 1004)]  # turn 1: completion j of prompt k is k * 4 + j


def test_schedule_and_partial_rollouts_are_checked():
    with pytest.raises(ConfigError, match="rollout.schedule=trajectories with rollout=hf"):
        validate(compose_cfg("rollout=hf", "rollout.schedule=trajectories"))
    with pytest.raises(ConfigError, match="single-turn task"):
        validate(compose_cfg("rollout=remote", "rollout.remote.urls=[http://x:1]", "algo.max_staleness=1",
                             "algo.partial_rollouts=true"))
    with pytest.raises(ConfigError, match="rollout.schedule=turns"):
        validate(compose_cfg("experiment=guess_tiny", "rollout=remote", "rollout.remote.urls=[http://x:1]",
                             "rollout.schedule=turns", "algo.max_staleness=1", "algo.partial_rollouts=true"))
    with pytest.raises(ConfigError, match="algo.max_staleness=0"):
        validate(compose_cfg("experiment=guess_tiny", "rollout=remote", "rollout.remote.urls=[http://x:1]",
                             "algo.partial_rollouts=true"))


def test_a_guess_run_with_partial_rollouts_through_remote(server, make_cfg, monkeypatch):
    """4 steps of experiment=guess_tiny on the server, one batch ahead (max_staleness=1) with partial
    rollouts: it trains and logs the versions each batch spans, never more than 2. Whether a batch of
    this run spans 2 depends on the machine's timing (CI saw [1, 1, 1, 1], even with 0.15 s environment
    steps, where a developer's machine saw a 2): that partial rollouts do mix versions, each token
    scored with the weights that sampled it, is asserted deterministically by
    test_partial_rollouts_score_each_token_with_the_weights_that_sampled_it above."""
    from grpo.auth import TOKEN_ENV
    from grpo.train import train

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = make_cfg("experiment=guess_tiny", "rollout=remote", f"rollout.remote.urls=[{server['url']}]", "steps=4",
                   "eval_every=0", "checkpoint_every=0", "algo.max_staleness=1", "algo.partial_rollouts=true")
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 4
    versions = [r["episode/versions_max"] for r in trained]
    assert all(1 <= v <= 2 for v in versions), versions
    assert all(r["async/staleness_max"] <= 1 for r in trained)


def test_a_failed_request_ends_only_its_trajectories(server, remote, refused_url):
    """Two pool entries, the second pointed at a closed port after the health checks, its watch saying
    nothing of a death (a transient failure): the prompts routed there end as 'error' (reward None, one
    warning for the batch), the others' episodes are whole. With every request failing the batch fails,
    naming the first error. (A server known dead stops the batch at once: the test below.)"""
    from grpo.auth import load_token
    from grpo.rollout.servers import ServerPool
    from grpo.rollout.trajectories import TrajectoryDriver

    _, _, tok = remote
    pool = ServerPool([server["url"], server["url"]], load_token(None), 60, 60, can_push=False, log=None)
    try:
        pool.servers[1].url = refused_url()
        for s in pool.servers:  # a failure that does not say the server died (a refused connection is ServerGone)
            s.watch = lambda: None
        prompts, samples = batch(tok)
        runner = runner_for(tok, pool)
        sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=5)
        with pytest.warns(UserWarning, match="4 of 8 trajectories ended as 'error'.*unreachable"):
            out = TrajectoryDriver(runner, pool, 0).run(prompts, samples, 2, sampling)
        assert out.finish_reasons[4:] == ["error"] * 4 and all(e.env_reward is None for e in out.episodes[4:])
        assert "error" not in out.finish_reasons[:4] and all(len(ids) > 0 for ids in out.completion_ids[:4])
        pool.servers[0].url = pool.servers[1].url
        with pytest.raises(ServerError, match="every trajectory of the episode batch"):
            TrajectoryDriver(runner, pool, 0).run(prompts, samples, 2, sampling)
    finally:
        pool.close()


def test_a_dead_server_stops_the_episode_batch(server, remote, refused_url):
    """A server whose engine is known dead (its `watch` says so, as a dedicated engine's exit does)
    fails the batch with ServerGone, naming why: its trajectories do not end as 'error' one by one while
    the run goes on with half a batch, every later batch failing the same way."""
    from grpo.auth import load_token
    from grpo.endpoints import ServerGone
    from grpo.rollout.servers import ServerPool
    from grpo.rollout.trajectories import TrajectoryDriver

    _, _, tok = remote
    pool = ServerPool([server["url"], server["url"]], load_token(None), 60, 60, can_push=False, log=None)
    try:
        pool.servers[1].url = refused_url()
        said = iter([None])  # the version check before the batch finds it silent; then its death is known
        pool.servers[1].watch = lambda: next(said, "its process exited (exit code 1)")
        prompts, samples = batch(tok)
        with pytest.raises(ServerGone, match=r"/v1/completions failed .*: its process exited \(exit code 1\)"):
            TrajectoryDriver(runner_for(tok, pool), pool, 0).run(prompts, samples, 2,
                                                                  Sampling(max_new_tokens=6, temperature=1.0, seed=5))
    finally:
        pool.close()


STOPPED_RUN = """
import os, sys, time
from omegaconf import OmegaConf
from grpo.config import RolloutConfig
from grpo.envs.guess import GuessEnv
from grpo.models import load_model
from grpo.rollout import Sampling
from grpo.rollout.episodes import Budget, EpisodeRunner
from grpo.rollout.render import RawRender
from grpo.rollout.remote import RemoteBackend
from grpo.tasks.base import Sample

url, path, marks, schedule = sys.argv[1:5]

class Marked(GuessEnv):  # every step takes 3 s and leaves a mark when it starts and when it ends
    def step(self, action):
        open(os.path.join(marks, "started"), "a").close()
        time.sleep(3)
        open(os.path.join(marks, "finished"), "a").close()
        return super().step(action)

model, tok = load_model(path)
cfg = OmegaConf.structured(RolloutConfig(backend="remote", schedule=schedule))
cfg.remote.urls = [url]
backend = RemoteBackend(cfg, model, tok)
runner = EpisodeRunner(Marked, tok, RawRender(tok), Budget(4, 6, 64, 4, backend.max_context), 10.0,
                       [tok.eos_token_id], "marked", max_concurrency=8)
texts = ["12+34=", "7+1="]
future = backend.submit_episodes([tok(t).input_ids for t in texts], [Sample(t, "9") for t in texts], 2,
                                 Sampling(max_new_tokens=6, temperature=1.0, seed=3), runner)
while not os.path.exists(os.path.join(marks, "started")):
    if future.done():
        sys.exit(f"no step started: {future.result()}")
    time.sleep(0.01)
backend.close()  # a stop, preemption or error: the run's finally closes its backend, then the process exits
sys.exit(0)
"""


@pytest.mark.parametrize("schedule", ["trajectories", "turns"])
def test_a_stopped_run_exits_without_waiting_for_the_episodes_in_flight(server, tmp_path, schedule):
    """A process closes its backend while an environment step (3 s) is in flight, then exits: it is gone
    before that step returns (its end mark is never written). Before, the trajectories' and the
    environment calls' ThreadPoolExecutor workers were joined at exit, and the episodes in flight played
    out (steps of up to env.step_timeout_s, turns of up to the generation timeout) before it ended."""
    from grpo.auth import TOKEN_ENV

    done = subprocess.run([sys.executable, "-c", STOPPED_RUN, server["url"], server["path"], str(tmp_path), schedule],
                          cwd=ROOT, env={**os.environ, TOKEN_ENV: TOKEN}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "started").exists()
    assert not (tmp_path / "finished").exists(), "the exit waited for the environment step in flight"


def test_a_closed_pool_sends_no_further_turn_and_fails_the_batch(remote):
    """Every step takes 0.5 s; once a step has returned, the backend closes: the batch fails with
    PoolClosed and no step starts after the close (before, the episodes played out on the pool)."""
    make, model, tok = remote
    backend = make()
    prompts, samples = batch(tok)
    EVENTS.clear()
    future = backend.submit_episodes(prompts, samples, 2, Sampling(max_new_tokens=6, temperature=1.0, seed=7),
                                     runner_for(tok, backend, slow=0, fast_s=0.5))
    while not EVENTS and not future.done():
        time.sleep(0.01)
    assert EVENTS, future.result()
    backend.close()
    closed_at = time.perf_counter()
    assert isinstance(future.exception(), PoolClosed), future.exception()
    assert [e for e in EVENTS if e[2] > closed_at] == []


def test_a_step_waiting_for_an_environment_slot_when_the_pool_closes_never_starts(tiny_lm):
    """One environment call at a time (max_concurrency 1): prompt A's step holds the slot, prompt B's turn
    has been answered and waits for it. The pool closes, then A's step returns: B's step never starts
    (before, the stop was checked before the wait for a slot, so B stepped after the close)."""
    _, tok = tiny_lm
    first, stepped = threading.Event(), []

    class HeldStep(GuessEnv):
        def step(self, action):
            stepped.append(time.perf_counter())
            if len(stepped) == 1:
                assert first.wait(30)
            return super().step(action)

    runner = EpisodeRunner(HeldStep, tok, RawRender(tok), Budget(1, 4, 64, 4), 10.0, [tok.eos_token_id], "held", 1)
    taken, take_turn = [], runner.take_turn
    runner.take_turn = lambda *a: taken.append(1) or take_turn(*a)
    pool = RecordingPool(tok)
    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids]
    future = in_thread(episode_driver("trajectories", runner, pool, 0), prompts,
                       [Sample("12+34=", "3"), Sample("7+1=", "3")], 1, Sampling(max_new_tokens=4, seed=1))
    deadline = time.time() + 30
    while (len(taken) < 2 or not stepped) and time.time() < deadline:  # A steps, B's turn is in
        time.sleep(0.01)
    assert len(taken) == 2 and len(stepped) == 1, (taken, stepped)
    time.sleep(0.2)  # B reaches its wait for the slot (if it were later, the old code would pass too: never a false failure)
    pool.stopped.set()
    closed_at = time.perf_counter()
    first.set()
    assert isinstance(future.exception(timeout=30), PoolClosed), future.exception()
    assert len(stepped) == 1 and stepped[0] < closed_at, stepped


def test_a_request_waiting_for_a_server_slot_when_the_pool_closes_is_never_sent(tiny_lm, monkeypatch):
    """One request in flight per server, no turn gate: prompt A's request holds the slot, prompt B's waits
    for it. The pool closes, then A's answer comes: B's request is never sent (before, the stop was
    checked before the wait for a slot)."""
    from grpo.rollout import trajectories

    _, tok = tiny_lm
    monkeypatch.setattr(trajectories, "MAX_REQUESTS_IN_FLIGHT", 1)
    prompt_a, prompt_b = tok("12+34=").input_ids, tok("7+1=").input_ids
    release = {tuple(prompt_a[:4]): threading.Event(), tuple(prompt_b[:4]): threading.Event()}
    pool = HeldPool(tok, release)
    pool.gate, pool.served_version = None, lambda server, fallback: fallback  # turn-synchronous pushes
    runner = EpisodeRunner(GuessEnv, tok, RawRender(tok), Budget(1, 4, 64, 4), 10.0, [tok.eos_token_id], "guess", 4)
    future = in_thread(episode_driver("trajectories", runner, pool, 0), [prompt_a, prompt_b],
                       [Sample("12+34=", "3"), Sample("7+1=", "3")], 1, Sampling(max_new_tokens=4, seed=1))
    deadline = time.time() + 30
    while not pool.entered and time.time() < deadline:
        time.sleep(0.01)
    assert len(pool.entered) == 1, pool.entered
    first = next(iter(pool.entered))
    time.sleep(0.2)  # the other request reaches its wait for the slot (later, the old code passed too)
    pool.stopped.set()
    for event in release.values():
        event.set()
    assert isinstance(future.exception(timeout=30), PoolClosed), future.exception()
    assert pool.entered == {first}


def test_a_rank_without_the_pool_resumes_its_turns_with_the_new_adapter(remote, tmp_path):
    """LoRA with partial rollouts on rank >= 1 (no pool to push with): a turn waiting out the push
    wakes asking for the adapter the push loaded, never the one rank 0 has just unloaded."""
    make, _, _ = remote
    backend = make(partial=True)
    gate, seen = backend.pool.gate, []
    gate.pause()  # a push is under way: the turn below waits

    def turn():
        with gate.turn():
            seen.append(backend.pool.servers[0].adapter)

    waiting = threading.Thread(target=turn)
    waiting.start()
    push_adapter_from_one_rank(None, None, [], 1, str(tmp_path), own=backend.pool)
    waiting.join(60)
    assert seen == [adapter_name(1)]


class RecordingPool(HeldPool):
    """HeldPool's one fake server answering at once: each turn guesses 7 (ended by `finish`), and its
    (n, seed) is recorded; `short` answers one completion fewer than asked; with `push`, the servers
    hold weight version 1 from the first request's answer on (a push between turns: partial rollouts)."""

    def __init__(self, tok, finish: str = "stop", short: bool = False, push: bool = False):
        super().__init__(tok)
        self.finish, self.short, self.push, self.sent = finish, short, push, []

    def complete(self, server, prompts, n, sampling, seed, timeout):
        self.sent.append((n, seed))
        if self.push:
            self.gate.version = 1
        ids = self.tok("7", add_special_tokens=False).input_ids + ([] if self.finish == "length" else [self.tok.eos_token_id])
        choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-1.0] * len(ids)}, "finish_reason": self.finish}
        return [choice] * (len(prompts) * n - self.short)


def test_each_turn_is_sent_with_its_trajectorys_seed_and_the_batch_takes_its_oldest_version(tiny_lm):
    """Two prompts, n = 2, two turns of the guess game (7 is wrong: each plays both turns). Turn 1: one
    request per prompt, seed 100 + p * n; turn 2: one per trajectory i, turn_seed(100, 2) + i. With a
    push after turn 1, its two tokens ("7", the end token) were sampled by version 0, the observation's
    is -1 (not sampled) and turn 2's by version 1: the batch's weight_version is the oldest, 0."""
    from grpo.rollout.episodes import turn_seed

    _, tok = tiny_lm
    runner = EpisodeRunner(GuessEnv, tok, RawRender(tok), Budget(2, 4, 64, 4), 10.0, [tok.eos_token_id], "guess", 4)
    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=100)
    pool = RecordingPool(tok)
    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids]
    out = episode_driver("trajectories", runner, pool, 9)(prompts, [Sample("12+34=", "3"), Sample("7+1=", "3")], 2, sampling)
    later = turn_seed(100, 2)
    assert sorted(pool.sent) == sorted([(2, 100), (2, 102)] + [(1, later + i) for i in range(4)])
    assert out.finish_reasons == ["turns"] * 4
    assert out.token_versions == [[0, 0, -1, 0, 0]] * 4 and out.weight_version == 0
    out = episode_driver("trajectories", runner, RecordingPool(tok, push=True), 9)(prompts[:1], [Sample("12+34=", "3")], 2,
                                                                                  sampling)
    assert out.token_versions == [[0, 0, -1, 1, 1]] * 2 and out.weight_version == 0


def test_per_trajectory_a_groups_environments_reset_with_one_seed(tiny_lm):
    """The per-trajectory schedule resets each group on its own thread, through the runner's `env_reset`:
    2 prompts x n = 3 still get one seed per group (one task instance for the group's baseline)."""
    from grpo.rollout.episodes import reset_seed
    from tests.test_episodes import SeededSecret

    _, tok = tiny_lm
    built = []

    def make():
        built.append(SeededSecret())
        return built[-1]

    runner = EpisodeRunner(make, tok, RawRender(tok), Budget(1, 4, 64, 4), 10.0, [tok.eos_token_id], "seeded", 4)
    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids]
    episode_driver("trajectories", runner, RecordingPool(tok), 0)(
        prompts, [Sample("12+34=", "3"), Sample("7+1=", "3")], 3, Sampling(max_new_tokens=4, seed=100))
    assert [env.seed for env in built] == [reset_seed(100, 0)] * 3 + [reset_seed(100, 1)] * 3  # built in the trajectories' order
    assert reset_seed(100, 0) != reset_seed(100, 1)


def test_a_turn_cut_at_max_new_tokens_ends_its_trajectory_as_length_and_a_short_answer_fails_the_batch(tiny_lm):
    _, tok = tiny_lm
    runner = EpisodeRunner(GuessEnv, tok, RawRender(tok), Budget(2, 4, 64, 4), 10.0, [tok.eos_token_id], "guess", 4)
    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=100)
    out = episode_driver("trajectories", runner, RecordingPool(tok, finish="length"), 0)(
        [tok("7+1=").input_ids], [Sample("7+1=", "3")], 2, sampling)
    assert out.finish_reasons == ["length"] * 2
    with pytest.raises(ServerError, match="asked fake for 2 completions, it returned 1"):
        episode_driver("trajectories", runner, RecordingPool(tok, short=True), 0)(
            [tok("7+1=").input_ids], [Sample("7+1=", "3")], 2, sampling)


class VersionedPool(RecordingPool):
    """RecordingPool without partial rollouts (no gate: the batch reads the servers' versions before
    and after it), with one server per entry of `versions`; server k reports versions[k][0] before the
    batch and versions[k][1] after it. A request whose prompt's second token (after BOS) is in `gone` or `fails` raises
    ServerGone (its engine exited) or a plain ServerError (this request failed)."""

    def __init__(self, tok, versions, gone=(), fails=()):
        super().__init__(tok)
        self.gate, self.asked = None, {}
        self.servers = [SimpleNamespace(url=f"fake{k}", speed=1.0, timeout_s=60.0, batches=0) for k in range(len(versions))]
        self.versions, self.gone, self.fails = versions, set(gone), set(fails)

    def served_version(self, server, fallback):
        k = int(server.url[4:])
        self.asked[k] = self.asked.get(k, -1) + 1
        return self.versions[k][min(self.asked[k], 1)]

    def complete(self, server, prompts, n, sampling, seed, timeout):
        from grpo.endpoints import ServerGone

        if prompts[0][1] in self.gone:
            raise ServerGone(f"{server.url}'s engine exited")
        if prompts[0][1] in self.fails:
            raise ServerError(f"{server.url} answered 500")
        return super().complete(server, prompts, n, sampling, seed, timeout)


def guess_runner(tok, budget=None):
    return EpisodeRunner(GuessEnv, tok, RawRender(tok), budget or Budget(2, 4, 64, 4), 10.0, [tok.eos_token_id], "guess", 4)


def test_a_version_that_changed_or_differs_between_servers_fails_an_episode_batch(tiny_lm):
    """Without partial rollouts weights change only between batches: a server at version 3 before the
    batch and 4 after it, or two servers at 3 and 4 (a push reached one), fail the batch by value; two
    servers at 3 throughout do not, and the batch takes their version, 3."""
    _, tok = tiny_lm
    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids]
    samples, sampling = [Sample("12+34=", "3"), Sample("7+1=", "3")], Sampling(max_new_tokens=4, seed=100)
    with pytest.raises(ServerError, match=r"went from \{0: 3\} to \{0: 4\} during an episode batch"):
        episode_driver("trajectories", guess_runner(tok), VersionedPool(tok, [(3, 4)]), 0)(prompts[:1], samples[:1], 2, sampling)
    with pytest.raises(ServerError, match=r"the servers hold different weight versions \[3, 4\]"):
        episode_driver("trajectories", guess_runner(tok), VersionedPool(tok, [(3, 3), (4, 4)]), 0)(prompts, samples, 2, sampling)
    out = episode_driver("trajectories", guess_runner(tok), VersionedPool(tok, [(3, 3), (3, 3)]), 0)(prompts, samples, 2, sampling)
    assert out.weight_version == 3 and out.finish_reasons == ["turns"] * 4


def test_a_servers_speed_moves_by_0_3_of_a_batchs_rate_after_its_first_batch(tiny_lm):
    """After its first batch a server's speed (how split_by_load shares prompts) is 0.7 x its speed + 0.3
    x the batch's tokens per second. One prompt, n = 2, two turns of 2 tokens ("7", the end token):
    8 tokens in at least 1e-6 s, so the rate is at most 8e6/s; from a speed of 1e12 the speed is
    between 7e11 and 7e11 + 0.3 x 8e6, and its batches count 2."""
    _, tok = tiny_lm
    pool = RecordingPool(tok)
    pool.servers[0].speed, pool.servers[0].batches = 1e12, 1
    episode_driver("trajectories", guess_runner(tok), pool, 0)([tok("7+1=").input_ids], [Sample("7+1=", "3")], 2,
                                                               Sampling(max_new_tokens=4, seed=100))
    assert len(pool.sent) == 3  # turn 1 for both, then turn 2 for each: 2 + 2 + 2 + 2 = 8 tokens
    assert 7e11 <= pool.servers[0].speed <= 7e11 + 0.3 * 8e6 and pool.servers[0].batches == 2


def test_a_prompt_that_leaves_no_room_for_a_turn_sends_no_request_and_ends_as_error(tiny_lm):
    """max_context 8 and max_new_tokens 4: a prompt of more than 4 tokens leaves no room for turn 1, so
    its trajectories end as "error" (no episode of the policy's) and no request is sent for them."""
    _, tok = tiny_lm
    prompt = tok("12+34=").input_ids
    assert len(prompt) > 4
    pool = RecordingPool(tok)
    with pytest.warns(UserWarning):
        out = episode_driver("trajectories", guess_runner(tok, Budget(2, 4, 64, 4, max_context=8)), pool, 0)(
            [prompt], [Sample("12+34=", "3")], 2, Sampling(max_new_tokens=4, seed=100))
    assert pool.sent == [] and out.finish_reasons == ["error"] * 2


def test_a_dead_server_stops_the_batch_and_a_failed_request_ends_only_its_trajectories(tiny_lm):
    """ServerGone (the engine exited: no later turn can be answered) fails the batch; a plain request
    failure ends only that request's trajectories as "error", with a warning, unless every trajectory
    failed so: then the batch fails (nothing to train on)."""
    from grpo.endpoints import ServerGone

    _, tok = tiny_lm
    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids]
    assert prompts[0][1] != prompts[1][1]
    samples, sampling = [Sample("12+34=", "3"), Sample("7+1=", "3")], Sampling(max_new_tokens=4, seed=100)
    with pytest.raises(ServerGone, match="fake0's engine exited"):
        episode_driver("trajectories", guess_runner(tok), VersionedPool(tok, [(0, 0)], gone=[prompts[0][1]]), 0)(
            prompts, samples, 2, sampling)
    with pytest.warns(UserWarning, match="2 of 4 trajectories ended as 'error'"):
        out = episode_driver("trajectories", guess_runner(tok), VersionedPool(tok, [(0, 0)], fails=[prompts[0][1]]), 0)(
            prompts, samples, 2, sampling)
    assert out.finish_reasons == ["error", "error", "turns", "turns"]
    with pytest.raises(ServerError, match=r"every trajectory of the episode batch \(2\) failed on its server's request; "
                                          r"the first: fake0 answered 500"):
        episode_driver("trajectories", guess_runner(tok), VersionedPool(tok, [(0, 0)], fails=[prompts[1][1]]), 0)(
            prompts[1:], samples[1:], 2, sampling)


@pytest.mark.parametrize("overrides", [
    ("rollout=hf", "rollout.schedule=turns"),
    ("rollout=remote", "rollout.remote.urls=[http://x:1]", "rollout.schedule=trajectories"),
    ("rollout=remote", "rollout.remote.urls=[http://x:1]", "rollout.schedule=turns"),
])
def test_a_schedule_with_env_none_is_refused_as_inert(overrides):
    """rollout.schedule is read only by the multi-turn episode drivers: with env=none it changed nothing,
    without a word, while env.max_turns and the other env.* settings are refused there by name."""
    with pytest.raises(ConfigError, match=r"rollout.schedule=\w+ with env=none: .* has no effect"):
        validate(compose_cfg(*overrides))
    validate(compose_cfg(*overrides[:-1]))  # auto: accepted
    validate(compose_cfg("experiment=guess_tiny", *overrides))  # with an environment: read
