"""`python -m grpo.bench vs-trl`: TRL's GRPOTrainer against this codebase's `rollout=hf` run on the
same tiny model, task, batch, completion length, learning rate and loss (needs trl, setup.cfg)."""

from __future__ import annotations

import statistics
import tempfile
import time

from grpo.bench_runs import bench_backend, compose, tiny_model_path


def bench_trl(steps: int, ours: dict) -> dict:
    """TRL's GRPOTrainer on the same tiny model, task, batch (32 prompts x 16), completion length,
    learning rate and loss, generating with transformers on this CPU, as `rollout=hf` does."""
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"grpo.bench vs-trl needs TRL: `.venv/bin/pip install trl==1.16.0` ({e})") from e
    from grpo.rewards.exact_match import exact_match as grpo_exact_match
    from grpo.tasks import build_task
    from grpo.tasks.base import Sample

    cfg = compose(["run_dir=unused"])
    path = tiny_model_path()
    task = build_task(cfg.task)
    data = Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in task.train])

    def exact_match(completions, answer, **_):  # TRL's reward signature around this codebase's reward
        return grpo_exact_match(completions, [Sample(prompt="", answer=a) for a in answer])

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
        warmup_steps=a.warmup_steps, lr_scheduler_type="linear", max_steps=steps, beta=0.0, loss_type="grpo",
        temperature=cfg.rollout.temperature, use_cpu=True, bf16=False, report_to=[], logging_steps=1000,
        save_strategy="no", seed=0, max_grad_norm=a.max_grad_norm,
    )
    timer = StepTimes()
    print(f"bench: TRL GRPOTrainer, {steps} steps", flush=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=exact_match, args=args,
                          train_dataset=data, processing_class=AutoTokenizer.from_pretrained(path), callbacks=[timer])
    trainer.train()
    trl_step = statistics.mean(timer.times[1:])
    import trl

    return {"trl_version": trl.__version__, "trl_step_s": trl_step, "grpo_step_s": ours["step_s"],
            "trl_over_grpo": trl_step / ours["step_s"], "steps_timed": len(timer.times) - 1}


def report_trl(steps: int, overrides: list[str]) -> tuple[dict, list]:
    ours = bench_backend("hf", steps, overrides)
    v = bench_trl(steps, ours)
    return {"vs_trl": v, "steps": [ours]}, [
        f"\nTRL {v['trl_version']} GRPOTrainer: {v['trl_step_s']:.3f} s/step vs grpo (rollout=hf) "
        f"{v['grpo_step_s']:.3f} s/step: TRL takes {v['trl_over_grpo']:.2f}x as long"]
