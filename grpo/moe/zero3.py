"""ZeRO-3 leaf modules for a Mixture-of-Experts policy.

ZeRO-3 gathers a module's parameters when its forward starts, through hooks on every submodule, and
all ranks must gather the same parameters in the same order. A MoE block whose experts are modules of
their own (transformers 4.x's `nn.ModuleList`, or any loop that skips an expert no token chose) runs
only the experts its tokens were routed to: ranks routing to different experts then gather different
lists, and the run hangs or fails. A block marked as a leaf gathers all of its parameters on entry,
whatever the routing (DeepSpeed's `set_z3_leaf_modules`).

DeepSpeed 0.19.8 marks the sparse blocks of Mixtral, Qwen2-MoE and Qwen3-MoE by default (its ZeRO
config's `leaf_module.classes`, applied inside `deepspeed.initialize`); `mark_leaves` adds the block of
every other family grpo/moe/routing.py finds a router in (OLMoE, gpt-oss, DeepSeek-V3, ...), and marks
the listed ones again, so a user's `leaf_module.classes` (which replaces DeepSpeed's list) drops none. With
transformers 5.x's fused experts (one module holds every expert) a missing leaf costs hooks, not
correctness; the leaf keeps the families that do loop over per-expert modules safe. A block is the
router's parent module, so a family whose router routing.py does not recognise gets no leaf here.
"""

from __future__ import annotations

import torch

from grpo.moe import routing


def moe_blocks(model: torch.nn.Module) -> list[type]:
    """The classes of `model`'s MoE blocks (each router's parent module), in module order; [] for a
    dense model."""
    routers = {id(r) for _, r in routing.moe_layers(model)}
    blocks: list[type] = []
    for module in model.modules():
        if type(module) not in blocks and any(id(child) in routers for child in module.children()):
            blocks.append(type(module))
    return blocks


def deepspeed_default_leaves() -> list[str]:
    """The block classes DeepSpeed marks as ZeRO-3 leaves by itself (fully qualified names). Its
    internal default list, read here only: tests/test_moe_zero3.py fails if an upgrade moves it."""
    # local: deepspeed is heavy and only needed under parallel=zero3
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    return list(DEFAULT_LEAF_MODULE_CLASSES)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def missing_leaves(model: torch.nn.Module) -> list[type]:
    """`model`'s MoE block classes that DeepSpeed does not mark as leaves by default (it matches a
    class by its fully qualified name or its bare name; so does this)."""
    defaults = set(deepspeed_default_leaves())
    return [c for c in moe_blocks(model) if _qualified(c) not in defaults and c.__name__ not in defaults]


def mark_leaves(model: torch.nn.Module) -> list[type]:
    """Mark every MoE block of `model` as a ZeRO-3 leaf, those DeepSpeed lists too: a
    `leaf_module.classes` in parallel.deepspeed_config replaces DeepSpeed's default list, and marking
    twice is harmless. Call it before `deepspeed.initialize` (which installs the gather hooks).
    Returns the classes marked."""
    classes = moe_blocks(model)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules  # local: as above

        set_z3_leaf_modules(model, classes)
    return classes
