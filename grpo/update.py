"""From rollouts to an optimizer step: collate, score tokens in micro-batches, accumulate the loss.

The batch is laid out padded: prompt (left-padded) + completion (right-padded). Position ids come
from the attention mask, as `generate` derives them, so the trainer's logprobs match the sampler's.
With `algo.packing` the model's forward sees the micro-batch's sequences packed end to end instead
(grpo/packing.py); everything else, the loss and its masks included, stays in the padded B x T layout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from grpo import dist
from grpo.errors import ConfigError
from grpo.logprobs import head_logprobs, pieces_for, plain_head, unwrapped
from grpo.packing import (
    attention_of, first_fit_rows, mask_dtype_for, pack, pack_shared, packs_exactly, shared_plan, shares_exactly,
    sliding_window_of,
)
from grpo.algorithm import (
    LossNorm, centred_moments, decoupled_loss, entropy, group_advantages, reinforce_pp_advantages,
    reward_moments, rloo_advantages, sampled_kl, std_from_moments, token_logprobs,
)


@dataclass
class Batch:
    input_ids_BL: torch.Tensor  # prompt then completion, L = P + T
    attention_mask_BL: torch.Tensor
    position_ids_BL: torch.Tensor
    completion_ids_BT: torch.Tensor
    mask_BT: torch.Tensor  # 1 for completion tokens that enter the loss
    sampler_logprobs_BT: torch.Tensor
    advantages_B: torch.Tensor
    prompt_width: int
    old_logprobs_BT: Optional[torch.Tensor] = None  # set when the batch is reused (off-policy)
    ref_logprobs_BT: Optional[torch.Tensor] = None  # set when beta > 0
    # a packed micro-batch (algo.packing): how many of its sequences, in order, each row holds
    rows: Optional[list[int]] = None
    # a shared-prompt micro-batch (algo.shared_prompt): per row, how many of its sequences, in order,
    # each of its trees (one prompt, several completions) holds
    trees: Optional[list[list[int]]] = None

    @property
    def size(self) -> int:
        return self.input_ids_BL.shape[0]

    def to(self, device) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
                        else getattr(self, f.name) for f in fields(self)})

    def select(self, idx) -> "Batch":
        picked = {
            f.name: getattr(self, f.name)[idx] if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name)
            for f in fields(self)
        }
        return Batch(**{**picked, "rows": None, "trees": None})  # a packing is laid out for the rows it was made for


def batch_advantages(rewards_PG: torch.Tensor, scale: str, estimator: str = "grpo") -> torch.Tensor:
    """Advantages of this rank's groups (`algo.adv_estimator`): grpo centres on the group mean and
    scales by `scale`; rloo takes the leave-one-out baseline; reinforce_pp centres on the group mean
    and divides by the std of the centred rewards. A batch std (scale=batch, reinforce_pp) is the
    whole batch's, over every rank (summed moments), so 1 process x 4 groups and 2 x 2 agree."""
    if estimator == "rloo":
        return rloo_advantages(rewards_PG)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards_PG, std_from_moments(*dist.all_reduce_sum(centred_moments(rewards_PG))))
    if estimator != "grpo":
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    batch_std = std_from_moments(*dist.all_reduce_sum(reward_moments(rewards_PG))) if scale == "batch" else None
    return group_advantages(rewards_PG, scale, batch_std=batch_std)


def collate(
    prompt_ids: list[list[int]], rollouts, advantages_B: torch.Tensor, pad_id: int, mask_truncated: bool
) -> Batch:
    """prompt_ids has one entry per completion (already repeated G times). Rows are built as lists
    and turned into tensors once (a tensor per row cost 15 ms at 512 rows, a tenth of the default
    run's update)."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in rollouts.completion_ids))
    ids, attn, logps, masks = [], [], [], []
    for i, (p, c, lp) in enumerate(zip(prompt_ids, rollouts.completion_ids, rollouts.logprobs)):
        pad_p, pad_c = P - len(p), T - len(c)
        ids.append([pad_id] * pad_p + list(p) + list(c) + [pad_id] * pad_c)
        attn.append([0] * pad_p + [1] * (len(p) + len(c)) + [0] * pad_c)
        logps.append(list(lp) + [0.0] * pad_c)
        drop = mask_truncated and rollouts.finish_reasons[i] == "length"
        # multi-turn: 0 on the environment's observation tokens, 1 on the sampled ones
        keep = [float(m) for m in rollouts.loss_masks[i]] if rollouts.loss_masks is not None else [1.0] * len(c)
        masks.append(([0.0] * len(c) if drop else keep) + [0.0] * pad_c)
    ids_BL, attn_BL = torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long)
    logp_BT, mask_BT = torch.tensor(logps, dtype=torch.float32), torch.tensor(masks, dtype=torch.float32)
    position_ids_BL = (attn_BL.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(ids_BL, attn_BL, position_ids_BL, ids_BL[:, P:], mask_BT, logp_BT, advantages_B.float(), P)


def forward_logprobs(model, batch: Batch, temperature: float, with_entropy: bool = False, max_tokens: int = 0):
    """Per-token logprobs of the completion under `model` -> logprobs_BT (and entropy_BT), the LM
    head run a piece at a time (`grpo/logprobs.py`): `max_tokens` is the micro-batch cap, which sets
    the number of pieces alike on every rank (0: this batch's own size). `batch` must already be on
    the model's device."""
    T = batch.completion_ids_BT.shape[1]
    inputs = dict(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, position_ids=batch.position_ids_BL)
    def probe():  # the same two tokens on every rank; built only on the model's first call
        b = padding_batch().to(batch.input_ids_BL.device)
        return dict(input_ids=b.input_ids_BL, attention_mask=b.attention_mask_BL, position_ids=b.position_ids_BL)

    plain = plain_head(model, probe)
    if batch.rows is not None or batch.trees is not None:
        return packed_logprobs(model, batch, temperature, with_entropy, max_tokens, plain)
    if not plain:
        # a head of its own (soft-capping, scaling): the model's logits, only the last T + 1 positions
        logits_BTV = model(**inputs, logits_to_keep=T + 1).logits[:, -(T + 1) : -1]
        logp_BT = token_logprobs(logits_BTV, batch.completion_ids_BT, temperature)
        with torch.no_grad():
            ent_BT = entropy(logits_BTV.detach() / max(temperature, 1e-6)) if with_entropy else None
        return logp_BT, ent_BT
    hidden_BLH = model(**inputs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
    hidden_BTH = hidden_BLH[:, -(T + 1) : -1]  # position p predicts token p + 1: the completion's T tokens
    vocab = unwrapped(model).get_output_embeddings().weight
    vocab_size = getattr(vocab, "ds_shape", vocab.shape)[0]  # ZeRO-3: the full shape, not the local shard
    pieces = pieces_for(max_tokens or batch.size * T, vocab_size)
    return head_logprobs(model, hidden_BTH, batch.completion_ids_BT, temperature, pieces, with_entropy)


def packed_logprobs(model, batch: Batch, temperature: float, with_entropy: bool, max_tokens: int, plain: bool):
    """forward_logprobs of a packed micro-batch (`batch.rows`, or `batch.trees` with the prompt once per
    tree): the model runs on the packed rows, the head on the completion tokens only, and logprobs_BT
    (entropy_BT) come back in the batch's B x T layout, 0 past each completion's end."""
    if batch.trees is not None and (mask_dtype := shared_mask_dtype(model)) is None:
        packed_batch, order = without_sharing(batch)
        logp_BT, ent_BT = packed_logprobs(model, packed_batch, temperature, with_entropy, max_tokens, plain)
        back = lambda x_BT: None if x_BT is None else torch.zeros_like(x_BT).index_copy(0, order.to(x_BT.device), x_BT)  # noqa: E731
        return back(logp_BT), back(ent_BT)
    if batch.trees is not None:
        packed = pack_shared(batch.input_ids_BL, batch.attention_mask_BL, batch.prompt_width, batch.trees, mask_dtype)
        inputs = dict(input_ids=packed.input_ids_RW, position_ids=packed.position_ids_RW,
                      attention_mask=packed.mask_R1WW, use_cache=False)
    else:
        if not packs_exactly(model, id(unwrapped(model))):
            raise ConfigError(
                f"algo.packing=true, but {type(unwrapped(model)).__name__} attends across the sequences of a packed row "
                f"(it does not restart attention where the position ids restart): set algo.packing=false.")
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
        vocab = unwrapped(model).get_output_embeddings().weight
        pieces = pieces_for(max_tokens or tokens_1N.shape[1], getattr(vocab, "ds_shape", vocab.shape)[0])
        logp_1N, ent_1N = head_logprobs(model, hidden_RWH[packed.hidden_at][None], tokens_1N, temperature, pieces,
                                        with_entropy)
    zeros_BT = torch.zeros(batch.completion_ids_BT.shape, device=logp_1N.device)
    return (zeros_BT.index_put(packed.token_at, logp_1N[0]),
            zeros_BT.index_put(packed.token_at, ent_1N[0]) if with_entropy else None)


_SHARED_MASK: dict[int, torch.dtype | None] = {}


def shared_mask_dtype(model) -> torch.dtype | None:
    """The attention mask `algo.shared_prompt` hands `model` (pack_shared), decided once per model
    (a one-off check that a tree row gives each completion what it gets alone); None, with a
    warning, where it cannot: its micro-batches are then packed without sharing (the same numbers)."""
    key = id(unwrapped(model))
    if key in _SHARED_MASK:
        return _SHARED_MASK[key]
    dtype, name, window = mask_dtype_for(model), type(unwrapped(model)).__name__, sliding_window_of(model)
    why = None
    if dtype is None:
        why = f"{name} runs {attention_of(model)!r} attention, which takes no custom 4D mask (sdpa and eager do)"
    elif window:
        why = f"{name} attends over a sliding window of {window} tokens, which a 4D mask replaces"
    elif not shares_exactly(model, key, dtype):
        why = f"{name} does not give a completion in a shared-prompt row what it gives it alone (it ignores a 4D mask)"
    if why is not None:
        warnings.warn(f"algo.shared_prompt=true, but {why}: the update packs its micro-batches without sharing "
                      f"prompts (algo.packing; the same numbers, more positions). Set algo.shared_prompt=false to "
                      f"say so.", stacklevel=2)
    _SHARED_MASK[key] = None if why is not None else dtype
    return _SHARED_MASK[key]


def without_sharing(batch: Batch) -> tuple[Batch, torch.Tensor]:
    """A shared-prompt micro-batch laid out packed (algo.packing) instead, and the order of its
    sequences in it."""
    lengths = batch.attention_mask_BL.sum(dim=1).tolist()
    rows = first_fit_rows(lengths, max(lengths))
    order = torch.tensor([i for row in rows for i in row])
    return replace(batch.select(order), rows=[len(row) for row in rows]), order


LAYOUTS = ("padded", "packed", "shared")


def layout_of(algo) -> str:
    """How the update lays out its micro-batches: padded rows, packed rows (algo.packing), or packed
    rows with each prompt once per tree of its completions (algo.shared_prompt)."""
    if not algo.packing:
        return "padded"
    return "shared" if getattr(algo, "shared_prompt", False) else "packed"


# On the CPU a packed row's attention is dense: a position attends over the row's whole width. One
# position's linear layers cost about as much as attending over this many keys (24 h^2 against 4 h
# multiply-adds per layer: 3,456 keys for SmolLM2's h = 576; more for wider models, so rows chosen
# with it are, if anything, too narrow)
KEYS_PER_POSITION = 4096


def shared_width(lengths: list[int], prompts: list[int], keys: list, longest: int, max_tokens: int):
    """(width, rows of shared_plan) for algo.shared_prompt: wider rows let a prompt serve more of its
    completions (fewer positions) but cost more attention per position. The widths tried are the
    longest sequence, then doubled while some prompt still needs several trees and the width stays
    within the micro-batch cap; the one of least positions x (KEYS_PER_POSITION + width) is kept."""
    best = None
    width = longest
    while True:
        rows = shared_plan(lengths, prompts, keys, width)
        cost = len(rows) * width * (KEYS_PER_POSITION + width)
        if best is None or cost < best[0]:
            best = (cost, width, rows)
        trees = sum(len(row) for row in rows)
        if trees == len(set(keys)) or 2 * width > max(max_tokens, longest):
            return best[1], best[2]
        width *= 2


def micro_batch_plan(batch: Batch, max_tokens: int, layout: str = "padded") -> list[tuple[torch.Tensor | slice, dict]]:
    """Which rows of `batch` each micro-batch takes, and (packed, shared) how its rows are laid out,
    as fields of the micro-batch's Batch. padded: consecutive slices of at most `max_tokens` padded
    tokens (at least one row each). packed: the sequences first-fit into rows as wide as the batch's
    longest sequence. shared: the sequences with equal prompts first-fit into trees, the trees into
    rows, as wide as the longest sequence (`shared_plan`). Packed and shared: `max_tokens // width`
    rows (at least one) per micro-batch."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown micro-batch layout {layout!r}; one of {LAYOUTS}")
    if layout == "padded":
        rows = max(1, max_tokens // batch.input_ids_BL.shape[1])
        return [(slice(i, i + rows), {}) for i in range(0, batch.size, rows)]
    lengths = batch.attention_mask_BL.sum(dim=1).tolist()
    if not lengths:
        return []
    width = max(lengths)
    per = max(1, max_tokens // width)
    if layout == "packed":
        rows = first_fit_rows(lengths, width)
        return [(torch.tensor([i for row in rows[k : k + per] for i in row]), {"rows": [len(row) for row in rows[k : k + per]]})
                for k in range(0, len(rows), per)]
    P = batch.prompt_width
    prompts = batch.attention_mask_BL[:, :P].sum(dim=1).tolist()
    keys = [tuple(ids[P - p :]) for ids, p in zip(batch.input_ids_BL[:, :P].tolist(), prompts)]
    width, rows = shared_width(lengths, prompts, keys, width, max_tokens)
    per = max(1, max_tokens // width)
    return [(torch.tensor([i for row in rows[k : k + per] for tree in row for i in tree]),
             {"trees": [[len(tree) for tree in row] for row in rows[k : k + per]]})
            for k in range(0, len(rows), per)]


def micro_batches(batch: Batch, max_tokens: int, layout: str = "padded") -> list[Batch]:
    """The micro-batches of `micro_batch_plan`."""
    return [replace(batch.select(idx), **fields_) for idx, fields_ in micro_batch_plan(batch, max_tokens, layout)]


def padding_batch(layout: str = "padded") -> Batch:
    """One row that enters no loss (mask 0, advantage 0): a rank with fewer micro-batches runs it so
    that every rank makes the same forward/backward calls, which ZeRO's collectives need (laid out as
    the rank's other micro-batches are, so every rank runs the layout's one-off check on the same call)."""
    ids = torch.zeros((1, 2), dtype=torch.long)
    zeros = torch.zeros((1, 1))
    return Batch(ids, torch.ones_like(ids), torch.tensor([[0, 1]]), ids[:, 1:], zeros, zeros, torch.zeros(1),
                 prompt_width=1, ref_logprobs_BT=zeros, rows=[1] if layout == "packed" else None,
                 trees=[[1]] if layout == "shared" else None)


def lockstep_padding(strategy, micro_batches: int) -> int:
    """How many padding micro-batches this rank adds to its `micro_batches`: for a `lockstep`
    strategy the count is raised to the largest on any rank, and to at least 1 (DeepSpeed's step
    needs a backward before it, even when every rank's groups were dropped); otherwise 0."""
    if not getattr(strategy, "lockstep", False):
        return 0
    return max(1, int(dist.all_reduce_max([micro_batches])[0])) - micro_batches


def lockstep_micro_batches(strategy, batch: Batch, max_tokens: int, layout: str = "padded") -> tuple[list[Batch], int]:
    """This rank's micro-batches and how many padding ones to add (`lockstep_padding`)."""
    mbs = micro_batches(batch, max_tokens, layout)
    return mbs, lockstep_padding(strategy, len(mbs))


@torch.no_grad()
def score_tokens(model, batch: Batch, temperature: float, max_tokens: int, strategy=None,
                 layout: str = "padded") -> torch.Tensor:
    """logprobs_BT of the whole batch (no gradient), in micro-batches."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    plan = micro_batch_plan(batch, max_tokens, layout)
    out_BT = torch.zeros_like(batch.sampler_logprobs_BT)
    for idx, fields_ in plan:
        mb = replace(batch.select(idx), **fields_).to(device)
        out_BT[idx] = forward_logprobs(model, mb, temperature, max_tokens=max_tokens)[0].cpu()
    for _ in range(lockstep_padding(strategy, len(plan))):
        forward_logprobs(model, padding_batch(layout).to(device), temperature, max_tokens=max_tokens)
    model.train(was_training)
    return out_BT


def loss_norm(batch: Batch, max_len: int, gen_tokens_per_step: float) -> LossNorm:
    return LossNorm(
        num_seqs=int((batch.mask_BT.sum(dim=1) > 0).sum()),
        num_tokens=int(batch.mask_BT.sum()),
        max_len=max_len,
        gen_tokens_per_step=gen_tokens_per_step,
    )


SUMS = ("loss", "clipped_tokens", "kl_sum", "entropy_sum", "sampler_diff_max", "sampler_kl_sum", "sampler_kl_tokens")


def accumulate_gradients(strategy, batch: Batch, algo, norm: LossNorm, temperature: float) -> dict[str, torch.Tensor]:
    """Forward + backward over micro-batches of `batch`; gradients add up to the full batch's. The
    statistics stay on the device (0-dim tensors): the step reads them once, not per micro-batch."""
    device = next(strategy.model.parameters()).device
    sums = {k: torch.zeros((), device=device) for k in SUMS}
    layout = layout_of(algo)
    mbs, padding = lockstep_micro_batches(strategy, batch, algo.micro_batch_tokens, layout)
    for mb in mbs + [padding_batch(layout)] * padding:
        mb = mb.to(device)
        logp_BT, ent_BT = forward_logprobs(strategy.forward_model, mb, temperature, with_entropy=True,
                                           max_tokens=algo.micro_batch_tokens)
        # proximal policy: the trainer before this update (decoupled loss, grpo/algorithm.py)
        old_BT = mb.old_logprobs_BT if mb.old_logprobs_BT is not None else logp_BT.detach()
        loss, stats = decoupled_loss(logp_BT, old_BT, mb.sampler_logprobs_BT, mb.advantages_B, mb.mask_BT, norm, algo,
                                     ref_logprobs_BT=mb.ref_logprobs_BT)
        strategy.backward(loss)
        if mb.size:  # |trainer - sampler| logprob on the sampled tokens (see policy_update)
            diff_BT = (logp_BT.detach() - mb.sampler_logprobs_BT).abs() * mb.mask_BT
            sums["sampler_diff_max"] = torch.maximum(sums["sampler_diff_max"], diff_BT.max())
            kl_sum, kl_tokens = sampled_kl(mb.sampler_logprobs_BT, logp_BT, mb.mask_BT)
            sums["sampler_kl_sum"] += kl_sum
            sums["sampler_kl_tokens"] += kl_tokens
        sums["loss"] += loss.detach()
        sums["clipped_tokens"] += stats["clipped_tokens"]
        sums["kl_sum"] += stats.get("kl_sum", 0.0)
        sums["entropy_sum"] += (ent_BT * mb.mask_BT).sum()
    return sums


def policy_update(
    strategy, batch: Batch, algo, max_len: int, temperature: float, ref_model=None
) -> dict[str, float]:
    """num_iterations passes over the batch, each cut into num_minibatches optimizer steps.

    The batch holds whole groups of G consecutive rows (zero-std groups may have been dropped);
    minibatches are cut between groups. On-policy (one pass, one step) the old logprobs are the
    current ones, detached; otherwise they are computed once before any update, so every step's
    ratio is against the sampling policy. Every optimizer step is taken even when its minibatch is
    empty (all its groups dropped), so the LR schedule and, across ranks, the collectives stay in
    step.
    """
    G = algo.group_size
    lockstep = strategy.lockstep  # every rank joins every forward, even with no rows
    if (batch.size or lockstep) and (algo.num_iterations > 1 or algo.num_minibatches > 1):
        old_BT = score_tokens(strategy.forward_model, batch, temperature, algo.micro_batch_tokens, strategy, layout_of(algo))
        batch = replace(batch, old_logprobs_BT=old_BT)
    if (batch.size or lockstep) and algo.beta > 0:  # a sharded reference (ZeRO-3) needs every rank too
        ref_BT = score_tokens(ref_model, batch, temperature, algo.micro_batch_tokens, strategy, layout_of(algo))
        batch = replace(batch, ref_logprobs_BT=ref_BT)
    # normalisers count the whole optimizer batch on every rank; each rank joins every reduction,
    # also with an empty minibatch
    gen_tokens_per_step = strategy.reduce_counts([float(batch.mask_BT.sum())])[0] / algo.num_minibatches
    group_chunks = torch.arange(batch.size // G).tensor_split(algo.num_minibatches)
    totals = {k: 0.0 for k in SUMS}  # 0-dim tensors on the device once a micro-batch ran
    tokens, grad_norm, steps = 0.0, 0.0, 0
    for _ in range(algo.num_iterations):
        for groups in group_chunks:
            rows = (groups[:, None] * G + torch.arange(G)).flatten()
            mb = batch.select(rows)
            local = loss_norm(mb, max_len, gen_tokens_per_step)
            num_seqs, num_tokens = strategy.reduce_counts([local.num_seqs, local.num_tokens])
            norm = replace(local, num_seqs=int(num_seqs), num_tokens=int(num_tokens))
            if rows.numel() or lockstep:
                sums = accumulate_gradients(strategy, mb, algo, norm, temperature)
                for k in ("loss", "clipped_tokens", "kl_sum", "entropy_sum"):
                    totals[k] = totals[k] + sums[k]
                if steps == 0:  # before any optimizer step the trainer holds the weights that sampled
                    totals["sampler_diff_max"] = sums["sampler_diff_max"]
                if steps < algo.num_minibatches:  # the first pass: each token once
                    totals["sampler_kl_sum"] = totals["sampler_kl_sum"] + sums["sampler_kl_sum"]
                    totals["sampler_kl_tokens"] = totals["sampler_kl_tokens"] + sums["sampler_kl_tokens"]
                tokens += local.num_tokens
            grad_norm += strategy.step()
            steps += 1
    # the one read of the statistics from the device
    totals = dict(zip(SUMS, torch.stack([torch.as_tensor(totals[k], dtype=torch.float32).cpu() for k in SUMS]).tolist()))
    tokens = max(tokens, 1.0)
    return {
        "loss": totals["loss"] / steps,
        "grad_norm": grad_norm / steps,
        "clip_frac": totals["clipped_tokens"] / tokens,
        "kl": totals["kl_sum"] / tokens,
        "entropy": totals["entropy_sum"] / tokens,
        "trained_completions": batch.size,
        # max |trainer - sampler| logprob of a sampled token, with the weights that sampled: ~1e-5
        # when the engine got the last sync (fp32), far larger when it still runs older weights
        "sampler_diff": totals["sampler_diff_max"],
        # KL(sampler || trainer) on the sampled tokens, k3, over the first pass; the trainer's side is
        # the weights before each minibatch's step: with a stale batch (algo.max_staleness), how far
        # the policy moved since the batch was sampled
        "sampler_kl": totals["sampler_kl_sum"] / max(totals["sampler_kl_tokens"], 1.0),
    }
