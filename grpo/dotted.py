"""User code named by a dotted path in the config (`reward.funcs`, `env.name`, `logger.backend`):
`mypkg.module.attr`, imported when the run is validated, so a wrong path stops it before any model loads."""

from __future__ import annotations

import importlib

from grpo.errors import ConfigError


def import_dotted(name: str, where: str):
    """`module.attr` of `name`; ConfigError naming `where` (the setting) when it cannot be imported.
    The caller has ruled out a name with no dot (its registry's message names the options)."""
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError, TypeError) as e:  # ValueError, TypeError: '.x', 'x..y'
        raise ConfigError(f"{where} could not be imported ({e}); check the dotted path.") from e
