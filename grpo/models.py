"""Load a model and tokenizer (hub id or local folder) and build the run's policy and reference from
the folder a run's `model.path` names. Which folder that is (grpo/tiny/folders.py), the models built
in code (grpo/tiny/) and those converted into the cache (grpo/packaged.py) are decided elsewhere:
this module knows no task.
"""

from __future__ import annotations

import contextlib
import os
import re

import torch

from grpo import lora, moe_model, vision
from grpo.dist import cuda_device_index
from grpo.errors import ConfigError
from grpo.prompts import format_prompt
from grpo.tiny.warm_start import TINY_KINDS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # what a hub id looks like: owner/name


def encode_prompts(tokenizer, samples, chat_template: str = "auto", system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each sample's prompt, as trainer and engines both see them (BOS included; a chat
    template writes its own special tokens, so the tokenizer adds none to it)."""
    out = []
    reader = getattr(tokenizer, "vision", None)  # a VLM's image processor (grpo/vision.py)
    for s in samples:
        if (getattr(s, "meta", None) or {}).get("images"):  # a sample with images (task=shapes)
            if reader is None:
                raise ConfigError("the task's prompts carry images but the model is a text model: use a vision-language "
                                  "model (model=tiny_vlm, or model=hub model.path=Qwen/Qwen2-VL-2B-Instruct).")
            out.append(vision.encode_image_prompt(tokenizer, reader.image_processor, reader.config, s, chat_template,
                                                  system_prompt))
            continue
        text, templated = format_prompt(tokenizer, s.prompt, chat_template, system_prompt)
        out.append(tokenizer(text, add_special_tokens=not templated).input_ids)
    return out


def check_hub_model(path: str) -> None:
    """validate's look at a hub id (grpo/tiny/folders.py `check_path`): load only the model's config,
    cheap, and fails fast for a wrong id or no network."""
    from transformers import AutoConfig  # transformers is imported on first use, as by load_model

    try:
        AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - anything here means the id cannot be loaded
        # owner/name reads as a hub id, and as a folder relative to the working directory: say both
        folder = os.path.abspath(os.path.expanduser(path))
        raise ConfigError(
            f"model.path={path!r} could not be loaded as a hub id ({type(e).__name__}: {e}), and no local "
            f"folder {folder} exists either. Check the hub id, your network or HF_HOME cache, or point "
            f"model.path at a local folder (an absolute path is safest)."
        ) from e


def check_freeze_vision(cfg, model_config: dict) -> None:
    """model.freeze_vision=false (train the vision tower) on a model known to have none: the tiny text
    models, a config.json without a vision_config. It would change nothing, without a word. `model_config`:
    what validate knows of config.json (grpo.config.known_model_config); {} (a hub id not cached): unknown,
    passes. Called by grpo.config.validate."""
    if cfg.model.freeze_vision:
        return
    if cfg.model.lora.rank > 0:
        raise ConfigError(f"model.freeze_vision=false with model.lora.rank={cfg.model.lora.rank}: only the adapter trains "
                          f"(peft freezes every base weight, the vision tower's too, and the adapter leaves the tower "
                          f"out), so the tower would not train. Remove model.freeze_vision=false, or set "
                          f"model.lora.rank=0 to train the tower with the whole model.")
    vlm = vision.is_vlm_setting(cfg.model.path, model_config)
    known = cfg.model.path in TINY_KINDS or bool(model_config)
    if known and not vlm:
        raise ConfigError(f"model.freeze_vision=false with model.path={cfg.model.path}, a text model: there is no vision "
                          f"tower to train, so the setting has no effect. Use a vision-language model (model=tiny_vlm, "
                          f"or a folder whose config.json has a vision_config), or remove the setting.")


def load_model(path: str, dtype: str = "float32", log=None):
    """A causal LM and its tokenizer from a local folder or hub id. With `log` (the main rank's) and a
    hub id, the download says so and shows the hub's progress bars (a 15 GB download is minutes);
    otherwise the bars stay off: a local folder loads in seconds, and every rank would draw them."""
    # transformers: heavy; grpo.config reaches this module (grpo/tiny/folders.py)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from_hub = log is not None and not os.path.isdir(os.path.expanduser(path))
    if from_hub:
        hf_logging.enable_progress_bar()
        log(f"loading {path} from the hub (downloaded once into the Hugging Face cache, HF_HOME)")
    else:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        # transformers: heavy; grpo.config reaches this module (grpo/tiny/folders.py)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        if getattr(config, "vision_config", None) is not None:  # a vision-language model: its image processor too
            # transformers: heavy; grpo.config reaches this module (grpo/tiny/folders.py)
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(path, dtype=DTYPES[dtype])
            vision.attach(tokenizer, path, model.config)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    finally:
        hf_logging.disable_progress_bar()
    if rows := getattr(model.get_input_embeddings(), "num_embeddings", None):  # an nn.Embedding (ZeRO-3's too)
        check_special_tokens(tokenizer, rows, path)
    moe_model.pin_experts_kernel(model, policy_device(0).type)  # a MoE's expert kernel for where policies run
    return model, tokenizer


def check_special_tokens(tokenizer, rows: int, path: str) -> None:
    """The end (eos), start (bos) and pad tokens' ids index the model's `rows` embeddings: a tokenizer
    whose pad token it invented past them (transformers adds `<|endoftext|>` to a Qwen2 tokenizer
    without one) failed step 1 with "index 99 is out of bounds" (on a GPU, a device-side assert)."""
    if tokenizer.pad_token_id is not None and not 0 <= tokenizer.pad_token_id < rows:
        tokenizer.pad_token = tokenizer.eos_token  # as for no pad token at all: padding is masked out
    for name in ("eos", "bos", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None and not 0 <= token_id < rows:
            raise ConfigError(f"model.path={path}: the tokenizer's {name} token {getattr(tokenizer, f'{name}_token')!r} "
                              f"has id {token_id}, but the model has {rows} token embeddings (ids 0 to {rows - 1}). Set "
                              f"{name}_token in the folder's tokenizer_config.json to a token the model has, or resize "
                              f"the model's embeddings to the tokenizer (model.resize_token_embeddings) and save it.")


def policy_device(local_rank: int) -> torch.device:
    """Where this rank's policy, reference model and batches live: its GPU, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device(f"cuda:{cuda_device_index(local_rank, torch.cuda.device_count())}")


def build_policy(cfg, path: str, info, log=print, loading=contextlib.nullcontext()):
    """(policy on this rank's device, tokenizer) from the folder `path` (grpo/tiny/folders.py
    `resolve_on_node` makes it). The model is loaded inside `loading`, the strategy's
    (`Strategy.loading`): ZeRO-3 builds it partitioned, each shard already on this rank's device, and
    `.to` finds only empty placeholders to move."""
    with loading:
        model, tokenizer = load_model(path, cfg.model.dtype, log=log if info.is_main else None)
        moe_model.check_model(model, cfg.algo.router_aux_loss_coef)  # a load-balancing loss to weigh
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if cfg.model.freeze_vision and getattr(model.config, "vision_config", None) is not None:
            frozen = vision.freeze_vision(model)
            if info.is_main:
                log(f"vision tower frozen (model.freeze_vision): {frozen / 1e6:.2f}M parameters take no gradient")
        if cfg.model.lora.rank > 0:  # only the adapter trains; the base weights stay the folder's
            model = lora.wrap(model, cfg.model.lora)
            if info.is_main:
                log(lora.describe(model))
    model.to(policy_device(info.local_rank)).train()
    return model, tokenizer


def enable_gradient_checkpointing(model) -> None:
    """Activations recomputed layer by layer in the backward pass (training mode only; generation
    and scoring under no_grad are unaffected). Non-reentrant, which ZeRO-3 and autocast need."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def build_reference(cfg, path: str, strategy):
    """The frozen reference policy for the KL term, loaded as the policy was (in the strategy's
    `loading`: partitioned under ZeRO-3) and prepared to run as the policy runs
    (`strategy.prepare_reference`); only loaded when beta > 0."""
    if cfg.algo.beta == 0:
        return None
    with strategy.loading(cfg.parallel, cfg.algo, DTYPES[cfg.model.dtype]):
        ref, _ = load_model(path, cfg.model.dtype)
    return strategy.prepare_reference(ref.eval().requires_grad_(False))
