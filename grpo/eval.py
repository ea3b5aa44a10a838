"""Held-out evaluation through the configured rollout backend: greedy accuracy and pass@k.

`python -m grpo.eval [overrides]` evaluates `model.path` (the tiny model by default) on the task's
held-out split with the same config groups as training, prints the figures, and writes them to
`eval.json` and a line of `metrics.jsonl` in the run folder. `grpo.train` calls `evaluate` before
and after training and every `eval_every` steps.

pass@k uses the unbiased estimator of Chen et al. (2021): with n samples of which c are correct,
pass@k = 1 - C(n - c, k) / C(n, k), averaged over prompts. n is `eval_samples`, drawn at the
rollout temperature; k runs over 1, 2, 4, ... up to n.
"""

from __future__ import annotations

import os
import sys
import warnings
from math import comb

import hydra
from omegaconf import DictConfig

from grpo.cli import compose_first, exit_on_user_error
from grpo.config import register_configs, validate
from grpo.dist import DistInfo, all_gather, all_reduce_sum, dist_info, init_distributed, shutdown
from grpo.errors import RewardStop, Unjudged
from grpo.log import dumps, write_json
from grpo.models import build_policy, encode_prompts
from grpo.rewards import MODEL_REWARDS, is_scored, score
from grpo.rewards.failure_streak import stop_together
from grpo.rollout import build_rollout, sampling_from
from grpo.tasks import build_task
from grpo.tiny.folders import resolve_on_node

register_configs()


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of them correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def agreement(name: str, scores: list, correct: list[bool]) -> dict[str, float]:
    """How a model reward's scores agree with the task's rule on the same completions:
    `eval/<name>_auc`, the probability that a correct completion scores above a wrong one (ties count
    half; 0.5 is chance, 1 a perfect ranking; NaN when every completion is right or every one wrong),
    and the mean score of the correct and of the wrong ones. Unscored completions (failed: NaN) are left out.
    A policy that learns to please the reward model and not the rule shows here first: its reward
    rises while the AUC falls."""
    right = [v for v, ok in zip(scores, correct) if is_scored(v) and ok]
    wrong = [v for v, ok in zip(scores, correct) if is_scored(v) and not ok]
    pairs = len(right) * len(wrong)
    above = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    nan = float("nan")
    return {f"eval/{name}_auc": above / pairs if pairs else nan,
            f"eval/{name}_mean_correct": sum(right) / len(right) if right else nan,
            f"eval/{name}_mean_wrong": sum(wrong) / len(wrong) if wrong else nan}


def evaluate(rollout, tokenizer, task, cfg, info: DistInfo, reward_fns=()) -> dict[str, float]:
    """Greedy accuracy (and pass@k when `eval_samples` > 1) on the held-out split; each rank takes a share.
    With an environment each prompt is played as an episode, through the same driver as training
    (the backend's `submit`), and its final turn is judged (an episode that failed as ""). Each model reward
    among `reward_fns` (a reward model, a judge) scores the greedy completions too, its running
    statistics left as they are, and its agreement with the task's rule is logged (`agreement`). A completion
    the task's check could not judge (`Unjudged`) is counted wrong and counted (`eval/unjudged`, a warning)."""
    samples = task.eval[info.rank :: info.world_size]
    prompt_ids = encode_prompts(tokenizer, samples, task.chat_template, task.system_prompt)

    def play(n: int, sampling) -> tuple[list[str], list[int], int]:
        """Each completion's text (an episode's final turn), its turns (1 without an environment), and
        how many episodes' environments failed ("error": judged as "", so counted wrong)."""
        out = rollout.submit(prompt_ids, samples, n, sampling).result()
        texts = [t if reason != "error" else "" for t, reason in zip(out.texts(tokenizer), out.finish_reasons)]
        return texts, out.turns(), sum(reason == "error" for reason in out.finish_reasons)

    unjudged: list[str] = []

    def judge(text: str, sample) -> bool:
        """The task's check; one that could not decide (`Unjudged`) is counted wrong, and counted."""
        try:
            return task.is_correct(text, sample)
        except Unjudged as e:
            unjudged.append(str(e))
            return False

    texts, turns, errors = play(1, sampling_from(cfg.rollout, greedy=True))
    greedy = texts
    solved = [judge(t, s) for t, s in zip(texts, samples)]
    sums = [sum(solved), len(samples), sum(k for k, ok in zip(turns, solved) if ok), errors]
    n = cfg.eval_samples
    ks = [k for k in (2**i for i in range(10)) if k <= n] if n > 1 else []
    passes = []
    if ks:
        texts, _, _ = play(n, sampling_from(cfg.rollout))
        correct = [sum(judge(texts[p * n + j], s) for j in range(n)) for p, s in enumerate(samples)]
        passes = [sum(pass_at_k(n, c, k) for c in correct) for k in ks]
    total = all_reduce_sum(sums + [len(unjudged)] + passes)
    metrics = {"eval/accuracy": total[0] / total[1]}
    if rollout.episodes is not None:  # turns per solved episode (guess: binary search takes 3.27)
        metrics["eval/turns_per_solve"] = total[2] / total[0] if total[0] else float("nan")
        metrics["eval/episode_errors"] = total[3]  # counted wrong above: an environment that fails lowers accuracy
    if total[4]:  # every rank has the same total, so the same keys
        metrics["eval/unjudged"] = total[4]
        if info.is_main:
            warnings.warn(f"{int(total[4])} eval completions could not be judged and were counted wrong, so eval/accuracy "
                          f"(and pass@k) is a lower bound; {unjudged[0] if unjudged else 'on another rank'} (a loaded "
                          "machine: evaluate with fewer processes beside it)", stacklevel=2)
    metrics.update({f"eval/pass@{k}": v / total[1] for k, v in zip(ks, total[5:])})
    for name, fn, _ in reward_fns:
        if name in MODEL_REWARDS:
            # a reward model's running normalisation learns from training batches only
            scorer = getattr(fn, "score_only", fn)
            stopped, values = None, [[]]
            try:
                values, _ = score([(name, scorer, 1.0)], greedy, samples, cfg.reward.timeout_s)
            except RewardStop as e:  # raised on every rank, not here alone (the others would wait in all_gather)
                stopped = e
            stop_together(stopped, all_reduce_sum([float(stopped is not None)])[0])
            pairs = [p for rank_pairs in all_gather(list(zip(values[0], solved))) for p in rank_pairs]
            metrics.update(agreement(name, [v for v, _ in pairs], [ok for _, ok in pairs]))
    return metrics


def run_eval(cfg: DictConfig) -> dict[str, float]:
    validate(cfg)
    info = dist_info()
    init_distributed(info)
    run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    task = build_task(cfg.task)
    path = resolve_on_node(cfg, info)
    model, tokenizer = build_policy(cfg, path, info)
    rollout = build_rollout(cfg.rollout, model, tokenizer, path, cfg.model.dtype, cfg.seed, run_dir, env=cfg.env, task=task)
    try:
        metrics = evaluate(rollout, tokenizer, task, cfg, info)
    finally:
        rollout.close()
        shutdown()
    if info.is_main:
        write_json(os.path.join(run_dir, "eval.json"), {"model_path": path, "eval_size": len(task.eval), **metrics})
        if not is_training_folder(run_dir):  # a training run's metrics stay in step order for grpo.plot
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(dumps({"step": 0, **metrics}) + "\n")
        print(" | ".join(f"{k} {v:.3f}" for k, v in metrics.items()) + f"  ({path}, {len(task.eval)} prompts)")
    return metrics


def is_training_folder(run_dir: str) -> bool:
    """A folder `grpo.train` wrote (checkpoints or a summary): `grpo.eval` then leaves its metrics.jsonl
    alone (a step-0 row appended after step N would be out of order) and writes eval.json only."""
    return any(os.path.exists(os.path.join(run_dir, name)) for name in ("checkpoints", "summary.json"))


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(run_eval, cfg)


if __name__ == "__main__":
    exit_on_user_error(compose_first, sys.argv[1:])  # Hydra's own answer to a typo'd key advises a `+`
    main()
