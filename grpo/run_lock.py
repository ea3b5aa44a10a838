"""One live run per run folder. Two runs in one folder (a second `grpo.train` with the same
hydra.run.dir, a sweep job started twice) each truncated the other's metrics.jsonl and removed the
other's checkpoint in progress (their temporary folders share a name): the first crashed in its next
save and its rows since the second started were lost. The run's rank 0 holds an exclusive `flock` on
`<run_dir>/.lock` from setup to exit; the kernel releases it when the process ends, however it ends
(a kill, a requeue), so a stale lock never blocks a resume. A file system without locks (some NFS
mounts) runs unguarded, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import warnings

from grpo.dist import broadcast_object
from grpo.errors import RunFolderError

LOCK = ".lock"


def _take(run_dir: str):
    """(the open lock file or None, an error message or None) on this process."""
    path = os.path.join(run_dir, LOCK)
    try:
        f = open(path, "a+", encoding="utf-8")
    except OSError as e:  # a read-only folder: said on every rank (the broadcast below), not a traceback on one
        return None, f"{run_dir}: this process cannot write there ({e.strerror or e}); give the run a folder it can write (hydra.run.dir=...)."
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        return None, (f"{run_dir} is in use by another run (process {holder}, holding {path}): two runs in one "
                      "folder truncate each other's metrics.jsonl and checkpoints. Wait for it or stop it, or give "
                      "this run its own folder (hydra.run.dir=...).")
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        warnings.warn(f"{run_dir}: the file system takes no locks ({e.strerror}); nothing stops a second run from "
                      "using this folder at the same time.", stacklevel=3)
        return f, None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f, None


@contextlib.contextmanager
def hold_run_folder(run_dir: str, is_main: bool):
    """Every rank calls this; rank 0 takes the lock, and every rank raises RunFolderError when another
    run holds it."""
    held, error = _take(run_dir) if is_main else (None, None)
    error = broadcast_object(error)
    if error:
        raise RunFolderError(error)
    try:
        yield
    finally:
        if held is not None:
            held.close()  # releases the flock
