"""Prompt sources. A task yields `Sample`s with what the rewards need; `TASKS` maps names to builders."""

from __future__ import annotations

import dataclasses
import os

from omegaconf import OmegaConf

from grpo.errors import ConfigError
from grpo.tasks import addition, arithmetic
from grpo.tasks.addition import build_addition
from grpo.tasks.arithmetic import build_arithmetic
from grpo.tasks.base import Sample, Task, TrainSampler
from grpo.tasks.countdown import build_countdown
from grpo.tasks.gsm8k import build_gsm8k
from grpo.tasks.guess import HIGH as GUESS_SECRETS, build_guess
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

IMAGE_TASKS = ("shapes",)  # the tasks whose prompts carry images (Sample.meta["images"]): a VLM's (grpo/vision.py)

# The task.* fields each task reads, besides name, chat_template and system_prompt (every task's):
# any other one set away from its schema default would change nothing, so validate refuses it.
SPLIT = ("eval_size", "seed")  # a seeded split holding eval_size prompts out
DATA = ("path", "eval_path", "hub_id", "hub_config", "train_split", "eval_split")
HUB_DATA = ("gsm8k", "math", "countdown")
READS = {
    "addition": (*SPLIT, "digits"),
    "arithmetic": (*SPLIT, "digits", "answer_format"),
    "jsonl": (*SPLIT, "path", "eval_path", "correct"),  # the rows are the prompts as they are: no answer_format
    **{name: (*SPLIT, *DATA, "answer_format") for name in HUB_DATA},
    "guess": (),  # one prompt, the 15 secrets: nothing to size, split or seed
    "shapes": (*SPLIT, "size"),
}
# values a task takes as they are: guess evaluates each of its secrets once (conf/task/guess.yaml)
FIXED = {"guess": {"eval_size": GUESS_SECRETS}}
DATA_FIELDS = ("path", "eval_path", "hub_id", "hub_config")  # the ones a file of rows would be given by
# the generated tasks' operands by task.digits: their prompts are every pair, counted before a job is submitted
OPERANDS = {"addition": addition.operands, "arithmetic": arithmetic.operands}


def unread_settings(cfg) -> list[str]:
    """The task.* fields of `cfg` set away from the schema's default that task `cfg.name` never reads."""
    schema = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(schema):  # an untyped config (a test's dict) has no defaults to compare with
        return []
    reads = {"name", "chat_template", "system_prompt", *READS.get(cfg.name, ()), *FIXED.get(cfg.name, {})}
    return [f.name for f in dataclasses.fields(schema)
            if f.name not in reads and f.default is not dataclasses.MISSING and cfg.get(f.name) != f.default]


def check_task(cfg, preset: dict | None = None) -> None:
    """validate's part (`cfg`: task): a field the chosen task does not read is refused
    (task.path=train.jsonl without task=jsonl trained on addition without a word; task.digits=3 on a
    file changed nothing), and so is an eval split that is the train split, and a hub setting changed
    from the task's own file (`preset`: the values conf/task/<name>.yaml sets) beside task.path."""
    if cfg.name in TASKS and cfg.name not in READS:  # a new task registered in TASKS alone (CONTRIBUTING.md)
        raise ConfigError(f"task={cfg.name} is in TASKS but not in READS (grpo/tasks/__init__.py): add the task.* fields "
                          f"its builder reads there, e.g. {cfg.name!r}: (*SPLIT, \"path\"), so that a field it does not "
                          f"read is refused.")
    unread = unread_settings(cfg)
    if unread:
        key, value = unread[0], cfg.get(unread[0])
        readers = sorted(name for name, keys in READS.items() if key in keys)
        rows_file = key in DATA_FIELDS and cfg.name != "jsonl"
        hint = ("Add task=jsonl for a file of prompt/answer rows, or drop it." if rows_file else
                "Drop it, or choose a task that reads it.")
        raise ConfigError(f"task.{key}={value!r} is not read by task={cfg.name}: it is read by "
                          f"task={', task='.join(readers) or '(none)'}. {hint}")
    for key, value in FIXED.get(cfg.name, {}).items():
        if cfg.get(key) != value:
            raise ConfigError(f"task.{key}={cfg.get(key)!r}: task={cfg.name} evaluates each of its {value} secrets "
                              f"once, so it takes task.{key}={value} only; drop the setting.")
    if cfg.name in OPERANDS:
        prompts = len(OPERANDS[cfg.name](cfg.digits)) ** 2
        if cfg.eval_size >= prompts:
            raise ConfigError(f"task.eval_size={cfg.eval_size} leaves no training rows out of the {prompts} prompts "
                              f"task={cfg.name} task.digits={cfg.digits} makes; lower task.eval_size or raise task.digits.")
    check_overlap(cfg)
    check_source(cfg, preset or {})


HUB_SOURCE = ("hub_id", "hub_config", "train_split", "eval_split")  # the hub's rows: unread under task.path


def check_source(cfg, preset: dict) -> None:
    """task.path set: the rows are that file's (grpo/tasks/dataset_task.py), so a hub setting changed
    from the task's file would change nothing (task.hub_id=my/gsm8k beside a path trained on the path
    without a word). `preset`: what conf/task/<name>.yaml sets; the schema's default elsewhere."""
    if cfg.name not in HUB_DATA or not cfg.get("path"):
        return
    schema = OmegaConf.get_type(cfg)
    chosen = {**({f.name: f.default for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}), **preset}
    for key in HUB_SOURCE:
        if key in chosen and cfg.get(key) != chosen[key]:
            raise ConfigError(f"task.{key}={cfg.get(key)!r} is not read: task.path={cfg.path!r} is set, so the rows "
                              f"come from that file (the eval prompts from task.eval_path, or task.eval_size rows of "
                              f"it held out). Drop task.{key}, or drop task.path to load the hub data set.")


def check_overlap(cfg) -> None:
    """An eval split that is the train split: every held-out prompt would be trained on, and eval
    accuracy would measure memory. A file given as both, or a hub split named twice."""
    if cfg.get("path") and cfg.get("eval_path"):
        train, held_out = (os.path.realpath(os.path.expanduser(cfg[k])) for k in ("path", "eval_path"))
        if train == held_out:
            raise ConfigError(f"task.eval_path={cfg.eval_path!r} is task.path ({train}): every held-out prompt would "
                              f"also be trained on. Drop task.eval_path to hold out task.eval_size rows of the file, "
                              f"or point it at a separate file.")
    elif cfg.name in HUB_DATA and not cfg.get("path") and cfg.get("eval_split") == cfg.get("train_split"):
        raise ConfigError(f"task.eval_split={cfg.eval_split!r} is task.train_split: every held-out prompt of "
                          f"{cfg.hub_id} would also be trained on. Set task.eval_split=null to hold out "
                          f"task.eval_size rows of that split (a data set with one split, e.g. MATH-500), or name "
                          f"another split.")


def build_task(cfg) -> Task:
    return TASKS[cfg.name](cfg)


__all__ = ["IMAGE_TASKS", "TASKS", "Sample", "Task", "TrainSampler", "build_task", "check_task"]
