"""A consolidated Hugging Face folder of the policy, whatever the strategy: transformers and vLLM
load it as they load any checkpoint.

Every rank walks the strategy's weight buckets (under ZeRO-3 each one is gathered from all ranks'
shards); rank 0 keeps a CPU copy, builds a fresh model from the policy's config, and writes it with
the tokenizer into a temporary folder that is renamed into place, so a kill never leaves half a
model under the final name.
"""

from __future__ import annotations

import copy
import json
import os

import torch

from grpo import dist, lora
from grpo.checkpoint import remove_leftovers, replace_folder


EXPORTED = "grpo_export.json"  # in an exported folder: the training step its weights are


def exported_step(folder: str) -> int | None:
    """The step an export in `folder` holds (its `EXPORTED` record), None where there is none: a folder
    exported before the record existed, by another run, or not at all."""
    try:
        with open(os.path.join(folder, EXPORTED)) as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return None


def export_hf(strategy, tokenizer, folder: str, bucket_bytes: int = 256 * 2**20,
              adapter_folder: str | None = None, step: int | None = None) -> str | None:
    """Write the policy to `folder` (rank 0); returns the folder on rank 0, None elsewhere. `step`: the
    training step the weights are, recorded in the folder (`exported_step`), so a finished run can tell
    its own export from an earlier one's (a run continued to more steps, stopped before its export)."""
    from transformers import AutoModelForCausalLM  # transformers' Auto classes: seconds to import; only when exporting

    keep = dist.rank() == 0
    if lora.is_lora(strategy.model):  # the adapter alone, as the engines get it
        adapter: dict[str, torch.Tensor] = {}
        for bucket in strategy.weight_buckets(bucket_bytes):  # a collective under ZeRO-3: every rank
            adapter.update((name, t.detach().to("cpu", copy=True)) for name, t in bucket)
        if keep:
            lora.write_adapter(strategy.model, adapter.items(),
                               adapter_folder or os.path.join(os.path.dirname(os.path.abspath(folder)), "adapter"))
    state: dict[str, torch.Tensor] = {}
    for bucket in strategy.export_buckets(bucket_bytes):  # a collective under ZeRO-3: every rank
        if keep:
            state.update((name, t.detach().to("cpu", copy=True)) for name, t in bucket)
    if not keep:
        dist.barrier()
        return None
    config = strategy.model.config
    if getattr(config, "vision_config", None) is not None:  # a vision-language model (grpo/vision.py)
        # transformers' Auto classes: as above
        from transformers import AutoModelForImageTextToText as AutoModelForCausalLM  # noqa: N814
    model = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    # the policy's own generation_config.json (its folder's: a second EOS such as Qwen2.5-Instruct's
    # <|endoftext|>, sampling defaults), not one from_config derives from config.json alone
    policy = strategy.model.get_base_model() if hasattr(strategy.model, "get_base_model") else strategy.model
    if getattr(policy, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(policy.generation_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"export: weights do not match the model: missing {missing}, unexpected {unexpected}")
    tmp = f"{folder}.tmp-{os.getpid()}"
    remove_leftovers(folder)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if getattr(tokenizer, "vision", None) is not None:  # a VLM's image processor, as the model folder had it
        tokenizer.vision.image_processor.save_pretrained(tmp)
    if step is not None:
        with open(os.path.join(tmp, EXPORTED), "w") as f:
            json.dump({"step": step}, f)
    replace_folder(tmp, folder)
    dist.barrier()
    return folder
