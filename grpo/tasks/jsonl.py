"""A local JSON-lines file of {"prompt": ..., "answer": ...} rows; the last `eval_size` rows after
a seeded shuffle are held out. Every row is checked: a bad one is an error naming file and line."""

from __future__ import annotations

import json
import os
import random

from grpo.tasks.base import Sample, Task


class DatasetError(ValueError):
    pass


def read_jsonl(path: str) -> list[Sample]:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DatasetError(f"task.path={path!r} does not exist; point it at a .jsonl file.")
    samples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove that line.") from e
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object with 'prompt' and 'answer'.")
            for key in ("prompt", "answer"):
                if not isinstance(row.get(key), str) or not row[key]:
                    raise DatasetError(f"{path}:{lineno}: field {key!r} is missing or not a non-empty string.")
            meta = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
            samples.append(Sample(prompt=row["prompt"], answer=row["answer"], meta=meta))
    if not samples:
        raise DatasetError(f"{path}: the file has no rows; a task needs at least one prompt.")
    return samples


def build_jsonl(cfg) -> Task:
    if not cfg.path:
        raise DatasetError("task=jsonl needs task.path=/path/to/file.jsonl.")
    samples = read_jsonl(cfg.path)
    if cfg.eval_size >= len(samples):
        raise DatasetError(
            f"{cfg.path}: task.eval_size={cfg.eval_size} leaves no training rows out of {len(samples)}; lower it."
        )
    random.Random(cfg.seed).shuffle(samples)
    return Task("jsonl", train=samples[cfg.eval_size :], eval=samples[: cfg.eval_size])
