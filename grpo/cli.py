"""The command-line wrapper shared by `grpo.train`, `grpo.eval` and `grpo.launch`."""

from __future__ import annotations

import sys

from grpo.errors import USER_ERRORS


def exit_on_user_error(fn, *args):
    """`fn(*args)` for a command line: an error the user can fix (grpo/errors.py) ends the process
    with its one-line message (`error: ...`, naming what to change) instead of a traceback."""
    try:
        return fn(*args)
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
