"""Where a run's code came from, for its summary.json: the commit, and whether the tree differed
from it (a result quoted from a run names the code that produced it)."""

from __future__ import annotations

import os
import subprocess


def git_revision(folder: str | None = None) -> str:
    """The commit of the checkout holding `folder` (this package's by default), with "-dirty" when a
    tracked file differs from it (a run from an edited tree is not that commit's); "unknown" outside a
    checkout. `GIT_OPTIONAL_LOCKS=0`: the status check takes no index lock, so it never blocks, nor
    is blocked by, a git command the user runs meanwhile."""
    here = folder or os.path.dirname(os.path.abspath(__file__))
    git = lambda *args: subprocess.check_output(["git", *args], cwd=here, text=True, stderr=subprocess.DEVNULL,  # noqa: E731
                                                env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}).strip()
    try:
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}-dirty" if changed else commit
