"""The local folder `model.path` names, for the trainer, `grpo.serve`, `grpo.launch` and the bench
alike: `tiny`/`tiny_vlm`/`tiny_moe` built and warm-started, a packaged model (smollm2-135m)
converted, both once into the cache; anything else (a folder, a hub id) as given.

The one place that knows both the task and the model: it builds the task the tiny model's warm start
trains on, and the check a multi-turn task is warm-started to pass (`PLAYS`: it plays episodes, so
it needs the rollout engine, which no task imports), and hands them to grpo/tiny/warm_start.py.
"""

from __future__ import annotations

import json
import os

from omegaconf import OmegaConf

from grpo import vision
from grpo.checkpoint import config_changes
from grpo.dist import barrier
from grpo.errors import ConfigError
from grpo.models import HUB_ID, check_hub_model
from grpo.packaged import PACKAGED, ensure_packaged_model
from grpo.rewards.reward_model import TINY_RM
from grpo.tasks import IMAGE_TASKS, build_task
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
    folder holding a model (`check_folder`), or a hub id whose config loads (nothing else is downloaded)."""
    if path in TINY_KINDS or path in PACKAGED:
        return
    if os.path.isdir(os.path.expanduser(path)):
        check_folder(path)
        return
    if not HUB_ID.match(path):
        raise ConfigError(
            f"model.path={path!r} is neither 'tiny', a packaged model {sorted(PACKAGED)}, an existing local "
            f"folder, nor a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'. Fix the path."
        )
    check_hub_model(path)


# what transformers loads a folder's weights from (transformers/utils/__init__.py: SAFE_WEIGHTS_NAME,
# WEIGHTS_NAME and their sharded indexes); a GGUF file needs gguf_file=, which only a packaged model gets
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# what AutoTokenizer builds a tokenizer from: a fast tokenizer's file, the config naming its class,
# a sentencepiece model, or a BPE/WordPiece vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_folder(path: str) -> None:
    """A local model.path folder holds what load_model reads: a config.json that parses, weights and a
    tokenizer. Without them the run failed after setup (an empty folder: a tokenizers traceback; no
    weights: transformers' OSError) or, without a tokenizer, trained on empty prompts scoring 0."""
    folder = os.path.expanduser(path)
    has = set(os.listdir(folder))
    if "config.json" not in has:
        raise ConfigError(f"model.path={path}: no config.json, so this is not a saved model folder. Point model.path at "
                          f"the folder save_pretrained wrote (config.json, weights, tokenizer), or use a hub id.")
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.path={path}: config.json is not valid JSON (line {e.lineno}: {e.msg}); fix the file "
                          f"or save the model into the folder again.") from e
    if not isinstance(config, dict):
        raise ConfigError(f"model.path={path}: config.json holds a {type(config).__name__}, not a model config "
                          f"(an object of fields); save the model into the folder again.")
    model_type = config.get("model_type")
    if isinstance(model_type, str) and "auto_map" not in config:  # auto_map: the folder's own code names it
        # transformers' registry of configs: heavy, and only a local folder's check reaches it
        from transformers import __version__ as transformers_version
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise ConfigError(f"model.path={path}: config.json's model_type {model_type!r} is not a model this "
                              f"transformers ({transformers_version}) knows (it loaded as KeyError: {model_type!r}). Fix "
                              f"the field (e.g. 'qwen2', 'llama'), or install the transformers that wrote the folder.")
    if not has & set(WEIGHT_FILES):
        raise ConfigError(f"model.path={path}: no weights (model.safetensors, pytorch_model.bin, or their index "
                          f".index.json). Save the model into it (model.save_pretrained(path)).")
    if not has & set(TOKENIZER_FILES):
        raise ConfigError(f"model.path={path}: no tokenizer (tokenizer.json or tokenizer_config.json): save the base "
                          f"model's tokenizer into it (AutoTokenizer.from_pretrained(base).save_pretrained(path)).")


def check_task_model(cfg, model_config: dict) -> None:
    """The task against the model (validate's part; `cfg`: the run config, `model_config`: what validate
    knows of config.json, grpo.config.known_model_config): an image task needs a vision-language model
    (a text model was warm-started on one for 14 minutes without an error); the tiny models, warm-started
    on the bare prompts with a character vocabulary, take no system prompt (they saw no such text: reward 0
    throughout) and have no chat template; nor has a local folder whose tokenizer carries none."""
    model, task = cfg.model, cfg.task
    known = model.path in TINY_KINDS or model.path in PACKAGED or bool(model_config)  # a hub id not cached: later
    if task.name in IMAGE_TASKS and known and not vision.is_vlm_setting(model.path, model_config):
        raise ConfigError(f"task={task.name} draws image prompts: use a vision-language model (model=tiny_vlm, or a hub "
                          f"VLM such as model=hub model.path=Qwen/Qwen2-VL-2B-Instruct); model.path={model.path} is a "
                          f"text model.")
    if model.path in TINY_KINDS and task.system_prompt:
        raise ConfigError(f"task.system_prompt={task.system_prompt!r} with model.path={model.path}: the tiny model is "
                          f"warm-started on the bare prompts, with a character vocabulary, so a system prompt before them "
                          f"is text it never saw: it earns no reward (eval 0.000). Drop task.system_prompt, or use a "
                          f"pretrained model (model=hub model.path=...).")
    if task.chat_template == "always" and not has_chat_template(model.path):
        raise ConfigError(f"task.chat_template=always but the tokenizer of model.path={model.path} has no chat template; "
                          f"use task.chat_template=auto or never.")


def has_chat_template(path: str) -> bool:
    """Whether model.path's tokenizer has a chat template, as far as its files tell (True where unknown: a
    hub id, a packaged model before its conversion). The tiny models' character tokenizer has none;
    transformers saves one as chat_template.jinja (older versions: in tokenizer_config.json)."""
    if path in TINY_KINDS:
        return False
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return True
    if {"chat_template.jinja", "chat_template.json", "additional_chat_templates"} & set(os.listdir(folder)):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):  # none, or not a JSON object: the load says so, not this guess
        return True


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
    if model.path in TINY_KINDS:
        check_tiny_ranges(model.tiny)


# model.tiny.* -> (the smallest value, the largest or None, the rule as the error says it). Outside them
# the build or the warm start failed late: a batch of 0 (IndexError), 0 layers or a check every 0
# steps (3000 steps, then an error), top_k above the experts (torch, after the build).
TINY_RANGES = {
    **{k: (1, None, "a whole number >= 1") for k in
       ("hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size", "warm_start_max_steps",
        "warm_start_batch", "warm_start_check_every", "moe.experts", "moe.moe_intermediate_size", "moe.layers")},
    "warm_start_accuracy": (0, 1, "between 0 and 1 (a greedy accuracy; 0 skips the warm start)"),
    "warm_start_warmup_steps": (0, None, ">= 0 steps"),
    "warm_start_clip": (0, None, ">= 0 (0: no clipping)"),
}


def check_tiny_ranges(tiny) -> None:
    """Each model.tiny.* value of a model built in code inside what the build and the warm start take."""
    for key, (low, high, rule) in TINY_RANGES.items():
        value = OmegaConf.select(tiny, key)
        if value < low or (high is not None and value > high):
            raise ConfigError(f"model.tiny.{key}={value!r} must be {rule}.")
    if not tiny.warm_start_lr > 0:
        raise ConfigError(f"model.tiny.warm_start_lr={tiny.warm_start_lr!r} must be > 0 (the default is 3e-3).")
    if not 1 <= tiny.moe.top_k <= tiny.moe.experts:
        raise ConfigError(f"model.tiny.moe.top_k={tiny.moe.top_k} must be between 1 and model.tiny.moe.experts="
                          f"{tiny.moe.experts} (each token is routed to top_k of the experts).")


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
