"""The update: num_iterations passes over the batch, each cut into optimizer steps; each step's
micro-batches through one forward, the loss and the strategy's backward.

Following one micro-batch: `plan` lays the batch out (grpo/update/layouts.py: the layout the model
runs, the micro-batches, each one's `Rows`), `forward.logprobs` gives its per-token logprobs
(grpo/update/forward.py), `decoupled_loss` its loss (grpo/algorithm.py), the strategy its backward
(grpo/parallel/). With sequence parallelism the strategy's `sequence` (grpo/parallel/sequence.py)
exchanges the group's micro-batches, runs the attention through the group and sums the logprobs.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch

from grpo import dist, flops, moe_model
from grpo.algorithm import LossNorm, decoupled_loss, sampled_kl
from grpo.batch import Batch
from grpo.moe import routing
from grpo.update import forward, layouts


def lockstep_padding(strategy, micro_batches: int) -> int:
    """How many padding micro-batches this rank adds to its `micro_batches`: for a `lockstep`
    strategy the count is raised to the largest on any rank, and to at least 1 (DeepSpeed's step
    needs a backward before it, even when every rank's groups were dropped); otherwise 0."""
    if not getattr(strategy, "lockstep", False):
        return 0
    return max(1, int(dist.all_reduce_max([micro_batches])[0])) - micro_batches


def split_of(strategy):
    """The strategy's sequence-parallel split (parallel.sequence_parallel > 1), or None."""
    return getattr(strategy, "sequence", None)


def work(strategy, model, batch: Batch, asked: str, max_tokens: int) -> tuple[layouts.Plan, list]:
    """(the batch's plan, what this rank runs forwards on): (micro-batch, whether it is this rank's own,
    whether it is padding) for each micro-batch, then for the padding micro-batches that keep the ranks
    in step. With sequence parallelism every micro-batch of the rank's group, in rank order (its statistics and outputs are kept by its
    own rank alone). The padding is counted before any forward: under ZeRO-3 a forward is a collective
    (parameter gathers, and DeepSpeed's trace check at its start), so a rank with fewer micro-batches
    must not reach this all-reduce while another is still in a forward."""
    plan = layouts.plan(model, batch, asked, max_tokens)
    split = split_of(strategy)
    mine = [(mb, True) for mb in plan.micro_batches] if split is None else split.exchange(plan.micro_batches)
    extra = lockstep_padding(strategy, len(mine))
    return plan, [(mb, own, False) for mb, own in mine] + [(layouts.padding(plan.layout), False, True)] * extra


@contextlib.contextmanager
def forwarding(strategy, model, mb: layouts.MicroBatch, temperature: float, with_entropy: bool = False,
               max_tokens: int = 0, experts: moe_model.Experts | None = None, replayed: routing.Replayed | None = None,
               tally: dict | None = None, part: str = ""):
    """(logprobs_BT, entropy_BT, routing) of micro-batch `mb` (on the model's device) under `model`
    (routing: with a MoE's `experts`, the forward's load-balancing loss and expert load, grpo/moe_model.py;
    else None); with
    sequence parallelism its rows split across the group, the split kept until the block ends so the
    caller's backward runs there too. With the sampler's routed experts (rollout.routing_replay) every
    MoE layer routes as the sampler did, through the block: gradient checkpointing's recompute in the
    caller's backward replays them too (grpo/moe/routing.py); `replayed` counts what the replay did.
    `tally[part]` adds the forward's work (grpo/flops.py; a split rank's: its share of the columns)."""
    split = split_of(strategy)
    rows = layouts.rows(model, mb, 1 if split is None else split.size)
    if tally is not None:
        b = mb.batch
        work = flops.rows_work(rows, b.attention_mask_BL[:, b.prompt_width:].sum())  # read once, at the update's end
        tally[part] = tally[part] + (work if split is None else work.scaled(1 / split.size))
    routes = rows.routes_RWMK  # a split rank's MoE layers run its own columns' tokens: their routes
    if split is not None and routes is not None:
        routes = routes[:, split.columns(routes.shape[1])]
    with contextlib.nullcontext() if split is None else split.running(rows), routing.replay(model, routes, replayed, mb.batch.replay_routes):
        yield forward.routed_logprobs(model, rows, temperature, with_entropy, max_tokens, split, experts)


@torch.no_grad()
def score_tokens(model, batch: Batch, temperature: float, max_tokens: int, strategy=None,
                 layout: str = "padded", training_mode: bool = False, tally: dict | None = None,
                 part: str = "", replayed: routing.Replayed | None = None) -> torch.Tensor:
    """logprobs_BT of the whole batch (no gradient), in micro-batches; in eval mode unless
    `training_mode` (the mode the loss's forward runs in: grpo.verify compares the two). `tally[part]`
    adds the forwards' work; `replayed` what routing replay did in the forwards this rank counts."""
    was_training = model.training
    model.train(training_mode)
    device = next(model.parameters()).device
    _, runs = work(strategy, model, batch, layout, max_tokens)
    out_BT = torch.zeros_like(batch.sampler_logprobs_BT)
    split = split_of(strategy)
    for mb, mine, padding in runs:  # lockstep padding is no work (docs/mfu.md): its one row enters no loss
        done = routing.Replayed()
        with forwarding(strategy, model, mb.to(device), temperature, max_tokens=max_tokens, replayed=done,
                        tally=None if padding else tally, part=part) as (logp_BT, _, _):
            if mine:
                out_BT[mb.index] = logp_BT.cpu()
        if replayed is not None and counts_routing(split, mine, padding):
            replayed.flips, replayed.given = replayed.flips + done.flips, replayed.given + done.given
    model.train(was_training)
    return out_BT


def loss_norm(batch: Batch, max_len: int, gen_tokens_per_step: float) -> LossNorm:
    return LossNorm(
        num_seqs=int((batch.mask_BT.sum(dim=1) > 0).sum()),
        num_tokens=int(batch.mask_BT.sum()),
        max_len=max_len,
        gen_tokens_per_step=gen_tokens_per_step,
    )


SUMS = ("loss", "clipped_tokens", "kl_sum", "entropy_sum", "sampler_diff_max", "sampler_diff_sum", "sampler_kl_sum",
        "sampler_kl_tokens", "aux_loss_sum", "routed_forwards", "routing_flips", "routing_given")
# summed over ranks before the update's ratios are taken (the loss stays each rank's share: summed by the loop)
RANK_SUMS = tuple(k for k in SUMS if k not in ("loss", "sampler_diff_max"))


def accumulate_gradients(strategy, batch: Batch, algo, norm: LossNorm, temperature: float,
                         tally: dict | None = None) -> tuple[dict, layouts.Plan]:
    """Forward + backward over micro-batches of `batch`; gradients add up to the full batch's. Returns
    the statistics, on the device (0-dim tensors: the step reads them once, not per micro-batch; a
    MoE's `load_E` too), and the plan the micro-batches ran in; `tally["train"]` adds the forwards' work.

    A MoE with a load-balancing loss (grpo/moe_model.py) adds coef x its aux loss to each micro-batch's
    loss, weighted by the micro-batch's share of the loss's tokens (the shares of every rank's
    micro-batches sum to 1, so the weight does not grow with the number of micro-batches)."""
    device = next(strategy.model.parameters()).device
    sums = {k: torch.zeros((), device=device) for k in SUMS}
    experts = moe_model.routed_experts(strategy.forward_model)
    coef = moe_model.aux_coef(algo.router_aux_loss_coef, strategy.forward_model)
    if experts is not None:
        sums["load_E"] = torch.zeros(experts.num_experts, device=device)
    plan, runs = work(strategy, strategy.forward_model, batch, layouts.layout_of(algo, device.type == "cuda"),
                      algo.micro_batch_tokens)
    # a micro-batch split across S ranks: each computes its whole loss and backs off 1/S of it
    # (grpo/parallel/sequence.py); its statistics count on its own rank alone, but its routing on
    # every rank of the group (`counts_routing`)
    split = split_of(strategy)
    share = 1 if split is None else split.size
    for planned, mine, padding in runs:
        planned = planned.to(device)
        mb = planned.batch
        replayed = routing.Replayed()  # rollout.routing_replay: the trainer's own routers against the sampler's
        with forwarding(strategy, strategy.forward_model, planned, temperature, True, algo.micro_batch_tokens,
                        experts, replayed, None if padding else tally, "train") as (logp_BT, ent_BT, routed):
            # proximal policy: the trainer before this update (decoupled loss, grpo/algorithm.py)
            old_BT = mb.old_logprobs_BT if mb.old_logprobs_BT is not None else logp_BT.detach()
            loss, stats = decoupled_loss(logp_BT, old_BT, mb.sampler_logprobs_BT, mb.advantages_B, mb.mask_BT, norm,
                                         algo, ref_logprobs_BT=mb.ref_logprobs_BT)
            if routed is not None and coef > 0:  # the router's load-balancing loss, this micro-batch's share
                loss = loss + coef * routed.aux_loss * (mb.mask_BT.sum() / max(norm.trained_tokens or norm.num_tokens, 1))
            # the backward under the forward's kernels too: gradient checkpointing recomputes layers there
            with forward.training_attention(device):
                strategy.backward(loss / share if share > 1 else loss)
        if counts_routing(split, mine, padding):
            sums["routing_flips"] += replayed.flips  # the first forward's (a gradient checkpointing recompute adds again)
            sums["routing_given"] += replayed.given
            if routed is not None:
                sums["aux_loss_sum"] += routed.aux_loss.detach()
                sums["routed_forwards"] += 1
                sums["load_E"] += routed.load_E
        if not mine:
            continue
        if mb.size:  # the sampler against the trainer before the update (old_BT: see policy_update)
            # with minibatches, later ones run after a step, and the update's own movement read as a
            # sampler mismatch (sampler_kl 0.058 on a fresh batch)
            diff_BT = (old_BT - mb.sampler_logprobs_BT).abs() * mb.mask_BT
            sums["sampler_diff_max"] = torch.maximum(sums["sampler_diff_max"], diff_BT.max())
            sums["sampler_diff_sum"] += diff_BT.sum()
            kl_sum, kl_tokens = sampled_kl(mb.sampler_logprobs_BT, old_BT, mb.mask_BT)
            sums["sampler_kl_sum"] += kl_sum
            sums["sampler_kl_tokens"] += kl_tokens
        sums["loss"] += loss.detach()
        sums["clipped_tokens"] += stats["clipped_tokens"]
        sums["kl_sum"] += stats.get("kl_sum", 0.0)
        sums["entropy_sum"] += (ent_BT * mb.mask_BT).sum()
    return sums, plan


def counts_routing(split, mine: bool, padding: bool) -> bool:
    """Whether this rank's forward of a micro-batch adds to the logged routing (a MoE's expert load and
    aux loss, routing replay's flips). Unsplit: its own rank's. Split: every rank of the group's, for each of the group's
    micro-batches (not the lockstep padding): a split rank's MoE layers route its own columns' tokens
    only, the columns do not overlap, so the group's sum is the micro-batch's load (its owner's alone
    was about 2/3 of it, the prompt-heavy first columns); each rank's aux loss, the one it trained
    on, is one forward of the mean. Summed over all ranks (`RANK_SUMS`), every token counts once."""
    return mine if split is None else not padding


def policy_update(
    strategy, batch: Batch, algo, max_len: int, temperature: float, ref_model=None, skip_P: torch.Tensor | None = None
) -> dict[str, float | str]:
    """num_iterations passes over the batch, each cut into num_minibatches optimizer steps. Returns
    the update's statistics, the layout its micro-batches ran in (`layout`) and the work of its
    forwards (`work`: grpo/flops.py `Work` for "old" logprobs, the "reference" and "train").

    The batch holds whole groups of G consecutive rows; minibatches are cut between groups. `skip_P`:
    groups left out of every forward (algo.zero_std_groups=drop: their advantages are 0, and with
    beta 0 so is their gradient), yet counted in the loss's normalisers as if trained, so the
    gradient is the whole batch's, not 1 / (1 - zero_std_frac) times it (minibatches are cut over
    every group, then the skipped ones left out). On-policy (one pass, one step) the old logprobs are
    the current ones, detached; otherwise they are computed once before any update, so every step's
    ratio is against the sampling policy. Every optimizer step is taken even when its minibatch is
    empty (all its groups skipped), so the LR schedule and, across ranks, the collectives stay in
    step.
    """
    G = algo.group_size
    whole, P = batch, batch.size // G  # the normalisers' batch, every group in it
    skip_P = torch.zeros(P, dtype=torch.bool) if skip_P is None else skip_P.cpu()
    kept_at_P = torch.cumsum(~skip_P, 0) - 1  # a kept group's place in the trained batch
    if skip_P.any():
        batch = batch.select((~skip_P).repeat_interleave(G))
    # every rank joins every forward, even with no rows (a rank's group shares its forwards: the same)
    lockstep = strategy.lockstep or split_of(strategy) is not None
    layout = layouts.layout_of(algo, next(strategy.model.parameters()).device.type == "cuda")
    ran = layout  # what the model ran: the asked layout, or its fallback (`layouts.plan`)
    tally = {"old": flops.Work(), "reference": flops.Work(), "train": flops.Work()}
    # routing replay's flips, counted in the forwards before any optimizer step over every trained row:
    # the proximal forward's where there is one, else the one training forward's
    proximal = algo.num_iterations > 1 or algo.num_minibatches > 1
    flipped = routing.Replayed()
    if (batch.size or lockstep) and proximal:
        old_BT = score_tokens(strategy.forward_model, batch, temperature, algo.micro_batch_tokens, strategy, layout,
                              tally=tally, part="old", replayed=flipped)
        batch = replace(batch, old_logprobs_BT=old_BT)
    if (batch.size or lockstep) and algo.beta > 0:  # a sharded reference (ZeRO-3) needs every rank too
        ref_BT = score_tokens(ref_model, batch, temperature, algo.micro_batch_tokens, strategy, layout,
                              tally=tally, part="reference")
        batch = replace(batch, ref_logprobs_BT=ref_BT)
    # normalisers count the whole optimizer batch on every rank; each rank joins every reduction,
    # also with an empty minibatch
    gen_tokens_per_step = strategy.reduce_counts([float(whole.mask_BT.sum())])[0] / algo.num_minibatches
    group_chunks = torch.arange(P).tensor_split(algo.num_minibatches)
    totals = {k: 0.0 for k in SUMS}  # 0-dim tensors on the device once a micro-batch ran
    experts = moe_model.routed_experts(strategy.forward_model)  # a MoE's routing is logged (grpo/moe_model.py)
    load_E = torch.zeros(experts.num_experts) if experts is not None else None  # top-k assignments per expert
    tokens, norms = 0.0, []
    for _ in range(algo.num_iterations):
        for groups in group_chunks:
            local = loss_norm(whole.select((groups[:, None] * G + torch.arange(G)).flatten()), max_len, gen_tokens_per_step)
            rows = (kept_at_P[groups[~skip_P[groups]]][:, None] * G + torch.arange(G)).flatten()
            mb = batch.select(rows)
            num_seqs, num_tokens, trained = strategy.reduce_counts([local.num_seqs, local.num_tokens,
                                                                    float(mb.mask_BT.sum())])
            norm = replace(local, num_seqs=int(num_seqs), num_tokens=int(num_tokens), trained_tokens=int(trained))
            if rows.numel() or lockstep:
                sums, plan = accumulate_gradients(strategy, mb, algo, norm, temperature, tally)
                ran = plan.layout
                for k in ("loss", "clipped_tokens", "kl_sum", "entropy_sum", "aux_loss_sum", "routed_forwards"):
                    totals[k] = totals[k] + sums[k]
                if experts is not None:
                    load_E = sums["load_E"] + load_E.to(sums["load_E"].device)
                if not proximal:  # one minibatch, one pass: the forward before the step, every row
                    flipped = routing.Replayed(flips=sums["routing_flips"], given=sums["routing_given"])
                if len(norms) < algo.num_minibatches:  # the first pass, each token once, against the proximal
                    # logprobs: a step whose first minibatch held flat groups alone measured no sampler_diff
                    totals["sampler_diff_max"] = torch.maximum(torch.as_tensor(totals["sampler_diff_max"]).to(
                        sums["sampler_diff_max"].device), sums["sampler_diff_max"])
                    for k in ("sampler_diff_sum", "sampler_kl_sum", "sampler_kl_tokens"):  # the tokens: both statistics'
                        totals[k] = totals[k] + sums[k]
                tokens += float(mb.mask_BT.sum())  # the trained tokens: the statistics' denominator
            norms.append(strategy.step())
    totals["routing_flips"], totals["routing_given"] = flipped.flips, flipped.given
    # the one read of the statistics from the device
    totals = dict(zip(SUMS, torch.stack([torch.as_tensor(totals[k], dtype=torch.float32).cpu() for k in SUMS]).tolist()))
    # every rank's share summed, so each ratio below is the whole batch's and the same on every rank (a
    # ratio per rank, averaged over ranks, was wrong wherever ranks hold unequal tokens: a rank with no
    # rows halved clip_frac, kl, entropy); the largest difference is the largest of every rank's
    load = load_E.cpu().tolist() if experts is not None else []
    # the sampler's routes: token-layers it forwarded that reached the update without one, every rank's
    # rows (grpo/moe/routing.py `unrouted`; (0, 0) without routes)
    unrouted = routing.unrouted(whole.routes_BLMK, whole.attention_mask_BL)
    summed = strategy.reduce_counts([totals[k] for k in RANK_SUMS] + [tokens, *load, *unrouted])
    (missing_routes, forwarded_routes), summed = summed[-2:], summed[:-2]
    totals.update(zip(RANK_SUMS, summed))
    # no sampled token scored (every group skipped as flat): the trainer-sampler difference was not
    # measured this step, not 0
    unmeasured = totals["sampler_kl_tokens"] == 0
    # no token trained at all (every group skipped as flat): clip_frac, kl and entropy are not 0 but unknown
    untrained = summed[len(RANK_SUMS)] == 0
    tokens = max(summed[len(RANK_SUMS)], 1.0)
    load_E = torch.tensor(summed[len(RANK_SUMS) + 1:]) if experts is not None else None
    totals["sampler_diff_max"] = dist.all_reduce_max([totals["sampler_diff_max"]])[0]
    # a step with a non-finite norm was skipped (grpo/guards.py); with num_minibatches > 1 the others
    # were applied, so grad_norm is their mean (inf for the whole update read "the step was skipped")
    applied = [n for n in norms if math.isfinite(n)]
    moe_metrics = {} if experts is None else moe_model.routing_metrics(
        totals["aux_loss_sum"] / max(totals["routed_forwards"], 1.0), load_E)
    return {
        "loss": totals["loss"] / len(norms),
        "grad_norm": sum(applied) / len(applied) if applied else sum(norms) / len(norms),
        "optimizer_steps": len(norms),
        "skipped_optimizer_steps": len(norms) - len(applied),
        "clip_frac": math.nan if untrained else totals["clipped_tokens"] / tokens,
        "kl": math.nan if untrained else totals["kl_sum"] / tokens,
        "entropy": math.nan if untrained else totals["entropy_sum"] / tokens,
        "trained_completions": int((batch.mask_BT.sum(1) > 0).sum()),  # with a token in the loss (a masked row trains nothing)
        "layout": ran,  # the micro-batches' layout: padded, packed or shared (grpo/update/layouts.py)
        # what the forwards processed (grpo/flops.py); the loop turns it into FLOPs and MFU
        "work": {part: work.resolved() for part, work in tally.items()},
        # max |trainer - sampler| logprob of a sampled token, the trainer's before the update: ~1e-5
        # when the engine got the last sync (fp32), far larger when it still runs older weights
        "sampler_diff": math.nan if unmeasured else totals["sampler_diff_max"],
        # its mean over the trained sampled tokens
        "sampler_diff_mean": math.nan if unmeasured else totals["sampler_diff_sum"] / max(totals["sampler_kl_tokens"], 1.0),
        # KL(sampler || trainer) on the sampled tokens, k3, each token once; the trainer's side is the
        # weights before the update (the proximal policy): with a stale batch (algo.max_staleness), how
        # far the policy moved since the batch was sampled, ~0 on a fresh one
        "sampler_kl": totals["sampler_kl_sum"] / totals["sampler_kl_tokens"] if totals["sampler_kl_tokens"] else math.nan,
        **moe_metrics,  # moe/aux_loss, moe/expert_load_max, moe/routing_entropy: a MoE's only
        # rollout.routing_replay: of the token-layers given the sampler's experts (every trained row,
        # before the update), the fraction the trainer's own router would have sent elsewhere, on the same input
        **({"routing/flip_fraction": totals["routing_flips"] / totals["routing_given"]} if totals["routing_given"] else {}),
        # of the token-layers the sampler forwarded, those that reached the update without its route (a
        # prefix cache's block no row of the batch had): the trainer's own router chose them
        **({"routing/unrouted_fraction": missing_routes / forwarded_routes} if forwarded_routes else {}),
    }
