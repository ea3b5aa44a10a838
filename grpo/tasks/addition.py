"""The embedded synthetic task: fixed-width addition, `07+45=` -> `052`. No download needed."""

from __future__ import annotations

from grpo.errors import ConfigError
from grpo.tasks.base import Sample, Task, hold_out


def build_addition(cfg) -> Task:
    d = cfg.digits
    if not 1 <= d <= 4:
        raise ConfigError(f"task.digits={d} must be between 1 and 4.")
    samples = [
        Sample(prompt=f"{a:0{d}d}+{b:0{d}d}=", answer=f"{a + b:0{d + 1}d}")
        for a in range(10**d)
        for b in range(10**d)
    ]
    train, held_out = hold_out(samples, cfg.eval_size, cfg.seed, ConfigError)
    return Task("addition", train=train, eval=held_out,
                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
