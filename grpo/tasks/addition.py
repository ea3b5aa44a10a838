"""The embedded synthetic task: fixed-width addition, `07+45=` -> `052`. No download needed."""

from __future__ import annotations

import random

from grpo.tasks.base import Sample, Task


def build_addition(cfg) -> Task:
    from grpo.errors import ConfigError

    d = cfg.digits
    if not 1 <= d <= 4:
        raise ConfigError(f"task.digits={d} must be between 1 and 4.")
    samples = [
        Sample(prompt=f"{a:0{d}d}+{b:0{d}d}=", answer=f"{a + b:0{d + 1}d}")
        for a in range(10**d)
        for b in range(10**d)
    ]
    random.Random(cfg.seed).shuffle(samples)
    if cfg.eval_size >= len(samples):
        raise ConfigError(f"task.eval_size={cfg.eval_size} leaves no training data out of {len(samples)} samples; lower it.")
    return Task("addition", train=samples[cfg.eval_size :], eval=samples[: cfg.eval_size],
                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
