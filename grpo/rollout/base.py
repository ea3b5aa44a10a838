"""The one interface every rollout backend implements.

The trainer hands the whole batch over at once: P prompts, n completions each, so the engine's
batching sees all P x n sequences together. What comes back is grouped by prompt: completion k of
prompt p sits at index p * n + k.
"""

from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import MISSING, dataclass, fields, replace

from grpo import dist
from grpo.errors import ConfigError
from grpo.moe import routing
from grpo.rollout_config import OWN_GROUPS, VLLM_READERS, VLLMConfig
from grpo.weights import WeightBuckets


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # engines with their own sampler RNG seed it from this (resumable runs)


def sampling_fields(s: Sampling) -> dict:
    """vLLM's sampling fields (SamplingParams and the /v1/completions body alike), every one that
    reshapes the distribution set: temperature, top-p and top-k as the trainer's logprobs assume, the
    penalties and min-p neutral. A field left unset would be filled from the model folder's
    generation_config.json by a server started without `--generation-config vllm`."""
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def schema_default(f):
    """A config dataclass field's default (a list field's from its factory: [])."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


@dataclass
class Rollouts:
    completion_ids: list[list[int]]  # B lists of generated token ids (eos included when it stopped)
    logprobs: list[list[float]]  # the sampler's logprob of each generated token
    finish_reasons: list[str]  # "stop" (eos) or "length" (hit max_new_tokens)
    weight_version: int  # the version of the weights that produced every completion
    # seconds the engines sat without a request between the previous batch and this one (waiting for
    # the trainer's weights, or for the staleness bound to let the next batch in); 0 in-process
    engine_wait_s: float = 0.0
    # seconds the batch waited on its pool's generator thread behind the batches handed over before it
    # (`queued`): the engines' seconds over it start after them (time/batch_generate_s)
    queued_s: float = 0.0
    # multi-turn episodes (grpo/rollout/episodes.py): completion_ids is the span after the prompt
    # (turn 1, observation 1, turn 2, ...); 1 on sampled tokens, 0 on observation tokens (logprob 0.0)
    loss_masks: list[list[int]] | None = None
    episodes: list | None = None  # one grpo.rollout.episodes.Episode per completion
    # per span token, the 0-based turn that sampled it (-1 on observation tokens); with episodes only
    token_turns: list[list[int]] | None = None
    # per span token, the weight version that sampled it (-1 on observation tokens); with episodes only.
    # One version per batch, except with partial rollouts (grpo/rollout/trajectories.py), where an
    # episode's later turns may come from newer weights and `weight_version` is the oldest
    token_versions: list[list[int]] | None = None
    # rollout.routing_replay: per completion, the experts each MoE layer routed each token to, as the
    # sampler ran them: a [P + C - 1, layers, top_k] LongTensor over prompt then completion (the last
    # token sampled is never forwarded; grpo/moe/routing.py)
    routed_experts: list | None = None
    # finish_reasons of an episode: stop (the environment ended it), length, turns (the cap), error

    def slice(self, start: int, end: int) -> "Rollouts":
        """Completions start..end (a rank's or a server's share), every per-completion field alike."""
        return type(self)(**{f.name: v[start:end] if isinstance(v := getattr(self, f.name), list) else v
                             for f in fields(self)})

    # What the loop reads, the same for every kind of rollout (multi-turn episodes answer their own way:
    # grpo.rollout.episodes.EpisodeRollouts).

    def texts(self, tokenizer) -> list[str]:
        """What the reward functions read, per completion: here the completion decoded."""
        return tokenizer.batch_decode(self.completion_ids, skip_special_tokens=True)

    def reward_info(self) -> dict:
        """What the reward functions get besides the text (grpo/rewards/__init__.py `score`)."""
        return {"completion_ids": self.completion_ids}

    def turns(self) -> list[int]:
        """Model turns per completion."""
        return [1] * len(self.completion_ids)

    def sampled_lengths(self) -> list[int]:
        """Tokens the sampler drew per completion (observation tokens, masked out of the loss, aside)."""
        if self.loss_masks is None:
            return [len(c) for c in self.completion_ids]
        return [sum(m) for m in self.loss_masks]

    def cut(self) -> list[bool]:
        """Per completion, whether it was cut at max_new_tokens ("length"): what `algo.mask_truncated` drops
        and `truncated_frac` counts. An episode ended because a whole next turn no longer fit
        (`out_of_budget`) is "length" too, but none of its turns was cut."""
        episodes = self.episodes
        return [reason == "length" and not (episodes is not None and episodes[i].out_of_budget)
                for i, reason in enumerate(self.finish_reasons)]

    def metrics(self) -> dict[str, float]:
        """This kind of rollout's own statistics for the step's log (none here)."""
        return {}


def finished_at(handle):
    """What `RolloutBackend.submit` returned, as something whose `.result()` gives (the Rollouts, the
    time.perf_counter() the engines were done with them): the time they finished, not when the trainer
    came to wait (with algo.max_staleness a batch is done steps earlier). A Future's time is taken in its
    done-callback before the result is handed on, so a waiter always finds it. Another handle (dedicated's
    `NodeShare`, whose `.result()` is a collective and so stays in the caller's thread) gives its own
    `done_at` after its result, else the moment the result came. perf_counter is the system's monotonic
    clock on Linux: one clock for the processes of a node."""
    if not isinstance(handle, Future):
        return _Finished(handle)
    out: Future = Future()

    def done(f: Future) -> None:
        t = time.perf_counter()
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result((f.result(), t))

    handle.add_done_callback(done)
    return out


def queued(executor, fn, *args) -> Future:
    """`fn(*args)` (its Rollouts) on `executor`'s thread, after the batches handed to it before: with
    algo.max_staleness the first step hands k + 1 over at once, and each waits for the ones before;
    the Rollouts' `queued_s` is that wait."""
    handed = time.perf_counter()

    def run() -> Rollouts:
        started = time.perf_counter()
        return replace(fn(*args), queued_s=started - handed)

    return executor.submit(run)


@dataclass
class _Finished:
    handle: object  # anything with .result()

    def result(self) -> tuple:
        rollouts = self.handle.result()
        return rollouts, getattr(self.handle, "done_at", None) or time.perf_counter()


class RolloutBackend(ABC):
    """submit (the loop's one request) / generate / update_weights / sleep / wake / close. Nothing
    outside grpo/rollout/ asks which backend it has, nor whether its rollouts are episodes."""

    weight_version: int = 0
    max_context: int | None = None  # the engine's limit on prompt + completion tokens (None: none known)
    generate_is_collective: bool = False  # every rank must call `generate` equally often (multi-turn lockstep)
    returns_routes: bool = False  # gives each completion's routed experts (rollout.routing_replay)
    # the engines run in other processes, so a batch can generate while the trainer updates
    # (algo.max_staleness >= 1); in-process backends would only take turns with the trainer
    overlaps_training: bool = False
    # multi-turn episodes can be scheduled per trajectory (rollout.schedule; grpo/rollout/trajectories.py)
    schedules_trajectories: bool = False
    # the run's environment: a grpo.rollout.episodes.EpisodeRunner (env=...; `build_rollout` sets it), else None
    episodes = None
    # the rollout.vllm.* fields this backend reads (`check_unread`)
    reads_vllm: frozenset = frozenset()

    @classmethod
    def check_unread(cls, cfg) -> None:
        """A rollout.vllm.* setting this backend never reads, set to other than its default, is refused:
        it would change nothing, without a word (rollout.vllm.max_model_len=4096 under rollout=hf). So is a
        rollout.remote.* or rollout.dedicated.* setting under another backend than its own (OWN_GROUPS)."""
        for f in fields(VLLMConfig):
            value = cfg.vllm.get(f.name)
            if f.name not in cls.reads_vllm and f.default is not MISSING and value != f.default:
                readers = [name for name, reads in VLLM_READERS.items() if f.name in reads]
                raise ConfigError(f"rollout.vllm.{f.name}={value!r} has no effect under rollout={cfg.backend} (it is read "
                                  f"by rollout={' and '.join(readers) or 'none'}): remove it, or pick a backend that reads it.")
        for group, schema in OWN_GROUPS.items():
            if group == cfg.backend:
                continue
            for f in fields(schema):
                value = cfg[group].get(f.name)
                if value != schema_default(f):
                    raise ConfigError(f"rollout.{group}.{f.name}={value!r} has no effect under rollout={cfg.backend} (it "
                                      f"is read by rollout={group} only): remove it, or use rollout={group}.")

    @classmethod
    def check(cls, cfg, world: int) -> None:
        """Raise ConfigError for settings of this backend that cannot work with `world` processes
        (called by grpo.config.validate before anything is built; no hardware is asked here)."""

    @classmethod
    def check_hardware(cls, cfg, cuda: bool) -> None:
        """Raise ConfigError for settings the run's hardware would leave unread (`cuda`: whether the run
        will have GPUs, as validate is told; grpo.launch checks a GPU job on a login node without any)."""

    @classmethod
    def check_memory(cls, cfg, model_config: dict, cuda: bool) -> None:
        """Raise ConfigError for a rollout.vllm.memory_fraction this backend's engines would not read: on CPU
        with an explicit KV-cache size (engine_memory.check_memory_fraction; `model_config`: the engine's
        config.json as validate knows it, `cuda`: whether the run has GPUs). Backends that start engines
        with rollout.vllm.* check it."""

    @classmethod
    def check_context(cls, cfg, model_config: dict) -> None:
        """Raise ConfigError where the model's context (its config.json, `model_config`; {} if unknown)
        cannot hold what this backend's engines are asked to (called by validate). Backends that start
        vLLM engines with rollout.vllm.max_model_len check it (engine_memory.engine_context)."""

    @classmethod
    def check_routing(cls, cfg, env: str) -> None:
        """rollout.routing_replay (or routing_observe) needs a backend that returns the routed experts, and
        single-turn rollouts (an episode's observation tokens are not sampled, so no sampler routed them)."""
        if not routing.wants_routes(cfg):
            return
        name = routing.setting(cfg)
        off = name.replace("true", "false")
        if not cls.returns_routes:
            raise ConfigError(f"{name} with rollout={cfg.backend}: this backend does not return the "
                              f"experts it routed each token to yet; use rollout=hf, or {off}.")
        if env != "none":
            raise ConfigError(f"{name} with env={env}: routing replay covers single-turn rollouts "
                              f"only; set env=none or {off}.")

    @classmethod
    def check_staleness(cls, cfg, max_staleness: int) -> None:
        """Say what `algo.max_staleness` >= 1 does here. Engines in other processes overlap the two
        phases. In-process backends cannot: they still hand out batches k versions stale (each is
        generated when it is submitted, before the update, with the weights engines elsewhere would
        have used), so the off-policy learning is the same, but generation takes turns with the update:
        no speed-up. A warning says so; use it to study staleness cheaply, not to go faster."""
        if max_staleness > 0 and not cls.overlaps_training:
            warnings.warn(
                f"algo.max_staleness={max_staleness} with rollout={cfg.backend}: batches are up to {max_staleness} "
                f"version(s) stale, as with engines in other processes, but rollout={cfg.backend} generates in the "
                f"trainer's own process and device, so generation takes turns with the update (no speed-up). For "
                f"the overlap use rollout=dedicated or rollout=remote; for the synchronous loop, algo.max_staleness=0.",
                stacklevel=2,
            )

    @classmethod
    def check_schedule(cls, cfg, algo, env: str) -> None:
        """rollout.schedule and algo.partial_rollouts (`env`: env.name; called by validate): per-trajectory
        turns need a backend whose generate is no collective (`schedules_trajectories`), partial rollouts
        need them, an environment and staleness."""
        if cfg.schedule == "trajectories" and not cls.schedules_trajectories:
            raise ConfigError(f"rollout.schedule=trajectories with rollout={cfg.backend}: its generate is one call for the "
                              f"whole batch (a collective under ZeRO-3 or tensor parallelism), so turns stay synchronous; "
                              f"use rollout=dedicated or rollout=remote, or rollout.schedule=turns (or auto).")
        if env == "none" and cfg.schedule != "auto":  # read only by the episode drivers (trajectories.episode_driver)
            raise ConfigError(f"rollout.schedule={cfg.schedule} with env=none: it schedules the turns of multi-turn "
                              f"episodes, and single completions have none, so the setting has no effect. Pick an "
                              f"environment (env=guess, or env.name=<module.Class>), or remove the setting.")
        if not algo.partial_rollouts:
            return
        if env == "none":
            raise ConfigError("algo.partial_rollouts=true with env=none: weights change between the turns of an episode, and "
                              "a single-turn task has one turn; pick an environment (env=guess, ...) or set "
                              "algo.partial_rollouts=false.")
        if not cls.schedules_trajectories or cfg.schedule == "turns":
            raise ConfigError(f"algo.partial_rollouts=true needs episodes scheduled per trajectory on servers: "
                              f"rollout=dedicated or rollout=remote with rollout.schedule=auto or trajectories (now "
                              f"rollout={cfg.backend}, rollout.schedule={cfg.schedule}).")
        if algo.max_staleness < 1:
            raise ConfigError("algo.partial_rollouts=true with algo.max_staleness=0: weights only change between batches "
                              "when the trainer waits for each batch; set algo.max_staleness=1 (or more) for pushes "
                              "during a batch.")

    @classmethod
    def check_lora(cls, cfg, lora, world: int) -> None:
        """Raise ConfigError if this backend cannot generate with a LoRA adapter (`model.lora`, rank > 0);
        called by grpo.config.validate only when LoRA is on."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Rollouts:
        """n completions for each prompt, all handed to the engine in one call."""

    def submit(self, prompt_ids: list[list[int]], samples: list, n: int, sampling: Sampling) -> Future:
        """The loop's one request: n rollouts of each prompt (`samples`: the prompts' task rows, which an
        environment starts from). `.result()` gives Rollouts that answer `texts`, `reward_info`, `turns`
        and `metrics` for what they are: single completions, or with an environment (`episodes`) whole
        episodes, each turn through this backend's `generate`."""
        if self.episodes is None:
            return self.submit_completions(prompt_ids, n, sampling)
        return self.submit_episodes(prompt_ids, samples, n, sampling, self.episodes)

    def submit_completions(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Future:
        """Start `generate` and return at once; `.result()` gives the Rollouts. Every rank calls it
        in the same order (it may gather prompts across ranks), and `.result()` likewise. In-process
        backends generate here, before returning; backends with engines elsewhere keep generating
        while the trainer updates, and `update_weights` waits for every batch submitted before it."""
        done: Future = Future()
        done.set_result(self.generate(prompt_ids, n, sampling))
        return done

    def submit_episodes(self, prompt_ids: list[list[int]], samples: list, n: int, sampling: Sampling, runner) -> Future:
        """Multi-turn episodes (`runner`: grpo.rollout.episodes.EpisodeRunner) through this backend's own
        `generate`, once per turn; returns like `submit`. In-process backends run them here, in the
        caller's thread (where a collective `generate` needs every rank); backends with engines elsewhere
        run them on their generator thread, so an episode batch is one unit there and weights change only
        between batches."""
        lockstep = (lambda active: dist.all_reduce_max([active])[0] > 0) if self.generate_is_collective else None
        done: Future = Future()
        done.set_result(runner.run(self.generate, prompt_ids, samples, n, sampling, lockstep, version=self.weight_version))
        return done

    def sampled_budget(self, max_new_tokens: int) -> int:
        """The most tokens the sampler draws for one completion (Dr. GRPO's constant): `max_new_tokens`
        (rollout.max_new_tokens), or with an environment every turn's."""
        return max_new_tokens * (self.episodes.budget.max_turns if self.episodes is not None else 1)

    @abstractmethod
    def update_weights(self, buckets: WeightBuckets, version: int) -> None:
        """Load new policy weights, streamed bucket by bucket; `buckets` is lazy, so a backend
        that shares the trainer's module never pays for gathering it."""

    def engine_busy_s(self) -> float | None:
        """Seconds so far, summed over this process's servers, that a server had one of its generation
        requests in flight (grpo/endpoints.py Occupancy); None where generation is in this process."""
        return None

    def sleep(self) -> None:
        """Free the engine's memory during the training phase, where that means something."""

    def wake(self) -> None:
        """Undo sleep before the next generation."""

    def close(self) -> None:
        """Release engines, servers and processes."""
