"""`python -m grpo.train`: the GRPO loop, readable top to bottom.

Variant implemented (DeepSeekMath GRPO, with the fixes later papers made optional):
  - P prompts per step, G completions each, sampled by the rollout backend with the current weights.
    Shape letters, as in grpo/algorithm.py: P prompts, G completions per prompt, B = P x G completions,
    T completion tokens, F reward functions.
  - Rewards: weighted sum of reward functions; a completion no function scores gets advantage 0.
  - Advantages: reward minus its group's mean, divided by the group's std (`algo.adv_scale=group`),
    the batch's std (`batch`, as in "A Closer Look at GRPO"; over all ranks) or nothing (`none`,
    Dr. GRPO); computed in float64, and a group of equal rewards gets exactly 0.
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
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import time
from dataclasses import replace

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from grpo.algorithm import combine_rewards, zero_std_groups
from grpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, set_aside_checkpoints
from grpo.cli import exit_on_user_error
from grpo.config import register_configs, validate
from grpo.cpus import configure_threads
from grpo.dist import DistInfo, all_reduce_sum, barrier, broadcast_object, dist_info, process_group
from grpo.eval import evaluate
from grpo.export import export_hf
from grpo.library_logs import quiet_library_logs
from grpo.log import RunLogger
from grpo.models import build_policy, build_reference, encode_prompts
from grpo.parallel import build_strategy
from grpo.preempt import StopSignal, stop
from grpo.rewards import build_rewards, score
from grpo.rollout import build_rollout, sampling_from
from grpo.tasks import TrainSampler, build_task
from grpo.update import batch_advantages, collate, policy_update

register_configs()


def reduce_metrics(metrics: dict[str, float], info: DistInfo) -> dict[str, float]:
    """Mean over ranks (every rank holds the same number of prompts); throughputs are summed."""
    if info.world_size == 1:
        return metrics
    keys = sorted(metrics)
    sums = all_reduce_sum([float(metrics[k]) for k in keys])
    summed = {"tokens_per_s", "gen_tokens_per_s", "trained_completions"}
    return {k: v if k in summed else v / info.world_size for k, v in zip(keys, sums)}


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The engines' sampling seed for one step of one rank: distinct per (run seed, step, rank), and
    the same again when a resumed run redoes the step. Engines add the prompt's index (< 65,536)."""
    return ((seed * 1_000_003 + step) * 256 + rank) * 65_536


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def git_revision() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def train(cfg: DictConfig) -> dict:
    """One run. Every way out (the end, an error, a stop signal, a lost peer) leaves through one
    ExitStack, which closes the engines or servers, the logger and the process group."""
    validate(cfg)
    info = dist_info()
    quiet_library_logs(info.rank)  # a library's repeating warning once per run; other ranks: grpo's warnings, errors
    threads = configure_threads(cfg.threads)
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(process_group(info, peer_timeout_s=cfg.parallel.peer_timeout_s))
        return run(cfg, info, threads, cleanup)


def run(cfg: DictConfig, info: DistInfo, threads: int, cleanup: contextlib.ExitStack) -> dict:
    t_start = time.perf_counter()
    # SIGTERM (scancel, preemption) or the time-limit warning, from here on: the loop checkpoints after
    # its step and stops (or requeues), grpo/preempt.py; one that comes during setup waits for step 1
    stop_signal = StopSignal()
    cleanup.callback(stop_signal.close)
    run_dir = broadcast_object(os.path.abspath(cfg.run_dir))  # every rank uses rank 0's folder
    os.makedirs(run_dir, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["run_dir"] = run_dir
    if info.is_main:
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(resolved))
    seed_everything(cfg.seed)  # model init and anything else in setup

    # ---- setup: task, model, rewards, strategy, rollout backend ----
    algo, G = cfg.algo, cfg.algo.group_size
    P = algo.batch_size // G // info.world_size  # prompts per step on this rank
    task = build_task(cfg.task)
    model, tokenizer, model_path = build_policy(cfg, info)
    reward_fns = build_rewards(cfg.reward)
    weights_F = [w for _, _, w in reward_fns]
    strategy = build_strategy(cfg.parallel, model, algo, cfg.steps * algo.num_iterations * algo.num_minibatches)
    rollout = cleanup.enter_context(contextlib.closing(
        build_rollout(cfg.rollout, strategy.model, tokenizer, model_path, cfg.model.dtype, cfg.seed, run_dir, strategy.lockstep)))
    ref_model = build_reference(cfg, model_path, info)
    seed_everything(cfg.seed + info.rank)  # again: a fresh and a cached tiny model start alike
    sampler = TrainSampler(task.train, seed=cfg.seed)
    sampling = sampling_from(cfg.rollout)
    bucket_bytes = int(cfg.parallel.sync_bucket_mb * 2**20)

    start, eval_before = 0, None
    ckpt = broadcast_object(latest_checkpoint(run_dir) if cfg.resume else None)
    if not cfg.resume and info.is_main and (aside := set_aside_checkpoints(run_dir)):
        print(f"resume=false: the folder's earlier checkpoints were moved to {aside}")
    barrier()
    if ckpt:
        state = load_checkpoint(ckpt, strategy)
        start, eval_before = state["step"], state["eval_before"]
        sampler.load_state_dict(state["sampler"])
    # The engines serve exactly the trainer's weights from the first batch (and the first evaluation)
    # on: a server started on another folder, or left with an earlier run's weights, sampled step 1
    # from the wrong policy before (seen: |trainer - sampler| logprob 0.54 at step 1, 1e-6 after).
    rollout.update_weights(strategy.weight_buckets(bucket_bytes), version=start)
    if start >= cfg.steps and os.path.exists(os.path.join(run_dir, "summary.json")):
        if info.is_main:
            print(f"{run_dir} already finished {start} steps; raise `steps` to train further.")
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)
    logger = RunLogger(cfg.logger, run_dir, cfg.steps, resolved, enabled=info.is_main, resume_step=start if ckpt else None)
    cleanup.callback(logger.close)

    def checkpoint(step: int) -> None:
        save_checkpoint(run_dir, step, strategy, {"sampler": sampler.state_dict(), "eval_before": eval_before}, cfg.keep_checkpoints)

    if ckpt:
        logger.info(f"resumed from {ckpt} at step {start}")
    else:
        before = evaluate(rollout, tokenizer, task, cfg, info)
        eval_before = before["eval/accuracy"]
        logger.log(0, before, console=True)

    gen_tokens_total, gen_time_total = 0, 0.0
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()

        # 1. sample: P prompts, G completions each, the whole batch handed over at once
        samples = sampler.next(P * info.world_size)[info.rank * P : (info.rank + 1) * P]  # this rank's share
        prompt_ids = encode_prompts(tokenizer, samples, task.chat_template, task.system_prompt)
        rollouts = rollout.generate(prompt_ids, G, replace(sampling, seed=sampling_seed(cfg.seed, step, info.rank)))
        t_gen = time.perf_counter()

        # 2. score: every reward function on every completion, weighted sum per completion
        completions = tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)
        samples_BG = [s for s in samples for _ in range(G)]
        rewards_FB, reward_means = score(
            reward_fns, completions, samples_BG, cfg.reward.timeout_s,
            completion_ids=rollouts.completion_ids, max_new_tokens=cfg.rollout.max_new_tokens,
        )
        rewards_PG = combine_rewards(rewards_FB, weights_F).view(P, G)
        t_score = time.perf_counter()

        # 3. advantages per group; groups with equal rewards carry no signal
        advantages_PG = batch_advantages(rewards_PG, algo.adv_scale, algo.adv_estimator)
        flat_P = zero_std_groups(rewards_PG)
        batch = collate(
            [p for p in prompt_ids for _ in range(G)], rollouts, advantages_PG.flatten(),
            tokenizer.pad_token_id, algo.mask_truncated,
        )
        if algo.zero_std_groups == "drop":
            batch = batch.select((~flat_P).repeat_interleave(G))

        # 4-6. logprobs, loss, backward and optimizer step(s); a colocated engine may sleep meanwhile
        rollout.sleep()
        stats = policy_update(strategy, batch, algo, cfg.rollout.max_new_tokens, sampling.temperature, ref_model)
        t_update = time.perf_counter()

        # 7. push the new weights to the rollout engine(s)
        rollout.update_weights(strategy.weight_buckets(bucket_bytes), version=step)
        t_end = time.perf_counter()

        # 8. metrics, samples, evaluation, checkpoint
        n_tokens = sum(len(c) for c in rollouts.completion_ids)
        gen_tokens_total += n_tokens
        gen_time_total += t_gen - t0
        valid = rewards_PG[~torch.isnan(rewards_PG)]
        metrics = {
            "reward/mean": float(valid.mean()) if valid.numel() else float("nan"),
            "reward/std": float(valid.std()) if valid.numel() > 1 else 0.0,
            "reward/zero_std_frac": float(flat_P.float().mean()),
            **reward_means,
            **stats,
            "completion_len": n_tokens / len(rollouts.completion_ids),
            "truncated_frac": sum(r == "length" for r in rollouts.finish_reasons) / len(rollouts.finish_reasons),
            "weight_version": rollouts.weight_version,
            "lr": strategy.lr,
            "tokens_per_s": n_tokens / (t_end - t0),
            "gen_tokens_per_s": n_tokens / (t_gen - t0),
            "step_s": t_end - t0,
            "time/generate_s": t_gen - t0,
            "time/score_s": t_score - t_gen,
            "time/update_s": t_update - t_score,
            "time/sync_s": t_end - t_update,
        }
        if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
            metrics.update(evaluate(rollout, tokenizer, task, cfg, info))
        logger.log(step, reduce_metrics(metrics, info))
        if cfg.logger.sample_every and step % cfg.logger.sample_every == 0:
            rows = [(samples_BG[i].prompt, completions[i], float(rewards_PG.flatten()[i])) for i in range(0, len(completions), G)]
            logger.samples(step, rows[: cfg.logger.num_samples])
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != cfg.steps:
            checkpoint(step)
        if step < cfg.steps and stop_signal.requested():
            checkpoint(step)
            logger.close()
            rollout.close()  # before stop(), which may wait for SLURM to end the allocation
            stop(step, logger.info, requeue=stop_signal.requeue)  # raises SystemExit; the ExitStack does the rest

    # ---- end: final evaluation, checkpoint and summary ----
    after = evaluate(rollout, tokenizer, task, cfg, info)
    eval_after = after["eval/accuracy"]
    logger.log(cfg.steps, after, console=True)
    if cfg.steps > start:
        checkpoint(cfg.steps)
    if cfg.export_model:
        export_hf(strategy, tokenizer, os.path.join(run_dir, "model"), bucket_bytes)
    summary = {
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_gain": eval_after - eval_before,
        "eval_after_all": after,  # pass@k too when eval_samples > 1
        "steps": cfg.steps,
        "resumed_from": start,
        "world_size": info.world_size,
        "threads_per_process": threads,
        "wall_s": time.perf_counter() - t_start,
        "gen_tokens_per_s": gen_tokens_total / gen_time_total if gen_time_total else None,
        "model_path": model_path,
        "git_revision": git_revision(),
    }
    if info.is_main:
        write_json(os.path.join(run_dir, "summary.json"), summary)
    logger.info(
        f"eval accuracy {eval_before:.3f} -> {eval_after:.3f} ({summary['eval_gain']:+.3f}) in {cfg.steps} steps, "
        f"{summary['wall_s']:.1f}s wall; run folder {run_dir}"
    )
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(train, cfg)


if __name__ == "__main__":
    main()
