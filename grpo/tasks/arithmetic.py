"""Arithmetic word questions generated in code, for instruction-tuned models on CPU:
"What is 37 + 48? Answer with just the number." -> `85`. Unlike `addition` (a bare `07+45=` for a
model trained from scratch), the prompt is a question for a chat template and the answer is
checked by value (math-verify finds the final number), so "The answer is 85." counts; "37 + 48",
the question restated, does not (grpo/rewards/math_answer.py: the answer must be written)."""

from __future__ import annotations

from grpo.errors import ConfigError
from grpo.rewards.math_answer import is_equivalent
from grpo.tasks.base import Sample, Task, check_digits, hold_out

ANSWER_FORMAT = "Answer with just the number."


def operands(d: int) -> range:
    """Each operand of the d-digit sums, no leading zeros (10 to 99); the prompts are every pair."""
    check_digits(d)
    return range(0 if d == 1 else 10 ** (d - 1), 10**d)


def build_arithmetic(cfg) -> Task:
    instruction = ANSWER_FORMAT if cfg.answer_format is None else cfg.answer_format
    samples = [
        Sample(prompt=f"What is {a} + {b}? {instruction}".strip(), answer=str(a + b))
        for a in operands(cfg.digits)
        for b in operands(cfg.digits)
    ]
    train, held_out = hold_out(samples, cfg.eval_size, cfg.seed, ConfigError)
    return Task("arithmetic", train=train, eval=held_out,
                is_correct=lambda completion, s: is_equivalent(completion, s.answer),
                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
