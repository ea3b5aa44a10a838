"""Temporary files in a folder of one's own: what an engine or a bench writes to TMPDIR (vLLM's ZMQ
sockets and FileStore files, which vLLM leaves behind, 8 a server start; torchrun's folders) goes where
it can be removed with the folder, while torch's compile cache stays where it was, shared and reused."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)
SOCKET_NAME = 36  # vLLM names its ZMQ sockets by a uuid4, in TMPDIR


def scratch_folder(prefix: str) -> str:
    """A new private folder (mkdtemp) in the temporary directory, or in /tmp where a socket vLLM makes in
    it would not fit a Unix socket's path ("ipc path ... is longer than 107 characters", with TMPDIR
    under a deep folder, as pytest's or a job's)."""
    base = tempfile.gettempdir()
    if len(os.path.join(base, prefix + "x" * 8, "x" * SOCKET_NAME)) > SOCKET_PATH_MAX:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def inductor_cache_dir() -> str:
    """Where torch's compile cache is now: TORCHINDUCTOR_CACHE_DIR, else torch's default under TMPDIR (what
    moving TMPDIR would move, and a cold cache costs an engine's start minutes of compiling)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # local: torch is heavy

    return default_cache_dir()


def scratch_env(folder: str) -> dict[str, str]:
    """The environment entries that send a child's temporary files to `folder`, keeping the compile cache."""
    return {"TMPDIR": folder, "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()}


@contextlib.contextmanager
def own_tmpdir(prefix: str):
    """This process's temporary files, and its children's, in a new folder (`scratch_folder`) while the
    block runs, removed after it: TMPDIR and tempfile's cached directory point there, the compile cache
    stays (`scratch_env`). A SIGKILL leaves the folder (a dedicated engine's reaper removes the engine's)."""
    folder = scratch_folder(prefix)
    saved = tempfile.tempdir, {key: os.environ.get(key) for key in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ.update(scratch_env(folder))
    tempfile.tempdir = folder
    try:
        yield folder
    finally:
        tempfile.tempdir = saved[0]
        for key, value in saved[1].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(folder, ignore_errors=True)
