"""Numbers no other test pinned: each test here was written against a mutation of the code (a plausible
bug) that every existing test let through. The expected values are worked out by hand in the comments."""

import math
from types import SimpleNamespace

import pytest
import torch

from grpo.algorithm import LossNorm, importance_weights, policy_loss, token_staleness

NORM1 = LossNorm(num_seqs=1, num_tokens=1, max_len=1, gen_tokens_per_step=1)


def test_sequence_importance_weight_sums_only_the_loss_tokens():
    # old - sampler = [ln 2, 5 (masked: an observation or padding)]: the sequence's log w is ln 2 alone
    # -> w = 2 on every token (inside cap 4). Summing the masked 5 too gave ln 2 + 5 -> capped at 4.
    old, sampler, mask = torch.tensor([[math.log(2.0), 5.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])
    torch.testing.assert_close(importance_weights(old, sampler, mask, "sequence", "truncate", 4.0), torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(importance_weights(old, sampler, mask, "sequence", "reject", 4.0), torch.tensor([[1.0, 1.0]]))


def test_truncated_importance_weights_are_capped_above_only():
    # TIS: min(w, cap). w = 0.25 at cap 2 stays 0.25 (raising it to 1 / cap = 0.5 is not truncation)
    old, sampler, mask = torch.tensor([[math.log(0.25), math.log(3.0)]]), torch.zeros(1, 2), torch.ones(1, 2)
    torch.testing.assert_close(importance_weights(old, sampler, mask, "token", "truncate", 2.0), torch.tensor([[0.25, 2.0]]))


def test_cispo_weight_inside_the_band_is_detached():
    # ratio 1.1 inside [0.8, 1.2], A = +1: loss = -1.1 x ln 1.1 = -0.104841; the weight is detached, so
    # d loss / d logp = -1.1 (with the weight's own gradient it would be -1.1 - 1.1 x ln 1.1 = -1.204841)
    logp = torch.tensor([[math.log(1.1)]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), NORM1, clip_eps=0.2,
                              pg_loss="cispo")
    assert loss.item() == pytest.approx(-0.104841, abs=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.1, abs=1e-6)
    assert stats["clipped_tokens"].item() == 0.0


def test_kl_statistic_counts_only_the_loss_tokens():
    # logp 0, ref [ln 2, ln 3], mask [1, 0]: k3 = [2 - ln 2 - 1, 3 - ln 3 - 1] = [0.306853, 0.901388]; the
    # masked token's 0.901388 is in neither the loss nor the logged KL sum
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[math.log(2.0), math.log(3.0)]])
    loss, stats = policy_loss(logp, torch.zeros(1, 2), torch.tensor([0.0]), torch.tensor([[1.0, 0.0]]), NORM1,
                              beta=0.1, ref_logprobs_BT=ref, loss_type="bnpo")
    assert stats["kl_sum"].item() == pytest.approx(0.306853, abs=1e-5)
    assert loss.item() == pytest.approx(0.0306853, abs=1e-6)


def test_token_staleness_is_the_mean_over_sampled_tokens_only():
    # trainer at 5; tokens sampled at versions [3, 3, 4], observations -1: (2 + 2 + 1) / 3 = 5 / 3
    assert token_staleness(5, [[3, 3, -1, -1], [4]]) == (5, 3)  # the parts of 5 / 3
    assert token_staleness(5, [[-1, -1]]) == (0, 0)  # nothing sampled


def test_loss_norm_counts_only_sequences_with_a_loss_token():
    # rows with 2, 0 (every token masked: excluded or truncated under DAPO) and 1 loss tokens: 2 sequences,
    # 3 tokens. Counting the empty row made loss_type=grpo's mean over sequences 2/3 of what it is.
    from grpo.update import loss_norm

    batch = SimpleNamespace(mask_BT=torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    norm = loss_norm(batch, max_len=3, gen_tokens_per_step=3.0)
    assert (norm.num_seqs, norm.num_tokens, norm.max_len) == (2, 3, 3)


def update_batch(tok, advantages, lengths, seed=0):
    """One prompt per 2 completions (G = 2) with the given completion lengths and advantages; the
    sampler's logprobs random in (-1, 0)."""
    from grpo.batch import collate
    from grpo.rollout.base import Rollouts

    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    prompts = [[tok.bos_token_id, 5 + p, 7 + p] for p in range(B // 2) for _ in range(2)]
    comps = [torch.randint(4, 20, (n,), generator=g).tolist() for n in lengths]
    logps = [(-torch.rand(n, generator=g)).tolist() for n in lengths]
    return collate(prompts, Rollouts(comps, logps, ["stop"] * B, 0), torch.tensor(advantages), tok.pad_token_id,
                   mask_truncated=False)


def k3_mean(p_BT, q_BT, mask_BT):
    """Mean over the loss tokens of k3 with log r = q - p: e^{q - p} - (q - p) - 1."""
    d = q_BT - p_BT
    return float(((d.exp() - d - 1) * mask_BT).sum() / mask_BT.sum())


def test_dapo_loss_with_minibatches_divides_by_the_generated_tokens_per_step(tiny_lm):
    # 2 groups, num_minibatches=2, lr ~ 0 so every ratio stays 1 and each token's loss is -A:
    # lengths [1, 2, 3, 2] (8 tokens, 4 per optimizer step), A = [1, -1, 2, -2]
    # step 1: -(1 x 1 - 1 x 2) / (8 / 2) = 0.25; step 2: -(2 x 3 - 2 x 2) / 4 = -0.5; logged loss: their mean -0.125
    # (dividing by all 8 generated tokens per step, not 8 / 2, halved it: -0.0625)
    import copy

    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import policy_update

    model, tok = tiny_lm
    batch = update_batch(tok, [1.0, -1.0, 2.0, -2.0], [1, 2, 3, 2])
    algo = OmegaConf.structured(AlgoConfig(loss_type="dapo", batch_size=4, group_size=2, num_minibatches=2,
                                           warmup_steps=0, lr=1e-20, lr_schedule="constant", weight_decay=0.0))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0)
    assert stats["optimizer_steps"] == 2
    assert stats["loss"] == pytest.approx(-0.125, rel=1e-4)


def test_trained_completions_counts_the_rows_with_a_token_in_the_loss(tiny_lm):
    """A completion cut at max_new_tokens under algo.mask_truncated (or excluded for a failed reward in a
    trained group) keeps its row with every token masked: it trains nothing, and was counted trained."""
    import copy

    from omegaconf import OmegaConf

    from grpo.batch import collate
    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.rollout.base import Rollouts
    from grpo.update import policy_update

    model, tok = tiny_lm
    prompts = [[tok.bos_token_id, 5, 7]] * 2 + [[tok.bos_token_id, 6, 8]] * 2
    batch = collate(prompts, Rollouts([[4, 5], [6, 7, 8], [9], [10, 11]], [[-0.5] * n for n in (2, 3, 1, 2)],
                                      ["stop", "length", "stop", "stop"], 0),
                    torch.tensor([1.0, -1.0, 2.0, -2.0]), tok.pad_token_id, mask_truncated=True,
                    excluded_B=torch.tensor([False, False, True, False]))
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, warmup_steps=0, lr=1e-3, lr_schedule="constant"))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0)
    assert stats["trained_completions"] == 2


def test_logged_kl_and_sampler_kl_are_means_over_tokens_of_the_first_pass(tiny_lm):
    # kl: k3 of the reference against the trainer before the update, its mean over the loss tokens
    # (not their sum); sampler_kl: k3 of the trainer against the sampler over the first pass only (with
    # num_iterations=2 the second pass's trainer has already stepped, lr 1e-2)
    import copy

    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import policy_update, score_tokens

    model, tok = tiny_lm
    batch = update_batch(tok, [1.0, -1.0, 2.0, -2.0], [2, 3, 4, 1], seed=1)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    trainer_BT = score_tokens(model, batch, 1.0, 10_000, training_mode=True)
    ref_BT = score_tokens(ref, batch, 1.0, 10_000)
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, beta=0.1, num_iterations=2, warmup_steps=0,
                                           lr=1e-2, lr_schedule="constant"))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 4, 1.0,
                          ref_model=ref)
    expected_sampler_kl = k3_mean(batch.sampler_logprobs_BT, trainer_BT, batch.mask_BT)
    assert expected_sampler_kl > 0.1
    assert stats["sampler_kl"] == pytest.approx(expected_sampler_kl, rel=1e-4)
    # with two minibatches the second runs after the first's optimizer step: it read 0.058 on a fresh
    # batch (docs/async.md: the trainer before the update, ~0 there); the same KL as one pass
    minibatches = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, num_minibatches=2, warmup_steps=0,
                                                  lr=1e-1, lr_schedule="constant"))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), minibatches, total_steps=1), batch, minibatches,
                          4, 1.0)
    assert stats["optimizer_steps"] == 2
    assert stats["sampler_kl"] == pytest.approx(expected_sampler_kl, rel=1e-4)
    # kl is over both passes' trained tokens; the first pass's is the one computable here, so check it
    # with one pass
    algo.num_iterations = 1
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 4, 1.0,
                          ref_model=ref)
    expected_kl = k3_mean(trainer_BT, ref_BT, batch.mask_BT)
    assert expected_kl > 1e-3
    assert stats["kl"] == pytest.approx(expected_kl, rel=1e-4)


def test_countdown_refuses_a_number_used_twice_and_a_value_that_only_rounds_to_the_target():
    from grpo.rewards.countdown import countdown
    from grpo.tasks import Sample

    s = Sample(prompt="", answer="22", meta={"numbers": [3, 5, 7, 7], "target": 22})
    completions = [
        "<answer>3 * 5 + 7 + 7 - 7</answer>",  # 7 three times, but it was given twice -> 0
        "<answer>3 * 5 + 7 + 7 / 7 - 5</answer>",  # 5 twice -> 0
        "<answer>3 * 7 + 7 / 5</answer>",  # each number once, but 21 + 1.4 = 22.4: rounds to 22, is not 22 -> 0
        "<answer>(7 + 7) + 5 + 3</answer>",  # 14 + 8 = 22, each given number once -> 1
    ]
    assert countdown(completions, [s] * len(completions)) == [0.0, 0.0, 0.0, 1.0]
    s = Sample(prompt="", answer="22", meta={"numbers": [3, 5, 7], "target": 22})
    # 5 x 7 / 3 = 11.6667 and 3 x 7 + 5 / 7 = 21.714: neither is 22; 3 x 5 + 7 = 22 exactly
    assert countdown(["<answer>3 * 7 + 5 / 7</answer>", "<answer>3 * 5 + 7</answer>"], [s] * 2) == [0.0, 1.0]


def test_a_later_minibatchs_ratio_is_against_the_policy_that_sampled(tiny_lm):
    # num_minibatches=2, one pass: the old logprobs are scored once before any step, so minibatch 2's ratio
    # is pi_after_step_1 / pi_sampling, not 1. With clip_eps 1e-4 and lr 1e-2 some of its tokens leave the
    # band: clip_frac > 0. Taken as the current policy's own (detached), every ratio is exactly 1 and
    # nothing is ever clipped (clip_frac 0). Minibatch 1 (the first 3 of 8 tokens) runs at ratio 1.
    import copy

    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import policy_update

    model, tok = tiny_lm
    batch = update_batch(tok, [1.0, -1.0, 2.0, -2.0], [1, 2, 3, 2])
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, num_minibatches=2, clip_eps=1e-4, warmup_steps=0,
                                           lr=1e-2, lr_schedule="constant"))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0)
    assert 0 < stats["clip_frac"] <= 5 / 8


def test_format_accepts_reasoning_over_several_lines():
    from grpo.rewards.format import answer_format

    multi = "<think>add the tens: 40\nthen the units: 12\n</think>\n<answer>52\n</answer>"
    assert answer_format([multi, multi + "\ntrailing"], []) == [1.0, 0.0]


def test_overlong_default_buffer_is_a_quarter_of_max_new_tokens():
    # Lmax 8, no buffer given: buffer 8 // 4 = 2, free up to 6; 7 -> (6 - 7) / 2 = -0.5, 8 -> -1
    # (a buffer of half, 4, would start at 5: 5 -> -0.25, 7 -> -0.75)
    from grpo.rewards.format import overlong_penalty

    ids = [[0] * n for n in (5, 6, 7, 8)]
    assert overlong_penalty([""] * 4, [], completion_ids=ids, max_new_tokens=8) == [0.0, 0.0, -0.5, -1.0]


def test_running_normaliser_without_update_leaves_its_statistics_alone():
    # [1, 3]: mean 2, population std 1. update=False (evaluation's scores): 5 -> (5 - 2) / 1 = 3, every
    # time, and the statistics stay count 2, mean 2, m2 2 (added, 5 would move the mean to 3)
    from grpo.rewards.reward_model import ScoreNormaliser

    n = ScoreNormaliser("running")
    assert n([1.0, 3.0]) == [-1.0, 1.0]
    assert n([5.0], update=False) == [3.0]
    assert n([5.0], update=False) == [3.0]
    assert n.state_dict() == {"count": 2, "mean": 2.0, "m2": 2.0}


def test_a_negative_coefficient_is_a_value_not_written_arithmetic():
    # sympy reads -3x as -1 * 3 * x: the -1 is the sign, not a second written number, so -3x is a
    # value and equals a ground truth written another way
    from grpo.rewards.math_answer import is_equivalent

    assert is_equivalent("$\\boxed{-3x}$", "x \\cdot (-3)")
    assert is_equivalent("The answer is $\\boxed{-3\\sqrt{2}}$", "-\\sqrt{18}")
    assert not is_equivalent("$\\boxed{-3 \\cdot 6}$", "-18")  # two written numbers multiplied: computed


def test_clip_frac_counts_every_pass_in_its_denominator(tiny_lm):
    # num_iterations=2, one minibatch, 8 tokens: 16 token-updates. Pass 1 runs at ratio 1 (nothing
    # clipped); pass 2, after a step at lr 1e-2 with clip_eps 1e-6, clips c of its 8 tokens: clip_frac =
    # c / 16, a multiple of 1/16 and at most 1/2 (over one pass's 8 tokens it read c / 8)
    import copy

    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import policy_update

    model, tok = tiny_lm
    batch = update_batch(tok, [1.0, -1.0, 2.0, -2.0], [1, 2, 3, 2])
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, num_iterations=2, clip_eps=1e-6, warmup_steps=0,
                                           lr=1e-2, lr_schedule="constant"))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0)
    clipped = stats["clip_frac"] * 16
    assert clipped == pytest.approx(round(clipped), abs=1e-5) and 4 < round(clipped) <= 8


def test_sampler_diff_is_over_every_trained_token_against_the_trainer_before_the_update(tiny_lm):
    # num_minibatches=2: |trainer - sampler| over all 8 sampled tokens, the trainer's side its logprobs
    # before the update (the proximal ones): the second minibatch runs after a step at lr 1e-1, and read
    # there it would carry the update's own movement. Measured on the first minibatch alone, a step
    # whose first minibatch held flat groups only (dropped) logged no sampler_diff though it trained:
    # here group 0 is dropped, and the value is group 1's
    import copy

    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import policy_update, score_tokens

    model, tok = tiny_lm
    batch = update_batch(tok, [1.0, -1.0, 2.0, -2.0], [1, 2, 3, 2])
    trainer_BT = score_tokens(model, batch, 1.0, 10_000, training_mode=True)
    diff_BT = (trainer_BT - batch.sampler_logprobs_BT).abs() * batch.mask_BT
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, num_minibatches=2, warmup_steps=0, lr=1e-1,
                                           lr_schedule="constant"))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0)
    assert stats["sampler_diff_mean"] == pytest.approx(float(diff_BT.sum() / 8), rel=1e-4)
    assert stats["sampler_diff"] == pytest.approx(float(diff_BT.max()), rel=1e-4)
    first_flat = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0,
                               skip_P=torch.tensor([True, False]))
    assert first_flat["sampler_diff_mean"] == pytest.approx(float(diff_BT[2:].sum() / 5), rel=1e-4)
    assert first_flat["sampler_diff"] == pytest.approx(float(diff_BT[2:].max()), rel=1e-4)


@pytest.mark.parametrize("settings", [dict(num_iterations=2, num_minibatches=2), dict(num_iterations=2),
                                      dict(num_minibatches=2), dict(micro_batch_tokens=6)])
def test_sampler_statistics_count_each_trained_token_once_whatever_the_passes_and_cuts(tiny_lm, settings):
    # seed 2 puts the largest |trainer - sampler| in group 0 (row 1): by hand from the trainer before the
    # update, sampler_diff 4.668, its mean over the 8 tokens 4.105, sampler_kl 3.122. Every pass, minibatch
    # and micro-batch cut must give these: a second pass counted again, a mean over both passes' tokens, the
    # largest of the last minibatch or micro-batch alone each read otherwise
    import copy

    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import policy_update, score_tokens

    model, tok = tiny_lm
    batch = update_batch(tok, [1.0, -1.0, 2.0, -2.0], [1, 2, 3, 2], seed=2)
    trainer_BT = score_tokens(model, batch, 1.0, 10_000, training_mode=True)
    diff_BT = (trainer_BT - batch.sampler_logprobs_BT).abs() * batch.mask_BT
    assert int(diff_BT.max(1).values.argmax()) == 1 and float(diff_BT.max()) > float(diff_BT[2:].max())
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, warmup_steps=0, lr=1e-1, lr_schedule="constant",
                                           **settings))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0)
    assert stats["sampler_diff"] == pytest.approx(float(diff_BT.max()), rel=1e-4)
    assert stats["sampler_diff_mean"] == pytest.approx(float(diff_BT.sum() / 8), rel=1e-4)
    assert stats["sampler_kl"] == pytest.approx(k3_mean(batch.sampler_logprobs_BT, trainer_BT, batch.mask_BT), rel=1e-4)


def test_a_sampler_that_agrees_exactly_is_a_difference_of_0_not_unmeasured(tiny_lm):
    import copy
    from dataclasses import replace

    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import policy_update, score_tokens

    model, tok = tiny_lm
    batch = update_batch(tok, [1.0, -1.0, 2.0, -2.0], [1, 2, 3, 2])
    exact = replace(batch, sampler_logprobs_BT=score_tokens(model, batch, 1.0, 10_000, training_mode=True) * batch.mask_BT)
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, warmup_steps=0))
    stats = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), exact, algo, 3, 1.0)
    assert stats["sampler_diff"] == 0.0 and stats["sampler_diff_mean"] == 0.0


def test_lockstep_padding_is_no_work(tiny_lm, monkeypatch):
    # ZeRO-3 keeps a rank with fewer micro-batches in step with a padding micro-batch (one 2-token row,
    # mask 0): it trains nothing, and a rank that trained nothing logged its 2 tokens as real tokens and
    # as FLOPs (docs/mfu.md: padding is not work)
    import copy

    from omegaconf import OmegaConf

    import grpo.update.step
    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import policy_update

    model, tok = tiny_lm
    batch = update_batch(tok, [1.0, -1.0, 2.0, -2.0], [1, 2, 3, 2])
    algo = OmegaConf.structured(AlgoConfig(batch_size=4, group_size=2, num_iterations=2, warmup_steps=0, beta=0.1))
    plain = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0,
                          ref_model=model)["work"]
    monkeypatch.setattr(grpo.update.step, "lockstep_padding", lambda strategy, n: 2)
    padded = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=1), batch, algo, 3, 1.0,
                           ref_model=model)["work"]
    assert padded == plain and plain["train"].head == 2 * 8 and plain["old"].head == plain["reference"].head == 8


def test_a_process_group_with_only_negative_token_advantages_is_not_flat():
    # process, scale none: turn rewards [2, 0] and [1]; group mean 1 -> normalised [1, -1] and [0];
    # advantages from each turn on: [1 - 1, -1] = [0, -1] and [0]. None positive, one negative: the
    # group has signal (flat only where every token's advantage is 0, |A| max = 1)
    from grpo.batch import step_advantages
    from grpo.rollout.base import Rollouts
    from grpo.rollout.episodes import Episode

    eps = [Episode(turns=2, step_rewards=[2.0, 0.0]), Episode(turns=1, step_rewards=[1.0])]
    rollouts = Rollouts([[5, 9, 6], [5]], [[0.0] * 3, [0.0]], ["stop"] * 2, 0, loss_masks=[[1, 0, 1], [1]],
                        episodes=eps, token_turns=[[0, -1, 1], [0]])
    algo = SimpleNamespace(turn_rewards="process", turn_discount=1.0, adv_scale="none", adv_estimator="grpo")
    adv, flat_P = step_advantages(torch.tensor([[2.0, 1.0]]), rollouts, {"env": [2.0, 1.0]}, [("env", None, 1.0)], algo)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, 0.0]]))
    assert flat_P.tolist() == [False]


def test_dynamic_sampling_counts_and_means():
    from grpo.dynamic_sampling import refill
    from grpo.metrics import resolve
    from tests.test_dynamic_sampling import never, scored

    # P = 2: the first batch has 1 informative group, the second 2 -> 3 drawn, 2 trained
    first, second = scored("a", [[1, 1], [0, 1]]), scored("b", [[0, 1], [1, 0]])
    _, m = refill(first, lambda k: second, max_draws=4, still_short=lambda n: n)
    assert resolve(m)["dynamic/trained_informative"] == 2.0
    # a failed reward (NaN) counts in neither mean: drawn [1, NaN, 0, 1] -> 2 / 3; reward/f alike
    out, m = refill(scored("a", [[1, math.nan], [0, 1]]), never, max_draws=1, still_short=never)
    assert resolve(m)["dynamic/reward_mean_drawn"] == pytest.approx(2 / 3)
    assert resolve(out.reward_means)["reward/f"] == pytest.approx(2 / 3)


def test_std_from_moments_of_equal_values_is_zero_not_complex():
    # [0.1] x 3: squares - total^2 / count rounds to -1.7e-18; the std is 0, not a complex root
    from grpo.algorithm import reward_moments
    from grpo.metrics import Ratio, resolve, std_from_moments

    assert std_from_moments(*reward_moments(torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float64))) == 0.0
    assert std_from_moments(3.0, 0.30000000000000004, 0.030000000000000006) == 0.0
    # a ratio with no denominator on any rank is unknown, not 0
    assert math.isnan(resolve({"r": Ratio(0.0, 0.0)})["r"])


def test_a_spread_is_resolved_and_its_moments_are_summed_in_float64():
    # one process's reward/std: [1, 2, 3] -> n 3, sum 6, squares 14 -> (14 - 12) / 2 = 1
    from grpo.metrics import Spread, resolve

    assert resolve({"reward/std": Spread(3.0, 6.0, 14.0)}) == {"reward/std": 1.0}
    # a reward model's scale, 1000 and 1000.5 x 500 in float32: the squares summed in float32 lose the
    # spread (std 0.0 there); in float64 it is torch's std of the values, 0.25
    values = torch.tensor([1000.0, 1000.5] * 500)
    spread = Spread.of(values)
    assert Spread.value(*spread.parts()) == pytest.approx(values.double().std().item(), rel=1e-9)


def test_a_turn_that_exactly_fits_the_budget_is_taken():
    # max_new_tokens 4, max_total_tokens 10: a span of 6 leaves exactly room for a turn; 7 does not
    # (ends as length, out of budget). The engine's context alike: prompt 2 + span 6 + 4 = 12 fits 12.
    from grpo.rollout.episodes import Budget, EpisodeRunner, Trajectory

    def room(span: int, budget: Budget):
        t = Trajectory([1, 2], None, None, 0)
        t.span, t.episode.turns = [0] * span, 1
        return EpisodeRunner(lambda: None, None, None, budget, 1.0, []).room(t), t.active, t.episode.out_of_budget

    assert room(6, Budget(3, 4, 10, 5)) == (True, True, False)
    assert room(7, Budget(3, 4, 10, 5)) == (False, False, True)
    assert room(6, Budget(3, 4, 100, 5, 12))[0] is True
    assert room(7, Budget(3, 4, 100, 5, 12))[0] is False


def test_episode_metrics_by_hand():
    # 2 episodes, 3 tool calls, 1 failed: tool_failure_rate 1 / 3 (of the calls, not of the 2 episodes);
    # versions [3, 3, obs, 4] and [4, 4]: newest 4, 2 of the 5 sampled tokens behind it
    from grpo.metrics import resolve
    from grpo.rollout.episodes import Episode, EpisodeRollouts

    eps = [Episode(turns=2, tool_calls=2, tool_errors=1, finish="stop"), Episode(turns=1, tool_calls=1, finish="stop")]
    r = EpisodeRollouts([[1, 2, 3, 4], [5, 6]], [[0.0] * 4, [0.0] * 2], ["stop"] * 2, 3, episodes=eps,
                        token_versions=[[3, 3, -1, 4], [4, 4]])
    m = resolve(r.metrics())
    assert m["episode/tool_failure_rate"] == pytest.approx(1 / 3)
    assert m["episode/tool_calls"] == 1.5
    assert m["episode/tokens_behind"] == pytest.approx(2 / 5)
    assert m["episode/mixed_versions"] == 0.5 and m["episode/versions_max"] == 2


def test_a_latest_naming_a_missing_step_falls_back_to_the_newest_complete_one(tmp_path):
    # steps 1 and 2 complete, `latest` naming step 3 (a kill before its folder was in place): the
    # newest complete one, step 2, not the oldest (step 1 would retrain step 2 and drop its progress)
    from grpo.checkpoint import DONE, latest_checkpoint

    root = tmp_path / "checkpoints"
    for step in ("step_00000001", "step_00000002"):
        (root / step).mkdir(parents=True)
        (root / step / DONE).write_text("")
    (root / "step_00000004").mkdir()  # no DONE marker: incomplete, never chosen
    (root / "latest").write_text("step_00000003")
    assert latest_checkpoint(str(tmp_path)) == str(root / "step_00000002")


def test_ranks_that_log_different_metric_names_are_stopped_naming_the_difference(monkeypatch):
    # this rank logs [a, b], the other [a]: their names' checksums differ, so max(crc) != -max(-crc);
    # the all-reduce would pair b's value with nothing (or another metric's): an error naming "b"
    import zlib

    import grpo.metrics
    from grpo.metrics import same_keys

    other = ["a"]
    theirs = zlib.crc32("\n".join(other).encode())
    monkeypatch.setattr(grpo.metrics, "all_reduce_max", lambda v: [max(v[0], theirs), max(v[1], -theirs)])
    monkeypatch.setattr(grpo.metrics, "all_gather", lambda keys: [keys, other])
    with pytest.raises(RuntimeError, match=r"the ranks log different metrics this step: \['b'\] only on some ranks"):
        same_keys(["a", "b"])
    same_keys(["a"])  # the same names: no error


def test_two_ranks_metrics_are_averaged_summed_maxed_and_divided_by_value(monkeypatch):
    # rank 0 and rank 1 (its values added as the all-reduce would): plain (1 + 3) / 2 = 2; loss summed
    # 2 + 3 = 5 (SUMMED: each rank's share of one loss); steps_max max(5, 7) = 7 (not the mean 6 nor
    # the sum 12); Ratio (1 + 3) / (2 + 2) = 1.0; Count 3 + 4 = 7; a name as it is
    import grpo.metrics
    from grpo.dist import DistInfo
    from grpo.metrics import Count, Ratio, reduce_metrics

    mine = {"plain": 1.0, "loss": 2.0, "steps_max": 5.0, "r": Ratio(1.0, 2.0), "n": Count(3.0), "layout": "padded"}
    # the other rank's parts in reduce_metrics' order (keys sorted: loss, n, plain, r, steps_max)
    other_sum = [3.0, 4.0, 3.0, 3.0, 2.0, 7.0]
    maxima = iter([None, [7.0]])  # same_keys' checksum call first (the same keys: unchanged), then the *_max values
    monkeypatch.setattr(grpo.metrics, "all_reduce_sum", lambda v: [a + b for a, b in zip(v, other_sum, strict=True)])
    monkeypatch.setattr(grpo.metrics, "all_reduce_max",
                        lambda v: v if (o := next(maxima)) is None else [max(a, b) for a, b in zip(v, o, strict=True)])
    out = reduce_metrics(mine, DistInfo(rank=0, world_size=2))
    assert out == {"plain": 2.0, "loss": 5.0, "steps_max": 7.0, "r": 1.0, "n": 7.0, "layout": "padded"}


def test_weight_buckets_names_and_sizes_by_value():
    """grpo/weights.py, what a sync sends (a mutation test's gaps): buckets of at most `bucket_bytes`,
    each counted from 0 (not from the bucket before); a ZeRO-3 placeholder's size is its full one
    (`ds_numel`, its local tensor is empty); the vision tower's parameters by name, at the root too."""
    from grpo.weights import full_nbytes, group_by_size, is_vision_parameter

    items = [(name, torch.zeros(1)) for name in "abcde"]  # 4 bytes each
    assert [[n for n, _ in b] for b in group_by_size(items, 8)] == [["a", "b"], ["c", "d"], ["e"]]
    placeholder = torch.empty(0)
    placeholder.ds_numel = 10
    assert full_nbytes(placeholder) == 40 and full_nbytes(torch.zeros(3, dtype=torch.bfloat16)) == 6
    assert is_vision_parameter("visual.blocks.0.attn.qkv.weight")  # a checkpoint's names from the root
    assert is_vision_parameter("model.visual.patch_embed.proj.weight")
    assert not is_vision_parameter("model.layers.0.mlp.nonvisual.weight")
    assert not is_vision_parameter("model.language_model.layers.0.self_attn.q_proj.weight")
