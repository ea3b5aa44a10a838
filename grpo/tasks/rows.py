"""Rows of a data set, from the hub through `datasets` or from a local .jsonl or .parquet file,
each paired with where it came from (`file:line`, `file: row N`, `hub_id[split] row N`) so that a
task can reject a malformed row with an error naming it. Nothing is skipped: a bad row stops the run.
"""

from __future__ import annotations

import json
import os

from grpo.errors import DatasetError

Row = tuple[str, dict]  # (where it came from, the row)


class WrittenFloat(float):
    """A JSON number with a fraction or exponent, remembering its text: an answer written 1.50 or 1e2
    is compared as written, not as Python prints the float ("1.5", "100.0")."""

    def __new__(cls, text: str):
        number = super().__new__(cls, text)
        number.written = text
        return number

    def __str__(self) -> str:  # str(answer) in a task's converter; json.dumps still writes the float
        return self.written

    def __reduce__(self):  # pickled (a sample sent to a worker) with its text
        return WrittenFloat, (self.written,)


def read_jsonl_rows(path: str) -> list[Row]:
    """One JSON object per line (UTF-8, with or without a byte-order mark); blank lines are allowed, anything
    else that is not an object is an error."""
    rows = []
    with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Notepad, PowerShell) is no part of line 1
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line, parse_float=WrittenFloat)
            except json.JSONDecodeError as e:
                if not rows and line.strip() == "[":  # an indented JSON array: its line 1 is no row to fix
                    raise DatasetError(array_message(path, lineno)) from e
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove that line.") from e
            if not rows and isinstance(row, list) and row and all(isinstance(r, dict) for r in row):
                raise DatasetError(array_message(path, lineno))  # the rows as one array on one line
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}.")
            rows.append((f"{path}:{lineno}", row))
    return rows


def array_message(path: str, lineno: int) -> str:
    return (f"{path}:{lineno}: the file is one JSON array of rows; task.path (and task.eval_path) read JSON lines, one "
            "object per line: convert it (jq -c '.[]' in.json > out.jsonl, or datasets' to_json(..., lines=True)).")


def read_parquet_rows(path: str) -> list[Row]:
    import pyarrow.parquet as pq  # local: pyarrow is heavy, needed only for a .parquet file

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e}).") from e
    return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist(), start=1)]


def read_local_rows(path: str) -> list[Row]:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DatasetError(f"{path!r} does not exist; point task.path (or task.eval_path) at a .jsonl or .parquet file.")
    if path.endswith(".parquet"):
        rows = read_parquet_rows(path)
    elif path.endswith((".jsonl", ".json")):
        rows = read_jsonl_rows(path)
    else:
        raise DatasetError(f"{path}: unknown file type; use a .jsonl (one JSON object per line) or .parquet file.")
    if not rows:
        raise DatasetError(f"{path}: the file has no rows; a task needs at least one prompt.")
    return rows


def load_hub_rows(hub_id: str, config: str | None, split: str, columns: list[str]) -> list[Row]:
    """A split of a hub data set through `datasets.load_dataset` (cached under HF_HOME)."""
    try:
        import datasets  # local: datasets is optional and heavy, needed only for a hub data set

        data = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # noqa: BLE001 - no network, a wrong id or split: all end the same way
        raise DatasetError(
            f"could not load {hub_id!r} (config {config!r}, split {split!r}) through datasets "
            f"({type(e).__name__}: {str(e)[:300]}). Check task.hub_id, task.hub_config and the split names; "
            f"without hub access, set task.path (and task.eval_path) to local .jsonl or .parquet files with "
            f"the columns {columns}."
        ) from e
    return [(f"{hub_id}[{split}] row {i}", row) for i, row in enumerate(data, start=1)]
