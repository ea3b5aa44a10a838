"""From rollouts to the batch the update trains on: the padded B x L layout, and its advantages.

The batch is laid out padded: prompt (left-padded) + completion (right-padded). Position ids come
from the attention mask, as `generate` derives them, so the trainer's logprobs match the sampler's.
How a micro-batch's forward lays these sequences out (packed rows, shared prompts) is
grpo/update/layouts.py's; the loss and its masks always stay in this B x T layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from grpo import dist
from grpo.algorithm import (
    centred_moments, combine_rewards, group_advantages, per_turn_advantages, process_advantages, reinforce_pp_advantages,
    reward_moments, rloo_advantages, zero_std_groups,
)
from grpo.metrics import std_from_moments


@dataclass
class Batch:
    input_ids_BL: torch.Tensor  # prompt then completion, L = P + T
    attention_mask_BL: torch.Tensor
    position_ids_BL: torch.Tensor
    completion_ids_BT: torch.Tensor
    mask_BT: torch.Tensor  # 1 for completion tokens that enter the loss
    sampler_logprobs_BT: torch.Tensor
    advantages_B: torch.Tensor  # per completion; per token (B x T) with algo.turn_rewards (`turn_token_advantages`)
    prompt_width: int
    old_logprobs_BT: Optional[torch.Tensor] = None  # set when the batch is reused (off-policy)
    ref_logprobs_BT: Optional[torch.Tensor] = None  # set when beta > 0
    # a vision-language model's image prompts: per row, its prompt's images (grpo.vision.VisionInputs;
    # None for a row without); None when no row has any
    vision: Optional[list] = None
    # rollout.routing_replay: the experts the sampler routed each token to, B x L x MoE layers x top_k,
    # laid out as input_ids_BL; -1 where none was given (padding, the last token: the router decides)
    routes_BLMK: Optional[torch.Tensor] = None
    replay_routes: bool = True  # False (rollout.routing_observe): the routers keep their choice, flips are counted

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
        if self.vision is not None:
            if isinstance(idx, slice):
                rows = list(range(self.size)[idx])
            else:
                t = torch.as_tensor(idx)
                rows = (t.nonzero().flatten() if t.dtype == torch.bool else t.reshape(-1)).tolist()
            picked["vision"] = [self.vision[i] for i in rows]
        return Batch(**picked)


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


TURN_ESTIMATORS = {"per_turn": per_turn_advantages, "process": process_advantages}


def turn_rewards(episodes: list, env_weight: float, others_B: torch.Tensor, rewards_B: torch.Tensor) -> torch.Tensor:
    """Each trajectory's reward per turn -> rewards_BK (K: the most turns; NaN past a trajectory's last
    turn, and on every turn of a trajectory with no reward, rewards_B NaN).

    r_k = env_weight x the reward the environment's step k gave (0 where it gave none), and the other
    reward functions' weighted sum (`others_B`: `combine_rewards` of every function but `env`; NaN,
    where none scored, counts 0) is added to the last turn's: they score the final turn. So with
    gamma = 1 the turn rewards sum to the completion's reward under algo.turn_rewards=none."""
    K = max([1] + [e.turns for e in episodes])
    rewards_BK = torch.full((len(episodes), K), torch.nan, dtype=torch.float64)
    for i, e in enumerate(episodes):
        if e.turns == 0 or torch.isnan(rewards_B[i]):
            continue
        steps = [env_weight * (r if r is not None else 0.0) for r in e.step_rewards]
        steps[-1] += float(torch.nan_to_num(others_B[i]))
        rewards_BK[i, : e.turns] = torch.tensor(steps, dtype=torch.float64)
    return rewards_BK


def turn_token_advantages(rewards_PG: torch.Tensor, rollouts, env_weight: float, others_B: torch.Tensor, mode: str,
                          gamma: float, scale: str) -> torch.Tensor:
    """`algo.turn_rewards` = per_turn | process -> advantages_BT (T: the longest span, as `collate`
    pads): every sampled token of turn t gets its trajectory's turn-t advantage (grpo/algorithm.py
    `per_turn_advantages`, `process_advantages`), observation tokens and padding 0."""
    P, G = rewards_PG.shape
    rewards_BK = turn_rewards(rollouts.episodes, env_weight, others_B, rewards_PG.flatten())
    adv_BK = TURN_ESTIMATORS[mode](rewards_BK.view(P, G, -1), gamma, scale).view(P * G, -1)
    T = max(1, max(len(c) for c in rollouts.completion_ids))
    adv_BT = torch.zeros(P * G, T)
    for i, turns in enumerate(rollouts.token_turns):
        index = torch.tensor(turns, dtype=torch.long)
        adv_BT[i, : len(turns)] = torch.where(index >= 0, adv_BK[i, index.clamp(min=0)], 0.0)
    return adv_BT


def step_advantages(rewards_PG: torch.Tensor, rollouts, rewards_FB: dict, reward_fns: list, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's advantages and its groups without signal (flat_P: `algo.zero_std_groups=drop`).
    algo.turn_rewards=none: one per completion from its reward (`batch_advantages`), flat where the
    group's rewards are equal. per_turn | process: one per token from the turns' rewards
    (`turn_token_advantages`; reward `env`'s weight scales the steps' rewards, the other functions'
    weighted sum joins the last turn), flat where every token's advantage in the group is 0.
    rewards_FB: each reward function's values by name (`Scored.rewards_FB`)."""
    if algo.turn_rewards == "none":
        return batch_advantages(rewards_PG, algo.adv_scale, algo.adv_estimator).flatten(), zero_std_groups(rewards_PG)
    env_weight = next(w for name, _, w in reward_fns if name == "env")
    others = [(rewards_FB[name], w) for name, _, w in reward_fns if name != "env"]
    others_B = (combine_rewards([v for v, _ in others], [w for _, w in others]) if others
                else torch.zeros(rewards_PG.numel()))
    adv_BT = turn_token_advantages(rewards_PG, rollouts, env_weight, others_B, algo.turn_rewards, algo.turn_discount,
                                   algo.adv_scale)
    P, G = rewards_PG.shape
    return adv_BT, adv_BT.view(P, G, -1).abs().amax(dim=(1, 2)) == 0


def collate(
    prompt_ids: list[list[int]], rollouts, advantages_B: torch.Tensor, pad_id: int, mask_truncated: bool,
    excluded_B: Optional[torch.Tensor] = None,
) -> Batch:
    """prompt_ids has one entry per completion (already repeated G times). Rows are built as lists
    and turned into tensors once (a tensor per row cost 15 ms at 512 rows, a tenth of the default
    run's update).

    Which tokens enter the loss (mask 1): the sampled ones (multi-turn: 0 on the environment's
    observations), except
      - every token of an excluded completion (`excluded_B`: no reward, e.g. an episode that ended in
        an environment error or a reward function that failed on it): advantage 0 alone would still
        count it in the loss normalisers and, with a reference, in the KL;
      - with `mask_truncated` (DAPO), every token of a completion cut off mid-turn ("length"). An
        episode that ended because a whole next turn no longer fit its budget (`out_of_budget`) was
        not cut: it keeps its tokens, as one that reached the turn cap does.

    A completion with an empty prompt is refused (ValueError): its first token's logprob has no
    position to be read from."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in rollouts.completion_ids))
    cut = rollouts.cut()
    ids, attn, logps, masks = [], [], [], []
    for i, (p, c, lp) in enumerate(zip(prompt_ids, rollouts.completion_ids, rollouts.logprobs)):
        if not len(p) and len(c):  # the logprob of token t is read at position t - 1 of the row
            raise ValueError(f"completion {i} has an empty prompt: no position predicts its first token (every layout "
                             "would read it from another sequence's token or a pad); give the task a prompt, a "
                             "system prompt or a BOS token")
        pad_p, pad_c = P - len(p), T - len(c)
        ids.append([pad_id] * pad_p + list(p) + list(c) + [pad_id] * pad_c)
        attn.append([0] * pad_p + [1] * (len(p) + len(c)) + [0] * pad_c)
        logps.append(list(lp) + [0.0] * pad_c)
        drop = (mask_truncated and cut[i]) or (excluded_B is not None and bool(excluded_B[i]))
        keep = [float(m) for m in rollouts.loss_masks[i]] if rollouts.loss_masks is not None else [1.0] * len(c)
        masks.append(([0.0] * len(c) if drop else keep) + [0.0] * pad_c)
    ids_BL, attn_BL = torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long)
    logp_BT, mask_BT = torch.tensor(logps, dtype=torch.float32), torch.tensor(masks, dtype=torch.float32)
    position_ids_BL = (attn_BL.cumsum(dim=1) - 1).clamp(min=0)
    vision = [getattr(p, "vision", None) for p in prompt_ids]  # grpo.vision.ImagePrompt carries its images
    routes = None if rollouts.routed_experts is None else routes_batch(prompt_ids, rollouts, P, T)
    return Batch(ids_BL, attn_BL, position_ids_BL, ids_BL[:, P:], mask_BT, logp_BT, advantages_B.float(), P,
                 vision=vision if any(v is not None for v in vision) else None, routes_BLMK=routes)


def routes_batch(prompt_ids: list[list[int]], rollouts, P: int, T: int) -> torch.Tensor:
    """Each completion's routed experts ([p + c - 1, M, K]: prompt, then completion but its last token)
    placed as `collate` places its tokens: B x (P + T) x M x K, -1 elsewhere."""
    shapes = {tuple(r.shape[1:]) for r in rollouts.routed_experts}
    if len(shapes) != 1:
        raise ValueError(f"routed experts of different shapes in one batch: {sorted(shapes)} (MoE layers, top_k)")
    routes = torch.full((len(prompt_ids), P + T, *shapes.pop()), -1, dtype=torch.long)
    for i, (p, c, r) in enumerate(zip(prompt_ids, rollouts.completion_ids, rollouts.routed_experts)):
        if r.shape[0] != len(p) + len(c) - 1:
            raise ValueError(f"completion {i}: {r.shape[0]} rows of routed experts for {len(p)} prompt and {len(c)} "
                             f"completion tokens; expected {len(p) + len(c) - 1} (every token but the last sampled)")
        routes[i, P - len(p): P + len(c) - 1] = r
    share_prompt_routes(routes, prompt_ids, P)
    return routes


def share_prompt_routes(routes: torch.Tensor, prompt_ids: list[list[int]], P: int) -> None:
    """A prompt's routes where a completion has none, taken from any row whose prompt starts with the
    same tokens up to that one, in place. vLLM's prefix cache serves a prompt's leading blocks from
    whichever request computed them: a sibling of the same prompt, or another prompt with the same
    start (a system prompt, a few-shot block); those rows come back -1 (grpo/moe/vllm_capture.py). Token
    t's route depends on tokens 0..t alone (causal attention, positions from the prompt's start), so
    every prompt sharing them routes it alike, and a layout that reads the prompt from one sibling (the
    shared rows' tree, a packed copy) replays it too. What no row has stays -1 (`routing.unrouted`
    counts it for the step's routing/unrouted_fraction).

    How: the distinct prompts sorted, so those sharing their first t + 1 tokens stand together; at
    position t a new run starts at a prompt whose common prefix with the one before is t tokens or
    fewer; a token with a layer missing takes those layers from a token of its run that has every one."""
    B = routes.shape[0]
    lens_B = torch.tensor([len(p) for p in prompt_ids])
    t_BP = torch.arange(P)[None, :] - (P - lens_B)[:, None]  # each column's place in its row's prompt
    valid_BP = t_BP >= 0
    complete_BP = (routes[:, :P, :, 0] >= 0).all(dim=-1)  # a route on every MoE layer
    missing_BP = ~complete_BP & valid_BP
    if not missing_BP.any():
        return
    distinct = sorted({tuple(p) for p in prompt_ids})
    place = {p: u for u, p in enumerate(distinct)}
    lens_U = torch.tensor([len(p) for p in distinct])
    tokens_UP = torch.full((len(distinct), P), -1, dtype=torch.long)
    for u, p in enumerate(distinct):
        tokens_UP[u, : len(p)] = torch.tensor(p, dtype=torch.long)
    # common prefix with the prompt before, in sorted order (no more than either's length)
    same = (tokens_UP[1:] == tokens_UP[:-1]).long().cumprod(dim=1).sum(dim=1)
    common = torch.minimum(same, torch.minimum(lens_U[1:], lens_U[:-1]))
    starts_UP = torch.ones(len(distinct), P, dtype=torch.long)
    starts_UP[1:] = (common[:, None] <= torch.arange(P)[None, :]).long()
    run_UP = starts_UP.cumsum(dim=0)  # prompts in one run at t share tokens 0..t
    u_B = torch.tensor([place[tuple(p)] for p in prompt_ids])
    t_BP = t_BP.clamp(min=0)
    key_BP = torch.where(valid_BP, run_UP[u_B[:, None], t_BP] * P + t_BP, -1)  # rows alike at (run, position)
    keys, key_BP = torch.unique(key_BP, return_inverse=True)
    cell_BP = torch.arange(B)[:, None] * P + torch.arange(P)[None, :]  # a donor, as row * P + column
    offer_BP = torch.where(complete_BP & valid_BP, cell_BP, -1)
    donor_K = torch.full((len(keys),), -1, dtype=torch.long).scatter_reduce(0, key_BP.flatten(), offer_BP.flatten(),
                                                                            "amax")
    row, col = missing_BP.nonzero(as_tuple=True)
    donor = donor_K[key_BP[row, col]]
    row, col, donor = row[donor >= 0], col[donor >= 0], donor[donor >= 0]
    given = routes[row, col]  # tokens x M x K: keep the layers the token has
    routes[row, col] = torch.where(given[..., :1] >= 0, given, routes[donor // P, donor % P])
