"""What the trainer reads of a transformers model through its wrappers (grpo's Autocast, DeepSpeed's
engine, peft): the model itself, its config, its attention implementation and sliding window, and the
dtype and autocast its forward runs in. Plain reads, no forward: the probes that need one are
grpo/update/support.py's.
"""

from __future__ import annotations

import contextlib

import torch


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under grpo's Autocast and DeepSpeed's engine (both keep it as
    `.module`); a peft model answers `get_output_embeddings` for its base."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def model_config(model):
    """The transformers config of the first module in `model` that has one (the model itself, or the
    one inside grpo's or DeepSpeed's wrapper)."""
    configs = (getattr(m, "config", None) for m in model.modules())  # DeepSpeed's engine has a config of its own
    return next((c for c in configs if hasattr(c, "_attn_implementation")), None)


def text_config(model):
    """The language model's config (a VLM's text part; a text model's own)."""
    config = model_config(model)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_of(model) -> str | None:
    return getattr(model_config(model), "_attn_implementation", None)


def sliding_window_of(model) -> int | None:
    """The window of a model whose layers (some or all) attend over a sliding window."""
    config = model_config(model)
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None


def precision(model: torch.nn.Module):
    """The autocast the model's own forward runs under, for the head run outside it."""
    return model.precision() if hasattr(model, "precision") else contextlib.nullcontext()


def compute_dtype(model) -> torch.dtype:
    """The dtype `model`'s matmuls run in: an Autocast wrapper's (fp32 masters under bf16/fp16), else
    its weights'."""
    if hasattr(model, "precision") and isinstance(getattr(model, "dtype", None), torch.dtype):
        return model.dtype
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
