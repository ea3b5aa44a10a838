"""Prompt sources. A task yields `Sample`s with what the rewards need; `TASKS` maps names to builders."""

from __future__ import annotations

from grpo.tasks.addition import build_addition
from grpo.tasks.arithmetic import build_arithmetic
from grpo.tasks.base import Sample, Task, TrainSampler
from grpo.tasks.countdown import build_countdown
from grpo.tasks.gsm8k import build_gsm8k
from grpo.tasks.guess import build_guess
from grpo.tasks.jsonl import build_jsonl
from grpo.tasks.math_problems import build_math
from grpo.tasks.shapes import build_shapes

TASKS = {
    "addition": build_addition,
    "arithmetic": build_arithmetic,
    "jsonl": build_jsonl,
    "gsm8k": build_gsm8k,
    "math": build_math,
    "countdown": build_countdown,
    "guess": build_guess,
    "shapes": build_shapes,
}


def build_task(cfg) -> Task:
    return TASKS[cfg.name](cfg)


__all__ = ["TASKS", "Sample", "Task", "TrainSampler", "build_task"]
