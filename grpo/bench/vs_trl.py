"""`python -m grpo.bench vs-trl [OVERRIDES]`: TRL's GRPOTrainer against this codebase's `rollout=hf`
run on the same model, prompts (as the task renders them), rewards, batch, completion length,
temperature, learning rate and schedule, loss, clipping (both sides of clip-higher), optimisation
passes per batch and KL (needs trl, setup.cfg). The overrides set up both sides: none is the default
run, `experiment=smollm2_arithmetic_cpu` SmolLM2-135M. A setting TRL has no counterpart for
(`unmatched`) is refused before anything runs: timing TRL without it would compare another algorithm."""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from grpo.bench.runs import bench_backend, compose, tiny_model_path
from grpo.models import format_prompt
from grpo.rewards import build_rewards
from grpo.tasks import build_task
from grpo.tasks.base import Sample
from grpo.tiny.folders import resolve_model_folder


# TRL's GRPOTrainer, single-turn, generating with transformers: what each of this codebase's settings must
# be for it to run the same algorithm, and what to change. Checked against trl 1.16.0's GRPOConfig.
UNMATCHED = (
    (lambda c: c.algo.adv_estimator != "grpo", "algo.adv_estimator={v.algo.adv_estimator}: TRL's advantages are the "
     "group mean's (scale_rewards only); set algo.adv_estimator=grpo"),
    (lambda c: c.algo.dynamic_sampling, "algo.dynamic_sampling=true: TRL draws one batch per step; set "
     "algo.dynamic_sampling=false"),
    (lambda c: c.algo.num_minibatches > 1, "algo.num_minibatches={v.algo.num_minibatches}: not mapped to TRL's "
     "steps_per_generation; set algo.num_minibatches=1"),
    (lambda c: c.algo.max_staleness > 0, "algo.max_staleness={v.algo.max_staleness}: TRL generates, then updates, "
     "on the same weights; set algo.max_staleness=0"),
    (lambda c: c.algo.pg_loss != "ppo", "algo.pg_loss={v.algo.pg_loss}: TRL's loss_type=cispo fixes its own "
     "normaliser and bounds, not this codebase's CISPO; set algo.pg_loss=ppo"),
    (lambda c: c.algo.is_level != "none", "algo.is_level={v.algo.is_level}: TRL corrects the sampler only under "
     "vLLM, not when transformers generates; set algo.is_level=none"),
    (lambda c: c.algo.trust_region == "behaviour", "algo.trust_region=behaviour: TRL clips against its own "
     "old-logprob pass; set algo.trust_region=auto"),
    (lambda c: c.env.name != "none" or c.algo.turn_rewards != "none", "env.name={v.env.name}, "
     "algo.turn_rewards={v.algo.turn_rewards}: the bench hands TRL single-turn prompts; set env=none"),
    (lambda c: c.model.dtype != "float32", "model.dtype={v.model.dtype}: the bench runs TRL in fp32 (bf16=False); "
     "set model.dtype=float32"),
    (lambda c: c.model.lora.rank > 0, "model.lora.rank={v.model.lora.rank}: the bench hands TRL the whole model "
     "(no peft_config); set model.lora.rank=0"),
)
SCHEDULES = {"linear": "linear", "constant": "constant_with_warmup"}  # algo.lr_schedule -> lr_scheduler_type


def unmatched(cfg) -> list[str]:
    """The settings of `cfg` TRL's GRPOTrainer cannot match, each with what to change."""
    return [why.format(v=cfg) for differs, why in UNMATCHED if differs(cfg)]


def trl_settings(cfg, steps: int, reward_weights: list[float]) -> dict:
    """GRPOConfig's arguments for `steps` GRPO steps of the run `cfg` composes, but where it writes
    and what it logs: a pure function of the config (tested without trl). TRL counts optimizer steps,
    each of the `algo.num_iterations` passes over a batch one of them, so it takes steps x passes.
    Refuses (SystemExit, every reason at once) what TRL cannot match."""
    if reasons := unmatched(cfg):
        raise SystemExit("grpo.bench vs-trl: TRL's GRPOTrainer cannot run this configuration, so its time would be "
                         "another algorithm's:\n  " + "\n  ".join(reasons))
    a = cfg.algo
    if a.lr_schedule not in SCHEDULES:
        raise SystemExit(f"grpo.bench vs-trl: algo.lr_schedule={a.lr_schedule} has no TRL scheduler here; "
                         f"set one of {sorted(SCHEDULES)}")
    return dict(
        per_device_train_batch_size=a.batch_size, num_generations=a.group_size,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        max_steps=steps * a.num_iterations, num_iterations=a.num_iterations, learning_rate=a.lr,
        warmup_steps=a.warmup_steps, lr_scheduler_type=SCHEDULES[a.lr_schedule], weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm, beta=a.beta, loss_type=a.loss_type, epsilon=a.clip_eps,
        epsilon_high=a.clip_eps if a.clip_eps_high is None else a.clip_eps_high,
        importance_sampling_level=a.ratio_level, scale_rewards=a.adv_scale, mask_truncated_completions=a.mask_truncated,
        # the KL as this codebase's loss takes it: k3, not weighted by the policy ratio (TRL's default is)
        use_bias_correction_kl=False, reward_weights=list(reward_weights), seed=cfg.seed,
        **({} if a.router_aux_loss_coef is None else {"router_aux_loss_coef": a.router_aux_loss_coef}),
    )


def per_batch(times: list[float], passes: int) -> list[float]:
    """TRL's optimizer-step times summed per generated batch (`passes` steps each: one GRPO step, as
    this codebase times it), the first batch left out (it carries the warm-ups)."""
    return [sum(times[i:i + passes]) for i in range(0, len(times) - passes + 1, passes)][1:]


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

    passes = cfg.algo.num_iterations
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-trl-"), use_cpu=True, bf16=False, report_to=[],
                      logging_steps=1000, save_strategy="no",
                      **trl_settings(cfg, steps, [w for _, _, w in rewards]))
    timer = StepTimes()
    print(f"bench: TRL GRPOTrainer, {steps} batches x {passes} optimizer steps", flush=True)
    # fp32, as this side's model.dtype=float32: transformers 5 loads a checkpoint's own dtype by default
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=data,
                          reward_funcs=[as_trl(name, fn) for name, fn, _ in rewards], processing_class=tokenizer,
                          callbacks=[timer])
    trainer.train()
    batches = per_batch(timer.times, passes)
    trl_step = statistics.mean(batches)
    import trl  # trl: optional, only for this bench

    return {"trl_version": trl.__version__, "trl_step_s": trl_step, "grpo_step_s": ours["step_s"],
            "trl_over_grpo": trl_step / ours["step_s"], "steps_timed": len(batches)}


def report_trl(steps: int, overrides: list[str]) -> tuple[dict, list]:
    cfg = compose(["run_dir=unused", *overrides])
    trl_settings(cfg, steps, [])  # refuses what TRL cannot match, before either side runs
    ours = bench_backend("hf", steps, overrides)
    v = {**bench_trl(steps, ours, overrides), "overrides": " ".join(overrides) or "(the default run)"}
    # the same update (flat groups carry no gradient at beta=0): this side skips their forward and backward
    flat = "; grpo leaves groups of equal rewards out of the update (algo.zero_std_groups=drop), TRL trains on them" \
        if cfg.algo.zero_std_groups == "drop" else ""
    return {"vs_trl": v, "steps": [ours]}, [
        f"\nTRL {v['trl_version']} GRPOTrainer on {v['overrides']}: {v['trl_step_s']:.3f} s/step vs grpo (rollout=hf) "
        f"{v['grpo_step_s']:.3f} s/step (a step: one generated batch, {cfg.algo.num_iterations} pass(es) over it): "
        f"TRL takes {v['trl_over_grpo']:.2f}x as long{flat}"]
