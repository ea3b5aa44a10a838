"""Countdown, as in TinyZero (Jiayi-Pan/Countdown-Tasks-3to4): `nums` and `target`; the model must
write an equation that uses each number once and equals the target, inside <answer> tags. It is
checked by grpo.rewards.countdown, which evaluates the equation safely (an `ast` walk, no `eval`)."""

from __future__ import annotations

from grpo.rewards.countdown import countdown
from grpo.tasks.base import Sample, Task
from grpo.tasks.dataset_task import RowError, build_dataset_task

COLUMNS = ["nums", "target"]
ANSWER_FORMAT = (  # TinyZero's instruction
    "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. "
    "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, "
    "for example <answer> (1 + 2) / 3 </answer>."
)


def build_countdown(cfg) -> Task:
    instruction = ANSWER_FORMAT if cfg.answer_format is None else cfg.answer_format

    def to_sample(row: dict) -> Sample:
        nums, target = row["nums"], row["target"]
        if not isinstance(nums, list) or not nums or not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
            raise RowError(f"column 'nums' must be a non-empty list of integers, got {nums!r}.")
        if not isinstance(target, int) or isinstance(target, bool):
            raise RowError(f"column 'target' must be an integer, got {target!r}.")
        prompt = f"Using the numbers {nums}, create an equation that equals {target}. {instruction}".strip()
        return Sample(prompt=prompt, answer=str(target), meta={"numbers": nums, "target": target})

    return build_dataset_task(cfg, COLUMNS, to_sample, lambda completion, s: countdown([completion], [s])[0] == 1.0)
