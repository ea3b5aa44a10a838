"""Dynamic sampling (`algo.dynamic_sampling`, DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", section 3.2): a group whose G rewards are all equal has
advantage 0 and carries no gradient, so the step keeps drawing batches of P prompts until it holds
P informative groups, or `algo.max_draws` batches were drawn.

Every rank draws its share of every batch (the prompt sampler stays the same on all ranks, so a
checkpoint's sampler state resumes the same prompts), and the ranks stop together: each says how
many informative groups it still lacks and they stop once the largest shortfall is 0 (one
all-reduce per draw). Each rank then trains its first P informative groups, in the order drawn;
when the bound stops it short, the rest of its P groups are the flat groups of its first batch (they
get advantage 0, and `algo.zero_std_groups=drop` drops them as before). The batch's shape stays P x G.

Departure from DAPO: its bound (`max_num_gen_batches`) ends the run when reached; here the step
trains on what it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import torch

from grpo.algorithm import zero_std_groups
from grpo.flops import Work
from grpo.metrics import Count, Ratio


@dataclass
class Scored:
    """One scored batch of P prompts x G completions on this rank (several, merged, after `refill`)."""

    samples: list  # P samples (with what the reward needs)
    prompt_ids: list[list[int]]  # P prompts' token ids
    rollouts: object  # grpo.rollout.base.Rollouts, B = P x G completions, grouped by prompt
    completions: list[str]  # B decoded completions
    rewards_PG: torch.Tensor
    rewards_FB: dict[str, list[float | None]]  # each reward function's value per completion (None: abstained, NaN: failed)
    generate_s: float = 0.0  # seconds the trainer spent generating (waiting for) the rollouts
    wait_s: float = 0.0  # of those, seconds it waited for them once handed over (every draw's: time/wait_for_data_s)
    # seconds the engines took over it, from hand-over to done (with algo.max_staleness, during earlier steps)
    batch_generate_s: float = 0.0
    score_s: float = 0.0  # seconds decoding and scoring them
    generated_tokens: int = 0  # tokens generated for this batch (every draw's)
    generation: Work = field(default_factory=Work)  # what the engines computed for it (grpo/flops.py), every draw's
    reward_stats: dict = field(default_factory=dict)  # each reward's seconds and counts (grpo.rewards.score), every draw's
    # after `refill`: the totals among every draw's rollout metrics (a Count or Ratio: an episode's errors,
    # environment seconds, tool failures), which the trained groups' alone would undercount: a group
    # whose every episode errored has no reward, is flat, and is never trained
    drawn_totals: dict = field(default_factory=dict)

    @property
    def reward_means(self) -> dict[str, float]:
        """reward/<function>: its mean over the completions it scored in this batch (after `refill`, the
        trained groups', as reward/mean is): neither abstained (None) nor failed (NaN)."""
        means = {}
        for name, values in self.rewards_FB.items():
            scored = [v for v in values if v is not None and not math.isnan(v)]
            means[f"reward/{name}"] = Ratio(sum(scored), len(scored))  # ranks score unequal numbers (grpo/metrics.py)
        return means


def take(batches: list[Scored], picks: list[tuple[int, int]], G: int) -> Scored:
    """The groups `picks` ((batch, group) pairs) of `batches`, as one batch. Every per-completion list
    of the Rollouts and every reward function's values are taken alike (a field added later comes
    along); times and tokens add up."""
    first = batches[0]
    rows = [(b, p * G + g) for b, p in picks for g in range(G)]

    def per_completion(name: str):
        values = [getattr(b.rollouts, name) for b in batches]
        if any(v is None for v in values):
            return None
        return [values[b][i] for b, i in rows]

    listed = {f.name: per_completion(f.name) for f in fields(first.rollouts)
              if isinstance(getattr(first.rollouts, f.name), list) or getattr(first.rollouts, f.name) is None}
    rollouts = replace(first.rollouts, **listed, engine_wait_s=sum(b.rollouts.engine_wait_s for b in batches))
    return Scored(
        samples=[batches[b].samples[p] for b, p in picks],
        prompt_ids=[batches[b].prompt_ids[p] for b, p in picks],
        rollouts=rollouts,
        completions=[batches[b].completions[i] for b, i in rows],
        rewards_PG=torch.stack([batches[b].rewards_PG[p] for b, p in picks]),
        rewards_FB={name: [batches[b].rewards_FB[name][i] for b, i in rows] for name in first.rewards_FB},
        generate_s=sum(b.generate_s for b in batches),
        wait_s=sum(b.wait_s for b in batches),
        batch_generate_s=sum(b.batch_generate_s for b in batches),
        score_s=sum(b.score_s for b in batches),
        generated_tokens=sum(b.generated_tokens for b in batches),
        generation=sum((b.generation for b in batches), Work()),
        # every draw's counts, also those a reward reports only when they happen (a judge's retries)
        reward_stats={k: sum(b.reward_stats.get(k, 0.0) for b in batches) for k in sorted({k for b in batches for k in b.reward_stats})},
        drawn_totals=drawn_totals(batches),
    )


def drawn_totals(batches: list[Scored]) -> dict:
    """The Count and Ratio metrics of every batch's rollouts, their parts summed over the batches."""
    totals = {}
    for b in batches:
        for key, v in b.rollouts.metrics().items():
            if isinstance(v, (Count, Ratio)):
                totals[key] = type(v)(*[a + c for a, c in zip(totals[key].parts(), v.parts())]) if key in totals else v
    return totals


def refill(first: Scored, draw: Callable[[int], Scored], max_draws: int, still_short: Callable[[int], int]) -> tuple[Scored, dict]:
    """Draw batches (`draw(k)`: the k-th of this step, k >= 1) after `first` until every rank holds P
    informative groups or `max_draws` batches were drawn -> (the P groups to train, metrics).

    `still_short(n)`: the largest of every rank's `n` (grpo.dist.all_reduce_max), so the ranks stop on
    the same draw."""
    P, G = first.rewards_PG.shape
    batches = [first]
    informative = [(0, p) for p in torch.nonzero(~zero_std_groups(first.rewards_PG)).flatten().tolist()]
    while len(batches) < max_draws and still_short(max(0, P - len(informative))) > 0:
        batches.append(draw(len(batches)))
        flat_P = zero_std_groups(batches[-1].rewards_PG)
        informative += [(len(batches) - 1, p) for p in torch.nonzero(~flat_P).flatten().tolist()]
    drawn = len(batches) * P
    picks = informative[:P]
    flat_first = [(0, p) for p in torch.nonzero(zero_std_groups(first.rewards_PG)).flatten().tolist()]
    picks += flat_first[: P - len(picks)]  # short of P informative groups: the first batch's flat ones
    all_rewards = torch.cat([b.rewards_PG for b in batches])
    valid = all_rewards[~torch.isnan(all_rewards)]
    metrics = {
        "dynamic/draws": float(len(batches)),
        "dynamic/informative_frac": len(informative) / drawn,  # of every group drawn this step
        "dynamic/trained_informative": Count(min(len(informative), P)),  # the whole step's, over ranks
        # the policy's reward over every completion drawn: reward/mean is the trained groups'
        "dynamic/reward_mean_drawn": Ratio(float(valid.sum()), valid.numel()),
    }
    return take(batches, picks, G), metrics
