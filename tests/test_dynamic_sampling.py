"""Dynamic sampling (algo.dynamic_sampling, grpo/dynamic_sampling.py): which groups a step trains,
worked out by hand, the ranks' common stop, the config rules, and a resumed run drawing the same
prompts as an uninterrupted one."""

import json
import math
import os
from dataclasses import dataclass

import pytest
import torch

from grpo.metrics import resolve
from grpo.config import ConfigError, validate
from grpo.dynamic_sampling import Scored, refill, take
from grpo.flops import Work
from grpo.rollout.base import Rollouts
from grpo.train import train
from tests.conftest import FAST, compose_cfg


@dataclass
class MaskedRollouts(Rollouts):
    """Rollouts with one more per-completion field (as multi-turn's loss masks will be): it is taken
    along with the others."""

    loss_masks: list | None = None


def scored(tag: str, rewards_PG: list[list[float]], wait: float = 1.0) -> Scored:
    """A batch of P prompts `tag0`, `tag1`, ... whose completion j of prompt p is `tag{p}.{j}`."""
    P, G = len(rewards_PG), len(rewards_PG[0])
    names = [f"{tag}{p}.{j}" for p in range(P) for j in range(G)]
    rollouts = MaskedRollouts([[i] for i in range(P * G)], [[-0.5]] * (P * G), ["stop"] * (P * G), 3,
                              engine_wait_s=wait, loss_masks=[[1, 0, 1] if i % 2 else [1] for i in range(P * G)])
    rewards = torch.tensor(rewards_PG, dtype=torch.float32)
    return Scored([f"{tag}{p}" for p in range(P)], [[p] for p in range(P)], rollouts, names, rewards,
                  {"f": rewards.flatten().tolist()}, generate_s=1.0, wait_s=0.25, score_s=0.5, generated_tokens=P * G,
                  batch_generate_s=0.75, generation=Work(tokens=P * G, computed=2 * P * G))


def never(_):
    raise AssertionError("no further draw expected")


def test_refill_takes_the_first_p_informative_groups_in_draw_order():
    # P = 3, G = 2. Batch 0: only group 1 (0 vs 1) is informative. Batch 1: groups 0 and 2 are.
    # 3 informative groups after 2 draws: stop; train a1, b0, b2 (in that order).
    first = scored("a", [[1, 1], [0, 1], [0, 0]])
    second = scored("b", [[0, 1], [1, 1], [1, 0]])
    asked = []
    out, m = refill(first, lambda k: {1: second}[k], max_draws=4, still_short=lambda n: asked.append(n) or n)
    assert asked == [2, 0]  # 3 - 1 short after the first batch, 0 after the second
    assert out.samples == ["a1", "b0", "b2"]
    assert out.completions == ["a1.0", "a1.1", "b0.0", "b0.1", "b2.0", "b2.1"]
    assert out.rewards_PG.tolist() == [[0, 1], [0, 1], [1, 0]]
    assert out.rollouts.completion_ids == [[2], [3], [0], [1], [4], [5]]  # rows 2, 3 of a; 0, 1 and 4, 5 of b
    assert out.rollouts.loss_masks == [[1], [1, 0, 1], [1], [1, 0, 1], [1], [1, 0, 1]]
    assert out.rollouts.weight_version == 3 and out.rollouts.engine_wait_s == 2.0
    assert (out.generate_s, out.score_s, out.generated_tokens) == (2.0, 1.0, 12)
    assert out.wait_s == 0.5  # time/wait_for_data_s: every draw's wait, not the first batch's alone
    # the engines' seconds and work (generation FLOPs, MFU) over every draw, not the first batch's alone
    assert out.batch_generate_s == 1.5 and out.generation == Work(tokens=12, computed=24)
    # 3 informative of the 6 groups drawn; the reward over all 12 completions drawn: 3 + 4 ones / 12
    m = resolve(m)  # the parts a rank logs (grpo/metrics.py), as one process's run reads them
    assert m == {"dynamic/draws": 2.0, "dynamic/informative_frac": 0.5, "dynamic/trained_informative": 3.0,
                 "dynamic/reward_mean_drawn": pytest.approx(7 / 12)}
    # reward/f over the trained groups, as reward/mean: a1, b0, b2 hold 3 ones in 6 (not the drawn 7 / 12)
    assert resolve(out.reward_means) == {"reward/f": pytest.approx(3 / 6)}


def test_a_per_completion_field_a_draw_lacks_is_none_for_the_step():
    """`take` over draws of which one has no `loss_masks` (None): the step's is None, not a list filled
    from the draws that have it and failing on the one that does not."""
    first, second = scored("a", [[0, 1], [1, 1]]), scored("b", [[1, 0], [0, 0]])
    second.rollouts.loss_masks = None
    out = take([first, second], [(0, 0), (1, 0)], 2)
    assert out.rollouts.loss_masks is None and out.completions == ["a0.0", "a0.1", "b0.0", "b0.1"]


def test_every_draws_reward_counts_add_up_even_those_the_first_lacks():
    """A judge reports `retries` only in a batch that retried: the second draw's 6 retries count though
    the first draw had none (only the first draw's keys were summed), as its requests and failures do."""
    first, second = scored("a", [[1, 1], [0, 0]]), scored("b", [[1, 0], [0, 1]])
    first.reward_stats = {"judge/requests": 4.0, "judge/failed": 0.0}
    second.reward_stats = {"judge/requests": 4.0, "judge/failed": 2.0, "judge/retries": 6.0}
    out, _ = refill(first, lambda k: second, max_draws=4, still_short=lambda n: n)
    assert out.reward_stats == {"judge/requests": 8.0, "judge/failed": 2.0, "judge/retries": 6.0}


@dataclass
class EpisodeRollouts(MaskedRollouts):
    """Rollouts that report episode totals as multi-turn's do (grpo/rollout/episodes.py `metrics`)."""

    errors: float = 0.0
    env_s: float = 0.0
    tool_errors: float = 0.0
    calls: float = 0.0

    def metrics(self):
        from grpo.metrics import Count, Ratio

        return {"episode/errors": Count(self.errors), "episode/env_s": Count(self.env_s),
                "episode/tool_failure_rate": Ratio(self.tool_errors, self.calls), "episode/turns_mean": 2.0}


def test_every_draws_episode_errors_and_env_seconds_count_not_only_the_trained_groups():
    """Draw 0: a group whose every episode errored (no reward: flat, never trained; 10 s in the
    environment, 6 of 6 tool calls failed) and a flat group; draw 1: informative. Before, the step
    logged the trained groups' alone: 0 errors, 4 s, 0 of 4 tool calls failed."""
    from dataclasses import replace as with_fields

    first, second = scored("a", [[math.nan, math.nan], [1, 1]]), scored("b", [[0, 1], [1, 0]])
    first = with_fields(first, rollouts=EpisodeRollouts(**vars(first.rollouts), errors=2, env_s=12, tool_errors=6, calls=6))
    second = with_fields(second, rollouts=EpisodeRollouts(**vars(second.rollouts), errors=0, env_s=4, tool_errors=0, calls=4))
    out, _ = refill(first, lambda k: second, max_draws=4, still_short=lambda n: n)
    assert out.samples == ["b0", "b1"]
    assert resolve(out.drawn_totals) == {"episode/errors": 2.0, "episode/env_s": 16.0,
                                         "episode/tool_failure_rate": pytest.approx(0.6)}


def test_a_steps_partial_rollout_staleness_is_the_mean_over_every_ranks_tokens():
    """async/staleness_mean with partial rollouts: one rank's 10 tokens 2 versions behind, another's 90
    tokens 0 behind is 20 / 100 = 0.2, not the mean of the ranks' means (1.0): the step logs the parts."""
    from dataclasses import replace as with_fields

    from grpo.metrics import Ratio
    from grpo.train import step_metrics

    def rank_metrics(versions):
        s = scored("a", [[0, 1]])
        s = with_fields(s, rollouts=with_fields(s.rollouts, token_versions=versions))
        return step_metrics(s, {}, step=6, lr=0.1, times={"step_s": 1.0, "time/batch_generate_s": 1.0},
                            flat_P=torch.tensor([False]))

    mine, other = rank_metrics([[3] * 5, [3] * 5]), rank_metrics([[5] * 45, [5] * 45])
    assert mine["async/staleness_mean"] == Ratio(20, 10) and other["async/staleness_mean"] == Ratio(0, 90)
    summed = [a + b for a, b in zip(mine["async/staleness_mean"].parts(), other["async/staleness_mean"].parts())]
    assert Ratio.value(*summed) == pytest.approx(0.2)


def test_refill_stops_at_max_draws_and_fills_with_the_first_batchs_flat_groups():
    # only a1 is informative in 2 draws (the bound): train a1, then a0 and a2 (flat, advantage 0)
    first = scored("a", [[1, 1], [0, 1], [0, 0]])
    out, m = refill(first, lambda k: scored("b", [[1, 1], [0, 0], [1, 1]]), max_draws=2, still_short=lambda n: n)
    assert out.samples == ["a1", "a0", "a2"] and out.rewards_PG.tolist() == [[0, 1], [1, 1], [0, 0]]
    assert m["dynamic/draws"] == 2.0 and m["dynamic/informative_frac"] == pytest.approx(1 / 6)
    assert resolve(m)["dynamic/trained_informative"] == 1.0


def test_a_rank_with_enough_groups_draws_as_long_as_another_is_short():
    # this rank has its 2 informative groups at once; another rank lacks 1 until draw 3 (the max over
    # ranks, all_reduce_max): this rank draws along, and trains its first two
    short_elsewhere = iter([1, 1, 0])
    first = scored("a", [[0, 1], [1, 0]])
    out, m = refill(first, lambda k: scored("bcd"[k - 1], [[0, 1], [0, 1]]), max_draws=5,
                    still_short=lambda n: max(n, next(short_elsewhere)))
    assert m["dynamic/draws"] == 3.0 and out.samples == ["a0", "a1"]


def test_max_draws_one_draws_nothing_more_and_calls_no_collective():
    first = scored("a", [[1, 1], [0, 1]])
    out, m = refill(first, never, max_draws=1, still_short=never)
    assert out.samples == ["a1", "a0"] and m["dynamic/draws"] == 1.0


def test_dynamic_sampling_settings_are_checked():
    with pytest.raises(ConfigError, match="algo.max_staleness=0"):
        validate(compose_cfg("algo.dynamic_sampling=true", "algo.max_staleness=1", "rollout=dedicated"))
    with pytest.raises(ConfigError, match="max_draws"):
        validate(compose_cfg("algo.dynamic_sampling=true", "algo.max_draws=0"))


def logged(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "loss" in r}


@pytest.mark.starts_process
def test_dynamic_sampling_run_resumes_drawing_the_same_prompts(tmp_path, cache_dir, learning_policy):
    """3 steps straight against 2 steps, then a resume to 3: step 3 draws as many batches, of the same
    prompts (the sampler's state is in the checkpoint), and trains the same groups."""
    args = [*FAST, "algo.dynamic_sampling=true", "algo.max_draws=3", "algo.zero_std_groups=drop"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(compose_cfg(*args, run_dir=straight, cache=cache_dir))
    train(compose_cfg(*args, "steps=2", run_dir=resumed, cache=cache_dir))
    train(compose_cfg(*args, run_dir=resumed, cache=cache_dir))
    a, b = logged(straight), logged(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert any(r["dynamic/draws"] > 1 for r in a.values()), a  # the tiny policy leaves flat groups
    for k in ("dynamic/draws", "dynamic/informative_frac", "dynamic/reward_mean_drawn", "reward/mean", "loss",
              "trained_completions"):
        assert b[3][k] == pytest.approx(a[3][k], rel=1e-5, abs=1e-6), k


def test_a_steps_flat_and_truncated_shares_are_the_updates_own():
    """reward/zero_std_frac counted groups of equal final rewards, but with algo.turn_rewards the update
    finds a group flat by its per-token advantages (episodes won at different turns carry signal): it
    read 0.78 where the update dropped 0.69. truncated_frac counted every "length" episode, those ended
    because no next turn fit (out_of_budget, never cut, kept by mask_truncated) too: 0.54 against 0.17."""
    from dataclasses import replace as with_fields
    from types import SimpleNamespace

    from grpo.train import step_metrics

    s = scored("a", [[1, 1], [0, 0]])  # both groups of equal rewards
    episodes = [SimpleNamespace(out_of_budget=b) for b in (False, True, False, False)]
    s = with_fields(s, rollouts=with_fields(s.rollouts, finish_reasons=["length", "length", "stop", "length"],
                                            episodes=episodes))
    assert s.rollouts.cut() == [True, False, False, True]
    m = step_metrics(s, {}, step=1, lr=0.1, times={"step_s": 1.0, "time/batch_generate_s": 1.0},
                     flat_P=torch.tensor([False, True]))  # group 0's turns carry signal
    assert m["reward/zero_std_frac"] == 0.5 and m["truncated_frac"] == 0.5
