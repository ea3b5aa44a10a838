"""Padding-free micro-batches (`algo.packing`): whole sequences laid end to end in rows.

The padded update lays every completion in a row as wide as the batch's widest prompt plus its
longest completion, so one long completion makes every row pay for it. Packed, a row holds as many
whole sequences (prompt + completion, no padding between them) as fit in the batch's longest
sequence, first-fit decreasing, and a micro-batch holds `algo.micro_batch_tokens // width` rows.

Attention stays inside each sequence through the position ids alone: they restart at 0 at every
sequence, and transformers (masking_utils, `find_packed_sequence_indices`) turns a restart into a
block-causal mask for sdpa and eager attention, or into varlen kernels for flash attention, when the
forward gets no attention mask and no cache (`use_cache=False`: with a cache it silently builds a
plain causal mask over the row). `packs_exactly` checks once per model that this holds (a model
class that ignores restarts is refused with a message, not trained on mixed-up attention).

Why rows as wide as the longest sequence and not one row of micro_batch_tokens: on the CPU the
mask is dense, so attention costs width^2 per row; measured on SmolLM2's shape (2 layers, 64
sequences of 4-400 completion tokens), rows of the longest sequence took 0.31 of the padded update's
time, rows of twice that 0.38, one row of 8,192 with a per-sequence attention loop 0.46
(docs/results/packing.md).

Only the model's forward sees the packed rows: the logprobs come back in the batch's B x T layout
(0 where a row has no completion token), so `mask_BT`, the sampler's logprobs, the advantages and
every normaliser and metric are the padded update's, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def first_fit_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `width` tokens (one longer sequence gets a
    row of its own), first-fit decreasing; ties keep their order, so the layout is deterministic."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


@dataclass
class PackedRows:
    input_ids_RW: torch.Tensor  # R rows of W tokens: whole sequences end to end, then padding
    position_ids_RW: torch.Tensor  # restarting at 0 at each sequence (and at the row's padding)
    hidden_at: tuple[torch.Tensor, torch.Tensor]  # (row, column) whose hidden state predicts completion token n
    token_at: tuple[torch.Tensor, torch.Tensor]  # (b, t): where completion token n sits in the B x T layout


def pack(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, prompt_width: int, rows: list[int],
         pad_id: int = 0) -> PackedRows:
    """The packed rows of a padded batch (prompts left-padded to `prompt_width`, completions
    right-padded) whose sequences, in order, fill `rows[0]` sequences of row 0, `rows[1]` of row 1, ...
    Every completion token is carried, whatever its mask (a truncated or an observation token is
    still context for the tokens after it)."""
    device = input_ids_BL.device
    input_ids_BL, attention_mask_BL = input_ids_BL.cpu(), attention_mask_BL.cpu()  # the layout is worked out here
    B, L = input_ids_BL.shape
    real_BL = attention_mask_BL.bool()
    lengths_B = real_BL.sum(dim=1)
    prompt_B = real_BL[:, :prompt_width].sum(dim=1)
    row_B = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
    # each sequence's start within its row: the lengths before it in the same row
    ends_B = lengths_B.cumsum(0)
    first_B = torch.tensor([0] + rows[:-1]).cumsum(0)[row_B]  # the row's first sequence
    start_B = ends_B - lengths_B - (ends_B - lengths_B)[first_B]
    width = int((start_B + lengths_B).max())

    in_seq_BL = real_BL.long().cumsum(dim=1) - 1  # a real token's index within its sequence
    b, col = real_BL.nonzero(as_tuple=True)
    r, w = row_B[b], start_B[b] + in_seq_BL[b, col]
    ids_RW = torch.full((len(rows), width), pad_id, dtype=input_ids_BL.dtype)
    # a row's padding keeps its column as position: transformers may count it into the last sequence's
    # run, but it comes after every real token, so causality keeps it out of their attention
    pos_RW = torch.arange(width).repeat(len(rows), 1)
    ids_RW[r, w] = input_ids_BL[b, col]
    pos_RW[r, w] = in_seq_BL[b, col]

    T = L - prompt_width
    completion_B = lengths_B - prompt_B
    tb, tt = (torch.arange(T)[None, :] < completion_B[:, None]).nonzero(as_tuple=True)
    # the hidden state at the position before a token predicts it: prompt_len + t - 1 into the sequence
    hidden_at = (row_B[tb], start_B[tb] + prompt_B[tb] + tt - 1)
    return PackedRows(ids_RW.to(device), pos_RW.to(device), tuple(x.to(device) for x in hidden_at),
                      (tb.to(device), tt.to(device)))


_PACKS: dict[int, bool] = {}


def packs_exactly(model, key: int) -> bool:
    """Whether `model` keeps attention inside each sequence of a packed row, given restarting
    position ids and no mask: a two-sequence row against its second sequence alone, once per model
    (`key`: the unwrapped model's id). Every rank checks on its first packed micro-batch, together
    (under ZeRO-3 the forward gathers parameters)."""
    if key not in _PACKS:
        device = next(model.parameters()).device
        ids = torch.tensor([[1, 2, 3, 3, 1, 2]], device=device)
        packed = dict(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]], device=device))
        alone = dict(input_ids=ids[:, 3:], position_ids=torch.tensor([[0, 1, 2]], device=device))
        with torch.no_grad():
            h_packed = model(**packed, use_cache=False, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
            h_alone = model(**alone, use_cache=False, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
        a, b = h_packed[0, 3:].float(), h_alone[0].float()
        # the tiny model: 5e-7 of the largest value in fp32, 0 under bf16 autocast; attending across
        # the restart (what a cache does, `use_cache=True`): 0.91
        _PACKS[key] = bool((a - b).abs().max() <= 1e-2 * b.abs().max().clamp(min=1e-6))
    return _PACKS[key]
