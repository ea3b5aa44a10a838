"""Save and resume everything a run needs: weights, optimizer, scheduler, step, data position, RNG.

A checkpoint is written into a temporary folder, fsynced, renamed into place, and only then named in
`checkpoints/latest` (itself replaced atomically). A kill at any moment leaves `latest` pointing at
a complete checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch

DONE = "COMPLETE"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path)


def save_checkpoint(run_dir: str, step: int, strategy, state: dict, keep: int = 2) -> str:
    root = os.path.join(run_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    name = f"step_{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    strategy.save(tmp)
    torch.save({**state, "step": step, "rng": rng_state()}, os.path.join(tmp, "state.pt"))
    open(os.path.join(tmp, DONE), "w").close()
    _fsync_tree(tmp)
    if os.path.exists(final):  # the same step saved again after a resume
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, f".latest-{os.getpid()}")
    with open(pointer, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, "latest"))
    _fsync_dir(root)
    _prune(root, keep, name)
    return final


def _prune(root: str, keep: int, newest: str) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for d in done[: max(0, len(done) - max(keep, 1))]:
        if d != newest:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    for d in os.listdir(root):  # leftovers of saves that were killed; this save has been renamed
        if d.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def latest_checkpoint(run_dir: str) -> str | None:
    pointer = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(run_dir, "checkpoints", f.read().strip())
    if not os.path.isfile(os.path.join(path, DONE)):
        raise RuntimeError(f"{pointer} names {path}, which is not a complete checkpoint; remove the pointer to start over.")
    return path


def load_checkpoint(path: str, strategy) -> dict:
    """Restore the strategy's state and the RNG; returns the trainer state (step, data position...)."""
    strategy.load(path)
    state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
    set_rng_state(state.pop("rng"))
    return state
