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
found once per model (grpo/model_support.py); those models take their own logits, whole.

`forward_logprobs` runs a micro-batch in the layout it was planned in (grpo/layouts.py): padded, packed
or shared; the logprobs always come back in the batch's B x T layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from grpo import attention, vision
from grpo.algorithm import entropy, token_logprobs
from grpo.batch import Batch
from grpo.layouts import pack, pack_shared
from grpo.model_support import has_plain_head, precision, support_of, unwrapped

LOGIT_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one piece (152k vocabulary: 441 tokens)


def pieces_for(max_tokens: int, vocab_size: int) -> int:
    """How many pieces the head runs on for a micro-batch of at most `max_tokens` positions."""
    per_piece = max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))
    return max(1, math.ceil(max_tokens / per_piece))


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


def vocab_size_of(model) -> int:
    vocab = unwrapped(model).get_output_embeddings().weight
    return getattr(vocab, "ds_shape", vocab.shape)[0]  # ZeRO-3: the full shape, not the local shard


def forward_logprobs(model, batch: Batch, temperature: float, with_entropy: bool = False, max_tokens: int = 0):
    """Per-token logprobs of the completion under `model` -> logprobs_BT (and entropy_BT), the LM
    head run a piece at a time: `max_tokens` is the micro-batch cap, which sets the number of pieces
    alike on every rank (0: this batch's own size). `batch` must already be on the model's device,
    laid out as `runnable_layout` allows for this model. The forward takes the attention kernels
    grpo.attention allows on that device (on CUDA: not cuDNN's), in rows as wide as it rounds them."""
    plain = has_plain_head(model)
    with attention.training_attention(batch.input_ids_BL.device):
        if batch.rows is not None or batch.trees is not None:
            return packed_logprobs(model, batch, temperature, with_entropy, max_tokens, plain)
        return padded_logprobs(model, batch, temperature, with_entropy, max_tokens, plain)


def padded_logprobs(model, batch: Batch, temperature: float, with_entropy: bool, max_tokens: int, plain: bool):
    """forward_logprobs of a padded micro-batch. Its rows are right-padded (mask 0) to the width
    grpo.attention rounds them to on their device (CUDA: a multiple of 128): the padding comes after
    every real token, so causality keeps it out of their attention, and its outputs are not read."""
    T = batch.completion_ids_BT.shape[1]
    ids_BL, mask_BL, pos_BL = batch.input_ids_BL, batch.attention_mask_BL, batch.position_ids_BL
    L = ids_BL.shape[1]
    extra = attention.row_width(L, attention.width_multiple(ids_BL.device.type)) - L
    if extra:  # positions repeat the row's last one, as collate's do past a completion's end
        ids_BL, mask_BL = F.pad(ids_BL, (0, extra)), F.pad(mask_BL, (0, extra))
        pos_BL = torch.cat([pos_BL, pos_BL[:, -1:].expand(-1, extra)], dim=1)
    inputs = dict(input_ids=ids_BL, attention_mask=mask_BL, position_ids=pos_BL)
    if batch.vision is not None or vision.is_vision_model(unwrapped(model)):  # the vision tower's output, M-RoPE
        inputs = vision.padded_inputs(model, unwrapped(model).config, batch, ids_BL, mask_BL, pos_BL)
    if not plain:
        # a head of its own (soft-capping, scaling): the model's logits, only the last T + 1 (+ padding) positions
        logits_BTV = model(**inputs, logits_to_keep=T + 1 + extra).logits[:, :T]
        logp_BT = token_logprobs(logits_BTV, batch.completion_ids_BT, temperature)
        with torch.no_grad():
            ent_BT = entropy(logits_BTV.detach() / max(temperature, 1e-6)) if with_entropy else None
        return logp_BT, ent_BT
    hidden_BLH = model(**inputs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
    hidden_BTH = hidden_BLH[:, L - T - 1 : L - 1]  # position p predicts token p + 1: the completion's T tokens
    pieces = pieces_for(max_tokens or batch.size * T, vocab_size_of(model))
    return head_logprobs(model, hidden_BTH, batch.completion_ids_BT, temperature, pieces, with_entropy)


def packed_logprobs(model, batch: Batch, temperature: float, with_entropy: bool, max_tokens: int, plain: bool):
    """forward_logprobs of a packed micro-batch (`batch.rows`, or `batch.trees` with the prompt once per
    tree): the model runs on the packed rows, the head on the completion tokens only, and logprobs_BT
    (entropy_BT) come back in the batch's B x T layout, 0 past each completion's end."""
    if batch.trees is not None:
        mask_dtype = support_of(model).mask_dtype
        if not support_of(model).shares:
            raise ValueError("a shared-prompt micro-batch for a model that cannot share prompts: plan the micro-batches "
                             "with the layout grpo.model_support.runnable_layout gives")
        packed = pack_shared(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, batch.trees, mask_dtype)
        inputs = dict(input_ids=packed.input_ids_RW, position_ids=packed.position_ids_RW,
                      attention_mask=packed.mask_R1WW, use_cache=False)
    elif batch.vision is not None or vision.is_vision_model(unwrapped(model)):  # M-RoPE positions, image slots moved
        packed = pack(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, batch.rows,
                      carry_KBL=vision.packing_carry(batch, unwrapped(model).config))
        inputs = vision.packed_inputs(model, batch, packed)
    else:
        packed = pack(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, batch.rows)
        inputs = dict(input_ids=packed.input_ids_RW, position_ids=packed.position_ids_RW, use_cache=False)
    tokens_1N = batch.completion_ids_BT[packed.token_at][None]
    if not plain:  # a head of its own: the model's logits at every position, those before a completion token kept
        logits_1NV = model(**inputs, logits_to_keep=0).logits[packed.hidden_at][None]
        logp_1N = token_logprobs(logits_1NV, tokens_1N, temperature)
        with torch.no_grad():
            ent_1N = entropy(logits_1NV.detach() / max(temperature, 1e-6)) if with_entropy else None
    else:
        hidden_RWH = model(**inputs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
        pieces = pieces_for(max_tokens or tokens_1N.shape[1], vocab_size_of(model))
        logp_1N, ent_1N = head_logprobs(model, hidden_RWH[packed.hidden_at][None], tokens_1N, temperature, pieces,
                                        with_entropy)
    zeros_BT = torch.zeros(batch.completion_ids_BT.shape, device=logp_1N.device)
    return (zeros_BT.index_put(packed.token_at, logp_1N[0]),
            zeros_BT.index_put(packed.token_at, ent_1N[0]) if with_entropy else None)


def forward_logprobs_split(model, batch: Batch, rows, cols: slice, gather, temperature: float, with_entropy: bool,
                           max_tokens: int, plain: bool):
    """forward_logprobs of a micro-batch whose rows a group of ranks shares (grpo/parallel/sequence.py):
    the model runs on this rank's columns `cols` of `rows` (the micro-batch laid out whole); the head on
    the completion tokens predicted from them; `gather` (the group's sum) gives every rank the whole
    micro-batch's logprobs_BT (entropy_BT). Every rank keeps the graph through its model forward, even
    with no token of its own, so every rank's backward joins the attention's all-to-alls."""
    inputs = dict(input_ids=rows.input_ids_RW[:, cols], position_ids=rows.position_ids_RW[:, cols], use_cache=False)
    row_N, col_N = rows.hidden_at
    mine_N = (col_N >= cols.start) & (col_N < cols.stop)
    at = (row_N[mine_N], col_N[mine_N] - cols.start)
    tokens_N = batch.completion_ids_BT[rows.token_at]
    with attention.training_attention(batch.input_ids_BL.device):
        if plain:
            hidden_RwH = model(**inputs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
            pieces = pieces_for(max_tokens or tokens_N.shape[0], vocab_size_of(model))
            logp_1n, ent_1n = head_logprobs(model, hidden_RwH[at][None], tokens_N[mine_N][None], temperature, pieces,
                                            with_entropy)
        else:  # a head of its own: the model's logits at this rank's positions
            logits_1nV = model(**inputs, logits_to_keep=0).logits[at][None]
            logp_1n = token_logprobs(logits_1nV, tokens_N[mine_N][None], temperature)
            with torch.no_grad():
                ent_1n = entropy(logits_1nV.detach() / max(temperature, 1e-6)) if with_entropy else None
    where = (mine_N.nonzero()[:, 0],)
    zeros_N = torch.zeros(tokens_N.shape, device=logp_1n.device)
    logp_N = gather(zeros_N.index_put(where, logp_1n[0]))
    zeros_BT = torch.zeros(batch.completion_ids_BT.shape, device=logp_N.device)
    if not with_entropy:
        return zeros_BT.index_put(rows.token_at, logp_N), None
    ent_N = gather(zeros_N.index_put(where, ent_1n[0].detach()))
    return zeros_BT.index_put(rows.token_at, logp_N), zeros_BT.index_put(rows.token_at, ent_N)
