"""GRPO math as pure tensor functions.

Shape suffixes: B = completions in the batch, G = completions per prompt, P = prompts, T = completion
tokens (right-padded), V = vocabulary. Masks are float tensors of 0/1.

Loss aggregation is written so the gradient does not depend on how a batch is cut into
micro-batches or ranks: every normaliser is a count over the whole optimizer batch, passed in as
`LossNorm`, and each micro-batch contributes its share of one global sum.

The algo group's schema and config rules (`check`, `check_turn_rewards`, ...) are grpo/algo_config.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo.metrics import std_from_moments


def combine_rewards(rewards_FB: list[list[float | None]], weights_F: list[float]) -> torch.Tensor:
    """Weighted sum over F reward functions -> rewards_B; NaN (excluded from the advantage statistics)
    where every function abstained or any one failed.

    A function that returns None for a completion abstains (it does not apply); the others still
    count. NaN is a function that failed on it (grpo.rewards.FAILED: it raised, hung, was not
    answered): the others' partial sum is not the reward asked for, so the completion is excluded.
    """
    abstained_FB = torch.tensor([[v is None for v in row] for row in rewards_FB], dtype=torch.bool)
    r_FB = torch.tensor([[0.0 if v is None else float(v) for v in row] for row in rewards_FB], dtype=torch.float64)
    w_F1 = torch.tensor(weights_F, dtype=torch.float64)[:, None]
    scored_B = ~abstained_FB.all(dim=0) & ~torch.isnan(r_FB).any(dim=0)
    total_B = (r_FB * w_F1).sum(dim=0)
    return torch.where(scored_B, total_B, torch.nan).float()


def _nanstd(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    """Sample std (n - 1) ignoring NaN; 0 where fewer than two values are present."""
    valid = ~torch.isnan(x)
    n = valid.sum(dim=dim, keepdim=True).clamp(min=1)
    mean = torch.nansum(x, dim=dim, keepdim=True) / n
    sq = torch.where(valid, (x - mean) ** 2, 0.0).sum(dim=dim, keepdim=True)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    return std if keepdim else std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(
    rewards_PG: torch.Tensor, scale: str = "group", eps: float = 1e-4, batch_std: float | None = None
) -> torch.Tensor:
    """Advantages_PG = (r - mean of its group) / (std + eps); NaN rewards get advantage 0.

    scale: "group" divides by the group's std (GRPO), "batch" by the std of all rewards in the
    batch (more robust when a group's std is tiny; pass `batch_std` from every rank's rewards,
    `std_from_moments`, so it is the global batch's, not this rank's), "none" only centres (Dr. GRPO).
    Computed in float64, and a group whose rewards are all equal gets exactly 0: in float32 a
    group of equal non-dyadic rewards (0.1, 0.1, ...) left a rounding residue in r - mean that the
    division by (0 + eps) blew up to same-sign advantages of up to 6e-4.
    """
    r_PG = rewards_PG.double()
    valid_PG = ~torch.isnan(r_PG)
    n_P1 = valid_PG.sum(dim=1, keepdim=True).clamp(min=1)
    mean_P1 = torch.nansum(r_PG, dim=1, keepdim=True) / n_P1
    centred_PG = r_PG - mean_P1
    if scale == "group":
        centred_PG = centred_PG / (_nanstd(r_PG, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred_PG = centred_PG / ((_nanstd(r_PG) if batch_std is None else batch_std) + eps)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}")
    flat_P1 = zero_std_groups(rewards_PG)[:, None]
    return torch.where(valid_PG & ~flat_P1, centred_PG, 0.0).float()


def rloo_advantages(rewards_PG: torch.Tensor) -> torch.Tensor:
    """RLOO's leave-one-out baseline -> advantages_PG = r_i - mean of the other scored rewards of its group.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs". With n scored rewards in a group, r_i - (sum - r_i) / (n - 1) equals
    n / (n - 1) x (r_i - mean): GRPO's centring without the std, scaled up by n / (n - 1). Not scaled
    by any std, as in the paper. NaN rewards are left out and get 0, like a group whose scored
    rewards are all equal (exactly 0, computed in float64, as `group_advantages`).
    """
    r_PG = rewards_PG.double()
    valid_PG = ~torch.isnan(r_PG)
    n_P1 = valid_PG.sum(dim=1, keepdim=True)
    total_P1 = torch.nansum(r_PG, dim=1, keepdim=True)
    loo_PG = r_PG - (total_P1 - r_PG) / (n_P1 - 1).clamp(min=1)
    flat_P1 = zero_std_groups(rewards_PG)[:, None]  # also every group with fewer than 2 scored rewards
    return torch.where(valid_PG & ~flat_P1, loo_PG, 0.0).float()


def turn_returns(rewards_BK: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted returns of each turn -> returns_BK, R_t = sum over k >= t of gamma^(k - t) x r_k.

    rewards_BK: trajectory b's reward at its turn k (0-based), NaN past its last turn (a trajectory's
    turns are a prefix of the K columns); the returns are NaN there too. Computed in float64,
    backwards: R_t = r_t + gamma x R_{t+1}."""
    r_BK = rewards_BK.double()
    valid_BK = ~torch.isnan(r_BK)
    returns_BK = torch.full_like(r_BK, torch.nan)
    running_B = torch.zeros(r_BK.shape[0], dtype=torch.float64)
    for k in reversed(range(r_BK.shape[1])):
        running_B = torch.where(valid_BK[:, k], torch.nan_to_num(r_BK[:, k]) + gamma * running_B, 0.0)
        returns_BK[:, k] = torch.where(valid_BK[:, k], running_B, torch.nan)
    return returns_BK


def per_turn_advantages(rewards_PGK: torch.Tensor, gamma: float, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """`algo.turn_rewards=per_turn` -> advantages_PGK: each turn's discounted return (`turn_returns`),
    group-normalised across the G trajectories of its prompt that reached the same turn index:
    A_{i,t} = (R_{i,t} - mean_j R_{j,t}) / (std_j R_{j,t} + eps), j over the trajectories with a turn t.

    A turn-indexed baseline: GiGPO's step-level group (Feng et al. 2025, "Group-in-Group Policy
    Optimization for LLM Agent Training": discounted returns normalised within a group of steps)
    with the group taken as "same prompt, same turn index" instead of "same environment state".
    Turn 1 (every trajectory has one) with gamma = 1 gets exactly the final-reward GRPO advantage.
    Biased where the policy decides how many turns a trajectory takes: the trajectories that reach
    turn t are a selection made by the earlier turns, so turn t's baseline compares a trajectory
    only with the survivors (a turn reached by one trajectory gets 0), and the std and the sample's
    own return in its baseline add GRPO's usual biases. Missing turns (NaN) and flat turn groups get
    exactly 0 (`group_advantages` per (prompt, turn))."""
    P, G, K = rewards_PGK.shape
    returns_XG = turn_returns(rewards_PGK.reshape(P * G, K), gamma).view(P, G, K).permute(0, 2, 1).reshape(P * K, G)
    return group_advantages(returns_XG, scale, eps).view(P, K, G).permute(0, 2, 1).contiguous()


def process_advantages(rewards_PGK: torch.Tensor, gamma: float, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """`algo.turn_rewards=process` -> advantages_PGK: DeepSeekMath's process supervision (Shao et al.
    2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    section 4.1.3) with a turn as the step: every turn reward of the group is normalised together,
    r~_{i,k} = (r_{i,k} - mean(R)) / (std(R) + eps), R = every (trajectory, turn) reward of the
    group, and the advantage of turn t is the sum of its trajectory's normalised rewards from t on,
    A_{i,t} = sum over k >= t of gamma^(k - t) x r~_{i,k} (the paper: gamma = 1).
    Every normalised reward is centred on the group's per-turn mean, so with a reward given only at
    the end a trajectory's extra turns each add (0 - mean) / std: the estimator prefers shorter
    episodes where rewards are positive (a length bias the paper's fixed-step solutions did not
    have). Flat groups get exactly 0; missing turns 0."""
    P, G, K = rewards_PGK.shape
    valid_PGK = ~torch.isnan(rewards_PGK)
    normed_PX = group_advantages(rewards_PGK.reshape(P, G * K), scale, eps).double()
    normed_BK = torch.where(valid_PGK, normed_PX.view(P, G, K), torch.nan).view(P * G, K)
    return torch.nan_to_num(turn_returns(normed_BK, gamma)).view(P, G, K).float()


def centred_moments(rewards_PG: torch.Tensor) -> list[float]:
    """`reward_moments` of the group-centred rewards (r - its group's mean): summed over ranks, they
    give REINFORCE++'s global std of the baseline-subtracted rewards."""
    r_PG = rewards_PG.double()
    n_P1 = (~torch.isnan(r_PG)).sum(dim=1, keepdim=True).clamp(min=1)
    return reward_moments(r_PG - torch.nansum(r_PG, dim=1, keepdim=True) / n_P1)


def reinforce_pp_advantages(rewards_PG: torch.Tensor, batch_std: float | None = None, eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE++ with a group baseline -> advantages_PG = (r - group mean) / (std over the batch of
    (r - group mean) + eps).

    Hu et al. 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and
    Reward Model" (the "REINFORCE++-baseline" variant for several responses per prompt): subtract the
    group's mean reward, then normalise globally over the batch. Pass `batch_std` from every rank's
    `centred_moments` (`std_from_moments`) so it is the whole batch's. Unlike adv_scale=batch (the
    std of the raw rewards), the between-group spread does not enter the scale.
    Departures: the paper (and OpenRLHF) whiten per token, after a per-token KL penalty folded into
    the reward; here the statistics are per completion and the KL stays a loss term (`beta`). The
    batch mean of centred rewards is 0 per completion, so only the std is applied. NaN rewards and
    flat groups get exactly 0, as in `group_advantages`.
    """
    centred_PG = group_advantages(rewards_PG, "none").double()  # exact 0 for flat groups and NaN
    std = std_from_moments(*centred_moments(rewards_PG)) if batch_std is None else batch_std
    return (centred_PG / (std + eps)).float()


def reward_moments(rewards_PG: torch.Tensor) -> list[float]:
    """[count, sum, sum of squares] of the scored rewards: summed over ranks, they give the global
    batch's std (`std_from_moments`) without gathering every reward."""
    r = rewards_PG.double()[~torch.isnan(rewards_PG)]
    return [float(r.numel()), float(r.sum()), float((r * r).sum())]


def zero_std_groups(rewards_PG: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """bool_P: groups whose scored rewards are all equal, within float noise (no learning signal)."""
    valid_PG = ~torch.isnan(rewards_PG)
    hi_P = torch.where(valid_PG, rewards_PG, -torch.inf).amax(dim=1)
    lo_P = torch.where(valid_PG, rewards_PG, torch.inf).amin(dim=1)
    return (hi_P - lo_P <= tol) | (valid_PG.sum(dim=1) < 2)


def importance_weights(
    old_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, level: str, mode: str, cap: float
) -> torch.Tensor:
    """Correction for the sampler (e.g. vLLM) and the trainer disagreeing on the same policy.

    w = pi_trainer / pi_sampler, per token or per sequence (product over its tokens).
      truncate: min(w, cap)                        (TIS)
      mask:     w * 1[1/cap <= w <= cap]           (MIS / IcePop: corrects inside the band, drops outside)
      reject:   1[1/cap <= w <= cap]               (drops outside the band, no correction inside)
    Returns detached weights_BT (1 where level == "none").
    """
    if level == "none":
        return torch.ones_like(old_logprobs_BT)
    log_w_BT = (old_logprobs_BT - sampler_logprobs_BT).detach() * mask_BT
    if level == "sequence":
        log_w_BT = log_w_BT.sum(dim=1, keepdim=True).expand_as(log_w_BT)
    elif level != "token":
        raise ValueError(f"unknown importance-sampling level {level!r}")
    # the band decided in log space, and w only taken inside it: a stale sequence's summed log-ratio
    # past ~88.7 makes exp() inf in fp32, and inf x 0 (outside the band) a NaN loss
    log_cap = torch.tensor(math.log(cap), dtype=log_w_BT.dtype)  # in the weights' dtype: w = cap is inside
    in_band_BT = log_w_BT.abs() <= log_cap
    if mode == "truncate":
        return log_w_BT.clamp(max=log_cap).exp()
    if mode == "mask":
        return torch.where(in_band_BT, log_w_BT.exp(), 0.0)
    if mode == "reject":
        return in_band_BT.float()
    raise ValueError(f"unknown importance-sampling mode {mode!r}")


@dataclass
class LossNorm:
    """Counts over the whole optimizer batch (all micro-batches, all ranks)."""

    num_seqs: int  # completions with at least one token in the loss
    num_tokens: int  # tokens in the loss
    max_len: int  # rollout.max_new_tokens (Dr. GRPO's constant)
    gen_tokens_per_step: float  # dapo: tokens in the generated batch / optimizer steps per pass
    # tokens the update runs forwards on (fewer than num_tokens where flat groups are skipped:
    # algo.zero_std_groups=drop); a MoE's router loss is shared among them. 0: num_tokens
    trained_tokens: int = 0


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, loss_type: str, norm: LossNorm) -> torch.Tensor:
    """Reduce per-token losses to this micro-batch's share of the optimizer batch's loss.

    grpo:    mean over each sequence's tokens, then mean over sequences   (DeepSeekMath)
    bnpo:    sum over tokens / tokens in the optimizer batch
    dr_grpo: sum over tokens / (sequences x max_new_tokens)               (Dr. GRPO, no length bias)
    dapo:    sum over tokens / (tokens in the generated batch / optimizer steps per pass). Equal to
             bnpo with one optimizer step per batch; with several minibatches every step is
             weighted by the whole generated batch's token count, as DAPO's token-level loss is.
    Summing this over micro-batches gives the full-batch loss exactly, so gradients are invariant
    to the split.
    """
    masked_BT = loss_BT * mask_BT
    if loss_type == "grpo":
        lengths_B = mask_BT.sum(dim=1).clamp(min=1)
        return (masked_BT.sum(dim=1) / lengths_B).sum() / max(norm.num_seqs, 1)
    if loss_type == "bnpo":
        return masked_BT.sum() / max(norm.num_tokens, 1)
    if loss_type == "dr_grpo":
        return masked_BT.sum() / max(norm.num_seqs * norm.max_len, 1)
    if loss_type == "dapo":
        return masked_BT.sum() / max(norm.gen_tokens_per_step, 1.0)
    raise ValueError(f"unknown loss type {loss_type!r}")


def sequence_ratio(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level importance ratio -> ratio_B = exp(mean over the sequence's tokens of
    (logp - logp_old)): the geometric mean of its token ratios (length-normalised, so one long
    sequence does not reach the clip bounds by the product of many small token ratios)."""
    lengths_B = mask_BT.sum(dim=1).clamp(min=1)
    return torch.exp(((logprobs_BT - old_logprobs_BT) * mask_BT).sum(dim=1) / lengths_B)


def ppo_loss_BT(ratio_BT: torch.Tensor, adv_B1: torch.Tensor, clip_eps: float, eps_high: float):
    """PPO's clipped surrogate per element -> (loss, 1 where the clipped term was the one taken)."""
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = torch.clamp(ratio_BT, 1 - clip_eps, 1 + eps_high) * adv_B1
    return -torch.min(unclipped_BT, clipped_BT), (clipped_BT < unclipped_BT).float()


def cispo_loss_BT(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, adv_B1: torch.Tensor, clip_eps: float,
                  eps_high: float):
    """CISPO per token -> (loss, 1 where the weight was clipped).

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention":
    loss = -sg(clip(ratio, 1 - eps_low_IS, 1 + eps_high_IS)) x A x logp. The importance weight is
    clipped and detached, but every token keeps its policy-gradient term: PPO's clip drops the
    gradient of tokens outside the band (often rare, high-entropy "fork" tokens), CISPO only bounds
    their weight. Here eps_low_IS = clip_eps and eps_high_IS = clip_eps_high (`algo=cispo`: 1.0, so
    no lower bound, as the paper, which tunes only the upper one; its value is not given there).
    """
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT).detach()
    weight_BT = torch.clamp(ratio_BT, 1 - clip_eps, 1 + eps_high)
    return -weight_BT * adv_B1 * logprobs_BT, (weight_BT != ratio_BT).float()


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    norm: LossNorm,
    *,
    loss_type: str = "grpo",
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    beta: float = 0.0,
    ref_logprobs_BT: torch.Tensor | None = None,
    is_weights_BT: torch.Tensor | None = None,
    ratio_level: str = "token",
    pg_loss: str = "ppo",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-ratio GRPO loss with optional clip-higher, k3 KL and importance weights.

    per token: ratio = exp(logp - logp_old)
               pg    = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
               kl    = exp(ref - logp) - (ref - logp) - 1          (k3, >= 0, unbiased)
               loss  = w * (pg + beta * kl)                        (w: importance weight)
    ratio_level="sequence" (GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization"): the
    ratio and its clip are per sequence (`sequence_ratio`), and the sequence's pg term is given to
    each of its tokens, so with loss_type=grpo (mean over a sequence's tokens, then over sequences)
    the loss is the paper's 1/G sum over sequences; other loss types weight sequences by length.
    pg_loss="cispo": CISPO's clipped, detached importance weight on the policy gradient (`cispo_loss_BT`).
    Returns the aggregated loss and sums (not means) of the statistics, for the caller to reduce.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    # one advantage per completion (B), or per token (B x T: algo.turn_rewards, grpo/batch.py)
    adv_B1 = advantages_B[:, None] if advantages_B.dim() == 1 else advantages_B
    if pg_loss == "cispo":
        if ratio_level != "token":
            raise ValueError("pg_loss=cispo weights tokens: it needs ratio_level=token")
        loss_BT, clipped_BT = cispo_loss_BT(logprobs_BT, old_logprobs_BT, adv_B1, clip_eps, eps_high)
    elif pg_loss != "ppo":
        raise ValueError(f"unknown policy loss {pg_loss!r}")
    elif ratio_level == "sequence":
        loss_B1, clipped_B1 = ppo_loss_BT(sequence_ratio(logprobs_BT, old_logprobs_BT, mask_BT)[:, None], adv_B1,
                                          clip_eps, eps_high)
        loss_BT, clipped_BT = loss_B1.expand_as(logprobs_BT), clipped_B1.expand_as(logprobs_BT)
    elif ratio_level == "token":
        loss_BT, clipped_BT = ppo_loss_BT(torch.exp(logprobs_BT - old_logprobs_BT), adv_B1, clip_eps, eps_high)
    else:
        raise ValueError(f"unknown ratio level {ratio_level!r}")
    stats = {"clipped_tokens": (clipped_BT * mask_BT).sum().detach()}
    if beta > 0:
        if ref_logprobs_BT is None:
            raise ValueError("beta > 0 needs ref_logprobs_BT")
        delta_BT = ref_logprobs_BT - logprobs_BT
        kl_BT = torch.exp(delta_BT) - delta_BT - 1
        loss_BT = loss_BT + beta * kl_BT
        stats["kl_sum"] = (kl_BT * mask_BT).sum().detach()
    if is_weights_BT is not None:
        loss_BT = loss_BT * is_weights_BT
    return aggregate(loss_BT, mask_BT, loss_type, norm), stats


def trust_region(setting: str, max_staleness: int, is_level: str) -> str:
    """The policy the clipped ratio is taken against (`algo.trust_region`): `proximal` or `behaviour`
    as set; `auto` is proximal for the synchronous loop (k = 0: unchanged) and for a stale batch with
    an explicit correction (is_level != none: the decoupled loss with its weights), else behaviour."""
    if setting != "auto":
        return setting
    return "behaviour" if max_staleness > 0 and is_level == "none" else "proximal"


def decoupled_loss(
    logprobs_BT: torch.Tensor,
    proximal_logprobs_BT: torch.Tensor,
    sampler_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    norm: LossNorm,
    algo,
    ref_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a batch that may be stale, where three policies meet:

      behaviour policy  mu        the sampler's weights, `algo.max_staleness` versions old at most
      proximal policy   pi_prox   the trainer's weights before this update (`proximal_logprobs_BT`)
      current policy    pi_theta  what the gradient moves (`logprobs_BT`)

    trust_region=proximal: the decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance
    for policy optimization"; AReaL, Fu et al. 2025, for asynchronous RL)

      loss = w * -min(r * A, clip(r, 1 - eps, 1 + eps_high) * A),
             r = pi_theta / pi_prox                 (the trust region, around the proximal policy)
             w = pi_prox / mu, detached             (the off-policy correction, `importance_weights`
                                                     with algo.is_level / is_mode / is_cap)

    trust_region=behaviour: PPO with the sampler as the old policy, r = pi_theta / mu and no w: the
    ratio is the importance correction, and its clip drops the gradient of a token whose probability
    already moved past the band since it was sampled, in its advantage's direction. The band is
    [1 - b, 1 + b] with b = `algo.behaviour_clip_eps` (default 0.1; None: clip_eps / clip_eps_high):
    the ratio to the sampler already holds the updates made since the batch was sampled: at the
    synchronous loop's 0.2, k = 1 trailed it by 0.11 held-out accuracy over 5 seeds, at 0.1 by 0.03.

    Why both: with one optimizer step per batch (num_iterations = num_minibatches = 1) the proximal
    policy is the current one, r = 1, and the decoupled loss has no trust region at all, only the
    weight w. A stale batch's advantages still credit what the last update already rewarded, and
    nothing stops the trainer pushing those tokens again: on the default task, 1 version stale, that
    diverged (held-out accuracy 0.129 -> 0.098 in 600 steps, against 0.637 synchronous), where the
    behaviour-centred clip stops the second push and learned (0.566; docs/async.md).
    With a fresh batch mu = pi_prox up to kernel noise: the proximal loss is the synchronous one, and so is
    the behaviour loss but with its band b (a set clip_eps / clip_eps_high with a set b is refused:
    grpo/algo_config.py `check_behaviour_band`)."""
    clip_eps, clip_eps_high = algo.clip_eps, algo.clip_eps_high
    if trust_region(algo.trust_region, algo.max_staleness, algo.is_level) == "behaviour":
        proximal_logprobs_BT, w_BT = sampler_logprobs_BT, None
        if algo.behaviour_clip_eps is not None:
            clip_eps = clip_eps_high = algo.behaviour_clip_eps
    elif algo.is_level == "none":
        w_BT = None  # no correction: w = 1
    else:
        w_BT = importance_weights(proximal_logprobs_BT, sampler_logprobs_BT, mask_BT, algo.is_level, algo.is_mode, algo.is_cap)
    return policy_loss(
        logprobs_BT,
        proximal_logprobs_BT,
        advantages_B,
        mask_BT,
        norm,
        loss_type=algo.loss_type,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        beta=algo.beta,
        ref_logprobs_BT=ref_logprobs_BT,
        is_weights_BT=w_BT,
        ratio_level=algo.ratio_level,
        pg_loss=algo.pg_loss,
    )


def sampled_kl(sampler_logprobs_BT: torch.Tensor, trainer_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(sampler || trainer) on the tokens the sampler drew -> (sum over tokens, tokens).

    k3 estimator per token, r = pi_trainer / pi_sampler: r - 1 - log r (>= 0; unbiased, since the
    tokens were drawn from the sampler). Summed, not averaged, so ranks and micro-batches add up;
    0-dim tensors, read from the device once per step."""
    log_r_BT = (trainer_logprobs_BT - sampler_logprobs_BT).detach()
    k3_BT = (log_r_BT.exp() - 1 - log_r_BT) * mask_BT
    return k3_BT.sum(), mask_BT.sum()


def staleness(trainer_version: int, sampler_version: int) -> int:
    """Versions the batch's sampler is behind the trainer that updates on it (0: on-policy)."""
    return trainer_version - sampler_version


def token_staleness(trainer_version: int, token_versions: list[list[int]]) -> tuple[int, int]:
    """Partial rollouts: (the versions each sampled token's sampler was behind the trainer, summed; the
    sampled tokens) (version >= 0; observations are -1): the parts of their mean, which ranks that sample
    unequal numbers of tokens add up before dividing (grpo/metrics.py `Ratio`)."""
    sampled = [v for vs in token_versions for v in vs if v >= 0]
    return sum(trainer_version - v for v in sampled), len(sampled)


def batches_to_submit(step: int, submitted: int, max_staleness: int, last_step: int) -> range:
    """The batches to hand to the engines at the start of `step`, when batches up to `submitted`
    already were: every one up to step + max_staleness (never past `last_step`). Submitted now, with
    the engines at version step - 1 and trained at step s' <= step + max_staleness with the trainer
    at version s' - 1, a batch is at most max_staleness versions behind."""
    return range(submitted + 1, min(step + max_staleness, last_step) + 1)
