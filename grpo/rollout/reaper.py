"""`python grpo/rollout/reaper.py PGID GRACE_S TRAINER_PID` (`reaper_argv`): ends an engine's process group when
the trainer that started it dies.

The engine server gets SIGTERM from the kernel when its trainer dies (PR_SET_PDEATHSIG), but
vLLM's server then waits for the requests in flight to finish, and with its trainer gone and its
engine core stopped it can wait without end (seen with several requests in flight at a SIGKILL).
This small process (no torch, no vLLM) is started beside each engine with the same death signal:
it sends SIGTERM to the engine's process group, then SIGKILL after GRACE_S. It exits by itself
once the group is gone (the trainer's own close() ends it on a normal exit).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import time


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """`sig` to this process when the one that started it dies (Linux; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to the group, then SIGKILL to what is left after `grace_s`."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reaper_argv(pgid: int, grace_s: float, trainer_pid: int, folder: str = "") -> list[str]:
    """The reaper's command: this file run by its path, not `-m grpo.rollout.reaper`, which would import the
    grpo.rollout package, and torch with it (235 MB and 3 s beside every engine, for a loop of signals)."""
    return [sys.executable, os.path.abspath(__file__), str(pgid), str(grace_s), str(trainer_pid), *([folder] if folder else [])]


def reap(pgid: int, grace_s: float, parent: int, folder: str = "") -> None:
    """Wait until the engine's group is gone, or `parent` (the trainer) dies: then end the group. Then
    remove `folder` (the engine's TMPDIR and URL file), which a killed trainer's close() never did."""
    parent_died = []
    signal.signal(signal.SIGTERM, lambda *_: parent_died.append(True))
    die_with_parent()
    while group_alive(pgid):
        if parent_died or os.getppid() != parent:  # the second: it died before the signal was set up
            end_group(pgid, grace_s)
            break
        time.sleep(0.5)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo.rollout.reaper", description=__doc__.split("\n\n")[0],
                                     epilog="Started by rollout=dedicated beside each engine; not run by hand.")
    parser.add_argument("pgid", type=int, help="the engine's process group")
    parser.add_argument("grace_s", type=float, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("trainer_pid", type=int, help="the trainer that started the engine")
    parser.add_argument("folder", nargs="?", default="", help="removed once the group is gone (the engine's TMPDIR)")
    args = parser.parse_args()
    reap(args.pgid, args.grace_s, args.trainer_pid, args.folder)
