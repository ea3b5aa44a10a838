"""A local JSON-lines file of {"prompt": ..., "answer": ...} rows (`task.path`); the held-out prompts
are `eval_size` rows of `task.eval_path` after a seeded shuffle, or, without one, `eval_size` rows of
the train file. Every row is checked: a bad one is an error naming file and line."""

from __future__ import annotations

import math
import os
import random

from grpo.errors import DatasetError
from grpo.rewards.math_answer import is_equivalent
from grpo.tasks.base import Sample, Task, exact_answer, hold_out, without_held_out
from grpo.tasks.dataset_task import RowError
from grpo.tasks.math_problems import check_ground_truth
from grpo.tasks.rows import WrittenFloat, read_jsonl_rows

__all__ = ["DatasetError", "build_jsonl", "read_jsonl"]


def read_jsonl(path: str, key: str = "task.path") -> list[Sample]:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DatasetError(f"{key}={path!r} does not exist; point it at a .jsonl file.")
    if path.lower().endswith((".csv", ".tsv", ".parquet", ".xlsx", ".xls")):  # .ndjson, no suffix: JSON lines too
        raise DatasetError(f"{key}={path!r}: task=jsonl reads JSON lines (one {{\"prompt\": ..., \"answer\": ...}} object "
                           "per line, a .jsonl file); convert the file (a .csv or .parquet is not read as one).")
    samples = []
    for where, row in read_jsonl_rows(path):
        answer = row.get("answer")
        if isinstance(answer, float) and not math.isfinite(answer):
            raise DatasetError(f"{where}: field 'answer' is {answer}, which no completion can match; give the "
                               "ground truth as a number or a string.")
        if type(answer) is int or isinstance(answer, WrittenFloat):  # {"answer": 4}, 1.50: the number as written
            row["answer"] = str(answer)
        if isinstance(row.get("prompt"), list):  # TRL's conversational rows
            raise DatasetError(f"{where}: field 'prompt' is a list (chat messages); give the user's text as a string: "
                               "the chat template is applied to it (task.chat_template), and task.system_prompt sets "
                               "a system message.")
        for key in ("prompt", "answer"):
            if not isinstance(row.get(key), str) or not row[key].strip():  # "  ": an empty completion would match it
                raise DatasetError(f"{where}: field {key!r} is missing or not a non-empty string"
                                   f"{' or a number' if key == 'answer' else ''}.")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
        samples.append(Sample(prompt=row["prompt"], answer=row["answer"], meta=meta))
    if not samples:
        raise DatasetError(f"{path}: the file has no rows; a task needs at least one prompt.")
    return samples


def build_jsonl(cfg) -> Task:
    if not cfg.path:
        raise DatasetError("task=jsonl needs task.path=/path/to/file.jsonl.")
    samples = read_jsonl(cfg.path)
    if cfg.eval_path:  # a seeded eval_size of the held-out file, as a data set's eval split
        train, held_out = samples, read_jsonl(cfg.eval_path, "task.eval_path")
        random.Random(cfg.seed).shuffle(held_out)
        held_out = held_out[: cfg.eval_size]
    else:
        train, held_out = hold_out(samples, cfg.eval_size, cfg.seed, DatasetError, f"{cfg.path}: ")
    if cfg.get("correct", "exact") == "math_verify":  # as gsm8k's and math's: now, not at the first evaluation
        for sample in held_out:
            try:
                check_ground_truth(sample)
            except RowError as e:
                raise DatasetError(f"{cfg.eval_path or cfg.path}: the held-out row with prompt {sample.prompt[:60]!r}: "
                                   f"{e}") from e
    train = without_held_out(train, held_out, f"{cfg.path}: ")
    correct = {"exact": exact_answer, "math_verify": lambda completion, s: is_equivalent(completion, s.answer)}
    return Task("jsonl", train=train, eval=held_out, is_correct=correct[cfg.get("correct", "exact")],
                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
