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
RPC_PATH = "VLLM_RPC_BASE_PATH"  # where vLLM binds its ZMQ sockets (default: the temporary directory)
_rpc_folder: str | None = None  # this process's, once chosen (rpc_folder)


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
def environ_kept(*keys: str):
    """These entries of os.environ as they are now come back after the block, whatever it set (an entry
    unset now is unset again), after a raise too."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def own_tmpdir(prefix: str):
    """This process's temporary files, and its children's, in a new folder (`scratch_folder`) while the
    block runs, removed after it: TMPDIR and tempfile's cached directory point there, the compile cache
    stays (`scratch_env`). A SIGKILL leaves the folder (a dedicated engine's reaper removes the engine's)."""
    folder = scratch_folder(prefix)
    saved_tempdir = tempfile.tempdir
    try:
        with environ_kept("TMPDIR", "TORCHINDUCTOR_CACHE_DIR"):  # kept before torch's import may set the cache's
            os.environ.update(scratch_env(folder))
            tempfile.tempdir = folder
            yield folder
    finally:
        tempfile.tempdir = saved_tempdir
        shutil.rmtree(folder, ignore_errors=True)


def rpc_folder() -> str | None:
    """A folder of this process's own for an in-process vLLM engine's ZMQ sockets (`rpc_path`), made here;
    removed with `remove_rpc_folder` after the engine. A tensor-parallel colocated engine's broadcast queue
    binds two (vllm/distributed/device_communicators/shm_broadcast.py) and vLLM never removes them: every
    such run left 2 in /tmp. The path is the same for every engine of the process, made again each time:
    once an engine has started vLLM caches its environment (`envs.enable_envs_cache`), so a later engine of
    the process binds under the first one's path. None where VLLM_RPC_BASE_PATH is set: the user's place."""
    global _rpc_folder
    if os.environ.get(RPC_PATH):
        return None
    if _rpc_folder is None:
        _rpc_folder = scratch_folder("grpo-rpc-")
    os.makedirs(_rpc_folder, mode=0o700, exist_ok=True)
    return _rpc_folder


@contextlib.contextmanager
def rpc_path(folder: str | None):
    """VLLM_RPC_BASE_PATH names `folder` while the block runs (an engine's start, when its sockets are
    bound), and is unset after: a process started later (a server, a subprocess trainer) never inherits a
    folder that goes with this engine. `folder` None: nothing changed."""
    if folder is None:
        yield
        return
    with environ_kept(RPC_PATH):
        os.environ[RPC_PATH] = folder
        yield


def remove_rpc_folder(folder: str | None) -> None:
    """After the engine is gone (or its start failed): its sockets' folder removed."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
