"""Per-token logprobs of the completion, taken through the LM head a chunk of tokens at a time.

The model's forward returns its last hidden states (`output_hidden_states`, with `logits_to_keep=1`
so its own head runs on one position), and the head runs here on pieces of at most about
`LOGIT_CHUNK_BYTES` of fp32 logits. With gradients, each piece is recomputed in the backward pass
(non-reentrant `torch.utils.checkpoint`), so no tokens x vocabulary tensor is kept for backward:
at 8,192 tokens and a 152k vocabulary the whole batch's fp32 logits are 5 GB, and the logit - logsumexp
that replaced log_softmax kept them (and their gradient) all the same. The price is the head's
forward run twice in training (measured in `python -m grpo.bench update-memory`).

Under ZeRO-3 every call of the head gathers its weight, a collective: the number of pieces comes
from the micro-batch cap (`algo.micro_batch_tokens`), the same on every rank, never from this
rank's own token count. A piece is not recomputed there: DeepSpeed does not gather the weight again
for checkpointing's recompute (it came back as its empty placeholder, shape [0], and torch refused
it), so under ZeRO-3 each piece's logits are kept for backward, as the whole batch's were before.

Heads that are not `lm_head(hidden)` (Gemma's logit soft-capping, Cohere's logit scale, ...) are
found by comparing both ways once per model on a two-token input; those models take their own
logits, whole, as before.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils.checkpoint import checkpoint

from grpo.algorithm import entropy, token_logprobs

LOGIT_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one piece (152k vocabulary: 441 tokens)


def pieces_for(max_tokens: int, vocab_size: int) -> int:
    """How many pieces the head runs on for a micro-batch of at most `max_tokens` positions."""
    per_piece = max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))
    return max(1, math.ceil(max_tokens / per_piece))


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under grpo's Autocast and DeepSpeed's engine (both keep it as
    `.module`); a peft model answers `get_output_embeddings` for its base."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def precision(model: torch.nn.Module):
    """The autocast the model's own forward runs under, for the head run outside it."""
    return model.precision() if hasattr(model, "precision") else contextlib.nullcontext()


def _piece(head, hidden_NH, tokens_N, temperature: float, with_entropy: bool):
    logits_NV = head(hidden_NH)
    logp_N = token_logprobs(logits_NV[None], tokens_N[None], temperature)[0]
    if not with_entropy:
        return logp_N, None
    with torch.no_grad():
        return logp_N, entropy(logits_NV[None].detach() / max(temperature, 1e-6))[0]


def head_logprobs(model, hidden_BTH: torch.Tensor, tokens_BT: torch.Tensor, temperature: float, pieces: int,
                  with_entropy: bool = False):
    """logprobs_BT (and entropy_BT) of `tokens_BT` from the final hidden states, in `pieces` calls
    of the head (some may be empty)."""
    head = unwrapped(model).get_output_embeddings()
    B, T, H = hidden_BTH.shape
    grad = torch.is_grad_enabled() and hidden_BTH.requires_grad
    recompute = grad and not hasattr(head.weight, "ds_id")  # not a ZeRO-3 parameter (see the top)
    logps, ents = [], []
    with precision(model):
        for h_NH, t_N in zip(hidden_BTH.reshape(B * T, H).tensor_split(pieces), tokens_BT.reshape(-1).tensor_split(pieces)):
            if recompute:
                logp_N, ent_N = checkpoint(_piece, head, h_NH, t_N, temperature, with_entropy, use_reentrant=False)
            else:
                logp_N, ent_N = _piece(head, h_NH, t_N, temperature, with_entropy)
            logps.append(logp_N)
            ents.append(ent_N)
    logp_BT = torch.cat(logps).reshape(B, T)
    return logp_BT, (torch.cat(ents).reshape(B, T) if with_entropy else None)


_PLAIN_HEAD: dict[int, bool] = {}


def plain_head(model, inputs) -> bool:
    """Whether the model's logits are `get_output_embeddings()(last hidden state)`, checked once
    per model on `inputs()` (a tiny batch; every rank checks on its first micro-batch, together)."""
    key = id(unwrapped(model))
    if key not in _PLAIN_HEAD:
        with torch.no_grad():
            out = model(**inputs(), output_hidden_states=True, logits_to_keep=0)
            hidden = getattr(out, "hidden_states", None)
            ok = hidden is not None
            if ok:
                with precision(model):
                    mine = unwrapped(model).get_output_embeddings()(hidden[-1]).float()
                ok = mine.shape == out.logits.shape and torch.allclose(mine, out.logits.float(), atol=1e-3, rtol=1e-3)
        _PLAIN_HEAD[key] = ok
    return _PLAIN_HEAD[key]
