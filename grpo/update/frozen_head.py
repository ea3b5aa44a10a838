"""The logprobs of a piece of tokens under a frozen LM head (LoRA trains adapters, never the head),
with their gradient to the hidden states worked out in the forward: no logits kept for the backward,
no recompute, and under ZeRO-3 the head's weight gathered once.

logp_n = z_n[t_n] / T - logsumexp(z_n / T) with z_n = W h_n + b, so
d logp_n / d h_n = ((onehot(t_n) - softmax(z_n / T)) / T) W, a vector of the hidden size per token:
`HeadLogprobs` keeps those rows (J, tokens x hidden) and its backward is `grad_logp_n * J_n`. The head's
weight is used only in the forward, so nothing of the vocabulary's size outlives a piece, and the
matmul that the backward would run (the logits' gradient through W) runs there instead; the
recompute (grpo/update/forward.py) ran the head's forward twice.

Under ZeRO-3 the weight is gathered around the piece (`deepspeed.zero.GatheredParameters`, one
collective a piece, as many pieces on every rank) and nothing of it is saved: checkpointing a frozen
head read the placeholder DeepSpeed's release leaves, so those pieces kept their logits before.

Numerics: fp32 gives the autograd gradient to rounding; in bf16 the logits' gradient is rounded to
bf16 before the upstream gradient scales it (autograd scales, then rounds), the same size of error.
"""

from __future__ import annotations

import contextlib

import torch


def applies(head: torch.nn.Module) -> bool:
    """A plain linear head none of whose parameters trains (LoRA's base head; a LoRA layer on the
    head itself, or any other module, takes the general path)."""
    return type(head) is torch.nn.Linear and not any(p.requires_grad for p in head.parameters())


class HeadLogprobs(torch.autograd.Function):
    """(logp_N, entropy_N) from hidden_NH (entropy empty unless asked for: a metric, no gradient);
    the backward to hidden_NH only, from the rows J_NH kept in the forward (see the top)."""

    @staticmethod
    def forward(ctx, hidden_NH, tokens_N, weight_VH, bias_V, temperature: float, with_entropy: bool):
        t = max(temperature, 1e-6)
        z_NV = torch.nn.functional.linear(hidden_NH, weight_VH, bias_V).float()  # a new tensor: in place below
        logp_NV = torch.log_softmax(z_NV.div_(t) if t != 1.0 else z_NV, dim=-1)
        del z_NV  # one tokens x vocabulary fp32 tensor at a time, beside the entropy's
        logp_N = logp_NV.gather(-1, tokens_N[:, None])[:, 0]
        ent_N = -(logp_NV.exp() * logp_NV).sum(-1) if with_entropy else logp_N.new_empty(0)
        grad_NV = logp_NV.exp_().neg_()  # d logp_n / d z_n = (onehot(t_n) - p_n) / T, in place
        grad_NV[torch.arange(len(tokens_N), device=tokens_N.device), tokens_N] += 1.0
        J_NH = grad_NV.div_(t).to(weight_VH.dtype) @ weight_VH
        ctx.save_for_backward(J_NH)
        ctx.hidden_dtype = hidden_NH.dtype
        ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, grad_logp_N, _grad_ent):
        (J_NH,) = ctx.saved_tensors
        return (grad_logp_N[:, None] * J_NH).to(ctx.hidden_dtype), None, None, None, None, None


def gathered(head: torch.nn.Module):
    """Under ZeRO-3 the head's whole weight for the piece (a collective) where it is partitioned now;
    elsewhere, and where DeepSpeed holds it whole (a persistent parameter, under
    `stage3_param_persistence_threshold`, or one kept for reuse), nothing: `GatheredParameters`
    partitions on exit whatever it was given, which un-persisted a persistent head (every later piece
    gathered it again) and released what DeepSpeed's coordinator counts as held."""
    if not hasattr(head.weight, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed  # deepspeed: only where its ZeRO-3 partitioned the head
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # likewise

    params = list(head.parameters())
    inflight = [p.ds_id for p in params if p.ds_status == ZeroParamStatus.INFLIGHT]
    if inflight:  # GatheredParameters would skip it and read an unfinished buffer; no prefetch reaches it now
        raise RuntimeError(f"the LM head's parameters {inflight} are being gathered by DeepSpeed's prefetch "
                           "while the frozen head's piece needs them whole: a grpo bug, please report it")
    partitioned = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    return deepspeed.zero.GatheredParameters(partitioned) if partitioned else contextlib.nullcontext()


def piece(head: torch.nn.Module, hidden_NH, tokens_N, temperature: float, with_entropy: bool):
    """(logp_N, entropy_N or None) of a piece under the frozen `head` (`applies`), differentiable in
    hidden_NH."""
    with gathered(head):
        logp_N, ent_N = HeadLogprobs.apply(hidden_NH, tokens_N, head.weight, head.bias, temperature, with_entropy)
    return logp_N, (ent_N if with_entropy else None)
