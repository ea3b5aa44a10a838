"""Model FLOPs per phase of a step, counted from the tokens each phase really processed.

A forward of a decoder costs, per token, 2 FLOPs per weight it multiplies by (`Shape.body`: every
matmul weight but the embeddings and the LM head; a MoE's routed experts at k of E), plus 2 per LM-head
weight where logits are read (`Shape.head`: the update reads only completion positions, generation
one position per sampled token), plus the attention's quadratic term: for each (query, key) pair a
causal layer attends, QK^T and AV cost 2 x heads x head_dim FLOPs each, so 4 x `Shape.attention`
(layers x heads x head_dim) per pair. A backward costs twice its forward on the same work, less the
weight gradients of frozen weights (LoRA trains its adapters only): input gradients 1x, weight
gradients 1x for trainable weights, the attention 2x. Gradient checkpointing recomputes each
decoder layer's forward once more (not the LM head, outside the checkpointed layers; nor, under
non-reentrant checkpointing, each layer's last matmul: an upper bound): counted apart (`recompute`), for model FLOPs (MFU) count the work the
model needs, not what a memory trade-off adds (PaLM's convention; with it the hardware FLOPs).

What is counted as work (`Work`, additive), so that padding is waste and not work:
- the update: each forward's rows as laid out (grpo/update/layouts.py `Rows`): real tokens, the
  tokens computed (padding included: `padding_waste` = real / computed), the head's tokens (real
  completion tokens), and each real token's causal keys (its position + 1: positions restart per
  sequence, and a shared-prompt tree's completion continues its prompt's);
- generation: each distinct prompt prefilled once (an engine with prefix caching does no more), every
  token of each completion's span but its last forwarded once with the prompt and the span before it
  as keys, the head once per sampled token. An engine that recomputes a prompt per completion or pads
  (the hf backend) does more than this: its MFU shows it.

Not counted: the embeddings' lookups, norms, activations, softmax and the optimizer (elementwise,
memory-bound, a few percent of the matmuls at these widths); a vision-language model's vision encoder
(its language model is counted); sliding windows (counted as full causal attention).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from grpo.modeling import text_config
from grpo.moe_model import experts_of

VISION_PARTS = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "mm_projector")


@dataclass(frozen=True)
class Shape:
    """What one token costs in a forward of a model, read once from its weights."""

    body: int  # matmul weights every token multiplies by (a MoE's routed experts: k / E of them)
    body_trained: int  # of those, the ones with a gradient (LoRA: the adapters)
    head: int  # the LM head's weights (hidden x vocab), tied to the embeddings or not
    head_trained: bool
    attention: int  # layers x heads x head_dim: 4 x this FLOPs per attended (query, key) pair


@dataclass
class Work:
    """Tokens a phase processed; they add up over micro-batches, draws and ranks. The update's are
    0-dim tensors on the model's device while it runs (no device read per micro-batch), read once at
    its end (`resolved`)."""

    tokens: int = 0  # real tokens through the body
    computed: int = 0  # tokens laid out (real + padding)
    head: int = 0  # tokens whose logits were computed
    pairs: int = 0  # (query, key) pairs of causal attention between real tokens of one sequence

    def __add__(self, other: "Work") -> "Work":
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, share: float) -> "Work":
        """This rank's share of a micro-batch split across a sequence-parallel group."""
        return Work(*(getattr(self, f.name) * share for f in fields(self)))

    def resolved(self) -> "Work":
        """Plain integers, read from the device once."""
        return Work(*(round(float(getattr(self, f.name))) for f in fields(self)))


def full_numel(p: torch.nn.Parameter) -> int:
    """A parameter's element count, also where ZeRO-3 holds only a shard of it here (`ds_numel`)."""
    return int(getattr(p, "ds_numel", p.numel()))


def full_dim(p: torch.nn.Parameter) -> int:
    return len(getattr(p, "ds_shape", p.shape))


def shape_of(model) -> Shape:
    """`model`'s `Shape` (through grpo's, peft's or DeepSpeed's wrappers)."""
    config = text_config(model)
    experts = experts_of(model)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is None:  # DeepSpeed's engine: the module it wraps
        inner = next(m for m in model.modules() if hasattr(m, "get_output_embeddings") and m is not model)
        out = inner.get_output_embeddings()
    head_weight = out.weight
    skip = {id(head_weight)} | {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    body = body_trained = 0.0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if id(p) in skip or full_dim(p) < 2 or any(v in parts for v in VISION_PARTS):
            continue
        n = full_numel(p) * (experts.top_k / experts.num_experts if experts and "experts" in parts else 1.0)
        body += n
        body_trained += n if p.requires_grad else 0.0
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shape(round(body), round(body_trained), full_numel(head_weight), bool(head_weight.requires_grad),
                 config.num_hidden_layers * heads * head_dim)


def forward_flops(shape: Shape, work: Work) -> float:
    return 2.0 * (shape.body * work.tokens + shape.head * work.head) + 4.0 * shape.attention * work.pairs


def backward_flops(shape: Shape, work: Work) -> float:
    """Input gradients (as the forward) plus trained weights' gradients plus the attention's 2x."""
    inputs = 2.0 * (shape.body * work.tokens + shape.head * work.head)
    weights = 2.0 * (shape.body_trained * work.tokens + (shape.head if shape.head_trained else 0) * work.head)
    return inputs + weights + 8.0 * shape.attention * work.pairs


def rows_work(rows, head_tokens) -> Work:
    """The work of one forward over `rows` (grpo/update/layouts.py `Rows`, whose `real_RW` marks the
    sequences' tokens) reading the logits of `head_tokens` completion tokens; counts left on the
    rows' device (`Work.resolved` reads them)."""
    real = rows.real_RW
    return Work(tokens=real.sum(), computed=rows.input_ids_RW.numel(), head=head_tokens,
                pairs=((rows.position_ids_RW + 1) * real).sum())


def generation_work(prompt_ids: list[list[int]], completion_ids: list[list[int]], sampled: list[int], G: int) -> Work:
    """What an engine must compute for P prompts (`prompt_ids`) with G completions each (B spans,
    `completion_ids`, grouped by prompt; `sampled`: each span's sampled tokens, an episode's
    observations aside): each prompt prefilled once, each span but its last token forwarded."""
    tokens = pairs = 0
    for i, prompt in enumerate(prompt_ids):
        p = len(prompt)
        tokens += p
        pairs += p * (p + 1) // 2
        for span in completion_ids[i * G:(i + 1) * G]:
            c = max(len(span) - 1, 0)  # the last sampled token is never forwarded
            tokens += c
            pairs += c * p + c * (c + 1) // 2
    return Work(tokens=tokens, computed=tokens, head=sum(sampled), pairs=pairs)
