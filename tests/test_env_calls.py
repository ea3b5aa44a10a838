"""Environments called concurrently (grpo/rollout/episodes.py, `EnvCalls`, `env.max_concurrency`):
resets, steps and closes overlap across trajectories up to the bound, and the episodes are exactly
the serial driver's, faults included. The driver runs on `Scripted` (tests/test_episodes.py)."""

from __future__ import annotations

import threading
import time
import warnings

import pytest

from grpo.envs import GuessEnv, Step, TextEnv
from grpo.rollout.base import Sampling

from tests.test_episodes import GUESS, Scripted, binary_search_policy, prompts_of, runner


class InFlight:
    """How many calls of each kind (reset, step, close) run at once, and the most there ever were."""

    def __init__(self, sleep_s: float):
        self.sleep_s, self.lock = sleep_s, threading.Lock()
        self.now = {"reset": 0, "step": 0, "close": 0}
        self.peak = dict(self.now)

    def call(self, kind: str) -> None:
        with self.lock:
            self.now[kind] += 1
            self.peak[kind] = max(self.peak[kind], self.now[kind])
        time.sleep(self.sleep_s)
        with self.lock:
            self.now[kind] -= 1


class Slow(TextEnv):
    """Every call sleeps; the episode ends at its first step."""

    def __init__(self, probe: InFlight):
        self.probe = probe

    def reset(self, sample, seed):
        self.probe.call("reset")
        return None

    def step(self, action):
        self.probe.call("step")
        return Step(None, 1.0, True)

    def close(self):
        self.probe.call("close")


def pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("grpo-env")]


@pytest.mark.parametrize("concurrency, sleep_s, low, high", [(32, 0.1, 8, 32), (4, 0.02, 2, 4), (1, 0.005, 1, 1)])
def test_resets_steps_and_closes_overlap_up_to_max_concurrency(tiny_lm, concurrency, sleep_s, low, high):
    """32 trajectories (8 prompts x 4) whose reset, step and close each sleep: with max_concurrency=32
    at least 8 of each run at once (serially one turn of 0.1 s steps takes 3.2 s), never more than
    max_concurrency=4, exactly one at a time with 1; the pool is gone when `run` returns."""
    _, tok = tiny_lm
    probe = InFlight(sleep_s)
    out = runner(tok, make_env=lambda: Slow(probe), max_concurrency=concurrency).run(
        Scripted(tok, lambda p: "8"), prompts_of(tok, GUESS[:8]), GUESS[:8], 4, Sampling(3))
    assert [e.finish for e in out.episodes] == ["stop"] * 32 and all(e.env_reward == 1.0 for e in out.episodes)
    assert all(low <= probe.peak[kind] <= high for kind in probe.peak), probe.peak
    assert pool_threads() == []


class Faulty(GuessEnv):
    """The guess game, each step after a delay that differs by secret (calls finish out of order);
    secret 3 raises at its step, secret 2 hangs past the step timeout (until `release`, 10 s at most),
    secret 5 raises at reset."""

    release = threading.Event()

    def reset(self, sample, seed):
        if sample.answer == "5":
            raise RuntimeError("no session for 5")
        return super().reset(sample, seed)

    def step(self, action):
        time.sleep((self.secret * 7 % 5) * 0.01)
        if self.secret == 2:
            self.release.wait(10)
        if self.secret == 3:
            raise RuntimeError("tool crashed")
        return super().step(action)


def play(tok, concurrency: int):
    gen = Scripted(tok, binary_search_policy(tok))
    Faulty.release.clear()
    # A timeout far above the steps' 0.04 s: on a loaded machine a step's thread can wait a second for a
    # core, and a step that missed its timeout would be one more "error" in one run and not the other.
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = runner(tok, make_env=Faulty, timeout=3.0, max_concurrency=concurrency).run(
                gen, prompts_of(tok, GUESS), GUESS, 2, Sampling(3, seed=11))
    finally:
        Faulty.release.set()  # the hung steps, abandoned by now, end
    return out, gen.requests, [str(w.message) for w in caught]


def test_concurrent_episodes_equal_the_serial_ones_faults_included(tiny_lm):
    """30 guess episodes (15 secrets x 2) with max_concurrency=1 and 16: token ids, masks, logprobs,
    finish reasons, rewards, every request sent and the warnings (their order too) are equal; the
    episodes that raised at reset or step or hung are "error" in both."""
    _, tok = tiny_lm
    serial, serial_requests, serial_warnings = play(tok, 1)
    pooled, pooled_requests, pooled_warnings = play(tok, 16)
    finish = serial.finish_reasons
    assert [finish[2 * (s - 1)] for s in (2, 3, 5)] == ["error"] * 3 and finish.count("stop") == 24
    assert "3s" in serial.episodes[2].error and "tool crashed" in serial.episodes[4].error
    assert pooled.completion_ids == serial.completion_ids and pooled.loss_masks == serial.loss_masks
    assert pooled.logprobs == serial.logprobs and pooled.finish_reasons == finish
    assert pooled.reward_info() == serial.reward_info()  # env rewards, turns, transcripts, last turns
    assert [e.error for e in pooled.episodes] == [e.error for e in serial.episodes]
    assert pooled_requests == serial_requests and len(serial_requests) == 4
    assert pooled_warnings == serial_warnings and len(serial_warnings) == 6, serial_warnings
