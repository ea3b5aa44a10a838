"""Prompt sources. A task yields `Sample`s with what the rewards need; `TASKS` maps names to builders."""

from __future__ import annotations

from grpo.tasks.addition import build_addition
from grpo.tasks.base import Sample, Task, TrainSampler
from grpo.tasks.jsonl import build_jsonl

TASKS = {
    "addition": build_addition,
    "jsonl": build_jsonl,
}


def build_task(cfg) -> Task:
    return TASKS[cfg.name](cfg)


__all__ = ["TASKS", "Sample", "Task", "TrainSampler", "build_task"]
