"""How the update lays a batch's sequences out in rows: the one home of the three layouts, from the
settings' choice to the rows a forward runs (`Rows`).

    padded  every sequence in a row of its own: prompt left-padded to the batch's widest, completion
            right-padded to its longest (grpo/batch.py `collate`); the batch's own B x L layout
    packed  (`algo.packing`) whole sequences end to end in rows as wide as the batch's longest
            sequence, first-fit decreasing, position ids restarting at 0 at every sequence
    shared  (`algo.shared_prompt`) rows of trees: one prompt, then several of the completions sampled
            from it, each attending to the prompt and to itself only, through a 4D mask

`plan` decides once per batch which layout the model runs (what the settings ask, `layout_of`; what
the model can, grpo/update/support.py `runnable_layout`, with the reason for any fallback) and which
sequences each micro-batch takes (`micro_batch_plan`: at most `algo.micro_batch_tokens` positions per
forward, at least one row). `rows` lays one micro-batch out as its forward runs it: ids, positions,
the mask (or none), where each completion token is read, and a VLM's M-RoPE positions and image slots
(grpo/vision.py). With sequence parallelism the rows are the whole micro-batch as every rank of the
group sees it, with the whole row's mask (the group's attention runs on all columns).

Packed: attention stays inside each sequence through the position ids alone: transformers
(masking_utils, `find_packed_sequence_indices`) turns a restart into a block-causal mask for sdpa
and eager attention, or into varlen kernels for flash attention, when the forward gets no attention
mask and no cache (`use_cache=False`: with a cache it silently builds a plain causal mask over the row).

Why rows as wide as the longest sequence and not one row of micro_batch_tokens: on the CPU the
mask is dense, so attention costs width^2 per row; measured on SmolLM2's shape (2 layers, 64
sequences of 4-400 completion tokens), rows of the longest sequence took 0.31 of the padded update's
time, rows of twice that 0.38, one row of 8,192 with a per-sequence attention loop 0.46
(docs/results/packing.md).

Widths: on CUDA every row a forward runs is padded to a multiple of 128, the tile the attention
kernels work in (`width_multiple`), so no width is 64 mod 128, where cuDNN's masked backward fails
(grpo/update/forward.py); on the CPU widths stay as the data gives them (dense attention costs width^2).

Only the model's forward sees the rows: the logprobs come back in the batch's B x T layout (0 where a
row has no completion token), so `mask_BT`, the sampler's logprobs, the advantages and every
normaliser and metric are the padded update's, token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from grpo import vision
from grpo.batch import Batch
from grpo.modeling import model_config
from grpo.update.support import LAYOUTS, has_plain_head, mask_form, runnable_layout, support_of

CUDA_WIDTH_MULTIPLE = 128


def width_multiple(device_type: str) -> int:
    """What the width of a forward's rows is rounded up to on `device_type`: 128 on CUDA, 1 (as the
    data gives it) on the CPU."""
    return CUDA_WIDTH_MULTIPLE if device_type == "cuda" else 1


def split_multiple(device_type: str, split_size: int) -> int:
    """What the width of whole rows a group of `split_size` ranks shares is rounded up to: a multiple
    of both the device's tile (`width_multiple`) and the group size (each rank takes 1/S of it)."""
    return math.lcm(width_multiple(device_type), split_size)


def row_width(width: int, multiple: int) -> int:
    """`width` rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(1, -(-width // multiple)) * multiple


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
    carried_KRW: torch.Tensor | None = None  # `carry_KBL` laid out as the rows are (0 on the rows' padding)
    real_RW: torch.Tensor | None = None  # True on the sequences' tokens, False on the rows' padding


def pack(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, prompt_width: int, rows: list[int],
         pad_id: int = 0, multiple: int | None = None, carry_KBL: torch.Tensor | None = None) -> PackedRows:
    """The packed rows of a padded batch (prompts left-padded to `prompt_width`, completions
    right-padded) whose sequences, in order, fill `rows[0]` sequences of row 0, `rows[1]` of row 1, ...
    Every completion token is carried, whatever its mask (a truncated or an observation token is
    still context for the tokens after it). The rows' width is the longest row's, rounded up to a
    multiple of `multiple` (None: `width_multiple` of the batch's device: 128 on CUDA).
    `carry_KBL`: K more values per token of the padded batch (a VLM's M-RoPE positions and image
    slots, grpo/vision.py) moved to the rows as the tokens are."""
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
    width = row_width(int((start_B + lengths_B).max()),
                                width_multiple(device.type) if multiple is None else multiple)

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
    carried = None
    if carry_KBL is not None:
        carried = torch.zeros((carry_KBL.shape[0], len(rows), width), dtype=carry_KBL.dtype)
        carried[:, r, w] = carry_KBL.cpu()[:, b, col]
        carried = carried.to(device)
    real_RW = torch.zeros((len(rows), width), dtype=torch.bool)
    real_RW[r, w] = True
    return PackedRows(ids_RW.to(device), pos_RW.to(device), tuple(x.to(device) for x in hidden_at),
                      (tb.to(device), tt.to(device)), carried, real_RW.to(device))


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
                trees: list[list[int]], mask_dtype: torch.dtype = torch.bool, pad_id: int = 0,
                multiple: int | None = None, carry_KBL: torch.Tensor | None = None) -> SharedRows:
    """The rows of a padded batch laid out as trees: the batch's sequences, in order, fill `trees[0][0]`
    sequences of row 0's first tree, `trees[0][1]` of its second, ... A tree is its first sequence's
    prompt once, then each of its sequences' completions; positions run on from the prompt in every
    completion, as in the sequence alone. `mask_dtype` bool: True where attended (sdpa); a float
    dtype: 0 there and the dtype's minimum elsewhere (eager attention). The rows' width is the widest
    row's, rounded up to a multiple of `multiple` (None: `width_multiple` of the batch's device: 128
    on CUDA); padding positions attend to themselves only. `carry_KBL`: K more values per token (the
    routed experts), moved as the tokens are: a tree's prompt takes its first sequence's (0 on padding)."""
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
    width = row_width(max(1, int((start_T + length_T).max())) if R else 1,
                                width_multiple(device.type) if multiple is None else multiple)
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
    carry = None if carry_KBL is None else carry_KBL.cpu()
    carried = None if carry is None else torch.zeros((carry.shape[0], R, width), dtype=carry.dtype)
    if carried is not None:
        carried[:, at[0], at[1]] = carry[:, first_T[t], c]
    # the completions, after their tree's prompt, positions running on from it
    b, n = (torch.arange(completion_B.max() if B else 0)[None, :] < completion_B[:, None]).nonzero(as_tuple=True)
    at = (row_T[tree_B[b]], start_B[b] + n)
    ids_RW[at] = ids_BL[b, P + n]
    pos_RW[at] = prompt_B[b] + n
    tree_RW[at] = k_T[tree_B[b]]
    branch_RW[at] = branch_B[b]
    if carried is not None:
        carried[:, at[0], at[1]] = carry[:, b, P + n]
    # token 0 is predicted by the prompt's last position, token n by the completion's n - 1
    prompt_last = start_T[tree_B[b]] + p_T[tree_B[b]] - 1
    hidden_at = (at[0], torch.where(n == 0, prompt_last, at[1] - 1))
    return SharedRows(ids_RW.to(device), pos_RW.to(device), tuple(x.to(device) for x in hidden_at),
                      (b.to(device), n.to(device)), None if carried is None else carried.to(device),
                      (tree_RW >= 0).to(device), mask_R1WW=tree_mask(tree_RW.to(device), branch_RW.to(device), mask_dtype))


def tree_mask(tree_RW: torch.Tensor, branch_RW: torch.Tensor, mask_dtype: torch.dtype) -> torch.Tensor:
    """mask_R1WW from two vectors per row, built where they are (on the model's device: an R x W x W
    mask is not built on the host and copied): position q attends to k <= q in its own tree (tree_RW,
    -1 on padding) that is the tree's prompt (branch 0) or q's own completion (branch_RW). A padding
    position attends to itself, so no softmax row is empty. bool: True where attended (sdpa); a float
    dtype: 0 there and the dtype's minimum elsewhere (eager attention adds it to the scores)."""
    width = tree_RW.shape[1]
    q, kv = (slice(None), slice(None), None), (slice(None), None, slice(None))
    allowed = ((tree_RW[q] == tree_RW[kv]) & (tree_RW[q] >= 0)
               & ((branch_RW[kv] == 0) | (branch_RW[kv] == branch_RW[q])))
    allowed &= torch.ones(width, width, dtype=torch.bool, device=tree_RW.device).tril()
    allowed |= torch.eye(width, dtype=torch.bool, device=tree_RW.device)
    return mask_form(allowed[:, None], mask_dtype)


def causal_mask(keep_RW: torch.Tensor) -> torch.Tensor:
    """mask_R1WW (bool): causal over the keys `keep_RW` allows; every position attends to itself, so
    no softmax row is empty (a padding query's output is never read)."""
    W = keep_RW.shape[1]
    allowed = keep_RW[:, None, :] & torch.ones(W, W, dtype=torch.bool, device=keep_RW.device).tril()
    return (allowed | torch.eye(W, dtype=torch.bool, device=keep_RW.device))[:, None]


def packed_mask(position_ids_RW: torch.Tensor) -> torch.Tensor:
    """mask_R1WW (bool) of packed rows: causal within each run of position ids that rise by one, as
    transformers' `find_packed_sequence_indices` reads a packed row for the unsplit forward."""
    diff = torch.diff(position_ids_RW, prepend=position_ids_RW[:, :1] - 1, dim=-1)
    seq_RW = (diff != 1).cumsum(dim=-1)
    W = position_ids_RW.shape[1]
    same = seq_RW[:, :, None] == seq_RW[:, None, :]
    return (same & torch.ones(W, W, dtype=torch.bool, device=seq_RW.device).tril())[:, None]


# ---------------------------------------------------------------------------------------------------
# Micro-batches: which rows each forward takes, in which layout.


SHARED_PROMPT_SETTINGS = (True, False, "auto")


def shares_prompts(setting, cuda: bool) -> bool:
    """algo.shared_prompt resolved: true and false as set; auto on for the CPU, where it was measured
    (docs/results/packing.md), and off on CUDA until it is measured on a GPU: there the R x W x W
    mask becomes a dense bias SDPA keeps per layer for backward, a cost the CPU measurements do not
    price (REVIEW G3; docs/gpu.md)."""
    if setting == "auto":
        return not cuda
    if setting is True or setting is False:
        return setting
    raise ValueError(f"algo.shared_prompt={setting!r}: one of true, false, auto")


def layout_of(algo, cuda: bool | None = None) -> str:
    """The layout the settings ask for: padded rows, packed rows (algo.packing), or packed rows with
    each prompt once per tree of its completions (algo.shared_prompt, `shares_prompts`; `cuda`:
    whether the trainer runs on a GPU, by default whether this process sees one, as
    grpo.models.policy_device places it). What a model really runs: `plan`."""
    if not algo.packing:
        return "padded"
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "shared" if shares_prompts(getattr(algo, "shared_prompt", False), cuda) else "packed"


# A CPU cost estimate, not a general constant: on the CPU a packed row's attention is dense, a
# position attends over the row's whole width. One position's linear layers cost about as much as
# attending over this many keys (24 h^2 against 4 h multiply-adds per layer: 3,456 keys for SmolLM2's
# h = 576; more for wider models, so rows chosen with it are, if anything, too narrow)
CPU_KEYS_PER_POSITION = 4096


def shared_width(lengths: list[int], prompts: list[int], keys: list, longest: int, max_tokens: int):
    """(width, rows of shared_plan) for algo.shared_prompt: wider rows let a prompt serve more of its
    completions (fewer positions) but cost more attention per position. The widths tried are the
    longest sequence, then doubled while some prompt still needs several trees and the width stays
    within the micro-batch cap; the one of least positions x (CPU_KEYS_PER_POSITION + width) is kept."""
    best = None
    width = longest
    while True:
        rows = shared_plan(lengths, prompts, keys, width)
        cost = len(rows) * width * (CPU_KEYS_PER_POSITION + width)
        if best is None or cost < best[0]:
            best = (cost, width, rows)
        trees = sum(len(row) for row in rows)
        if trees == len(set(keys)) or 2 * width > max(max_tokens, longest):
            return best[1], best[2]
        width *= 2


def micro_batch_plan(batch: Batch, max_tokens: int, layout: str = "padded",
                     multiple: int = 1) -> list[tuple[torch.Tensor | slice, list | None]]:
    """Which sequences of `batch` each micro-batch takes, and (packed, shared) how its rows are laid
    out (`MicroBatch.groups`). padded: consecutive slices of at most `max_tokens`
    padded tokens (at least one sequence each). packed: the sequences first-fit into rows as wide as
    the batch's longest sequence. shared: the sequences with equal prompts first-fit into trees, the
    trees into rows (`shared_width`). Packed and shared: `max_tokens // width` rows (at least one)
    per micro-batch. `multiple`: what the forward rounds its rows' width up to (`width_multiple`
    of the model's device), counted here so a micro-batch stays within `max_tokens`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown micro-batch layout {layout!r}; one of {LAYOUTS}")
    if layout == "padded":
        per = max(1, max_tokens // row_width(batch.input_ids_BL.shape[1], multiple))
        return [(slice(i, i + per), None) for i in range(0, batch.size, per)]
    lengths = batch.attention_mask_BL.sum(dim=1).tolist()
    if not lengths:
        return []
    width = max(lengths)
    if layout == "packed":
        rows = first_fit_rows(lengths, width)
        sizes = [len(row) for row in rows]
    else:
        P = batch.prompt_width
        prompts = batch.attention_mask_BL[:, :P].sum(dim=1).tolist()
        keys = [tuple(ids[P - p :]) for ids, p in zip(batch.input_ids_BL[:, :P].tolist(), prompts)]
        width, rows = shared_width(lengths, prompts, keys, width, max_tokens)
        sizes = [[len(tree) for tree in row] for row in rows]
        rows = [[i for tree in row for i in tree] for row in rows]
    per = max(1, max_tokens // row_width(width, multiple))
    plan = []
    for k in range(0, len(rows), per):
        plan.append((torch.tensor([i for row in rows[k : k + per] for i in row]), sizes[k : k + per]))
    return plan


@dataclass
class MicroBatch:
    """One forward's sequences and how its rows hold them."""

    batch: Batch  # its sequences, in the order the rows take them
    layout: str  # padded | packed | shared
    # packed: how many of its sequences, in order, each row holds; shared: per row, how many each of
    # its trees (one prompt, several completions) holds; padded: None (one sequence per row)
    groups: list | None = None
    index: torch.Tensor | slice | None = None  # its sequences' rows in the planned batch (None: padding)

    def to(self, device) -> "MicroBatch":
        return replace(self, batch=self.batch.to(device))


@dataclass
class Plan:
    """A batch's micro-batches and the layout the model runs them in."""

    asked: str  # the layout the settings ask for (`layout_of`)
    layout: str  # the one the model runs (grpo/update/support.py `runnable_layout`)
    reason: str | None  # why `layout` is not `asked` (None: as asked)
    micro_batches: list[MicroBatch]


def plan(model, batch: Batch, asked: str, max_tokens: int) -> Plan:
    """`batch` cut into micro-batches of at most `max_tokens` positions, in the layout `model` runs of
    `asked` (decided before the cut, so a fallback is planned within the token cap). Under ZeRO-3 the
    decision's probes are forwards, collectives: every rank plans, also with an empty batch."""
    longest = int(batch.attention_mask_BL.sum(dim=1).max()) if batch.size else 0
    layout, reason = runnable_layout(model, asked, longest)
    multiple = width_multiple(next(model.parameters()).device.type)
    return Plan(asked, layout, reason, [MicroBatch(batch.select(idx), layout, groups, idx)
                                        for idx, groups in micro_batch_plan(batch, max_tokens, layout, multiple)])


def micro_batches(batch: Batch, max_tokens: int, layout: str = "padded", multiple: int = 1) -> list[MicroBatch]:
    """The micro-batches of `micro_batch_plan`, in `layout` as given (no model asked)."""
    return [MicroBatch(batch.select(idx), layout, groups, idx)
            for idx, groups in micro_batch_plan(batch, max_tokens, layout, multiple)]


def padding(layout: str = "padded") -> MicroBatch:
    """One sequence that enters no loss (mask 0, advantage 0): a rank with fewer micro-batches runs it
    so that every rank makes the same forward/backward calls, which ZeRO's collectives need (laid out
    as the rank's other micro-batches are)."""
    ids = torch.zeros((1, 2), dtype=torch.long)
    zeros = torch.zeros((1, 1))
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([[0, 1]]), ids[:, 1:], zeros, zeros, torch.zeros(1),
                  prompt_width=1, ref_logprobs_BT=zeros)
    return MicroBatch(batch, layout, {"padded": None, "packed": [1], "shared": [[1]]}[layout])


@dataclass
class Rows:
    """A micro-batch laid out as its forward runs it (`rows`); the one value grpo/update/forward.py takes."""

    layout: str  # padded | packed | shared
    input_ids_RW: torch.Tensor
    position_ids_RW: torch.Tensor  # the text positions (a VLM's M-RoPE ones: rope_3RW)
    # what the attention is given: padded, the R x W attention mask (1 on real tokens); packed, None (the
    # restarting positions keep the sequences apart); shared, the R x 1 x W x W tree mask in the model's
    # mask dtype. Whole rows (sequence parallelism): the R x 1 x W x W bool mask of the whole row, or
    # None where that is plain causal (so SDPA runs causal with no W x W tensor; on CUDA: flash)
    mask: torch.Tensor | None
    hidden_at: tuple[torch.Tensor, torch.Tensor]  # (row, column) whose hidden state predicts completion token n
    token_at: tuple[torch.Tensor, torch.Tensor]  # (b, t): where completion token n sits in the B x T layout
    tokens_N: torch.Tensor  # completion token n
    shape_BT: tuple[int, int]  # the micro-batch's B x T, where the logprobs go back to
    plain_head: bool  # the logits are lm_head(last hidden state): the head runs in pieces (grpo/update/forward.py)
    # a vision-language model's: (3, R, W) M-RoPE positions, (R, W) image placeholder slots, each
    # sequence's images in order (grpo/vision.py); None for a text model
    rope_3RW: torch.Tensor | None = None
    image_slots_RW: torch.Tensor | None = None
    images: list | None = None
    # rollout.routing_replay: the sampler's experts per token, R x W x MoE layers x top_k (-1: the router
    # decides); moved with the tokens (grpo/moe/routing.py replays them)
    routes_RWMK: torch.Tensor | None = None
    real_RW: torch.Tensor | None = None  # True on the sequences' tokens (what a MoE router's statistics count)


def routes_carry(routes_BLMK: torch.Tensor) -> torch.Tensor:
    """B x L x M x K routes as `carry_KBL` rows (M*K values per token), for the layouts that move tokens;
    shifted by one so a token without a route (-1) and the rows' padding (0) both come back as -1."""
    B, L, M, K = routes_BLMK.shape
    return (routes_BLMK + 1).permute(2, 3, 0, 1).reshape(M * K, B, L)


def routes_back(carried_CRW: torch.Tensor, M: int, K: int) -> torch.Tensor:
    C, R, W = carried_CRW.shape
    return (carried_CRW.reshape(M, K, R, W).permute(2, 3, 0, 1) - 1).contiguous()


def rows(model, mb: MicroBatch, split_size: int = 1) -> Rows:
    """`mb` (on `model`'s device) laid out as its forward runs it. `split_size` > 1: the whole rows a
    group of that many ranks shares (grpo/parallel/sequence.py), as wide as a multiple of the group
    and with each row's whole mask, for the group's attention runs over every column."""
    b = mb.batch
    device = b.input_ids_BL.device
    whole = split_size > 1
    multiple = split_multiple(device.type, split_size)
    config = model_config(model)
    vlm = vision.is_vision_model(config)
    if whole and vlm:
        raise ValueError("split rows do not carry images: parallel.sequence_parallel > 1 with a vision-language model "
                         "(grpo.vision.check_config refuses it)")
    carry_KBL = vision.packing_carry(b, config) if vlm else None  # M-RoPE positions, image slots
    routes = b.routes_BLMK
    if routes is not None and vlm:
        raise ValueError("routed experts are not carried into a vision-language model's rows "
                         "(rollout.routing_replay with a VLM is refused by validate)")
    T = b.completion_ids_BT.shape[1]
    if mb.layout == "shared":
        support = support_of(model)
        if not support.shares:
            raise ValueError("a shared-prompt micro-batch for a model that cannot share prompts: plan the micro-batches "
                             "with grpo.update.layouts.plan")
        packed = pack_shared(b.input_ids_BL, b.attention_mask_BL, b.prompt_width, mb.groups,
                             torch.bool if whole else support.mask_dtype, multiple=multiple,
                             carry_KBL=None if routes is None else routes_carry(routes))
        ids_RW, pos_RW, mask, carried = packed.input_ids_RW, packed.position_ids_RW, packed.mask_R1WW, None
        hidden_at, token_at, real_RW = packed.hidden_at, packed.token_at, packed.real_RW
        routes_RW = None if routes is None else routes_back(packed.carried_KRW, *routes.shape[2:])
    elif mb.layout == "packed":
        packed = pack(b.input_ids_BL, b.attention_mask_BL, b.prompt_width, mb.groups, multiple=multiple,
                      carry_KBL=carry_KBL if routes is None else routes_carry(routes))
        ids_RW, pos_RW, carried = packed.input_ids_RW, packed.position_ids_RW, packed.carried_KRW
        routes_RW = None
        if routes is not None:  # (a VLM's carry is refused above)
            routes_RW, carried = routes_back(carried, *routes.shape[2:]), None
        # whole rows: a row of one sequence is one causal run (its padding's positions run on from it)
        mask = packed_mask(pos_RW) if whole and any(n > 1 for n in mb.groups) else None
        hidden_at, token_at, real_RW = packed.hidden_at, packed.token_at, packed.real_RW
    else:
        # rows right-padded to the width: padding after every real token, which causality keeps out of
        # their attention; positions repeat the row's last one, as collate's do past a completion's end
        ids_RW, mask_RW, pos_RW = b.input_ids_BL, b.attention_mask_BL, b.position_ids_BL
        L = ids_RW.shape[1]
        extra = row_width(L, multiple) - L
        # whole rows' keys: every position from the row's first real token on (the left padding is out);
        # the padding after a completion is seen only by later padding, whose outputs are never read
        keep_RW = F.pad(mask_RW.long().cumsum(dim=1) > 0, (0, extra), value=True)
        ids_RW, mask_RW = F.pad(ids_RW, (0, extra)), F.pad(mask_RW, (0, extra))
        pos_RW = torch.cat([pos_RW, pos_RW[:, -1:].expand(-1, extra)], dim=1)
        mask = mask_RW if not whole else None if bool(keep_RW.all()) else causal_mask(keep_RW)
        real_RW = mask_RW.bool()
        carried = None
        if carry_KBL is not None:
            carried = torch.cat([carry_KBL, carry_KBL[:, :, -1:].expand(-1, -1, extra)], dim=2).to(device)
            carried[3, :, L:] = 0  # no image slot in the padding
        routes_RW = None if routes is None else F.pad(routes, (0, 0, 0, 0, 0, extra), value=-1)
        b_N, t_N = torch.meshgrid(torch.arange(b.size, device=device), torch.arange(T, device=device), indexing="ij")
        token_at = (b_N.reshape(-1), t_N.reshape(-1))
        hidden_at = (token_at[0], L - T - 1 + token_at[1])  # position p predicts token p + 1
    out = Rows(mb.layout, ids_RW, pos_RW, mask, hidden_at, token_at, b.completion_ids_BT[token_at],
               tuple(b.completion_ids_BT.shape), has_plain_head(model), routes_RWMK=routes_RW,
               real_RW=real_RW)
    if carried is not None:
        out.rope_3RW, out.image_slots_RW, out.images = carried[:3], carried[3].bool(), b.vision
    return out
