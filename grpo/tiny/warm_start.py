"""The tiny models' warm start and cache: the model built (grpo/tiny/text.py, the VLM of
grpo/tiny/vlm.py, the MoE of grpo/tiny/moe.py) and trained by a short supervised run on the task's
training split until its greedy accuracy on training prompts reaches `warm_start_accuracy`. GRPO
learns nothing from a policy that never gets a reward, so the warm start is part of building the
model, not of the run. It is saved as a normal HF folder (config, safetensors, tokenizer) under
`model.cache_dir`, keyed by a hash of everything that shaped it, so vLLM can load the same folder.

The task (and a multi-turn task's `play`) is handed in: this module knows no task and no rollout
engine; grpo/tiny/folders.py, which knows both, builds them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import torch
from omegaconf import OmegaConf

from grpo import vision
from grpo.errors import ConfigError, WarmStartError
from grpo.packaged import publish_model_folder
from grpo.tiny import moe, text, vlm

# model.path values built in code: the text model, the vision-language one, the mixture of experts
TINY_KINDS = ("tiny", "tiny_vlm", "tiny_moe")
TINY_FORMAT = 2  # bump when the tiny model's recipe changes, so old cache entries are not reused
# the task fields the key always held; the others join it only away from their defaults, so the
# folders cached before them (the default run's, task=addition) keep their keys
KEYED_TASK_FIELDS = ("name", "seed", "digits", "eval_size", "path", "size")


def warm_start(model, tokenizer, task, cfg, max_new_tokens: int, log=print, play=None) -> dict:
    """Supervised training on prompt + answer + <eos>, loss on the answer, until greedy accuracy
    on 256 training prompts reaches cfg.warm_start_accuracy (checked every `warm_start_check_every` steps). AdamW, lr
    warmed up linearly over `warm_start_warmup_steps`, gradient norm clipped at `warm_start_clip`.
    Returns what it measured; raises WarmStartError if the step cap comes first, since GRPO learns
    nothing from a policy that never earns a reward. A multi-turn task trains on its
    `task.demonstration` and is checked by `play(model, tokenizer, samples, max_new_tokens)` (a greedy
    solve rate, handed in: grpo/tiny/folders.py `PLAYS`) instead of one-shot exact match."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warm_start_lr)
    warmup = max(0, cfg.warm_start_warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    n_probe = min(256, len(task.train) // 2)
    probe, train = task.train[:n_probe], task.train[n_probe:]
    if not probe or not train:
        raise ConfigError(f"the tiny model's warm start needs at least 2 training samples; the task has "
                          f"{len(task.train)} (after its held-out rows). Give the task more distinct rows, or a smaller "
                          f"task.eval_size.")
    images = getattr(tokenizer, "vision", None) is not None  # a VLM on image prompts (grpo/tiny/vlm.py)

    def accuracy() -> float:  # greedy: one-shot exact match, or a multi-turn task's own episodes
        if images:
            return vlm.greedy_accuracy(model, tokenizer, probe, max_new_tokens)
        if play is None:
            return text.greedy_accuracy(model, tokenizer, probe, max_new_tokens)
        model.eval()
        with torch.no_grad():
            acc = play(model, tokenizer, probe, max_new_tokens)
        model.train()
        return acc

    t0, acc, step = time.perf_counter(), accuracy(), 0
    while acc < cfg.warm_start_accuracy and step < cfg.warm_start_max_steps:
        idx = torch.randint(len(train), (cfg.warm_start_batch,), generator=gen).tolist()
        rows = [train[i] for i in idx]
        batch = (vlm.supervised_batch(tokenizer, rows) if images
                 else text.supervised_batch(tokenizer, rows) if task.demonstration is None
                 else text.demonstration_batch(tokenizer, rows, task.demonstration))
        loss = model(**batch).loss
        loss.backward()
        if cfg.warm_start_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.warm_start_clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.warm_start_check_every == 0 or step == cfg.warm_start_max_steps:
            acc = accuracy()
    info = {"warm_start_steps": step, "warm_start_train_accuracy": acc, "warm_start_s": time.perf_counter() - t0}
    log(f"warm start: {step} supervised steps, greedy train accuracy {acc:.3f}, {info['warm_start_s']:.1f}s")
    if acc < cfg.warm_start_accuracy:
        raise WarmStartError(
            f"the tiny model's warm start reached greedy train accuracy {acc:.3f} after {step} steps "
            f"(model.tiny.warm_start_max_steps={cfg.warm_start_max_steps}), below its target "
            f"model.tiny.warm_start_accuracy={cfg.warm_start_accuracy}; nothing was cached. A policy that never "
            f"earns a reward cannot learn by GRPO. Raise model.tiny.warm_start_max_steps, try another model.tiny.seed, "
            f"or lower model.tiny.warm_start_lr (now {cfg.warm_start_lr}).")
    return info


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def task_recipe(task_cfg) -> dict:
    """What of the task shapes the prompts and answers the warm start trains on: every task.* field
    (answer_format, system_prompt, eval_path and hub_id move rows in or out of the train split, or
    change their text), and the contents of task.path and task.eval_path (a file edited in place keeps
    its name). A field at its schema default is left out (KEYED_TASK_FIELDS aside)."""
    given = dict(task_cfg) if isinstance(task_cfg, dict) else OmegaConf.to_container(task_cfg, resolve=True)
    schema = OmegaConf.get_type(task_cfg)
    defaults = {f.name: f.default for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    recipe = {k: v for k, v in given.items()
              if k in KEYED_TASK_FIELDS or k not in defaults or v != defaults[k]}
    for key in ("path", "eval_path"):
        path = os.path.expanduser(given.get(key) or "")
        if os.path.isfile(path):  # a missing one: building the task says so
            recipe[f"{key}_sha256"] = file_sha256(path)
    return recipe


def tiny_model_dir(cfg, task_cfg, max_new_tokens: int) -> str:
    """Cache folder of the tiny model: a hash of its recipe, the task it was warm-started on."""
    tiny = OmegaConf.to_container(cfg.tiny, resolve=True) if not isinstance(cfg.tiny, dict) else dict(cfg.tiny)
    if cfg.path != "tiny_moe":  # the MoE's block shapes no other kind: their folders keep the key they had
        tiny.pop("moe", None)
    else:  # and the dense model's layers shape no MoE (a setting of them is refused: grpo/tiny/moe.py)
        for k in moe.DENSE_ONLY:
            tiny.pop(k, None)
    kind_format = {"tiny_vlm": {"vlm_format": vlm.TINY_VLM_FORMAT}, "tiny_moe": {"moe_format": moe.TINY_MOE_FORMAT}}
    recipe = {
        "format": TINY_FORMAT,
        **({"kind": cfg.path, **kind_format[cfg.path]} if cfg.path != "tiny" else {}),
        "tiny": tiny,
        "task": task_recipe(task_cfg),
        "max_new_tokens": max_new_tokens,  # the warm start's greedy checks decode this far
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser(cfg.cache_dir), f"{cfg.path}-{key}")


def build_warm_tiny(tiny, task, max_new_tokens: int, log=print, kind: str = "tiny", play=None):
    """(model, tokenizer, info): the tiny model built from `tiny` (model.tiny) and warm-started on
    `task` (checked by `play` where one is given) unless `tiny.warm_start_accuracy` is 0; raises
    WarmStartError on a miss. `kind` tiny_vlm: the vision-language one (grpo/tiny/vlm.py), its
    tokenizer carrying its image processor; tiny_moe: the mixture of experts (grpo/tiny/moe.py)."""
    tokenizer = text.build_char_tokenizer()
    if kind == "tiny_vlm":
        model = vlm.build_tiny_vlm(tiny, tokenizer)
        tokenizer.vision = vision.ImageReader(vlm.tiny_image_processor(), model.config)
    elif kind == "tiny_moe":
        model = moe.build_tiny_moe(tiny, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    else:
        model = text.build_tiny_model(tiny, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    info = {"parameters": sum(p.numel() for p in model.parameters())}
    if tiny.warm_start_accuracy > 0:
        info.update(warm_start(model, tokenizer, task, tiny, max_new_tokens, log, play))
    return model, tokenizer, info


def ensure_tiny_model(cfg, task_cfg, task, max_new_tokens: int, log=print, play=None) -> str:
    """Build, warm-start (on `task`, checked by `play` where given) and save the tiny model unless the
    cache already holds it. Atomic: the folder is written under a temporary name and renamed, so a
    killed build leaves no half model."""
    path = tiny_model_dir(cfg, task_cfg, max_new_tokens)
    if os.path.isfile(os.path.join(path, "grpo_tiny.json")):
        return path
    log(f"building the tiny model in {path}")
    model, tokenizer, info = build_warm_tiny(cfg.tiny, task, max_new_tokens, log, kind=cfg.path, play=play)
    from transformers.utils import logging as hf_logging  # local: transformers is heavy; only when a model is built

    hf_logging.disable_progress_bar()
    return publish_model_folder(model, tokenizer, path, "grpo_tiny.json", info)
