"""reward `rm`: its settings checked and its function built, in the trainer process
(grpo/rewards/reward_model.py) or on servers when `reward.rm.urls` is set (grpo/rewards/served_rm.py).
`MODEL_REWARDS["rm"]` (grpo/rewards/__init__.py) names this module."""

from __future__ import annotations

import os

from grpo.errors import ConfigError
from grpo.models import HUB_ID
from grpo.rewards.reward_model import (NORMALISATIONS, TINY_RM, RewardModel, ScoreNormaliser, load_reward_model,
                                       load_tokenizer)
from grpo.rewards.served_rm import build_served, check_served
from grpo.tiny.rm import built_tiny_rm


def check(cfg) -> None:
    """validate's part: reward.rm's settings, with nothing loaded."""
    rm = cfg.reward.rm
    if not rm.path:
        raise ConfigError("reward `rm` needs reward.rm.path: a local folder or hub id of a sequence-classification "
                          "model with one label (num_labels=1), or tiny_rm (the addition task's, built in code): e.g. "
                          "reward.rm.path=tiny_rm. With reward.rm.urls only its tokenizer is loaded here.")
    if rm.path == TINY_RM:
        if cfg.task.name != "addition":
            raise ConfigError(f"reward.rm.path=tiny_rm is trained on the addition task, not task={cfg.task.name}; "
                              f"give a reward model for this task.")
        if rm.tiny.steps < 1 or rm.tiny.batch < 1 or rm.tiny.lr <= 0 or rm.tiny.new_layers < 3:
            raise ConfigError("reward.rm.tiny needs steps >= 1, batch >= 1, lr > 0 and new_layers >= 3 (the digit "
                              "checks are read from the first two fresh layers' outputs, gathered by the last).")
    elif not os.path.isdir(os.path.expanduser(rm.path)) and not HUB_ID.match(rm.path):
        raise ConfigError(f"reward.rm.path={rm.path!r} is neither tiny_rm, an existing local folder, nor a hub id "
                          f"like 'owner/name'. Fix the path.")
    if rm.normalise not in NORMALISATIONS:
        raise ConfigError(f"reward.rm.normalise={rm.normalise!r} is not one of {list(NORMALISATIONS)}.")
    if rm.normalise == "fixed" and rm.scale == 0:
        raise ConfigError("reward.rm.normalise=fixed divides by reward.rm.scale: give a scale other than 0.")
    if rm.max_tokens < 1:
        raise ConfigError(f"reward.rm.max_tokens={rm.max_tokens} must be >= 1 (padded tokens per forward).")
    if rm.timeout_s_per_1k_tokens is not None and rm.timeout_s_per_1k_tokens <= 0:
        raise ConfigError(f"reward.rm.timeout_s_per_1k_tokens={rm.timeout_s_per_1k_tokens} must be > 0, or null for "
                          f"no bound on a batch.")
    if rm.dtype not in (None, "float32", "bfloat16"):
        raise ConfigError(f"reward.rm.dtype={rm.dtype!r}: use float32, bfloat16, or null for model.dtype.")
    if rm.urls:
        check_served(rm)


def build(cfg, device="cpu") -> RewardModel:
    """The reward function of `reward.rm`, its model loaded now (tiny_rm as the run's setup built it:
    grpo.tiny.folders.resolve_on_node); with reward.rm.urls only its tokenizer, the servers checked
    now (served_rm.build_served)."""
    rm, path = cfg.reward.rm, os.path.expanduser(cfg.reward.rm.path)
    if rm.path == TINY_RM:
        path = built_tiny_rm(cfg)
    normaliser = ScoreNormaliser(rm.normalise, rm.offset, rm.scale)
    if rm.urls:
        return build_served(rm, load_tokenizer(path), normaliser)
    model, tokenizer = load_reward_model(path, rm.dtype or cfg.model.dtype, device)
    return RewardModel(model, tokenizer, rm.max_tokens, normaliser, rm.timeout_s_per_1k_tokens)
