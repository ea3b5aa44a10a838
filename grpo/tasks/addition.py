"""The embedded synthetic task: fixed-width addition, `07+45=` -> `052`. No download needed."""

from __future__ import annotations

from grpo.errors import ConfigError
from grpo.tasks.base import Sample, Task, check_digits, hold_out


def operands(d: int) -> range:
    """Each operand of the d-digit sums (zero-padded: 00 to 99); the prompts are every pair."""
    check_digits(d)
    return range(10**d)


def build_addition(cfg) -> Task:
    d = cfg.digits
    samples = [
        Sample(prompt=f"{a:0{d}d}+{b:0{d}d}=", answer=f"{a + b:0{d + 1}d}")
        for a in operands(d)
        for b in operands(d)
    ]
    train, held_out = hold_out(samples, cfg.eval_size, cfg.seed, ConfigError)
    return Task("addition", train=train, eval=held_out,
                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
