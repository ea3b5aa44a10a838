"""User code named by a dotted path in the config (`reward.funcs`, `env.name`, `logger.backend`):
`mypkg.module.attr`, imported when the run is validated, so a wrong path stops it before any model loads."""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

from grpo.errors import ConfigError


def import_dotted(name: str, where: str):
    """`module.attr` of `name`; ConfigError naming `where` (the setting) when it cannot be imported.
    The caller has ruled out a name with no dot (its registry's message names the options)."""
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError, TypeError) as e:  # ValueError, TypeError: '.x', 'x..y'
        raise ConfigError(f"{where} could not be imported ({e}); check the dotted path.") from e


def signature_of(fn) -> inspect.Signature | None:
    """fn's signature, or None for a builtin or C function that has none to read (nothing to check then)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def bind_or_refuse(fn, args: tuple, kwargs: dict, refusal: Callable[[inspect.Signature, TypeError], str],
                   partial: bool = False) -> None:
    """The call the run will make, bound to fn's signature now (a misfit failed after the model loaded):
    ConfigError(refusal(signature, error)) where it does not fit; `partial` for a call given more later."""
    signature = signature_of(fn)
    if signature is None:
        return
    try:
        (signature.bind_partial if partial else signature.bind)(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(refusal(signature, e)) from e
