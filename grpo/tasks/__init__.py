"""Prompt sources. A task yields `Sample`s with what the rewards need; `TASKS` maps names to builders."""

from __future__ import annotations

from grpo.errors import ConfigError
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


# the data-source fields each task reads (the others take none: their prompts are made in code)
DATA_FIELDS = {"jsonl": ("path", "eval_path"), **{name: ("path", "eval_path", "hub_id", "hub_config")
                                                    for name in ("gsm8k", "math", "countdown")}}


def check_task(cfg) -> None:
    """validate's part: a task.path, eval_path, hub_id or hub_config the chosen task does not read is
    refused (task.path=train.jsonl without task=jsonl trained on addition without a word)."""
    unread = [k for k in ("path", "eval_path", "hub_id", "hub_config")
              if cfg.get(k) is not None and k not in DATA_FIELDS.get(cfg.name, ())]
    if unread:
        readers = sorted(name for name, keys in DATA_FIELDS.items() if unread[0] in keys)
        raise ConfigError(f"task.{unread[0]}={cfg.get(unread[0])!r} is not read by task={cfg.name}: it is read by "
                          f"task={', task='.join(readers)}. Add task=jsonl for a file of prompt/answer rows, or drop it.")


def build_task(cfg) -> Task:
    return TASKS[cfg.name](cfg)


__all__ = ["TASKS", "Sample", "Task", "TrainSampler", "build_task", "check_task"]
