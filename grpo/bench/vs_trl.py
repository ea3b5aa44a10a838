"""`python -m grpo.bench vs-trl [OVERRIDES]`: TRL's GRPOTrainer against this codebase's `rollout=hf`
run on the same model, prompts (as the task renders them), rewards, batch, completion length,
temperature, learning rate, loss and clipping (needs trl, setup.cfg). The overrides set up both
sides: none is the default run, `experiment=smollm2_arithmetic_cpu` SmolLM2-135M."""

from __future__ import annotations

import statistics
import tempfile
import time

from grpo.bench.runs import bench_backend, compose, tiny_model_path
from grpo.models import format_prompt
from grpo.rewards import build_rewards
from grpo.tasks import build_task
from grpo.tasks.base import Sample
from grpo.tiny.folders import resolve_model_folder


def bench_trl(steps: int, ours: dict, overrides: list[str]) -> dict:
    """TRL's GRPOTrainer on the run that `overrides` compose, generating with transformers on this
    CPU, as `rollout=hf` does."""
    try:
        # datasets, trl: optional, only for this bench (transformers with them: the same try)
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"grpo.bench vs-trl needs TRL: `.venv/bin/pip install trl==1.16.0` ({e})") from e

    cfg = compose(["run_dir=unused", *overrides])
    path = resolve_model_folder(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = build_task(cfg.task)
    # the prompt text our trainer tokenizes (chat template and system prompt applied), as a plain string
    data = Dataset.from_list([{"prompt": format_prompt(tokenizer, s.prompt, cfg.task.chat_template, cfg.task.system_prompt)[0],
                               "answer": s.answer} for s in task.train])

    def as_trl(name, fn):  # TRL's reward signature around this codebase's reward
        def reward(completions, answer, **_):
            return fn(completions, [Sample(prompt="", answer=a) for a in answer])

        reward.__name__ = name
        return reward

    rewards = build_rewards(cfg)
    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.t0)

    a = cfg.algo
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=a.batch_size,
        num_generations=a.group_size, max_completion_length=cfg.rollout.max_new_tokens, learning_rate=a.lr,
        warmup_steps=a.warmup_steps, lr_scheduler_type="linear", max_steps=steps, beta=a.beta, loss_type=a.loss_type,
        epsilon=a.clip_eps, scale_rewards=a.adv_scale, mask_truncated_completions=a.mask_truncated,
        reward_weights=[w for _, _, w in rewards], temperature=cfg.rollout.temperature, use_cpu=True, bf16=False,
        report_to=[], logging_steps=1000, save_strategy="no", seed=0, max_grad_norm=a.max_grad_norm,
    )
    timer = StepTimes()
    print(f"bench: TRL GRPOTrainer, {steps} steps", flush=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), args=args, train_dataset=data,
                          reward_funcs=[as_trl(name, fn) for name, fn, _ in rewards], processing_class=tokenizer,
                          callbacks=[timer])
    trainer.train()
    trl_step = statistics.mean(timer.times[1:])
    import trl  # trl: optional, only for this bench

    return {"trl_version": trl.__version__, "trl_step_s": trl_step, "grpo_step_s": ours["step_s"],
            "trl_over_grpo": trl_step / ours["step_s"], "steps_timed": len(timer.times) - 1}


def report_trl(steps: int, overrides: list[str]) -> tuple[dict, list]:
    ours = bench_backend("hf", steps, overrides)
    v = {**bench_trl(steps, ours, overrides), "overrides": " ".join(overrides) or "(the default run)"}
    return {"vs_trl": v, "steps": [ours]}, [
        f"\nTRL {v['trl_version']} GRPOTrainer on {v['overrides']}: {v['trl_step_s']:.3f} s/step vs grpo (rollout=hf) "
        f"{v['grpo_step_s']:.3f} s/step: TRL takes {v['trl_over_grpo']:.2f}x as long"]
