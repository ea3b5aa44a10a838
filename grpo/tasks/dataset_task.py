"""The part every data-set task shares: read the train and eval rows (hub or local files), turn
each into a `Sample` with the task's own converter, and split off the held-out prompts.

Sources, in order:
  - `task.path` set: that local .jsonl or .parquet file is the train split; `task.eval_path`, if
    set, is the eval split, else `eval_size` rows of the train file are held out (seeded).
  - else `task.hub_id` (with `task.hub_config`) through `datasets.load_dataset`: `task.train_split`,
    and `task.eval_split` (null: hold out `eval_size` rows of the train split, for data sets that
    ship one split only).
A data set's eval split is shuffled (seeded) and cut to `eval_size` prompts.
"""

from __future__ import annotations

import random
from typing import Callable

from grpo.errors import DatasetError
from grpo.tasks.base import Sample, Task, hold_out, without_held_out
from grpo.tasks.rows import Row, load_hub_rows, read_local_rows


class RowError(ValueError):
    """Raised by a converter for a row it cannot use; reported with the row's place."""


def convert_rows(rows: list[Row], columns: list[str], to_sample: Callable[[dict], Sample]) -> list[Sample]:
    samples = []
    for where, row in rows:
        missing = [c for c in columns if row.get(c) is None]
        if missing:
            raise DatasetError(f"{where}: missing column(s) {missing}; the row has {sorted(row)}.")
        try:
            samples.append(to_sample(row))
        except RowError as e:
            raise DatasetError(f"{where}: {e}") from e
    return samples


def read_splits(cfg, columns: list[str]) -> tuple[list[Row], list[Row] | None]:
    if cfg.path:
        return read_local_rows(cfg.path), read_local_rows(cfg.eval_path) if cfg.eval_path else None
    if cfg.eval_path:
        raise DatasetError("task.eval_path is set without task.path; give both local files, or neither.")
    if not cfg.hub_id:
        raise DatasetError(f"task={cfg.name} needs task.hub_id (a hub data set) or task.path (a local file).")
    train = load_hub_rows(cfg.hub_id, cfg.hub_config, cfg.train_split, columns)
    held_out = load_hub_rows(cfg.hub_id, cfg.hub_config, cfg.eval_split, columns) if cfg.eval_split else None
    return train, held_out


def build_dataset_task(cfg, columns: list[str], to_sample: Callable[[dict], Sample], is_correct,
                       check_answer: Callable[[Sample], None] | None = None) -> Task:
    """The task from `cfg`'s rows. `check_answer(sample)` (RowError: the ground truth cannot be
    compared) runs on the held-out prompts only: an unreadable one would stop the evaluation, before
    step 1, while a training prompt's fails its completions' reward with a warning, and checking every
    row (math-verify, milliseconds each) would add a minute to building MATH."""
    train_rows, eval_rows = read_splits(cfg, columns)
    # (where, sample) pairs: a seeded shuffle moves both alike, and a held-out row keeps its place for errors
    train = list(zip([where for where, _ in train_rows], convert_rows(train_rows, columns, to_sample)))
    if eval_rows is None:  # hold out rows of the train split
        train, held_out = hold_out(train, cfg.eval_size, cfg.seed, DatasetError, "no eval split: ")
    else:  # a seeded eval_size of the eval split
        held_out = list(zip([where for where, _ in eval_rows], convert_rows(eval_rows, columns, to_sample)))
        random.Random(cfg.seed).shuffle(held_out)
        held_out = held_out[: cfg.eval_size]
    for where, sample in held_out if check_answer is not None else ():
        try:
            check_answer(sample)
        except RowError as e:
            raise DatasetError(f"{where}: {e}") from e
    train = without_held_out(train, held_out, f"task={cfg.name}: ", sample=lambda pair: pair[1])
    return Task(cfg.name, train=[s for _, s in train], eval=[s for _, s in held_out], is_correct=is_correct,
                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
