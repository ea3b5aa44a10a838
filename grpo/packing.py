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


# ---------------------------------------------------------------------------------------------------
# The prompt once per group (`algo.shared_prompt`): a row holds trees, each one prompt followed by
# several of the completions sampled from it; every completion attends to its prompt and to itself.


def shared_plan(lengths: list[int], prompts: list[int], keys: list, width: int) -> list[list[list[int]]]:
    """Rows of trees: `lengths[i]` is sequence i's prompt + completion, `prompts[i]` its prompt's
    length, `keys[i]` its prompt (sequences with equal keys may share one). Each prompt's sequences,
    longest completion first, first-fit into trees of at most `width` tokens (the prompt counted
    once); the trees first-fit into rows of `width` (first-fit decreasing, ties in order). Returns,
    per row, its trees as lists of sequence indices."""
    by_prompt: dict = {}
    for i, k in enumerate(keys):
        by_prompt.setdefault(k, []).append(i)
    trees: list[list[int]] = []
    for members in by_prompt.values():
        p = prompts[members[0]]
        mine: list[list[int]] = []
        room: list[int] = []
        for i in sorted(members, key=lambda i: -lengths[i]):
            c = lengths[i] - p
            for t, free in enumerate(room):
                if c <= free:
                    mine[t].append(i)
                    room[t] -= c
                    break
            else:
                mine.append([i])
                room.append(width - p - c)
        trees += mine
    sizes = [prompts[t[0]] + sum(lengths[i] - prompts[i] for i in t) for t in trees]
    return [[trees[k] for k in row] for row in first_fit_rows(sizes, width)]


@dataclass
class SharedRows(PackedRows):
    mask_R1WW: torch.Tensor = None  # which positions each position attends to, in the attention's own form


def pack_shared(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, prompt_width: int,
                trees: list[list[int]], mask_dtype: torch.dtype = torch.bool, pad_id: int = 0) -> SharedRows:
    """The rows of a padded batch laid out as trees: the batch's sequences, in order, fill `trees[0][0]`
    sequences of row 0's first tree, `trees[0][1]` of its second, ... A tree is its first sequence's
    prompt once, then each of its sequences' completions; positions run on from the prompt in every
    completion, as in the sequence alone. `mask_dtype` bool: True where attended (sdpa); a float
    dtype: 0 there and the dtype's minimum elsewhere (eager attention)."""
    device = input_ids_BL.device
    ids_BL, real_BL = input_ids_BL.cpu(), attention_mask_BL.cpu().bool()
    P, B = prompt_width, ids_BL.shape[0]
    sizes = torch.tensor([n for row in trees for n in row], dtype=torch.long)
    if int(sizes.sum()) != B:
        raise ValueError(f"the trees hold {int(sizes.sum())} sequences, the batch {B}")
    R = len(trees)
    row_T = torch.repeat_interleave(torch.arange(R), torch.tensor([len(row) for row in trees]))  # T trees
    k_T = torch.cat([torch.arange(len(row)) for row in trees]) if R else torch.zeros(0, dtype=torch.long)
    tree_B = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    first_T = sizes.cumsum(0) - sizes
    branch_B = torch.arange(B) - first_T[tree_B] + 1  # 1, 2, ... within the tree
    prompt_B = real_BL[:, :P].sum(dim=1)
    completion_B = real_BL[:, P:].sum(dim=1)
    first_B = first_T[tree_B]
    if not (prompt_B.equal(prompt_B[first_B]) and (ids_BL[:, :P] * real_BL[:, :P]).equal((ids_BL * real_BL)[first_B, :P])):
        i = int(((ids_BL[:, :P] * real_BL[:, :P]) != (ids_BL * real_BL)[first_B, :P]).any(dim=1).logical_or(
            prompt_B != prompt_B[first_B]).nonzero()[0])
        raise ValueError(f"sequence {i} of a shared-prompt tree has another prompt than sequence {int(first_B[i])}")
    p_T = prompt_B[first_T]
    length_T = p_T + torch.zeros(len(sizes), dtype=torch.long).index_add(0, tree_B, completion_B)
    # each tree's start in its row, each completion's start in its tree: the lengths before it
    ends_T = length_T.cumsum(0)
    row_first_T = torch.tensor([0] + [len(row) for row in trees[:-1]], dtype=torch.long).cumsum(0)[row_T]
    start_T = ends_T - length_T - (ends_T - length_T)[row_first_T]
    width = max(1, int((start_T + length_T).max())) if R else 1
    ends_B = completion_B.cumsum(0)
    start_B = start_T[tree_B] + p_T[tree_B] + (ends_B - completion_B) - (ends_B - completion_B)[first_B]

    ids_RW = torch.full((R, width), pad_id, dtype=ids_BL.dtype)
    pos_RW = torch.zeros((R, width), dtype=torch.long)
    tree_RW = torch.full((R, width), -1)
    branch_RW = torch.zeros((R, width), dtype=torch.long)
    # the prompts, once per tree (left-padded in the batch: column c is token c - (P - p) of the prompt)
    t, c = real_BL[first_T, :P].nonzero(as_tuple=True)
    at = (row_T[t], start_T[t] + c - (P - p_T[t]))
    ids_RW[at] = ids_BL[first_T[t], c]
    pos_RW[at] = c - (P - p_T[t])
    tree_RW[at] = k_T[t]
    # the completions, after their tree's prompt, positions running on from it
    b, n = (torch.arange(completion_B.max() if B else 0)[None, :] < completion_B[:, None]).nonzero(as_tuple=True)
    at = (row_T[tree_B[b]], start_B[b] + n)
    ids_RW[at] = ids_BL[b, P + n]
    pos_RW[at] = prompt_B[b] + n
    tree_RW[at] = k_T[tree_B[b]]
    branch_RW[at] = branch_B[b]
    # token 0 is predicted by the prompt's last position, token n by the completion's n - 1
    prompt_last = start_T[tree_B[b]] + p_T[tree_B[b]] - 1
    hidden_at = (at[0], torch.where(n == 0, prompt_last, at[1] - 1))
    q, kv = (slice(None), slice(None), None), (slice(None), None, slice(None))
    allowed = ((tree_RW[q] == tree_RW[kv]) & (tree_RW[q] >= 0)
               & ((branch_RW[kv] == 0) | (branch_RW[kv] == branch_RW[q])))
    allowed &= torch.ones(width, width, dtype=torch.bool).tril()
    allowed |= torch.eye(width, dtype=torch.bool)  # a padding position attends to itself: no empty softmax
    mask = allowed[:, None] if mask_dtype == torch.bool else \
        torch.zeros(allowed[:, None].shape, dtype=mask_dtype).masked_fill(~allowed[:, None], torch.finfo(mask_dtype).min)
    return SharedRows(ids_RW.to(device), pos_RW.to(device), tuple(x.to(device) for x in hidden_at),
                      (b.to(device), n.to(device)), mask.to(device))


def mask_dtype_for(model) -> torch.dtype | None:
    """The form of a custom 4D mask `model`'s attention takes: bool for sdpa (True where attended),
    the model's float dtype for eager attention (added to the scores); None for any other attention
    (flash attention takes no 4D mask)."""
    impl = attention_of(model)
    if impl == "sdpa":
        return torch.bool
    if impl == "eager":
        return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    return None


def model_config(model):
    """The transformers config of the first module in `model` that has one (the model itself, or the
    one inside grpo's or DeepSpeed's wrapper)."""
    configs = (getattr(m, "config", None) for m in model.modules())  # DeepSpeed's engine has a config of its own
    return next((c for c in configs if hasattr(c, "_attn_implementation")), None)


def attention_of(model) -> str | None:
    return getattr(model_config(model), "_attn_implementation", None)


def sliding_window_of(model) -> int | None:
    """The window of a model whose layers (some or all) attend over a sliding window: a custom 4D
    mask replaces the one transformers would build with the window, so it would attend past it."""
    config = model_config(model)
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None


_SHARES: dict[int, bool] = {}


def shares_exactly(model, key: int, mask_dtype: torch.dtype) -> bool:
    """Whether `model` gives each completion of a shared-prompt row (pack_shared) the hidden states it
    gives it alone: the row `1 2 | 3 3 | 1` (prompt 1 2, completions 3 3 and 1) against `1 2 3 3`
    and `1 2 1`, once per model (`key`); every rank checks on its first shared micro-batch, together."""
    if key not in _SHARES:
        device = next(model.parameters()).device
        ids = torch.tensor([[1, 2, 3, 3], [1, 2, 1, 0]])
        shared = pack_shared(ids, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), 2, [[2]], mask_dtype)
        with torch.no_grad():
            hidden = lambda **kw: model(**{k: v.to(device) for k, v in kw.items()}, use_cache=False,  # noqa: E731
                                        output_hidden_states=True, logits_to_keep=1).hidden_states[-1][0].float()
            h_row = hidden(input_ids=shared.input_ids_RW, position_ids=shared.position_ids_RW,
                           attention_mask=shared.mask_R1WW)
            h_a = hidden(input_ids=ids[:1], position_ids=torch.arange(4)[None])
            h_b = hidden(input_ids=ids[1:, :3], position_ids=torch.arange(3)[None])
        a, b = torch.cat([h_a, h_b[2:]]), torch.cat([h_row[:4], h_row[4:]])
        _SHARES[key] = bool((a - b).abs().max() <= 1e-2 * a.abs().max().clamp(min=1e-6))
    return _SHARES[key]
