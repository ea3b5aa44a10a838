"""From rollouts to the batch the update trains on: the padded B x L layout, and its advantages.

The batch is laid out padded: prompt (left-padded) + completion (right-padded). Position ids come
from the attention mask, as `generate` derives them, so the trainer's logprobs match the sampler's.
How a micro-batch's forward lays these sequences out (packed rows, shared prompts) is
grpo/layouts.py's; the loss and its masks always stay in this B x T layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from grpo import dist
from grpo.algorithm import (
    centred_moments, group_advantages, reinforce_pp_advantages, reward_moments, rloo_advantages, std_from_moments,
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
    # a packed micro-batch (grpo/layouts.py): how many of its sequences, in order, each row holds
    rows: Optional[list[int]] = None
    # a shared-prompt micro-batch: per row, how many of its sequences, in order, each of its trees
    # (one prompt, several completions) holds
    trees: Optional[list[list[int]]] = None

    @property
    def size(self) -> int:
        return self.input_ids_BL.shape[0]

    @property
    def layout(self) -> str:
        return "shared" if self.trees is not None else "packed" if self.rows is not None else "padded"

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
        not cut: it keeps its tokens, as one that reached the turn cap does."""
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in rollouts.completion_ids))
    episodes = rollouts.episodes
    ids, attn, logps, masks = [], [], [], []
    for i, (p, c, lp) in enumerate(zip(prompt_ids, rollouts.completion_ids, rollouts.logprobs)):
        pad_p, pad_c = P - len(p), T - len(c)
        ids.append([pad_id] * pad_p + list(p) + list(c) + [pad_id] * pad_c)
        attn.append([0] * pad_p + [1] * (len(p) + len(c)) + [0] * pad_c)
        logps.append(list(lp) + [0.0] * pad_c)
        cut = rollouts.finish_reasons[i] == "length" and not (episodes is not None and episodes[i].out_of_budget)
        drop = (mask_truncated and cut) or (excluded_B is not None and bool(excluded_B[i]))
        keep = [float(m) for m in rollouts.loss_masks[i]] if rollouts.loss_masks is not None else [1.0] * len(c)
        masks.append(([0.0] * len(c) if drop else keep) + [0.0] * pad_c)
    ids_BL, attn_BL = torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long)
    logp_BT, mask_BT = torch.tensor(logps, dtype=torch.float32), torch.tensor(masks, dtype=torch.float32)
    position_ids_BL = (attn_BL.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(ids_BL, attn_BL, position_ids_BL, ids_BL[:, P:], mask_BT, logp_BT, advantages_B.float(), P)
