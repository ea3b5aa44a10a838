"""Save and resume everything a run needs: weights, optimizer, scheduler, step, data position, RNG,
the rewards' running statistics.

A checkpoint is written into a temporary folder, fsynced, renamed into place, and only then named in
`checkpoints/latest` (itself replaced atomically). A kill at any moment leaves `latest` pointing at
a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import time
import warnings

import numpy as np
import torch
from omegaconf import OmegaConf

from grpo import dist
from grpo.errors import ConfigError
from grpo.reward_config import DEFAULT_CHOICES

DONE = "COMPLETE"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(folder)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: str) -> int:
    """The step a checkpoint folder (`checkpoint_name`) holds."""
    return int(os.path.basename(os.path.normpath(path)).removeprefix("step_"))


# what wrote a checkpoint: {"strategy": parallel.strategy, "world_size": processes, "adapter": grpo.lora.adapter_layout}
LAYOUT = "grpo_layout.json"
REPLICAS = ("single", "ddp")  # a full copy of the weights and AdamW in trainer.pt: either reads the other's


def save_checkpoint(run_dir: str, step: int, strategy, state: dict, keep: int = 2, layout: dict | None = None) -> str:
    """Every rank calls this. Rank 0 owns the folder and writes `layout` (LAYOUT); each rank adds its own
    RNG state."""
    root = os.path.join(run_dir, "checkpoints")
    name = checkpoint_name(step)
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    if dist.rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    strategy.save(tmp)
    torch.save({**state, "step": step, "rng": rng_state()}, os.path.join(tmp, f"state_rank{dist.rank()}.pt"))
    if dist.rank() == 0 and layout is not None:
        with open(os.path.join(tmp, LAYOUT), "w") as f:
            json.dump(layout, f)
    dist.barrier()
    if dist.rank() == 0:
        _publish(root, name, tmp, final, keep)
    dist.barrier()
    return final


def _publish(root: str, name: str, tmp: str, final: str, keep: int) -> None:
    open(os.path.join(tmp, DONE), "w").close()
    _fsync_tree(tmp)
    old = None
    if os.path.exists(final):  # the same step saved again: move the old one aside, never delete first
        old = os.path.join(root, f".old-{name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, f".latest-{os.getpid()}")
    with open(pointer, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, "latest"))
    _fsync_dir(root)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep, name)


def _prune(root: str, keep: int, newest: str) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for d in done[: max(0, len(done) - max(keep, 1))]:
        if d != newest:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    for d in os.listdir(root):  # leftovers of saves that were killed; this save has been renamed
        if d.startswith((".tmp-", ".old-")):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        elif d.startswith(".latest-"):  # a pointer a kill left unrenamed
            os.remove(os.path.join(root, d))


def check_writable(run_dir: str) -> None:
    """Every rank writes its own state into each checkpoint: a checkpoints folder it cannot write failed
    at the first save, as a PermissionError traceback, after every step up to it had trained."""
    root = os.path.join(run_dir, "checkpoints")
    where = root if os.path.isdir(root) else run_dir  # not made here: an empty checkpoints/ reads as an earlier run's
    probe = os.path.join(where, f".probe-{socket.gethostname()}-{os.getpid()}")
    try:
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{where}: this process cannot write checkpoints there ({e.strerror or e}); make it writable, "
                          "or give the run a folder it can write (hydra.run.dir=...).") from None


def remove_leftovers(folder: str) -> None:
    """`folder`.tmp-<pid> of any process: a write into place (an export, an adapter) that a kill ended
    left a partial copy (a real model's: gigabytes) beside `folder`. One live run per run folder
    (grpo/run_lock.py), so none is another's in progress."""
    parent, name = os.path.split(os.path.abspath(folder))
    for d in os.listdir(parent) if os.path.isdir(parent) else ():
        if d.startswith(f"{name}.tmp-"):
            shutil.rmtree(os.path.join(parent, d), ignore_errors=True)


def replace_folder(tmp: str, folder: str) -> None:
    """`tmp` (written whole) renamed to `folder`; an earlier `folder` is first renamed aside, as a leftover
    `remove_leftovers` removes, and removed only once the new one is in place: a kill at any moment leaves
    `folder` whole, the earlier one or the new one, never half of one (an rmtree in place left half)."""
    old = f"{folder}.tmp-old-{os.getpid()}"
    if os.path.exists(folder):
        os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str) -> str | None:
    """The checkpoint `latest` names; if a kill left it naming a missing folder, the newest
    complete `step_*` folder instead."""
    root = os.path.join(run_dir, "checkpoints")
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if os.path.isfile(os.path.join(path, DONE)):
            return path
    complete = sorted(d for d in os.listdir(root) if d.startswith("step_") and os.path.isfile(os.path.join(root, d, DONE))) if os.path.isdir(root) else []
    return os.path.join(root, complete[-1]) if complete else None


# what a run leaves that a fresh start must not reuse (an earlier run's export must not stand as this one's)
RUN_RECORDS = ("checkpoints", "metrics.jsonl", "summary.json", "wandb_id", "config.yaml", "model", "adapter")


def set_aside_checkpoints(run_dir: str) -> str | None:
    """`resume=false` in a folder an earlier run used: its checkpoints, `metrics.jsonl`, `summary.json`,
    wandb run id, `config.yaml` (and the `config-<time>.yaml` its resumes kept) and exported `model/` and
    `adapter/` move together into `replaced-<time>-<n>/`, kept but where a resume won't look, so the new
    run neither resumes from them nor truncates or appends to the earlier run's metrics."""
    present = [name for name in RUN_RECORDS if os.path.exists(os.path.join(run_dir, name))]
    present += sorted(n for n in os.listdir(run_dir) if n.startswith("config-") and n.endswith(".yaml"))  # its resumes
    if not present:
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
    while os.path.exists(aside := os.path.join(run_dir, f"replaced-{stamp}-{n}")):
        n += 1
    os.makedirs(aside)
    for name in present:
        os.rename(os.path.join(run_dir, name), os.path.join(aside, name))
    return aside


# what a resumed run may change without training differently from an unbroken one
RESUME_MAY_CHANGE = ("steps", "resume", "run_dir", "threads", "logger", "eval_every", "eval_samples", "checkpoint_every",
                     "keep_checkpoints", "export_model", "launcher", "hydra",
                     # where the servers and judges are: a requeued grpo.launch trainer starts new ones (grpo/companions.py)
                     "rollout.remote.urls", "reward.judge.urls")


# values that mean the same, written differently by another version of grpo: no change on resume
SAME_MEANING = {"reward.judge.choices": ({}, DEFAULT_CHOICES)}  # empty reads as yes/no (since 31a69dd; {yes, no} before)
# settings added later, at a default that keeps what the version before did: absent on one side, the same
ADDED = {"task.correct": "exact"}  # since 1db02ee


def config_changes(old, new, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two resolved configs (nested dicts compared key by
    key, a key on one side only counted unless `ADDED` gives it at that value), leaving out
    `RESUME_MAY_CHANGE`'s keys and values `SAME_MEANING` says are the same."""
    if prefix in SAME_MEANING and old in SAME_MEANING[prefix] and new in SAME_MEANING[prefix]:
        return []
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [prefix or "(root)"]
    changed = []
    for key in sorted(set(old) | set(new), key=str):
        name = f"{prefix}.{key}" if prefix else str(key)
        if name in RESUME_MAY_CHANGE:
            continue
        if key not in old or key not in new:
            if not (name in ADDED and (old if key in old else new)[key] == ADDED[name]):
                changed.append(name)
        else:
            changed += config_changes(old[key], new[key], name)
    return changed


def record_config(run_dir: str, resolved: dict, resuming: bool, finished: bool = False) -> list[str]:
    """Write the run's resolved config to `config.yaml`. Resuming in a folder whose earlier config says
    otherwise (algo.lr, a model, model.lora.alpha: anything a checkpoint does not hold), the earlier file
    is kept as `config-<time>.yaml` beside it, and the keys that changed are returned (and warned of by
    the caller): such a run does not train as the unbroken one would have. `finished`: the folder's run
    already holds every step and its summary, and this one trains nothing: config.yaml stays that run's
    (it was rewritten, and the folder claimed settings its model was never trained with)."""
    path = os.path.join(run_dir, "config.yaml")
    changed = []
    if resuming and os.path.isfile(path):
        changed = config_changes(OmegaConf.to_container(OmegaConf.load(path), resolve=False), resolved)
        if finished:
            return changed
    tmp = path + ".tmp"
    with open(tmp, "w") as f:  # written whole before the earlier file is touched: a failed write keeps it as it was
        f.write(OmegaConf.to_yaml(resolved))
    if changed:  # a copy, not a move: config.yaml is never missing, whenever a kill comes
        shutil.copy2(path, os.path.join(run_dir, f"config-{time.strftime('%Y%m%d-%H%M%S')}.yaml"))
    os.replace(tmp, path)
    return changed


def record_run_config(run_dir: str, resolved: dict, resuming: bool, finished: bool) -> None:
    """`record_config`, warning of the keys that changed since the folder's earlier run."""
    changed = record_config(run_dir, resolved, resuming, finished)
    listed = f"{', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}"
    if changed and finished:
        warnings.warn(f"{run_dir} already finished with a config that differs from this one in {len(changed)} key(s): "
                      f"{listed}. Nothing is trained with them, and config.yaml still holds the settings the run was "
                      f"trained with; raise steps to train further with the new ones, or resume=false to start afresh.",
                      stacklevel=3)
    elif changed:
        warnings.warn(f"resuming in {run_dir} with a config that differs from its earlier run's in {len(changed)} key(s): "
                      f"{listed}. The run goes on, but it does not train as the unbroken one would have; the earlier "
                      f"config is kept beside config.yaml (config-<time>.yaml). resume=false starts afresh.", stacklevel=3)


def reward_states(reward_fns) -> dict:
    """The state of each reward that keeps one (a reward model's running score statistics), by name: a
    rank's own, in its own state file, since each rank normalises its own share of the batches."""
    return {name: fn.state_dict() for name, fn, _ in reward_fns if hasattr(fn, "state_dict")}


def load_reward_states(reward_fns, states: dict) -> None:
    """Restore `reward_states`' output (an older checkpoint has none: the statistics start afresh)."""
    for name, fn, _ in reward_fns:
        if name in states:
            fn.load_state_dict(states[name])


def written_by(path: str) -> dict:
    """A checkpoint's layout: its LAYOUT file, or for one written before it existed what its files say
    (a DeepSpeed folder: some ZeRO stage, processes unknown; trainer.pt: a replica)."""
    if os.path.exists(os.path.join(path, LAYOUT)):
        with open(os.path.join(path, LAYOUT)) as f:
            return json.load(f)
    return {"strategy": "zero" if os.path.isdir(os.path.join(path, "deepspeed")) else "ddp", "world_size": None}


def check_layout(path: str, strategy: str, world_size: int, adapter: dict | None = None) -> None:
    """A resume reads the checkpoint as its strategy wrote it: single and ddp share trainer.pt (any
    number of processes); ZeRO's shards are read only by the same stage on as many processes (DeepSpeed:
    "automatic adjustment of ZeRO's optimizer state partitioning ... not currently supported"). Refused
    before anything is built or config.yaml is touched, naming the launch that reads it; it was a
    FileNotFoundError of trainer.pt (or DeepSpeed's message) after the model was built. `adapter`: this
    run's LoRA adapter (grpo.lora.adapter_layout; None: full fine-tuning), which must be the one written
    (a checkpoint from before it was recorded is not asked)."""
    was = written_by(path)
    if "adapter" in was and was["adapter"] != adapter:
        def said(a):
            return ("full fine-tuning (model.lora.rank=0)" if a is None else
                    f"a LoRA adapter of model.lora.rank={a['rank']} on model.lora.target_modules=[{','.join(a['target_modules'])}]")
        raise ConfigError(f"{path} holds {said(was['adapter'])}; this run asks for {said(adapter)}, whose parameters "
                          f"are others, so the checkpoint cannot be read. Resume with the checkpoint's model.lora "
                          f"settings, or start afresh with resume=false (or another run_dir).")
    if was["strategy"] in REPLICAS:
        fits = strategy in REPLICAS
    else:  # "zero": a DeepSpeed folder from before LAYOUT, its stage and processes unrecorded
        fits = strategy.startswith("zero") and was["strategy"] in ("zero", strategy) and was["world_size"] in (None, world_size)
    if not fits:
        processes = f" on {was['world_size']} process(es)" if was["world_size"] else ""
        need = ("parallel=single or parallel=ddp" if was["strategy"] in REPLICAS
                else f"parallel={was['strategy'] if was['strategy'] != 'zero' else 'zero2 or zero3 (as it was written)'}"
                     f"{processes}")
        writer = "a ZeRO strategy (its stage unrecorded)" if was["strategy"] == "zero" else f"parallel={was['strategy']}"
        raise ConfigError(f"{path} was written by {writer}{processes}; this run is parallel={strategy} on "
                          f"{world_size} process(es), which cannot read it. Resume with {need}, or start afresh with "
                          f"resume=false (or another run_dir).")


def load_checkpoint(path: str, strategy) -> dict:
    """Restore the strategy's state and this rank's RNG; returns the trainer state (step, data
    position...). A rank the checkpoint has no state for (the run grew) takes rank 0's."""
    strategy.load(path)
    own = os.path.join(path, f"state_rank{dist.rank()}.pt")
    state = torch.load(own if os.path.exists(own) else os.path.join(path, "state_rank0.pt"), map_location="cpu", weights_only=False)
    set_rng_state(state.pop("rng"))
    return state
