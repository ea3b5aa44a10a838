"""The local folder `model.path` names, for the trainer, `grpo.serve`, `grpo.launch` and the bench
alike: `tiny`/`tiny_vlm`/`tiny_moe` built and warm-started, a packaged model (smollm2-135m)
converted, both once into the cache; anything else (a folder, a hub id) as given.

The one place that knows both the task and the model: it builds the task the tiny model's warm start
trains on, and the check a multi-turn task is warm-started to pass (`PLAYS`: it plays episodes, so
it needs the rollout engine, which no task imports), and hands them to grpo/tiny/warm_start.py.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from grpo.checkpoint import config_changes
from grpo.dist import barrier
from grpo.errors import ConfigError
from grpo.models import HUB_ID, check_hub_model
from grpo.packaged import PACKAGED, ensure_packaged_model
from grpo.rewards.reward_model import TINY_RM
from grpo.tasks import build_task
from grpo.tiny import moe
from grpo.tiny.guess import solve_rate
from grpo.tiny.rm import ensure_tiny_rm
from grpo.tiny.warm_start import TINY_KINDS, ensure_tiny_model

PLAYS = {"guess": solve_rate}  # task.name -> its warm start's greedy check (else one-shot exact match)


def ensure_model_folder(cfg, task_cfg, max_new_tokens: int, log=print) -> str:
    """The local folder of `model.path=tiny` (tiny_vlm, tiny_moe: built and warm-started on `task_cfg`'s
    task) or of a packaged model (converted), made once and cached. `cfg` is model."""
    if cfg.path in TINY_KINDS:
        return ensure_tiny_model(cfg, task_cfg, build_task(task_cfg), max_new_tokens, log, play=PLAYS.get(task_cfg.name))
    return ensure_packaged_model(cfg.path, cfg.cache_dir, log)


def resolve_model_folder(cfg, log=print) -> str:
    """The folder of `model.path` (this module's docstring). `cfg` is a whole run config."""
    path = os.path.expanduser(cfg.model.path)
    if path not in TINY_KINDS and path not in PACKAGED:
        return path
    return ensure_model_folder(cfg.model, cfg.task, cfg.rollout.max_new_tokens, log)


def check_path(path: str) -> None:
    """model.path (validate's part): one of the names `resolve_model_folder` makes a folder of, an existing
    folder, or a hub id whose config loads (nothing else is downloaded)."""
    if path in TINY_KINDS or path in PACKAGED or os.path.isdir(os.path.expanduser(path)):
        return
    if not HUB_ID.match(path):
        raise ConfigError(
            f"model.path={path!r} is neither 'tiny', a packaged model {sorted(PACKAGED)}, an existing local "
            f"folder, nor a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'. Fix the path."
        )
    check_hub_model(path)


def check_tiny_settings(model, defaults) -> None:
    """model.tiny.* shapes only the models built in code, and model.tiny.moe.* only tiny_moe: a setting
    there for another model would change nothing (not even the cache key), so it is refused. `defaults`:
    TinyModelConfig()."""
    given = OmegaConf.create(model.tiny)
    differ = config_changes(OmegaConf.to_container(OmegaConf.create(defaults)), OmegaConf.to_container(given))
    changed = [f"model.tiny.{k}={OmegaConf.select(given, k)!r}" for k in differ
               if model.path not in TINY_KINDS or (k.startswith("moe.") and model.path != "tiny_moe")]
    if changed:
        reads = "model.path=tiny_moe" if model.path in TINY_KINDS else f"a model built in code ({', '.join(TINY_KINDS)})"
        raise ConfigError(f"{', '.join(changed)}: only {reads} reads this, and model.path={model.path!r}; drop the "
                          f"setting or choose that model.")
    if model.path == "tiny_moe":
        moe.check_unread(model.tiny, defaults)  # the dense model's num_layers, intermediate_size: the MoE reads neither


def uses_tiny_rm(cfg) -> bool:
    return cfg.reward.rm.path == TINY_RM and any(f.name == "rm" for f in cfg.reward.funcs)


def resolve_on_node(cfg, info, log=print) -> str:
    """`resolve_model_folder` for a rank of a run (`info`: its DistInfo): the folder is made (tiny,
    packaged) on each node's local rank 0 first, while the node's other ranks wait, then found by all.
    A run scored by `reward.rm.path=tiny_rm` gets that model built here too, on the run's task."""
    if info.local_rank == 0:
        resolve_model_folder(cfg, log)
        if uses_tiny_rm(cfg):
            ensure_tiny_rm(cfg, build_task(cfg.task), log if info.is_main else lambda *_: None)
    barrier()
    return resolve_model_folder(cfg, log)
