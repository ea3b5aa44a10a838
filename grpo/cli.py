"""The command-line wrapper shared by `grpo.train`, `grpo.eval`, `grpo.launch`, `grpo.verify` and `grpo.bench`."""

from __future__ import annotations

import sys

from hydra.errors import HydraException

from grpo.errors import USER_ERRORS


def hydra_message(e: HydraException) -> str:
    """One line for an override Hydra cannot apply (`algo.lr=abc`, a typo'd key, an unknown group option):
    Hydra's own words (which override; for a group, its options) and, after them, the cause it wraps
    (which key and type), whitespace folded and cut at 40 words; an unknown option's list of Hydra's
    search path, which names no fix, left off."""
    cause = f" ({' '.join(str(e.__cause__).split()[:40])})" if e.__cause__ else ""
    return f"{' '.join(str(e).split('Config search path:')[0].split())}{cause}"


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
