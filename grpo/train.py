"""`python -m grpo.train`: the GRPO loop, readable top to bottom.

Variant implemented (DeepSeekMath GRPO, with the fixes later papers made optional):
  - P prompts per step, G completions each, sampled by the rollout backend with the current weights.
    Shape letters, as in grpo/algorithm.py: P prompts, G completions per prompt, B = P x G completions,
    T completion tokens, F reward functions.
  - Rewards: weighted sum of reward functions; a completion no function scores gets advantage 0.
  - Advantages: reward minus its group's mean, divided by the group's std (`algo.adv_scale=group`),
    the batch's std (`batch`, as in "A Closer Look at GRPO"; over all ranks) or nothing (`none`,
    Dr. GRPO); computed in float64, and a group of equal rewards gets exactly 0.
    Multi-turn episodes may instead credit each turn with its own discounted return (`algo.turn_rewards`:
    per_turn, normalised per turn index; process, DeepSeekMath's process supervision), one advantage
    per token (grpo/batch.py `step_advantages`).
  - Loss: PPO's clipped ratio per token with an optional higher upper clip (DAPO's clip-higher),
    plus beta * KL(policy || reference) by the k3 estimator; aggregated by `algo.loss_type`.
    Departure from the paper: beta defaults to 0 (no reference model), as DAPO and Dr. GRPO do.
  - `num_iterations` > 1 reuses a batch against old logprobs (the paper's mu); with 1 the ratio is
    exactly 1 and the loss reduces to the policy gradient.
  - Variants (grpo/algorithm.py, one config key each): RLOO's leave-one-out or REINFORCE++'s
    batch-normalised baseline (`algo.adv_estimator`), GSPO's sequence-level ratio and clip
    (`algo.ratio_level=sequence`), CISPO's clipped, detached importance weight (`algo.pg_loss=cispo`).
  - With `model.lora.rank` > 0 only a LoRA adapter trains (peft), and only it is synced.
  - Optional importance correction when the sampler's logprobs disagree with the trainer's
    (vLLM vs. transformers kernels), per token or per sequence: truncated (TIS), masked with the
    weight kept inside the band (MIS/IcePop), or rejected outside it without re-weighting.
  - Asynchronous rollouts (`algo.max_staleness` = k >= 1): at the start of step s the engines get
    every batch up to s + k, so engines in other processes generate while the trainer updates (hf
    and colocated generate each batch as it is handed over: as stale, not overlapped),
    and a batch is trained on weights at most k versions newer than the ones that sampled it. Its
    loss (`algorithm.decoupled_loss`, `algo.trust_region`): with an `algo.is_level`, decoupled PPO
    (Hilton et al. 2022, "Batch size-invariance for policy optimization"; used for asynchronous RL
    by AReaL, Fu et al. 2025): the clipped ratio is taken against the proximal policy, the trainer's
    weights before this update, and each token is weighted by proximal / behaviour (the sampler's
    logprobs), capped or masked by `algo.is_*`. By default, PPO clipped around the behaviour policy
    (ratio = trainer / sampler, band `algo.behaviour_clip_eps` = 0.1): with one optimizer step per
    batch the decoupled ratio is 1 and keeps no trust region, and 1 version stale it diverged on the
    default task. Weights reach the engines only between requests. A checkpoint
    records the sampler as of the batches trained, so batches in flight at a stop are drawn again
    (same prompts, same sampling seeds) after resume, from the resumed weights: a resumed run
    trains the same prompts but not bit-for-bit the same completions as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from grpo.algorithm import batches_to_submit, combine_rewards, staleness, token_staleness
from grpo.checkpoint import (check_layout, checkpoint_step, latest_checkpoint, load_checkpoint, load_reward_states,
                             check_writable, record_run_config, reward_states, save_checkpoint,
                             set_aside_checkpoints)
from grpo.cli import compose_first, exit_on_user_error
from grpo.config import check_sweep_folder, register_configs, validate
from grpo.cpus import configure_threads, machine_info
from grpo.dist import (DistInfo, all_reduce_max, all_reduce_sum, barrier, broadcast_object, dist_info, node_names,
                       process_group)
from grpo.dynamic_sampling import Scored, refill
from grpo.eval import evaluate
from grpo.errors import ConfigError, RewardStop
from grpo.export import export_hf, exported_step
from grpo.metrics import Count, Ratio, Spread, reduce_metrics
from grpo.flops import generation_work
from grpo.guards import RunGuards, healthy
from grpo.library_logs import quiet_library_logs
from grpo.listeners import log_listeners
from grpo.log import RunLogger, truncate_after, write_json
from grpo import lora, mfu
from grpo.models import DTYPES, build_policy, build_reference, encode_prompts, policy_device
from grpo.parallel import build_strategy, strategy_class
from grpo.parallel.base import resume_schedule
from grpo.preempt import StopSignal, restarts, stop
from grpo.provenance import git_revision
from grpo.run_lock import hold_run_folder
from grpo.rewards import MODEL_REWARDS, build_rewards, score
from grpo.rewards.failure_streak import FailureStreak
from grpo.rollout import build_rollout, finished_at, sampling_from
from grpo.rollout.push import nccl_peers
from grpo.tasks import TrainSampler, build_task
from grpo.tiny.folders import resolve_on_node
from grpo.batch import collate, step_advantages
from grpo.update import policy_update

register_configs()


STREAM_BITS = 32  # sequences a run can sample before streams repeat: 2**32 (seeds stay below 2**63)


def sampling_seed(seed: int, step: int, rank: int, world_size: int, prompts: int, n: int) -> int:
    """The engines' sampling seed of one step of one rank: the seed of its prompt 0, completion 0.
    The engines seed prompt i with this + i * n, and vLLM completion j of it with that + j, so
    (step, rank, prompt, completion) number every sampled sequence of the run in mixed radix:

        seed * 2**32 + ((step * world_size + rank) * prompts + i) * n + j

    Pairwise distinct while steps x ranks x prompts x n <= 2**32 (1,000 steps of 64 ranks x 1,024
    prompts x 16 is 1.05e9), below 2**63 (what vLLM's server accepts) for any seed < 2**31 (validate checks it), and
    the same again when a resumed run redoes the step."""
    return (seed << STREAM_BITS) + ((step * world_size + rank) * prompts * n) % (1 << STREAM_BITS)


def withhold_errored(rewards_FB: list[list], finish_reasons: list[str]) -> None:
    """An episode whose environment failed ("error") gets no reward from any function (None: advantage
    0, and `collate` keeps its tokens out of the loss), whatever its final text would score."""
    for i, reason in enumerate(finish_reasons):
        if reason == "error":
            for values in rewards_FB:
                values[i] = None


@dataclass
class InFlight:
    """A batch handed to the rollout engines, waiting to be trained on."""

    step: int  # the step that trains on it
    samples: list  # this rank's P prompts (with what the reward needs)
    prompt_ids: list[list[int]]
    sampler_state: dict  # the sampler before this batch was drawn: what a checkpoint before `step` saves
    rollouts: object  # .result(): (the Rollouts, the time.perf_counter() they were done): grpo.rollout.base.finished_at
    submitted_at: float  # time.perf_counter() when it was handed over


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def peak_memory_gb() -> float:
    """This process's peak in GiB (2**30 bytes): CUDA memory allocated by torch on a GPU (vLLM's own
    pool aside), else the resident set (an in-process engine's included)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_process_group(cfg: DictConfig, info: DistInfo):
    """The run's process group (grpo.dist.process_group) with its timeouts, and NCCL kept on loopback
    where the servers it pushes to over NCCL are on this node too."""
    return process_group(info, cfg.parallel.collective_timeout_s, cfg.parallel.peer_timeout_s,
                         nccl_peers(cfg.rollout, torch.cuda.is_available()))


def train(cfg: DictConfig, before_requeue: Callable[[], None] | None = None) -> dict:
    """One run. Every way out (the end, an error, a stop signal, a lost peer) leaves through one
    ExitStack, which closes the engines or servers, the logger and the process group. `before_requeue`:
    what rank 0 does before the run requeues itself on the time-limit warning (grpo/preempt.py `stop`)."""
    validate(cfg)
    info = dist_info()
    quiet_library_logs(info.rank)  # a library's repeating warning once per run; other ranks: grpo's warnings, errors
    threads = configure_threads(cfg.threads)
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(run_process_group(cfg, info))
        return run(cfg, info, threads, cleanup, before_requeue)


@dataclass
class Run:
    """One run's state, built once by `setup()` and read by every phase of the loop."""

    cfg: DictConfig
    info: DistInfo
    run_dir: str
    task: object
    tokenizer: object
    model_path: str
    reward_fns: list  # (name, fn, weight) per reward function: F of them
    strategy: object  # grpo.parallel: the model, its optimizer and how ranks share them
    rollout: object  # grpo.rollout: the engines that sample
    ref_model: object  # None unless algo.beta > 0
    sampler: TrainSampler
    sampling: object  # the engines' sampling settings, reseeded per step (`sampling_seed`)
    P: int  # prompts per step on this rank
    G: int  # completions per prompt
    start: int = 0  # the last step trained before this process began (> 0 on resume)
    eval_before: float | None = None
    checkpoint_path: str | None = None  # the checkpoint resumed from
    logger: RunLogger | None = None
    in_flight: deque = field(default_factory=deque)  # batches the engines work on, oldest first
    submitted: int = 0  # the last step whose batch was handed over
    engine_busy_s: float = 0.0  # the servers' busy seconds so far (RolloutBackend.engine_busy_s)
    # this rank's sampled tokens and its engines' seconds on their batches, every step of the run so far
    # (a resumed run's from its checkpoint): summary.json's gen_tokens_per_s
    gen_tokens: int = 0
    gen_seconds: float = 0.0
    guards: object = None  # grpo.guards.RunGuards: their counts go into each checkpoint
    guard_state: dict = field(default_factory=dict)  # the counts resumed from
    failure_streak: FailureStreak = field(init=False)  # stops a run whose rule reward fails throughout

    def __post_init__(self):
        self.failure_streak = FailureStreak([name for name, _, _ in self.reward_fns if name not in MODEL_REWARDS])

    @property
    def bucket_bytes(self) -> int:
        return int(self.cfg.parallel.sync_bucket_mb * 2**20)

    def push_weights(self, version: int) -> None:
        self.rollout.update_weights(self.strategy.weight_buckets(self.bucket_bytes), version=version)

    def submit(self, step: int, draw: int = 0) -> InFlight:
        """Draw the step's prompts (the same on every rank, each taking its share) and hand them over.
        `draw` k >= 1: the step's k-th extra batch (algo.dynamic_sampling), seeded as batch
        step x max_draws + k of the run, so no two batches share sampling seeds."""
        before = self.sampler.state_dict()
        rank, P = self.info.rank, self.P
        samples = self.sampler.next(P * self.info.world_size)[rank * P : (rank + 1) * P]
        prompt_ids = encode_prompts(self.tokenizer, samples, self.task.chat_template, self.task.system_prompt)
        batch = step * self.cfg.algo.max_draws + draw if self.cfg.algo.dynamic_sampling else step
        seeded = replace(self.sampling, seed=sampling_seed(self.cfg.seed, batch, rank, self.info.world_size, P, self.G))
        t0 = time.perf_counter()
        return InFlight(step, samples, prompt_ids, before, finished_at(self.rollout.submit(prompt_ids, samples, self.G, seeded)), t0)

    def score(self, batch: InFlight) -> Scored:
        """Wait for a batch's rollouts, then every reward function on every completion, weighted sum per
        completion."""
        t0 = time.perf_counter()
        rollouts, done_at = batch.rollouts.result()
        t_gen = time.perf_counter()
        completions = rollouts.texts(self.tokenizer)  # an episode's: its final turn
        stopped, (rewards_FB, reward_stats) = None, ([], {})
        try:
            rewards_FB, reward_stats = score(
                self.reward_fns, completions, [s for s in batch.samples for _ in range(self.G)], self.cfg.reward.timeout_s,
                counted=[reason != "error" for reason in rollouts.finish_reasons],
                max_new_tokens=self.cfg.rollout.max_new_tokens, **rollouts.reward_info(),
            )
        except RewardStop as e:  # a judge's min_scored, a refusing reward server: raised below, on every rank
            stopped = e
        withhold_errored(rewards_FB, rollouts.finish_reasons)
        rewards_B = None if stopped else combine_rewards(rewards_FB, [w for _, _, w in self.reward_fns])
        self.failure_streak.observe(reward_stats, stopped, rewards_B, rollouts.finish_reasons)  # every rank: stops at once
        rewards_PG = rewards_B.view(self.P, self.G)
        by_name = {name: values for (name, _, _), values in zip(self.reward_fns, rewards_FB)}
        return Scored(batch.samples, batch.prompt_ids, rollouts, completions, rewards_PG, by_name,
                      generate_s=t_gen - t0, wait_s=t_gen - t0, score_s=time.perf_counter() - t_gen,
                      batch_generate_s=done_at - batch.submitted_at - rollouts.queued_s,  # from when the engines began it
                      generated_tokens=sum(rollouts.sampled_lengths()), reward_stats=reward_stats,
                      generation=generation_work(batch.prompt_ids, rollouts.completion_ids, rollouts.sampled_lengths(), self.G))

    def draw_more(self, step: int, k: int) -> Scored:
        """The step's k-th extra batch (algo.dynamic_sampling), drawn, generated and scored now."""
        t0 = time.perf_counter()
        scored = self.score(self.submit(step, draw=k))
        return replace(scored, generate_s=time.perf_counter() - t0 - scored.score_s)  # hf generates in submit

    def checkpoint(self, step: int) -> None:
        # the sampler as of the batches trained: batches still in flight are drawn again on resume
        drawn = self.in_flight[0].sampler_state if self.in_flight else self.sampler.state_dict()
        layout = {"strategy": self.cfg.parallel.strategy, "world_size": self.info.world_size,
                  "adapter": lora.adapter_layout(self.cfg.model.lora)}
        save_checkpoint(self.run_dir, step, self.strategy, {"sampler": drawn, "eval_before": self.eval_before,
                                                            "rewards": reward_states(self.reward_fns),
                                                            "guards": self.guards.state_dict() if self.guards else {},
                                                            "failure_streak": self.failure_streak.state_dict(),
                                                            "generation": [self.gen_tokens, self.gen_seconds]},
                        self.cfg.keep_checkpoints, layout)


def setup(cfg: DictConfig, info: DistInfo, cleanup: contextlib.ExitStack) -> Run:
    """Run folder, task, model, rewards, strategy, rollout backend; the checkpoint to resume from;
    and the engines given the trainer's weights. Everything that must be closed joins `cleanup`."""
    run_dir = broadcast_object(os.path.abspath(cfg.run_dir))  # every rank uses rank 0's folder
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:  # a file of that name, a read-only or virtual file system (/proc), no permission
        raise ConfigError(f"run_dir={run_dir}: cannot make that folder ({e.strerror or e}); give a folder this user can "
                          f"write (run_dir=..., or hydra.run.dir=...).") from None
    cleanup.enter_context(hold_run_folder(run_dir, info.is_main))  # one live run per folder (grpo/run_lock.py)
    if (resume := cfg.resume or restarts() > 0) != cfg.resume and info.is_main:  # the same overrides, run again by SLURM
        print(f"resume=false, but SLURM requeued this job ({restarts()} time(s)): it resumes the run its first start began")
    if not resume and info.is_main and (aside := set_aside_checkpoints(run_dir)):
        print(f"resume=false: the folder's earlier run (checkpoints, metrics, config) was moved to {aside}")
    barrier()  # rank 0 has moved checkpoints/ aside: the others probe what stays
    check_writable(run_dir)  # before any step trains: every rank writes into each checkpoint
    done = False  # the folder's run finished these steps already: `finished` returns its summary, trains nothing
    if resume:  # before anything is built: a refused resume leaves the folder as it was
        check_not_past(run_dir, cfg.steps)
        if latest := latest_checkpoint(run_dir):
            # the strategy and processes that read it, and the adapter it holds
            check_layout(latest, cfg.parallel.strategy, info.world_size, lora.adapter_layout(cfg.model.lora))
            done = checkpoint_step(latest) >= cfg.steps and finished_steps(run_dir) == checkpoint_step(latest)
    seed_everything(cfg.seed)  # model init and anything else in setup

    algo, G = cfg.algo, cfg.algo.group_size
    task = build_task(cfg.task)
    loading = strategy_class(cfg.parallel.strategy).loading(cfg.parallel, algo, DTYPES[cfg.model.dtype])
    model_path = resolve_on_node(cfg, info)  # tiny: built and warm-started on the task, once per node
    model, tokenizer = build_policy(cfg, model_path, info, loading=loading)  # partitioned from the start under ZeRO-3
    reward_fns = build_rewards(cfg, policy_device(info.local_rank))  # a reward model is loaded here, once
    strategy = build_strategy(cfg.parallel, model, algo, cfg.steps * algo.num_iterations * algo.num_minibatches)
    rollout = cleanup.enter_context(contextlib.closing(
        build_rollout(cfg.rollout, strategy.model, tokenizer, model_path, cfg.model.dtype, cfg.seed, run_dir, strategy.lockstep,
                      algo.partial_rollouts, env=cfg.env, task=task)))
    ref_model = build_reference(cfg, model_path, strategy)  # runs as the policy does: KL 0 before the first step
    seed_everything(cfg.seed + info.rank)  # again: a fresh and a cached tiny model start alike
    r = Run(cfg, info, run_dir, task, tokenizer, model_path, reward_fns, strategy, rollout, ref_model,
            TrainSampler(task.train, seed=cfg.seed), sampling_from(cfg.rollout), P=algo.batch_size // G // info.world_size, G=G)

    r.checkpoint_path = broadcast_object(latest_checkpoint(run_dir) if resume else None)
    barrier()
    if r.checkpoint_path:
        state = load_checkpoint(r.checkpoint_path, strategy)
        r.start, r.eval_before = state["step"], state["eval_before"]
        r.sampler.load_state_dict(state["sampler"])
        load_reward_states(r.reward_fns, state.get("rewards", {}))
        r.guard_state = state.get("guards", {})
        r.failure_streak.load_state_dict(state.get("failure_streak", {}))  # an older checkpoint has none: afresh
        r.gen_tokens, r.gen_seconds = state.get("generation", (0, 0.0))  # the steps before it (an older one: none)
        resume_schedule(strategy.scheduler, algo)  # this run's lr, weight decay and schedule, not the checkpoint's
    if info.is_main:  # once the checkpoint is read: a resume refused there (another model's) leaves config.yaml
        record_run_config(run_dir, resolved_config(cfg, run_dir), resume, done)
    r.submitted = r.start
    # The engines serve exactly the trainer's weights from the first batch (and the first evaluation)
    # on: a server started on another folder, or left with an earlier run's weights, sampled step 1
    # from the wrong policy before (seen: |trainer - sampler| logprob 0.54 at step 1, 1e-6 after).
    r.push_weights(version=r.start)
    log_listeners(os.getpid())  # every socket this run listens on, with its purpose (grpo/listeners.py)
    return r


def finished_steps(run_dir: str) -> int | None:
    """The steps of the run that finished in `run_dir` (its summary.json), None where none did."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f).get("steps")
    except (OSError, ValueError):
        return None


def check_not_past(run_dir: str, steps: int) -> None:
    """A resume from a checkpoint past `steps` is refused, unless that checkpoint is a finished run's
    last step: it would end as a `steps`-step run (its summary and export) holding more training (a
    6-step checkpoint resumed with steps=4; a finished 2-step run continued to 3, stopped before its
    own summary, then started again with steps=2)."""
    latest = latest_checkpoint(run_dir)
    at = checkpoint_step(latest) if latest else 0
    if at > steps and finished_steps(run_dir) != at:
        raise ConfigError(f"{latest} is at step {at}, past steps={steps}: the run would finish as a {steps}-step run "
                          f"holding {at} steps of training. Raise steps to at least {at}, or start afresh with "
                          f"resume=false.")


def finished(r: Run) -> dict:
    """A run folder that already holds every step and its summary: export if a stop came before
    that, and return the summary."""
    if r.info.is_main:
        print(f"{r.run_dir} already finished {r.start} steps; raise `steps` to train further.")
        truncate_after(os.path.join(r.run_dir, "metrics.jsonl"), r.start)  # a killed continuation's rows: not this run's
    if r.cfg.export_model and exported_step(os.path.join(r.run_dir, "model")) != r.start:  # stopped before it
        export_hf(r.strategy, r.tokenizer, os.path.join(r.run_dir, "model"), r.bucket_bytes, step=r.start)
    with open(os.path.join(r.run_dir, "summary.json")) as f:
        return json.load(f)


def step_metrics(scored: Scored, stats: dict, step: int, lr: float, times: dict[str, float], flat_P,
                 handed: int = 1) -> dict[str, float]:
    """What one step logs: the trained groups' rewards, the update's statistics (`stats`, with dynamic
    sampling's), lengths, staleness (with partial rollouts the mean over sampled tokens, the max the
    batch's oldest), throughput and the phases' seconds (`times`, with `step_s`). `handed`: the batches
    handed to the engines this step (algo.max_staleness k: k + 1 at the first, none at the last k)."""
    rollouts, rewards_PG = scored.rollouts, scored.rewards_PG
    valid = rewards_PG[~torch.isnan(rewards_PG)]
    n_tokens = scored.generated_tokens  # every draw's sampled tokens (an episode's observations aside)
    lengths = rollouts.sampled_lengths()
    return {
        # over the completions with a reward, which ranks hold unequal numbers of: parts summed over ranks (grpo/metrics.py)
        "reward/mean": Ratio(float(valid.sum()), valid.numel()),
        "reward/std": Spread.of(valid),
        # completions with no reward (a function failed on it, or every one abstained): out of the loss
        "reward/excluded_frac": 1.0 - valid.numel() / max(rewards_PG.numel(), 1),
        "reward/zero_std_frac": float(flat_P.float().mean()),  # the groups with no signal, as the update found them
        **scored.reward_means,  # reward/<function>, over the same trained groups
        # time/reward_<function>_s; a judge's requests, failures and garbage answers: counts, summed over ranks
        **{k: v if k.startswith("time/") else Count(v) for k, v in scored.reward_stats.items()},
        **stats,
        "completion_len": sum(lengths) / len(lengths),
        **rollouts.metrics(),  # an episode's turns, tool calls, finish reasons
        **scored.drawn_totals,  # with dynamic sampling, its errors, env seconds and tool failures over every draw
        "truncated_frac": sum(rollouts.cut()) / len(rollouts.finish_reasons),  # cut mid-turn: what mask_truncated drops
        "weight_version": rollouts.weight_version,
        # versions the sampler was behind the trainer (one version per batch: mean = max per
        # rank; every rank's batch comes from the same push)
        "async/staleness_mean": (staleness(step - 1, rollouts.weight_version) if rollouts.token_versions is None
                                 else Ratio(*token_staleness(step - 1, rollouts.token_versions))),
        "async/staleness_max": staleness(step - 1, rollouts.weight_version),
        "time/engine_wait_s": rollouts.engine_wait_s,  # the engines, idle before it (waiting for weights)
        "lr": lr,
        # the step's seconds cover one batch's generation only when it handed one over: at an asynchronous
        # run's first step (k + 1 generated) and last k (none; the batch came from earlier) it is NaN
        "tokens_per_s": n_tokens / times["step_s"] if handed == 1 else math.nan,
        # over the seconds the engines took over the batch (with algo.max_staleness, not the trainer's wait)
        "gen_tokens_per_s": n_tokens / times["time/batch_generate_s"] if times["time/batch_generate_s"] > 0 else 0.0,
        **times,
    }


def stop_after(r: Run, step: int, stop_signal: StopSignal, before_requeue: Callable[[], None] | None) -> None:
    """A stop signal, once `step`'s checkpoint is written: close, then exit or requeue (grpo/preempt.py)."""
    r.logger.close()
    r.rollout.close()  # before stop(), which may wait for SLURM to end the allocation
    stop(step, r.logger.info, stop_signal.requeue, before_requeue, r.cfg.resume)  # raises SystemExit; the ExitStack does the rest


def resolved_config(cfg: DictConfig, run_dir: str) -> dict:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["run_dir"] = run_dir
    return resolved


def run(cfg: DictConfig, info: DistInfo, threads: int, cleanup: contextlib.ExitStack,
        before_requeue: Callable[[], None] | None = None) -> dict:
    t_start = time.perf_counter()
    # SIGTERM (scancel, preemption) or the time-limit warning: the loop checkpoints after its step and
    # stops (or requeues), grpo/preempt.py; a SIGTERM during setup (nothing trained yet) exits at once
    stop_signal = StopSignal(in_setup=True)
    cleanup.callback(stop_signal.close)

    # ---- setup: task, model, rewards, strategy, rollout backend, resume ----
    r = setup(cfg, info, cleanup)
    algo, G = cfg.algo, r.G
    if r.start >= cfg.steps and finished_steps(r.run_dir) == r.start:  # that run's own summary, not an earlier one's
        return finished(r)
    r.logger = logger = RunLogger(cfg.logger, r.run_dir, cfg.steps, resolved_config(cfg, r.run_dir), enabled=info.is_main,
                                  resume_step=r.start if r.checkpoint_path else None)
    cleanup.callback(logger.close)
    if r.checkpoint_path:
        logger.info(f"resumed from {r.checkpoint_path} at step {r.start}")
    else:
        before = evaluate(r.rollout, r.tokenizer, r.task, cfg, info, r.reward_fns)
        r.eval_before = before["eval/accuracy"]
        logger.log(0, before, console=True)
    r.engine_busy_s = r.rollout.engine_busy_s() or 0.0  # from here: the evaluation's busy seconds are no step's

    meter = mfu.meter(r.strategy.forward_model, DTYPES[cfg.model.dtype], cfg.rollout.backend,
                      cfg.model.gradient_checkpointing)  # the device's peak, measured now
    watch = healthy(cfg.model.dtype, policy_device(info.local_rank).type)  # the engines' environment is this one's
    r.guards = guards = RunGuards(r.strategy, r.bucket_bytes, watch, cfg.parallel.check_ranks_every, info.world_size)
    guards.load_state_dict(r.guard_state)  # skipped steps so far, and a run of them, across a resume
    stop_signal.training()
    for step in range(r.start + 1, cfg.steps + 1):
        t0 = time.perf_counter()

        # 1. sample: P prompts, G completions each, the whole batch handed over at once; with
        #    algo.max_staleness = k the engines get the batches up to step + k now, and generate
        #    them while this step trains (k = 0: this step's batch only, generated right here)
        handed = batches_to_submit(step, r.submitted, algo.max_staleness, cfg.steps)
        for ahead in handed:
            r.in_flight.append(r.submit(ahead))
            r.submitted = ahead
        current = r.in_flight.popleft()
        t_wait = time.perf_counter()

        # 2. score: every reward function on every completion, weighted sum per completion (an
        #    episode's: its final turn, with the transcript, turns and the environment's reward)
        scored = r.score(current)
        draw_metrics = {}
        if algo.dynamic_sampling:  # DAPO: more batches of P prompts until P groups carry signal
            scored, draw_metrics = refill(scored, lambda k: r.draw_more(step, k), algo.max_draws,
                                          lambda short: int(all_reduce_max([short])[0]))
        wait_s = scored.wait_s  # the trainer, waiting for this step's batches once handed over (every draw)
        samples, prompt_ids, rollouts, rewards_PG = scored.samples, scored.prompt_ids, scored.rollouts, scored.rewards_PG
        completions, samples_BG = scored.completions, [s for s in samples for _ in range(G)]
        generate_s = (t_wait - t0) + scored.generate_s  # submitting (hf: generating) and waiting, every draw

        # 3. advantages per group (per completion; per token with algo.turn_rewards); groups with
        #    equal rewards carry no signal
        advantages, flat_P = step_advantages(rewards_PG, rollouts, scored.rewards_FB, r.reward_fns, algo)
        batch = collate(
            [p for p in prompt_ids for _ in range(G)], rollouts, advantages,
            r.tokenizer.pad_token_id, algo.mask_truncated, excluded_B=torch.isnan(rewards_PG).flatten(),
        )
        batch.replay_routes = cfg.rollout.routing_replay  # routes only observed: rollout.routing_observe

        # 4-6. logprobs, loss, backward and optimizer step(s); a colocated engine may sleep meanwhile
        t_sleep = time.perf_counter()
        r.rollout.sleep()
        lr = r.strategy.lr  # the rate this step's update takes (after it, the scheduler holds the next one's)
        budget = r.rollout.sampled_budget(cfg.rollout.max_new_tokens)  # Dr. GRPO's constant (episodes: every turn's)
        t_policy = time.perf_counter()
        stats = policy_update(r.strategy, batch, algo, budget, r.sampling.temperature, r.ref_model,
                              skip_P=flat_P if algo.zero_std_groups == "drop" else None)  # flat groups: no forward
        update_s = time.perf_counter() - t_policy  # what flops/update was computed in (mfu/update)
        work = stats.pop("work")  # what its forwards processed: FLOPs and MFU below (grpo/mfu.py)
        # a non-finite step was skipped (a run of them stops); ranks' weights compared; a drifting sampler warned
        stats.update(guards.after_update(step, stats, staleness(step - 1, rollouts.weight_version)))
        t_update = time.perf_counter()

        # 7. push the new weights to the rollout engine(s)
        r.push_weights(version=step)
        t_end = time.perf_counter()

        # 8. metrics, samples, evaluation, checkpoint
        r.gen_tokens += scored.generated_tokens  # every draw's sampled tokens (an episode's observations aside)
        r.gen_seconds += scored.batch_generate_s
        times = {"time/wait_for_data_s": wait_s, "time/generate_s": generate_s,
                 "time/batch_generate_s": scored.batch_generate_s, "time/score_s": scored.score_s,
                 "time/sleep_s": t_policy - t_sleep, "time/update_s": update_s, "time/sync_s": t_end - t_update,
                 "step_s": t_end - t0}
        if (busy := r.rollout.engine_busy_s()) is not None:  # servers: seconds with a request in flight, this step
            times["time/engine_busy_s"], r.engine_busy_s = busy - r.engine_busy_s, busy
        metrics = step_metrics(scored, {**stats, **draw_metrics}, step, lr, times, flat_P, len(handed))
        metrics.update(meter.metrics(scored.generation, work, times, len(handed)))  # flops/, mfu/ per phase
        if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
            metrics.update(evaluate(r.rollout, r.tokenizer, r.task, cfg, info, r.reward_fns))
            r.engine_busy_s = r.rollout.engine_busy_s() or 0.0  # the evaluation's busy seconds are no step's
        logger.log(step, reduce_metrics(metrics, info))
        if cfg.logger.sample_every and step % cfg.logger.sample_every == 0:
            rows = [(samples_BG[i].prompt, completions[i], float(rewards_PG.flatten()[i])) for i in range(0, len(completions), G)]
            logger.samples(step, rows[: cfg.logger.num_samples])
        saved = bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0 and step != cfg.steps
        if saved:
            r.checkpoint(step)
        if step < cfg.steps and stop_signal.requested():
            if not saved:  # once: the grace period before SIGKILL is short
                r.checkpoint(step)
            stop_after(r, step, stop_signal, before_requeue)

    # ---- end: checkpoint, final evaluation, summary, export ----
    # The last step's checkpoint comes first, so a stop signal (honoured here too) or a failure in the
    # long final evaluation or the export loses no step; a resumed run then evaluates and exports.
    r.failure_streak.finish()  # a run too short to see a broken reward twice: not an end as if it trained
    if cfg.steps > r.start:
        r.checkpoint(cfg.steps)
    if stop_signal.requested():
        stop_after(r, cfg.steps, stop_signal, before_requeue)
    after = evaluate(r.rollout, r.tokenizer, r.task, cfg, info, r.reward_fns)
    eval_after = after["eval/accuracy"]
    logger.log(cfg.steps, after, console=True)
    # each rank's sampled tokens over its engines' seconds, every step of the run (a resumed run's too),
    # summed over ranks as the step metric is
    gen_rate = all_reduce_sum([r.gen_tokens / r.gen_seconds if r.gen_seconds else 0.0])[0]
    summary = {
        "eval_before": r.eval_before,
        "eval_after": eval_after,
        "eval_gain": eval_after - r.eval_before,
        "eval_after_all": after,  # pass@k too when eval_samples > 1
        "steps": cfg.steps,
        "resumed_from": r.start,
        "world_size": info.world_size,
        "nodes": node_names(),  # each rank's node, in rank order
        "threads_per_process": threads,
        "machine": machine_info(),  # CPU model, torch's kernel set (cpu_capability), threads
        # this process's: a resumed run's cover steps resumed_from + 1 to steps
        "wall_s": time.perf_counter() - t_start,
        "gen_tokens_per_s": gen_rate if r.gen_seconds else None,
        "peak_memory_gb": all_reduce_max([peak_memory_gb()])[0],  # the ranks' largest
        **meter.summary(r.strategy.forward_model),  # the device's matmul peak the mfu/ metrics are measured against
        "model_path": r.model_path,
        "git_revision": git_revision(),
    }
    if info.is_main:
        write_json(os.path.join(r.run_dir, "summary.json"), summary)
    if cfg.export_model:  # after the summary: a stop or a failure here keeps the finished run's record
        if stop_signal.requested():
            stop_after(r, cfg.steps, stop_signal, before_requeue)  # the resumed run exports
        export_hf(r.strategy, r.tokenizer, os.path.join(r.run_dir, "model"), r.bucket_bytes, step=cfg.steps)
    logger.info(
        f"eval accuracy {r.eval_before:.3f} -> {eval_after:.3f} ({summary['eval_gain']:+.3f}) in {cfg.steps} steps, "
        f"{summary['wall_s']:.1f}s wall{resumed_span(r.start, cfg.steps)}; run folder {r.run_dir}"
    )
    return summary


def resumed_span(start: int, steps: int) -> str:
    """What this process of a resumed run did, for its last line ('' for an unbroken run)."""
    if not start:
        return ""
    return " (resumed: the final evaluation only)" if start >= steps else f" for steps {start + 1}-{steps} (resumed)"


def train_from_command_line(cfg: DictConfig) -> dict:
    check_sweep_folder(cfg, HydraConfig.get().mode == RunMode.MULTIRUN)
    return train(cfg)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(train_from_command_line, cfg)


if __name__ == "__main__":
    exit_on_user_error(compose_first, sys.argv[1:])  # Hydra's own answer to a typo'd key advises a `+`
    main()
