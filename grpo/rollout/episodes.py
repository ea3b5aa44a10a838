"""Multi-turn episodes on any backend: one driver that calls the backend's own generation once per turn.

    turn 1:  generate(prompts, n)                    P x n trajectories, the prompt shared per group
    env:     each finished turn's text -> env.step -> observation tokens (loss mask 0)
    turn t:  generate(prompt + span so far, n=1)     over the trajectories still active

The trainer gets, per trajectory, the span after the prompt (turn 1, observation 1, turn 2, ...) as
`completion_ids`, with a loss mask (1 on sampled tokens, 0 on observations) and the sampler's
logprobs (0.0 on observations). Sampled ids are never decoded and encoded again: the text each
environment reads is decoded from them, but the sequence keeps the ids themselves.

Budgets, checked before every request: `max_turns`; each turn `rollout.max_new_tokens`; the span
(`env.max_total_tokens`, sampled + observation tokens), and prompt + span + a whole next turn within
the engine's context (`max_context`). A trajectory with no room for a whole next turn ends as
"length" (`out_of_budget`: not cut, so `algo.mask_truncated` keeps it); the observation it last got
stays at the end of its span, masked, so a span may pass `max_total_tokens` by up to
`env.max_observation_tokens`. A turn cut off by `max_new_tokens` ends the episode as
"length" and never reaches the environment. Observations longer than `env.max_observation_tokens`
are cut in the middle.

Finish reasons: stop (the environment said done), length (a budget), turns (the turn cap),
error (the environment raised or hung past `env.step_timeout_s`: reward None, a warning names it).
An environment that raises ConfigError (a setup mistake, not the episode's fault) stops the run.

Each trajectory has its own environment, so their calls are independent: the batch's resets, each
turn's steps and the closes run concurrently across trajectories, up to `env.max_concurrency` at once
(`EnvCalls`; 1: one after another in the driver's thread, as before), each reset and step under its
own `env.step_timeout_s`, and the results are applied in the trajectories' order, so spans, masks,
finish reasons, warnings and the lockstep's decisions are the serial driver's.

Turns are synchronous over the batch, so the episode batch is one unit of engine work with one
weight version. Where generation is a collective (`lockstep`: ZeRO-3's synced generate, tensor-
parallel colocated engines), every rank calls it as often as the rank with the longest episodes,
an idle rank with one throwaway request of the same sampling settings.
"""

from __future__ import annotations

import math
import time
import warnings
from concurrent.futures import wait
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional

import numpy as np

from grpo.envs import env_factory
from grpo.envs.base import Step
from grpo.errors import ConfigError
from grpo.metrics import Count, Ratio
from grpo.rewards import as_number
from grpo.rollout.base import Rollouts, Sampling
from grpo.rollout.render import ChatRender, RawRender
from grpo.rollout.servers import DaemonWorker
from grpo.timeouts import call_with_timeout

FINISH = ("stop", "length", "turns", "error")


@dataclass
class Budget:
    max_turns: int
    max_new_tokens: int  # per turn
    max_total_tokens: int  # the span after the prompt: sampled and observation tokens
    max_observation_tokens: int
    max_context: Optional[int] = None  # the engine's limit on prompt + span + next turn (None: no limit)


@dataclass
class Episode:
    """One trajectory, as rewards and metrics see it."""

    final_text: str = ""  # the last turn's text: what reward functions score
    transcript: str = ""  # every turn and observation, as text
    turns: int = 0
    finish: str = "length"
    env_reward: Optional[float] = None  # sum of the rewards the environment gave (None: none)
    # per turn, the reward its step gave (None: none, or the turn never reached the environment);
    # algo.turn_rewards credits each turn with its own (grpo/batch.py `turn_token_advantages`)
    step_rewards: list = field(default_factory=list)
    sampled_tokens: int = 0
    observation_tokens: int = 0
    observations_cut: int = 0  # observations cut to env.max_observation_tokens (their middle dropped)
    env_s: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    error: Optional[str] = None
    last_turn_ids: list = field(default_factory=list)
    out_of_budget: bool = False  # ended ("length") because a whole next turn no longer fit the span or context


def turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    """The sampling seed of turn `turn` (1-based): turn 1 keeps the step's seed (so an episode that
    ends at turn 1 samples exactly what `generate` would); later turns mix the turn into the low 32
    bits, which number the step's sequences (grpo.train.sampling_seed), keeping the run seed's bits."""
    if seed is None or turn == 1:
        return seed
    high, low = seed >> 32 << 32, seed & 0xFFFFFFFF
    return high | ((low + turn * 0x9E3779B9) & 0xFFFFFFFF)


def reset_seed(seed: Optional[int], group: int) -> int:
    """The seed an environment's `reset` gets, in [0, 2**31): the step's sampling seed (a new one every
    step and rank, the same again when a resumed run redoes the step; grpo.train.sampling_seed, which is
    2**32 or more for any run seed >= 1) plus the group's index (the prompt's), mixed (splitmix64) and
    folded into 31 bits, which every seeding API takes (numpy's legacy seeding refuses 2**32 and more).

    The group's, not the trajectory's: the n trajectories of a prompt reset with one seed, so an
    environment that draws its instance from the seed (an OpenEnv server picking a puzzle, with no
    `reset_fields`) plays one task instance per group, as GRPO's baseline needs (the group mean must
    compare attempts at the same task, not mix in how hard each member's instance was). One that wants
    per-trajectory randomness inside an episode draws it from its own RNG, seeded by this and its own state."""
    x = ((seed or 0) + group * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) % 2**31


def cut_middle(ids: list[int], limit: int, marker: list[int]) -> list[int]:
    """At most `limit` ids: the head and the tail kept, `marker` between them."""
    if len(ids) <= limit:
        return ids
    keep = max(0, limit - len(marker))
    head = keep - keep // 2
    return (ids[:head] + marker + ids[len(ids) - keep // 2:])[:limit] if keep else ids[:limit]


class Trajectory:
    def __init__(self, prompt_ids: list[int], sample, env, index: int, group: int = 0):
        self.prompt_ids, self.sample, self.env, self.index = prompt_ids, sample, env, index
        self.group = group  # the prompt's index, shared by its n trajectories: what seeds the reset (`reset_seed`)
        self.span: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[int] = []  # per span token: the 0-based turn that sampled it, -1 on observations
        self.version = 0  # the weight version sampling the turn being added
        self.versions: list[int] = []  # per span token: the weight version that sampled it, -1 on observations
        self.episode = Episode()
        self.rewards: list[float] = []
        self.active = True
        self.texts: list[str] = []

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.span += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.turns += [self.episode.turns if logprobs is not None else -1] * len(ids)
        self.versions += [self.version if logprobs is not None else -1] * len(ids)

    def end(self, finish: str) -> None:
        self.active = False
        self.episode.finish = finish


class EnvCalls:
    """One call per trajectory into the batch's environments, the results in the trajectories' order:
    up to `max_concurrency` calls at once on a pool of threads that lives as long as one
    `EpisodeRunner.run` (every turn reuses it), or one after another in the caller's thread where at
    most one would run at once. A call under `env.step_timeout_s` (reset, step) runs the
    environment's code on a daemon thread of its own (`call_with_timeout`), not on the pool's worker:
    its timeout counts from its start, not from its submission, and a hung call is abandoned without
    holding a worker. The workers are daemon threads (`DaemonWorker`): a stopped run's exit never
    waits for an environment call in flight, as it would for a ThreadPoolExecutor's."""

    def __init__(self, max_concurrency: int, calls: int):
        workers = min(max_concurrency, calls)
        self.pool = DaemonWorker("grpo-env", workers) if workers > 1 else None

    def __enter__(self) -> "EnvCalls":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)  # `map` has returned: every call has returned or been abandoned by its timeout

    def map(self, fn: Callable, items: list) -> Iterable:
        """fn(item) for each item, in the items' order. Serially a generator: each call runs as its
        result is taken, so the caller applies one before the next call starts, as the loop did before
        the pool. On the pool, an exception (a ConfigError) is raised as the serial loop would raise
        it: the first in the items' order, once the calls already running have returned (no environment
        is closed while one of its calls runs), the ones not yet started cancelled."""
        if self.pool is None:
            return (fn(item) for item in items)
        futures = [self.pool.submit(fn, item) for item in items]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)
            raise


class EpisodeRollouts(Rollouts):
    """Rollouts of multi-turn episodes: the reward functions read each episode's final turn, and get its
    transcript, turns, finish reason and the environment's reward besides."""

    def texts(self, tokenizer=None) -> list[str]:
        return [e.final_text for e in self.episodes]

    def reward_info(self) -> dict:
        eps = self.episodes
        return {"completion_ids": [e.last_turn_ids for e in eps], "transcripts": [e.transcript for e in eps],
                "turns": [e.turns for e in eps], "finish_reasons": list(self.finish_reasons),
                "env_rewards": [e.env_reward for e in eps]}

    def turns(self) -> list[int]:
        return [e.turns for e in self.episodes]

    def metrics(self) -> dict[str, float]:
        eps = self.episodes
        n = max(len(eps), 1)
        calls = sum(e.tool_calls for e in eps)
        metrics = {
            "episode/turns_mean": sum(e.turns for e in eps) / n,
            "episode/turns_max": max((e.turns for e in eps), default=0),
            "episode/sampled_tokens": sum(e.sampled_tokens for e in eps) / n,
            "episode/observation_tokens": sum(e.observation_tokens for e in eps) / n,
            "episode/env_s": Count(sum(e.env_s for e in eps)),  # totals: summed over ranks too (grpo/metrics.py)
            "episode/errors": Count(sum(e.finish == "error" for e in eps)),
            "episode/out_of_budget": sum(e.out_of_budget for e in eps) / n,  # of finish_length: no room for a turn
            "episode/observations_cut": Count(sum(e.observations_cut for e in eps)),
            "episode/tool_calls": calls / n,
            "episode/tool_failure_rate": Ratio(sum(e.tool_errors for e in eps), calls),  # NaN: no call anywhere
        }
        metrics.update({f"episode/finish_{r}": sum(e.finish == r for e in eps) / n for r in FINISH})
        if self.token_versions is not None:  # partial rollouts: the weight versions within a trajectory
            spans = [sorted({v for v in vs if v >= 0}) for vs in self.token_versions]
            newest = max((s[-1] for s in spans if s), default=0)
            sampled = [v for vs in self.token_versions for v in vs if v >= 0]
            metrics["episode/versions_max"] = max((len(s) for s in spans), default=0)
            metrics["episode/mixed_versions"] = sum(len(s) > 1 for s in spans) / n  # of trajectories
            metrics["episode/tokens_behind"] = Ratio(sum(v < newest for v in sampled), len(sampled))
        return metrics


class EpisodeRunner:
    """Builds one environment per trajectory (`make_env`), renders observations (`render`: grpo/rollout/
    render.py) and drives a batch of episodes through a backend's `generate`, calling up to
    `max_concurrency` environments at once (`EnvCalls`)."""

    def __init__(self, make_env: Callable, tokenizer, render, budget: Budget, step_timeout_s: float, stop_ids: list[int],
                 env_name: str = "env", max_concurrency: int = 32):
        self.make_env, self.tokenizer, self.render, self.budget = make_env, tokenizer, render, budget
        self.step_timeout_s, self.stop_ids, self.env_name = step_timeout_s, set(stop_ids), env_name
        self.max_concurrency = max_concurrency

    def run(self, generate: Callable, prompt_ids: list[list[int]], samples: list, n: int, sampling: Sampling,
            lockstep: Optional[Callable[[int], bool]] = None, version: int = 0) -> Rollouts:
        """`generate(prompt_ids, n, sampling) -> Rollouts` is the backend's; `lockstep(active)`, where
        generation is a collective, says whether any rank still has an active trajectory. `version`: the
        weight version the backend holds, which a batch without a single turn (every reset failed)
        reports; a turn's own version wins (as the trajectory driver's `self.version`)."""
        return self.drive(prompt_ids, samples, n, sampling, lambda calls, trajectories, sampling: self.episodes(
            calls, trajectories, generate, prompt_ids, n, sampling, lockstep, version))

    def drive(self, prompt_ids: list[list[int]], samples: list, n: int, sampling: Sampling, episodes: Callable) -> Rollouts:
        """The batch's trajectories (completion k of prompt i is trajectory i * n + k, of group i), each with
        its own environment, through `episodes(calls, trajectories, sampling)` (turn by turn here, per trajectory in
        grpo/rollout/trajectories.py); every environment built is closed after it, on an error too."""
        sampling = replace(sampling, max_new_tokens=self.budget.max_new_tokens)
        trajectories = [Trajectory(p, s, None, i * n + k, i) for i, (p, s) in enumerate(zip(prompt_ids, samples)) for k in range(n)]
        with EnvCalls(self.max_concurrency, len(trajectories)) as calls:
            try:
                for t in trajectories:
                    t.env = self.make_env()
                return episodes(calls, trajectories, sampling)
            finally:
                built = [t for t in trajectories if t.env is not None]
                for error in calls.map(self.env_close, built):
                    if error:  # a close that fails loses nothing of the episode
                        warnings.warn(f"{self.env_name}.close() raised {error}", stacklevel=2)

    def episodes(self, calls: EnvCalls, trajectories: list[Trajectory], generate: Callable, prompt_ids: list[list[int]],
                 n: int, sampling: Sampling, lockstep: Optional[Callable[[int], bool]], held: int) -> Rollouts:
        """`run`'s turns, with every trajectory's environment built; `held`: `run`'s version."""
        first = []
        for t, (text, error) in zip(trajectories, calls.map(lambda t: self.env_reset(t, sampling.seed), trajectories)):
            if error:
                self.fail(t, error, "reset")
            elif text:
                self.open(t, text)
            first.append(bool(text))
        shared = not any(first)  # no opening observation: turn 1 is generate(prompts, n), as without an environment
        turn, wait_s, version = 0, 0.0, None
        while True:
            turn += 1
            active = [t for t in trajectories if t.active and self.room(t)]
            if lockstep is not None:
                if not lockstep(len(active)):
                    break
            elif not active:
                break
            seeded = replace(sampling, seed=turn_seed(sampling.seed, turn))
            whole = turn == 1 and shared and len(active) == len(trajectories)
            if turn == 1 and lockstep is not None:  # the request shape is collective too: one rank's failed
                # reset, opening observation or long prompt sends every rank to per-trajectory requests
                whole = not lockstep(int(not whole))
            if whole:
                out = generate(prompt_ids, n, seeded)
            elif active:  # a pool's StickyRoutes keeps each trajectory on its first server
                keys = {"keys": [t.index for t in active]} if getattr(generate, "takes_keys", False) else {}
                out = generate([t.prompt_ids + t.span for t in active], 1, seeded, **keys)
            else:  # a collective this rank must join with nothing to do: one throwaway request, with the
                # same sampling as the others' (tensor-parallel ranks run one engine schedule together); a
                # rank with no prompts (evaluation: fewer prompts than ranks) sends [], which hf joins with
                generate(prompt_ids[:1], 1, seeded)
                continue
            version = out.weight_version if version is None else version
            if out.weight_version != version:
                raise RuntimeError(f"turn {turn} came from weight version {out.weight_version}, turn 1 from {version}: "
                                   "weights changed inside an episode batch")
            wait_s += out.engine_wait_s
            for t in active:
                t.version = out.weight_version
            texts = [self.take_turn(t, ids, lps, reason)
                     for t, ids, lps, reason in zip(active, out.completion_ids, out.logprobs, out.finish_reasons)]
            stepped = [(t, text) for t, text in zip(active, texts) if text is not None]
            for (t, text), (step, error, seconds) in zip(stepped, calls.map(self.env_step, stepped)):
                self.take_step(t, step, error, seconds)
        return self.rollouts(trajectories, held if version is None else version, wait_s)

    def env_reset(self, t: Trajectory, seed: Optional[int]) -> tuple[Optional[str], Optional[str]]:
        """(the opening text, None) or (None, what went wrong): on an `EnvCalls` thread. The reset's seed is
        the group's: one task instance per group (`reset_seed`); the sampling seeds stay per trajectory."""
        text, error = call_with_timeout(lambda: t.env.reset(t.sample, reset_seed(seed, t.group)), self.step_timeout_s,
                                        "env.step_timeout_s", reraise=(ConfigError,), stop_if_hung=False)
        if error is None and not isinstance(text, (str, type(None))):
            return None, f"reset returned {describe(text)}; it must return the opening text, a str or None"
        return text, error

    def env_step(self, stepped: tuple[Trajectory, str]) -> tuple[Optional[Step], Optional[str], float]:
        """(the Step, None, seconds) or (None, what went wrong, seconds): on an `EnvCalls` thread."""
        t, text = stepped
        t0 = time.perf_counter()
        step, error = call_with_timeout(lambda: t.env.step(text), self.step_timeout_s, "env.step_timeout_s",
                                        reraise=(ConfigError,), stop_if_hung=False)
        if error is None:
            error = step_error(step)
        return (None if error else step), error, time.perf_counter() - t0

    @staticmethod
    def env_close(t: Trajectory) -> Optional[str]:
        """None, or what the close raised: on an `EnvCalls` thread, with no timeout (as before the pool:
        an environment bounds its own close, as OpenEnv's does)."""
        try:
            t.env.close()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            return f"{type(e).__name__}: {e}"
        return None

    def room(self, t: Trajectory) -> bool:
        """Whether a whole next turn fits the span budget and the engine's context; if not, the episode
        ends here ("length"). Before its first turn that is no episode of the policy's at all (the prompt
        and the opening observation fill the budget): it ends as "error", excluded from the rewards,
        where "length" had its empty answer scored beside its group's real ones."""
        b = self.budget
        if len(t.span) + b.max_new_tokens > b.max_total_tokens or (
                b.max_context is not None and len(t.prompt_ids) + len(t.span) + b.max_new_tokens > b.max_context):
            if t.episode.turns == 0:
                self.fail(t, f"the prompt ({len(t.prompt_ids)} tokens) and the opening observation ({len(t.span)}) "
                             f"leave no room for a turn of rollout.max_new_tokens={b.max_new_tokens} within "
                             f"env.max_total_tokens={b.max_total_tokens} and the engine's context {b.max_context}",
                          "budget")
                return False
            t.episode.out_of_budget = True
            t.end("length")
            return False
        return True

    def take_turn(self, t: Trajectory, ids: list[int], logprobs: list[float], reason: str) -> Optional[str]:
        """Adds a sampled turn; returns its text for the environment, or None where the turn ends the
        episode (cut off mid-turn: never handed to the environment)."""
        ep = t.episode
        t.add(ids, logprobs)
        ep.turns += 1
        ep.step_rewards.append(None)
        ep.sampled_tokens += len(ids)
        ep.last_turn_ids = list(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        t.texts.append(text)
        ep.final_text = text
        ep.transcript += text
        if reason == "length":
            t.end("length")
            return None
        return text

    def take_step(self, t: Trajectory, step: Optional[Step], error: Optional[str], seconds: float) -> None:
        """Applies what the environment answered to the turn `take_turn` added."""
        ep = t.episode
        ep.env_s += seconds
        if error:
            self.fail(t, error, "step")
            return
        if step.reward is not None:
            t.rewards.append(as_number(step.reward))
            ep.env_reward = sum(t.rewards)
            ep.step_rewards[-1] = as_number(step.reward)
        ep.tool_calls += bool(step.info.get("tool_call"))
        ep.tool_errors += bool(step.info.get("tool_error"))
        if step.done:
            t.end("stop")
        elif ep.turns >= self.budget.max_turns:
            t.end("turns")
        else:
            ids = ep.last_turn_ids
            self.observe(t, step.observation or "", after_eos=bool(ids) and ids[-1] in self.stop_ids)

    def open(self, t: Trajectory, text: str) -> None:
        """The opening observation `reset` returned, before turn 1."""
        self.observe(t, text, ids=self.render.opening(text, self.env_name))

    def observe(self, t: Trajectory, text: str, after_eos: bool = False, ids: Optional[list[int]] = None) -> None:
        ids = self.render(text, after_eos) if ids is None else ids
        limit = self.budget.max_observation_tokens
        if len(ids) > limit:  # the text's middle goes; the template's tokens around it (chat) stay whole
            head, tail = self.render.fixed(after_eos)
            body = cut_middle(ids[head:len(ids) - tail], max(0, limit - head - tail), self.render.marker)
            ids = ids[:head] + body + ids[len(ids) - tail:]
            t.episode.observations_cut += 1
        t.add(ids, None)
        t.episode.observation_tokens += len(ids)
        t.episode.transcript += text

    def fail(self, t: Trajectory, error: str, where: str) -> None:
        t.episode.error = error
        t.episode.env_reward = None
        t.end("error")
        warnings.warn(f"environment {self.env_name!r} {where} failed on sample {str(t.sample.prompt)[:60]!r} "
                      f"(trajectory {t.index}): {error}; the episode ends as 'error', excluded from the rewards",
                      stacklevel=3)

    @staticmethod
    def rollouts(trajectories: list[Trajectory], version: int, wait: float) -> EpisodeRollouts:
        return EpisodeRollouts(
            [t.span for t in trajectories], [t.logprobs for t in trajectories], [t.episode.finish for t in trajectories],
            version, engine_wait_s=wait, loss_masks=[t.mask for t in trajectories],
            episodes=[t.episode for t in trajectories], token_turns=[t.turns for t in trajectories],
            token_versions=[t.versions for t in trajectories],
        )


def describe(value) -> str:
    return f"a {type(value).__name__} ({str(value)[:40]!r})"


def step_error(step) -> Optional[str]:
    """What is wrong with what an environment's step returned, None if nothing: an observation that is
    not text would otherwise fail deep in the tokenizer and end the run, not the episode."""
    if not isinstance(step, Step):
        return f"step returned {describe(step)}, not a Step(observation=str | None, reward, done, info)"
    if not isinstance(step.observation, (str, type(None))):
        return f"step returned Step.observation={describe(step.observation)}; it must be a str or None"
    if step.reward is not None and ((n := as_number(step.reward)) is None or not math.isfinite(n)):  # as a reward's
        return f"step returned Step.reward={describe(step.reward)}; it must be a finite number or None"
    if not isinstance(step.done, (bool, np.bool_)):  # "False" would end the episode
        return f"step returned Step.done={describe(step.done)}; it must be a bool (True: the episode ends here)"
    if not isinstance(step.info, dict):
        return f"step returned Step.info={describe(step.info)}; it must be a dict"
    return None


def episode_span(env, max_new_tokens: int) -> int:
    """The most tokens after the prompt: `env.max_total_tokens`, or by default every turn and observation."""
    return env.max_total_tokens or env.max_turns * (max_new_tokens + env.max_observation_tokens)


def build_episodes(e, max_new: int, task, tokenizer, max_context: int | None,
                   stop_ids: list[int] | None = None) -> Optional[EpisodeRunner]:
    """The episode runner of a run with an environment (`e`: the env config; `max_new`: each turn's
    rollout.max_new_tokens; `max_context`: the engine's; `stop_ids`: the ids a turn ends on, by default the
    tokenizer's EOS), None for env=none."""
    if e.name == "none":
        return None
    render = ChatRender(tokenizer, e.role) if e.render == "chat" else RawRender(tokenizer)
    head, tail = render.fixed(after_eos=True)
    if (head or tail) and e.max_observation_tokens < head + tail + len(render.marker) + 2:  # text either side of the cut
        raise ConfigError(f"env.max_observation_tokens={e.max_observation_tokens} leaves no room for an observation's text: "
                          f"env.render={e.render} wraps each in {head + tail} tokens of the chat template; raise it to "
                          f"at least {head + tail + len(render.marker) + 2}.")
    budget = Budget(e.max_turns, max_new, episode_span(e, max_new), e.max_observation_tokens, max_context)
    return EpisodeRunner(env_factory(e, task), tokenizer, render, budget, e.step_timeout_s,
                         stop_ids or [tokenizer.eos_token_id], e.name, e.max_concurrency)


