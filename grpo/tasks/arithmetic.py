"""Arithmetic word questions generated in code, for instruction-tuned models on CPU:
"What is 37 + 48? Answer with just the number." -> `85`. Unlike `addition` (a bare `07+45=` for a
model trained from scratch), the prompt is a question for a chat template and the answer is
checked by value (math-verify finds the final number), so "The answer is 85." counts; "37 + 48",
the question restated, does not (grpo/rewards/math_answer.py: the answer must be written)."""

from __future__ import annotations

from grpo.errors import ConfigError
from grpo.rewards.math_answer import is_equivalent
from grpo.tasks.base import Sample, Task, hold_out

ANSWER_FORMAT = "Answer with just the number."


def build_arithmetic(cfg) -> Task:
    d = cfg.digits
    if not 1 <= d <= 4:
        raise ConfigError(f"task.digits={d} must be between 1 and 4.")
    instruction = ANSWER_FORMAT if cfg.answer_format is None else cfg.answer_format
    low = 0 if d == 1 else 10 ** (d - 1)  # d-digit operands, no leading zeros
    samples = [
        Sample(prompt=f"What is {a} + {b}? {instruction}".strip(), answer=str(a + b))
        for a in range(low, 10**d)
        for b in range(low, 10**d)
    ]
    train, held_out = hold_out(samples, cfg.eval_size, cfg.seed, ConfigError)
    return Task("arithmetic", train=train, eval=held_out,
                is_correct=lambda completion, s: is_equivalent(completion, s.answer),
                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
