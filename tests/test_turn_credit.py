"""Per-turn credit (`algo.turn_rewards`, issue 37 item 4): the estimators by hand-worked numbers, the
turn rewards an episode records, the token advantages built from them, what validate refuses, and
`none` unchanged.

The batch of the estimator tests: 2 prompts x 3 trajectories, each trajectory's reward per turn
(NaN past its last turn):

    group 0   a: [0, 0, 1]    b: [0, 2]    c: [0, 0, 0]
    group 1   d: [1]          e: [0, 1]    f: [3, 1]
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grpo.algorithm import group_advantages, per_turn_advantages, process_advantages, turn_returns, zero_std_groups
from grpo.batch import collate, step_advantages, turn_rewards, turn_token_advantages
from grpo.envs import GuessEnv
from grpo.errors import ConfigError
from grpo.rollout.base import Rollouts, Sampling
from grpo.rollout.episodes import Episode
from tests.test_episodes import GUESS, Scripted, prompts_of, runner

NAN = math.nan
EPS = 1e-4
REWARDS_PGK = torch.tensor([
    [[0, 0, 1], [0, 2, NAN], [0, 0, 0]],
    [[1, NAN, NAN], [0, 1, NAN], [3, 1, NAN]],
], dtype=torch.float64)


def test_turn_returns_sum_discounted_later_rewards_backwards():
    # gamma 0.5: a [0, 0, 1] -> R2 = 1, R1 = 0 + 0.5 x 1 = 0.5, R0 = 0 + 0.5 x 0.5 = 0.25;
    # f [3, 1] -> R1 = 1, R0 = 3 + 0.5 = 3.5; NaN past the last turn stays NaN
    R = turn_returns(REWARDS_PGK.view(6, 3), 0.5)
    assert R[0].tolist() == [0.25, 0.5, 1.0]
    assert R[5, :2].tolist() == [3.5, 1.0] and math.isnan(R[5, 2])
    assert turn_returns(REWARDS_PGK.view(6, 3), 1.0)[1, :2].tolist() == [2.0, 2.0]


def test_per_turn_normalises_each_turn_over_the_trajectories_that_reached_it():
    A = per_turn_advantages(REWARDS_PGK, 1.0)
    # group 0, returns (gamma 1): a [1, 1, 1], b [2, 2], c [0, 0, 0]
    #   turns 0 and 1: {1, 2, 0}, mean 1, std 1 -> a 0, b 1, c -1
    #   turn 2 (a and c only): {1, 0}, mean 0.5, std sqrt(0.5) -> a +0.5 / sqrt(0.5), c -0.5 / sqrt(0.5)
    one, half = 1 / (1 + EPS), 0.5 / (math.sqrt(0.5) + EPS)
    expected0 = [[0, 0, half], [one, one, 0], [-one, -one, -half]]
    # group 1, returns: d [1], e [1, 1], f [4, 1]
    #   turn 0: {1, 1, 4}, mean 2, std sqrt(3) -> d, e -1 / sqrt(3), f 2 / sqrt(3)
    #   turn 1: {1, 1} (e, f): flat -> 0; turn 2: nobody -> 0
    s3 = math.sqrt(3) + EPS
    expected1 = [[-1 / s3, 0, 0], [-1 / s3, 0, 0], [2 / s3, 0, 0]]
    assert torch.allclose(A, torch.tensor([expected0, expected1], dtype=torch.float32), atol=1e-6)


def test_per_turn_with_a_discount():
    A = per_turn_advantages(REWARDS_PGK, 0.5)
    # group 0, returns: a [0.25, 0.5, 1], b [1, 2], c [0, 0, 0]
    #   turn 0: {1/4, 1, 0}, mean 5/12, deviations -1/6, 7/12, -5/12, var (1/36 + 49/144 + 25/144) / 2 = 39/144
    #   turn 1: {1/2, 2, 0}, every value doubled: the same advantages; turn 2: {1, 0} as without discount
    s = math.sqrt(39) / 12 + EPS
    s1 = math.sqrt(39) / 6 + EPS
    half = 0.5 / (math.sqrt(0.5) + EPS)
    expected0 = [[-1 / 6 / s, -1 / 3 / s1, half], [7 / 12 / s, 7 / 6 / s1, 0], [-5 / 12 / s, -5 / 6 / s1, -half]]
    # group 1, returns: d [1], e [0.5, 1], f [3.5, 1]
    #   turn 0: {1, 1/2, 7/2}, mean 5/3, deviations -2/3, -7/6, 11/6, var (16 + 49 + 121) / 36 / 2 = 93/36
    #   turn 1: {1, 1}: flat -> 0
    t = math.sqrt(93) / 6 + EPS
    expected1 = [[-2 / 3 / t, 0, 0], [-7 / 6 / t, 0, 0], [11 / 6 / t, 0, 0]]
    assert torch.allclose(A, torch.tensor([expected0, expected1], dtype=torch.float32), atol=1e-6)


def test_process_normalises_every_turn_reward_of_the_group_then_sums_from_the_turn_on():
    # group 0: the 8 rewards {0, 0, 1, 0, 2, 0, 0, 0}: mean 3/8, squared deviations 6 x 9/64 + 25/64 + 169/64
    # = 248/64, var 248/64 / 7 = 31/56; n(r) = (r - 3/8) / sqrt(31/56)
    n = lambda r: (r - 3 / 8) / (math.sqrt(31 / 56) + EPS)  # noqa: E731
    # group 1: the 5 rewards {1, 0, 1, 3, 1}: mean 6/5, squared deviations 0.04 x 3 + 1.44 + 3.24 = 4.8, var 1.2
    m = lambda r: (r - 6 / 5) / (math.sqrt(1.2) + EPS)  # noqa: E731
    A = process_advantages(REWARDS_PGK, 1.0)
    expected = [
        [[n(0) + n(0) + n(1), n(0) + n(1), n(1)], [n(0) + n(2), n(2), 0], [3 * n(0), 2 * n(0), n(0)]],
        [[m(1), 0, 0], [m(0) + m(1), m(1), 0], [m(3) + m(1), m(1), 0]],
    ]
    assert torch.allclose(A, torch.tensor(expected, dtype=torch.float32), atol=1e-6)
    # gamma 0.5: A_t = n_t + 0.5 A_{t+1}; a: A2 = n(1), A1 = n(0) + n(1) / 2, A0 = n(0) + n(0) / 2 + n(1) / 4
    A = process_advantages(REWARDS_PGK, 0.5)
    assert torch.allclose(A[0, 0], torch.tensor([1.5 * n(0) + n(1) / 4, n(0) + n(1) / 2, n(1)], dtype=torch.float32), atol=1e-6)
    assert torch.allclose(A[1, 2, :2], torch.tensor([m(3) + m(1) / 2, m(1)], dtype=torch.float32), atol=1e-6)


def test_flat_groups_and_missing_turns_get_exactly_zero():
    flat = torch.tensor([[[0.1, 0.1, NAN], [0.1, 0.1, NAN]], [[0.3, NAN, NAN], [0.3, NAN, NAN]]], dtype=torch.float64)
    assert per_turn_advantages(flat, 0.9).abs().sum() == 0 and process_advantages(flat, 0.9).abs().sum() == 0


def episode(step_rewards):
    return Episode(turns=len(step_rewards), step_rewards=list(step_rewards))


def test_turn_rewards_weight_the_env_steps_and_add_the_other_functions_to_the_last_turn():
    eps = [episode([0.25, None, 1.0]), episode([0.5]), episode([]), episode([0.5, 0.5])]
    others_B = torch.tensor([0.5, NAN, NAN, 1.0])
    rewards_B = torch.tensor([3.0, 1.0, NAN, NAN])  # 2 x (0.25 + 1) + 0.5; the last: excluded (e.g. an env error): every turn NaN
    r = turn_rewards(eps, 2.0, others_B, rewards_B)
    assert r[0].tolist() == [0.5, 0.0, 2.5]  # 2 x 0.25, 2 x 0 (no reward given), 2 x 1 + 0.5
    assert r[1, 0].item() == 1.0 and torch.isnan(r[1, 1:]).all()  # others NaN (none scored): 0
    assert torch.isnan(r[2:]).all()
    # gamma 1: turn 1's return is the completion's reward under turn_rewards=none
    assert turn_returns(r[:2], 1.0)[:, 0].tolist() == rewards_B[:2].tolist()


def test_each_sampled_token_gets_its_turns_advantage_observations_and_padding_zero():
    # one group of 2: x plays 2 turns (rewards 0, 1), y 1 turn (reward 0); per_turn, gamma 1:
    # turn 0 returns {1, 0} -> +-0.5 / sqrt(0.5); turn 1 only x -> 0
    eps = [episode([0.0, 1.0]), episode([0.0])]
    spans = [[5, 6, 9, 7, 8], [5, 6]]  # x: turn 0 (2 tokens), an observation, turn 1 (2 tokens)
    rollouts = Rollouts(spans, [[0.0] * len(s) for s in spans], ["stop", "stop"], 0,
                        loss_masks=[[1, 1, 0, 1, 1], [1, 1]], episodes=eps, token_turns=[[0, 0, -1, 1, 1], [0, 0]])
    adv_BT = turn_token_advantages(torch.tensor([[1.0, 0.0]]), rollouts, 1.0, torch.zeros(2), "per_turn", 1.0, "group")
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert torch.allclose(adv_BT, torch.tensor([[a, a, 0, 0, 0], [-a, -a, 0, 0, 0]]), atol=1e-6)
    batch = collate([[1, 2]] * 2, rollouts, adv_BT, 0, False)
    assert batch.advantages_B.shape == batch.mask_BT.shape == (2, 5)


def test_the_driver_records_each_turns_step_reward_and_each_tokens_turn(tiny_lm):
    _, tok = tiny_lm
    # secret 3, a policy that says 8, then 20 (outside the interval), then 3
    plays = iter(["8", "20", "3"])
    gen = Scripted(tok, lambda p: next(plays))
    make_env = lambda: GuessEnv(miss_reward=-0.1, narrow_reward=0.3)  # noqa: E731
    out = runner(tok, make_env=make_env).run(gen, prompts_of(tok, GUESS[2:3]), GUESS[2:3], 1, Sampling(3, seed=1))
    e = out.episodes[0]
    # 8 rules out 8 of the 15 secrets (8..15): -0.1 + 0.3 x 8/15; 20 rules out none: -0.1; the hit: 1
    assert e.step_rewards == pytest.approx([-0.1 + 0.3 * 8 / 15, -0.1, 1.0]) and e.env_reward == pytest.approx(sum(e.step_rewards))
    # "8" eos "<" "20" eos "<" "3" eos: turns 0, observation, 1, observation, 2
    assert out.token_turns[0] == [0, 0, -1, 1, 1, 1, -1, 2, 2]
    assert [t >= 0 for t in out.token_turns[0]] == [bool(m) for m in out.loss_masks[0]]


def test_the_default_guess_env_gives_no_shaping():
    env = GuessEnv()
    env.reset(GUESS[2], 0)
    assert [env.step(a).reward for a in ["8", "x", "3"]] == [0.0, 0.0, 1.0]


def algo(**kw):
    base = dict(turn_rewards="none", turn_discount=1.0, adv_scale="group", adv_estimator="grpo")
    return SimpleNamespace(**{**base, **kw})


def test_none_is_the_per_completion_advantage_as_before():
    rewards_PG = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.2, 0.2]])
    adv, flat_P = step_advantages(rewards_PG, None, {}, [("env", None, 1.0)], algo())
    # the code before turn_rewards: group_advantages(rewards_PG).flatten(), zero_std_groups(rewards_PG)
    assert adv.shape == (6,) and torch.equal(adv, group_advantages(rewards_PG).flatten())
    assert torch.equal(flat_P, zero_std_groups(rewards_PG)) and flat_P.tolist() == [False, True]
    assert torch.allclose(adv[:3], torch.tensor([0.5, -0.5, 0.0]) / (0.5 + EPS))  # mean 0.5, std 0.5


def test_per_turn_groups_are_flat_only_where_every_token_advantage_is_zero():
    # equal rewards (1, 1) but one trajectory takes 2 turns: per_turn with gamma 0.5 credits them
    eps = [episode([1.0]), episode([0.0, 1.0])]
    rollouts = Rollouts([[5], [5, 9, 6]], [[0.0], [0.0] * 3], ["stop"] * 2, 0, loss_masks=[[1], [1, 0, 1]],
                        episodes=eps, token_turns=[[0], [0, -1, 1]])
    rewards_PG = torch.tensor([[1.0, 1.0]])
    adv, flat_P = step_advantages(rewards_PG, rollouts, {"env": [1.0, 1.0]}, [("env", None, 1.0)],
                                  algo(turn_rewards="per_turn", turn_discount=0.5))
    assert flat_P.tolist() == [False] and adv[0, 0] > 0 > adv[1, 0]  # returns 1 vs 0.5 at turn 0
    _, flat_P = step_advantages(rewards_PG, rollouts, {"env": [1.0, 1.0]}, [("env", None, 1.0)], algo(turn_rewards="per_turn"))
    assert flat_P.tolist() == [True]  # gamma 1: both returns 1 at turn 0, only one trajectory at turn 1


@pytest.mark.parametrize("overrides, message", [
    (["algo.turn_rewards=per_turn"], "env=none has no turns"),
    (["algo.turn_rewards=per_step"], "algo.turn_rewards='per_step' is not one of"),
    (["env=guess", "task=guess", "algo.turn_rewards=process"], "which reward.funcs lacks"),
    (["env=guess", "task=guess", "reward=env", "algo.turn_rewards=per_turn", "algo=rloo"], "algo.adv_estimator=grpo"),
    (["env=guess", "task=guess", "reward=env", "algo.turn_rewards=per_turn", "algo.adv_scale=batch"],
     "normalises within each group: it needs algo.adv_estimator=grpo with algo.adv_scale=group or none (got grpo / batch)"),
    (["env=guess", "task=guess", "reward=env", "algo.turn_discount=0.9"], "algo.turn_rewards=none gives one reward"),
    (["env=guess", "task=guess", "reward=env", "algo.turn_rewards=per_turn", "algo.turn_discount=0"], "in (0, 1]"),
])
def test_validate_refuses_turn_credit_it_cannot_give(make_cfg, overrides, message):
    from grpo.config import validate

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        validate(make_cfg(*overrides))


def test_validate_takes_turn_credit_on_the_guess_task(make_cfg):
    from grpo.config import validate

    validate(make_cfg("experiment=guess_tiny", "algo.turn_rewards=per_turn", "algo.turn_discount=0.9"))


@pytest.mark.starts_process
def test_a_per_turn_run_trains_on_token_advantages_and_differs_from_the_final_reward(make_cfg, tmp_path):
    """2 steps of the shaped guess game: per_turn (gamma 0.9) trains, and its losses are not the
    final-reward run's (same seed, same episodes at step 1): the token advantages reached the loss."""
    import json
    import os

    from grpo.train import train

    losses = {}
    for mode, extra in (("none", []), ("per_turn", ["algo.turn_discount=0.9"])):
        cfg = make_cfg("experiment=guess_tiny", "steps=2", "eval_every=0", "checkpoint_every=0", "+env.kwargs.narrow_reward=0.2",
                       f"algo.turn_rewards={mode}", *extra, f"run_dir={tmp_path / mode}")
        train(cfg)
        rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
        trained = [r for r in rows if "loss" in r]
        assert len(trained) == 2 and all(math.isfinite(r["loss"]) and r["trained_completions"] > 0 for r in trained)
        losses[mode] = [r["loss"] for r in trained]
    assert losses["none"][0] != pytest.approx(losses["per_turn"][0], abs=1e-6), losses
