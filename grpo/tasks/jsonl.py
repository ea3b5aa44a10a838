"""A local JSON-lines file of {"prompt": ..., "answer": ...} rows; the last `eval_size` rows after
a seeded shuffle are held out. Every row is checked: a bad one is an error naming file and line."""

from __future__ import annotations

import os

from grpo.errors import DatasetError
from grpo.tasks.base import Sample, Task, hold_out
from grpo.tasks.rows import read_jsonl_rows

__all__ = ["DatasetError", "build_jsonl", "read_jsonl"]


def read_jsonl(path: str) -> list[Sample]:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DatasetError(f"task.path={path!r} does not exist; point it at a .jsonl file.")
    samples = []
    for where, row in read_jsonl_rows(path):
        for key in ("prompt", "answer"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise DatasetError(f"{where}: field {key!r} is missing or not a non-empty string.")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
        samples.append(Sample(prompt=row["prompt"], answer=row["answer"], meta=meta))
    if not samples:
        raise DatasetError(f"{path}: the file has no rows; a task needs at least one prompt.")
    return samples


def build_jsonl(cfg) -> Task:
    if not cfg.path:
        raise DatasetError("task=jsonl needs task.path=/path/to/file.jsonl.")
    samples = read_jsonl(cfg.path)
    train, held_out = hold_out(samples, cfg.eval_size, cfg.seed, DatasetError, f"{cfg.path}: ")
    return Task("jsonl", train=train, eval=held_out,
                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
