"""The command-line wrapper shared by `grpo.train`, `grpo.eval`, `grpo.launch`, `grpo.verify` and `grpo.bench`."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from grpo.errors import USER_ERRORS, did_you_mean


def override_advice(e: HydraException) -> str | None:
    """What to change for the two override mistakes whose Hydra message misleads: a key the schema does
    not have (Hydra advises `+key=value`, which validate then refuses: the key would be read by no code)
    and one value given to a list (`rollout.remote.urls=http://node7:8000`: "str is not a ListConfig")."""
    cause = e.__cause__
    full_key, schema = str(getattr(cause, "full_key", "") or ""), getattr(cause, "object_type", None)
    if full_key and "To append to your config use +" in str(e) and dataclasses.is_dataclass(schema):
        key = str(getattr(cause, "key", None) or full_key.rsplit(".", 1)[-1])
        prefix = full_key[: len(full_key) - len(key)]
        declared = {f.name for f in dataclasses.fields(schema)}
        return f"{full_key} is not a setting of {prefix.rstrip('.') or 'the config'}{did_you_mean(key, declared, prefix)}."
    if full_key and "is not a ListConfig" in str(cause) and "override " in str(e):
        value = str(e).split("override ", 1)[1].split("=", 1)[-1].strip()
        return f"{full_key} takes a list: write {full_key}=[{value}] (several: [{value},...])."
    return None


FILE_KEY = re.compile(r"^In '([^']+)': ConfigKeyError raised while composing config:\s*Key '([^']+)' not in '([^']*)'"
                      r"\s*full_key: (\S+)")


def schema_of(path: str):
    """The dataclass that types the config node at `path` ("algo", "rollout.vllm"), or None."""
    from grpo.config import Config  # local: the schema imports torch; a mistake in a file is rare

    schema = Config
    for part in path.split(".") if path else ():
        hint = typing.get_type_hints(schema).get(part)
        schema = next((t for t in typing.get_args(hint) if dataclasses.is_dataclass(t)), hint)  # Optional[X]: X
        if not dataclasses.is_dataclass(schema):
            return None
    return schema


def list_entry_schema(name: str) -> tuple[str, type] | None:
    """(path, dataclass) of the list whose entries the dataclass called `name` types ("RewardFuncConfig":
    reward.funcs), or None."""
    from grpo.config import Config  # local: as in schema_of

    todo = [("", Config)]
    while todo:
        path, schema = todo.pop()
        for field, hint in typing.get_type_hints(schema).items():
            inner = [t for t in typing.get_args(hint) if dataclasses.is_dataclass(t)]
            if typing.get_origin(hint) is list and inner and inner[0].__name__ == name:
                return f"{path}{field}", inner[0]
            todo += [(f"{path}{field}.", t) for t in (hint, *inner) if dataclasses.is_dataclass(t)]
    return None


def file_key_advice(e: HydraException) -> str | None:
    """A key its schema does not declare, set in a config file (an experiment, a group's option): Hydra
    names the file and the key but not the setting meant (`lerning_rate`), and no code reads the key.
    In a list's entry (reward.funcs) Hydra's full_key is the key alone: the entry's type names the list."""
    found = FILE_KEY.match(str(e))
    if not found:
        return None
    where, key, type_name, full_key = found.groups()
    path = full_key[: len(full_key) - len(key)].rstrip(".")
    schema = schema_of(path)
    entry = schema is not None and schema.__name__ != type_name
    if entry:
        path, schema = list_entry_schema(type_name) or (path, None)
    if schema is None:
        return None
    declared = {f.name for f in dataclasses.fields(schema)}
    said = (f"{key} in an entry of {path}, which has no such setting{did_you_mean(key, declared, '')}" if entry else
            f"{full_key}, which is not a setting of {path or 'the config'}{did_you_mean(key, declared, path + '.' if path else '')}")
    return f"{where!r} sets {said}; fix that file (conf/{where}.yaml, or the same path under your hydra.searchpath)."


def hydra_message(e: HydraException) -> str:
    """One line for an override Hydra cannot apply (`algo.lr=abc`, a typo'd key, an unknown group option):
    `override_advice` where Hydra's own advice misleads, else Hydra's own words (which override; for a
    group, its options) and, after them, the cause it wraps (which key and type), whitespace folded and
    cut at 40 words; an unknown option's list of Hydra's search path, which names no fix, left off."""
    advice = override_advice(e) or file_key_advice(e)
    if advice:
        return advice
    cause = f" ({' '.join(str(e.__cause__).split()[:40])})" if e.__cause__ else ""
    return f"{' '.join(str(e).split('Config search path:')[0].split())}{cause}"


def compose_first(argv: list[str]) -> None:
    """For `grpo.train` and `grpo.eval` (Hydra apps): compose the command line's overrides before
    @hydra.main does, so that a mistake in one gets `hydra_message`'s answer (exit_on_user_error) rather
    than the one Hydra prints itself (`+algo.lerning_rate=...`). A command line with a flag (-m, --help,
    --cfg, -cn, ...) is left to Hydra."""
    if any(arg.startswith("-") for arg in argv):
        return
    from grpo.config import compose_config  # torch and the schema: the app imports them anyway

    overrides = OverridesParser.create().parse_overrides(argv)
    if any(o.is_sweep_override() or o.key_or_group == "hydra.mode" for o in overrides):  # a sweep: Hydra's (hydra.mode=MULTIRUN)
        return
    compose_config(argv)


def exit_on_user_error(fn, *args):
    """`fn(*args)` for a command line: an error the user can fix (grpo/errors.py, or an override Hydra
    cannot apply) ends the process with its one-line message (`error: ...`, naming what to change)
    instead of a traceback."""
    try:
        return fn(*args)
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    except HydraException as e:
        sys.exit(f"error: {hydra_message(e)}")
