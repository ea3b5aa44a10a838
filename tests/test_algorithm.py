"""The GRPO math against numbers worked out by hand (each derivation is in the comments)."""

import math

import pytest
import torch

from grpo.algorithm import (
    LossNorm,
    aggregate,
    batches_to_submit,
    combine_rewards,
    decoupled_loss,
    trust_region,
    group_advantages,
    reward_moments,
    std_from_moments,
    importance_weights,
    policy_loss,
    sampled_kl,
    staleness,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_ratio,
    zero_std_groups,
)

NAN = float("nan")


def test_group_advantages_scaled_by_group_std():
    # group [1, 0, 0, 1]: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.86603
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "group", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.86603, -0.86603, -0.86603, 0.86603]]), atol=1e-5, rtol=0)


def test_group_advantages_none_reward_is_excluded_and_gets_zero():
    # valid [1, 0, 0]: mean 1/3; deviations 2/3, -1/3, -1/3; var (4/9 + 1/9 + 1/9) / 2 = 1/3, std 0.57735
    # -> 0.6667 / 0.57735 = 1.1547 and -0.3333 / 0.57735 = -0.57735; the NaN one gets 0
    adv = group_advantages(torch.tensor([[1.0, NAN, 0.0, 0.0]]), "group", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.1547, 0.0, -0.57735, -0.57735]]), atol=1e-4, rtol=0)


def test_group_advantages_batch_std_and_none():
    # groups [1, 0] and [1, 1]: centred [0.5, -0.5], [0, 0]
    # batch std of [1, 0, 1, 1]: mean 0.75, squares .0625 + .5625 + .0625 + .0625 = .75, / 3 = .25 -> 0.5
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(group_advantages(r, "batch", eps=0.0), torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    torch.testing.assert_close(group_advantages(r, "none"), torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    assert zero_std_groups(r).tolist() == [False, True]


def test_group_advantages_zero_std_group_is_zero_not_nan():
    adv = group_advantages(torch.tensor([[1.0, 1.0, 1.0]]), "group")
    assert torch.equal(adv, torch.zeros(1, 3))


def test_equal_non_dyadic_rewards_give_exactly_zero_advantages():
    # 0.1 + 0.7 + 0.7 (weighted rewards) is not exact in float32: (r - mean) left a residue of ~1e-8
    # that / (0 + 1e-4) became same-sign advantages of up to 6e-4. A flat group now gets exactly 0.
    r = torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]])
    r = r + torch.tensor(0.7) - torch.tensor(0.7)  # float32 arithmetic, as combine_rewards' output
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(r, scale), torch.zeros(2, 7)), scale


def test_a_group_equal_within_float_noise_is_flat_and_gets_exactly_zero():
    # [1, 1 + 2^-23]: one float32 ulp apart, within zero_std_groups' 1e-6, so the group is flat (no learning
    # signal; algo.zero_std_groups=drop skips it) and every scale gives it exactly 0. Centred, it would be
    # +-2^-24 = +-5.96e-8 over its std 8.43e-8 (+ eps 1e-4): +-5.96e-4, a push from float noise alone.
    r = torch.tensor([[1.0, 1.0 + 2.0**-23], [1.0, 0.0]])
    assert zero_std_groups(r).tolist() == [True, False]
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(r, scale)[0], torch.zeros(2)), scale
    assert torch.equal(rloo_advantages(r)[0], torch.zeros(2))


def test_a_failed_completion_does_not_hide_a_flat_group():
    # NaN (a reward function failed) is left out of the spread: [1, NaN, 1] is flat (1 - 1 = 0), [0, NaN, 1]
    # is not, [2, NaN, NaN] has one scored reward and [NaN, NaN, NaN] none (no signal either way)
    r = torch.tensor([[1.0, NAN, 1.0], [0.0, NAN, 1.0], [2.0, NAN, NAN], [NAN, NAN, NAN]])
    assert zero_std_groups(r).tolist() == [True, False, True, True]


def test_batch_std_from_moments_matches_the_direct_std():
    # rewards [1, 0, 1, 1]: n 4, sum 3, squares 3 -> var (3 - 9/4) / 3 = 0.25, std 0.5
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert reward_moments(r) == [4.0, 3.0, 3.0]
    assert std_from_moments(4.0, 3.0, 3.0) == pytest.approx(0.5)
    assert std_from_moments(1.0, 1.0, 1.0) == 0.0
    halves = [reward_moments(r[:1]), reward_moments(r[1:])]  # two ranks' shares, summed
    assert std_from_moments(*[a + b for a, b in zip(*halves)]) == pytest.approx(0.5)
    # with batch_std given, a rank's groups are scaled by the global std, not their own
    torch.testing.assert_close(group_advantages(r[:1], "batch", eps=0.0, batch_std=0.5), torch.tensor([[1.0, -1.0]]))


def test_combine_rewards_weights_and_none():
    # f1 = [1, None, 0], f2 = [0.5, None, None], weights [1, 2]
    # -> [1 + 2 * 0.5, all None -> NaN, 0 (f2 abstains)]
    r = combine_rewards([[1.0, None, 0.0], [0.5, None, None]], [1.0, 2.0])
    assert r[0].item() == 2.0 and math.isnan(r[1].item()) and r[2].item() == 0.0
    # a NaN (the function failed on it) excludes the completion whatever the other gave: [NaN, 3, NaN]
    r = combine_rewards([[math.nan, 1.0, math.nan], [0.5, 1.0, None]], [1.0, 2.0])
    assert math.isnan(r[0].item()) and r[1].item() == 3.0 and math.isnan(r[2].item())


def one_token(logp: float, old: float = 0.0):
    return torch.tensor([[logp]], requires_grad=True), torch.tensor([[old]])


NORM1 = LossNorm(num_seqs=1, num_tokens=1, max_len=1, gen_tokens_per_step=1)
NORM_1x2 = LossNorm(num_seqs=1, num_tokens=2, max_len=2, gen_tokens_per_step=2)  # one sequence of 2 tokens


def test_clip_positive_advantage_is_clipped_and_has_no_gradient():
    # ratio = e^{ln 1.5} = 1.5, A = +1: min(1.5, clip 1.2) = 1.2 -> loss -1.2, gradient 0 (clipped)
    logp, old = one_token(math.log(1.5))
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), NORM1, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert stats["clipped_tokens"].item() == 1.0


def test_clip_negative_advantage_keeps_the_pessimistic_unclipped_term():
    # ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, d loss / d logp = ratio = 1.5
    logp, old = one_token(math.log(1.5))
    loss, stats = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), NORM1, clip_eps=0.2)
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    assert logp.grad.item() == pytest.approx(1.5)
    assert stats["clipped_tokens"].item() == 0.0


def test_clip_higher_raises_only_the_upper_bound():
    # eps_high 0.28: ratio 1.5, A = +1 -> min(1.5, 1.28) = 1.28; ratio 0.5, A = -1: clip at 0.8
    # -> -min(-0.5, -0.8) = 0.8
    logp, old = one_token(math.log(1.5))
    loss, _ = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), NORM1, clip_eps=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    logp, old = one_token(math.log(0.5))
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), NORM1, clip_eps=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(0.8)


def test_k3_kl_term():
    # ref - logp = ln 2: kl = e^{ln 2} - ln 2 - 1 = 0.306853; A = 0, beta 0.1 -> loss 0.0306853
    logp, old = one_token(0.0)
    ref = torch.tensor([[math.log(2.0)]])
    loss, stats = policy_loss(logp, old, torch.tensor([0.0]), torch.ones(1, 1), NORM1, beta=0.1, ref_logprobs_BT=ref)
    assert loss.item() == pytest.approx(0.0306853, abs=1e-6)
    assert stats["kl_sum"].item() == pytest.approx(0.306853, abs=1e-5)
    # d/dlogp [beta (e^{ref - logp} - (ref - logp) - 1)] = beta (1 - e^{ref - logp}) = 0.1 * (1 - 2) = -0.1
    loss.backward()
    assert logp.grad.item() == pytest.approx(-0.1)


def test_kl_needs_reference():
    logp, old = one_token(0.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, torch.tensor([0.0]), torch.ones(1, 1), NORM1, beta=0.1)


# Two sequences at ratio 1, so each token's loss is -A: seq a has A = 1 and 1 token (loss -1),
# seq b has A = -2 and 3 tokens (loss +2 each). max_len 4, token sum -1 + 6 = 5.
LOSS_BT = torch.tensor([[-1.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
MASK_BT = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
NORM2 = LossNorm(num_seqs=2, num_tokens=4, max_len=4, gen_tokens_per_step=10)
# the same two sequences as one micro-batch of an optimizer batch of 5 sequences and 16 loss tokens: the
# normalisers are the optimizer batch's counts, never the micro-batch's own (2 sequences, 4 tokens)
NORM_OF_5 = LossNorm(num_seqs=5, num_tokens=16, max_len=4, gen_tokens_per_step=20)


@pytest.mark.parametrize(
    "loss_type, norm, expected",
    [
        ("grpo", NORM2, 0.5),  # sequence means -1 and 2, averaged over 2 sequences
        ("bnpo", NORM2, 1.25),  # 5 / 4 tokens
        ("dr_grpo", NORM2, 0.625),  # 5 / (2 sequences x max_len 4)
        ("dapo", NORM2, 0.5),  # 5 / 10 tokens per optimizer step in the generated batch
        ("grpo", NORM_OF_5, 0.2),  # (-1 + 2) / 5 sequences (not / the 2 here: 0.5)
        ("bnpo", NORM_OF_5, 0.3125),  # 5 / 16 tokens (not / the 4 here: 1.25)
        ("dr_grpo", NORM_OF_5, 0.25),  # 5 / (5 sequences x max_len 4)
        ("dapo", NORM_OF_5, 0.25),  # 5 / 20 tokens per optimizer step
    ],
)
def test_aggregation_per_loss_type(loss_type, norm, expected):
    assert aggregate(LOSS_BT, MASK_BT, loss_type, norm).item() == pytest.approx(expected)


def test_policy_loss_uses_the_aggregation():
    logp = torch.zeros(2, 3)
    loss, _ = policy_loss(logp, logp, torch.tensor([1.0, -2.0]), MASK_BT, NORM2, loss_type="grpo")
    assert loss.item() == pytest.approx(0.5)


def test_importance_weights_token_and_sequence():
    # old - sampler = [ln 3, ln 0.5] -> w = [3, 0.5]; the band at cap 2 is [1/2, 2]
    # truncate: [min(3, 2), 0.5] = [2, 0.5]; mask: w x 1[band] = [0, 0.5]; reject: 1[band] = [0, 1]
    old = torch.tensor([[math.log(3.0), math.log(0.5)]])
    sampler = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    torch.testing.assert_close(importance_weights(old, sampler, mask, "token", "truncate", 2.0), torch.tensor([[2.0, 0.5]]))
    torch.testing.assert_close(importance_weights(old, sampler, mask, "token", "mask", 2.0), torch.tensor([[0.0, 0.5]]))
    torch.testing.assert_close(importance_weights(old, sampler, mask, "token", "reject", 2.0), torch.tensor([[0.0, 1.0]]))
    # sequence: ln 3 + ln 0.5 = ln 1.5 -> w 1.5 for both tokens, inside the cap
    torch.testing.assert_close(importance_weights(old, sampler, mask, "sequence", "truncate", 2.0), torch.tensor([[1.5, 1.5]]))
    torch.testing.assert_close(importance_weights(old, sampler, mask, "sequence", "mask", 1.4), torch.tensor([[0.0, 0.0]]))
    # at cap 2, 1.5 is inside the band: mask keeps the weight itself, reject only the 1
    torch.testing.assert_close(importance_weights(old, sampler, mask, "sequence", "mask", 2.0), torch.tensor([[1.5, 1.5]]))
    torch.testing.assert_close(importance_weights(old, sampler, mask, "sequence", "reject", 2.0), torch.tensor([[1.0, 1.0]]))
    assert torch.equal(importance_weights(old, sampler, mask, "none", "truncate", 2.0), torch.ones(1, 2))
    # a stale sequence far outside the band: sum log w = 1000 x 0.09 = 90 nats, past fp32's exp (inf);
    # mask and reject drop it (0, never inf x 0 = NaN), truncate caps it; the in-band row is kept
    far = torch.tensor([[0.09] * 1000, [0.0] * 1000])
    ones = torch.ones_like(far)
    for mode, row0 in (("truncate", 2.0), ("mask", 0.0), ("reject", 0.0)):
        w = importance_weights(far, torch.zeros_like(far), ones, "sequence", mode, 2.0)
        assert torch.isfinite(w).all(), mode
        torch.testing.assert_close(w[:, 0], torch.tensor([row0, 1.0]))


def test_importance_weights_scale_the_loss():
    # A = 1 at ratio 1: token loss -1; weights [2, 0.5] -> -2.5 summed, bnpo over 2 tokens -> -1.25
    logp = torch.zeros(1, 2)
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = policy_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), NORM_1x2, loss_type="bnpo", is_weights_BT=w)
    assert loss.item() == pytest.approx(-1.25)


def _advantages_on_rank(rank: int, world: int, init_file: str, rewards_PG, out_dir: str, scale: str = "batch",
                        estimator: str = "grpo") -> None:
    import torch.distributed as tdist

    from grpo.batch import batch_advantages

    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    share = len(rewards_PG) // world
    adv = batch_advantages(rewards_PG[rank * share : (rank + 1) * share], scale, estimator)
    torch.save(adv, f"{out_dir}/adv{rank}.pt")
    tdist.destroy_process_group()


def algo_for(is_level="token", is_mode="truncate", is_cap=2.0, trust_region="proximal", max_staleness=1,
             behaviour_clip_eps=None):
    from types import SimpleNamespace

    return SimpleNamespace(is_level=is_level, is_mode=is_mode, is_cap=is_cap, trust_region=trust_region,
                           max_staleness=max_staleness, loss_type="bnpo", clip_eps=0.2, ratio_level="token", pg_loss="ppo",
                           clip_eps_high=None, beta=0.0, behaviour_clip_eps=behaviour_clip_eps)


def three_policies():
    """Behaviour (sampler) logprobs 0; proximal (trainer before the update) [ln 3, ln 0.5]; current =
    proximal + [ln 1.5, ln 1.1] (requires grad); A = 1; bnpo over 2 tokens."""
    behaviour = torch.zeros(1, 2)
    proximal = torch.tensor([[math.log(3.0), math.log(0.5)]])
    current = (proximal + torch.tensor([[math.log(1.5), math.log(1.1)]])).requires_grad_()
    return current, proximal, behaviour, torch.ones(1), torch.ones(1, 2), NORM_1x2


def test_decoupled_loss_clips_against_the_proximal_policy_and_weights_by_proximal_over_behaviour():
    # behaviour (sampler) logprobs 0; proximal (trainer before the update) [ln 3, ln 0.5]; current =
    # proximal + [ln 1.5, ln 1.1]; A = 1, eps 0.2, bnpo over 2 tokens.
    #   ratio r = current / proximal = [1.5, 1.1] -> min(r, clip(r, 0.8, 1.2)) = [1.2, 1.1]
    #   w = proximal / behaviour = [3, 0.5], truncated at cap 2 -> [2, 0.5]
    #   loss = -(2 x 1.2 + 0.5 x 1.1) / 2 = -(2.4 + 0.55) / 2 = -1.475
    # Against the behaviour policy instead (r = [4.5, 0.55], no w) it would be -(1.2 + 0.55) / 2 = -0.875.
    current, proximal, behaviour, adv, mask, norm = three_policies()
    loss, _ = decoupled_loss(current, proximal, behaviour, adv, mask, norm, algo_for())
    assert loss.item() == pytest.approx(-1.475, abs=1e-6)
    # gradient: token 1 is clipped (none); token 2: d/dlogp of -w r A / 2 = -0.5 x 1.1 / 2 = -0.275
    loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[0.0, -0.275]]))
    # is_mode=mask at cap 2: w = 3 is outside [1/2, 2] -> 0; 0.5 kept -> -(0.5 x 1.1) / 2 = -0.275
    masked, _ = decoupled_loss(current, proximal, behaviour, adv, mask, norm, algo_for(is_mode="mask"))
    assert masked.item() == pytest.approx(-0.275, abs=1e-6)
    # is_level=none: no correction, w = 1 -> -(1.2 + 1.1) / 2 = -1.15
    plain, _ = decoupled_loss(current, proximal, behaviour, adv, mask, norm, algo_for(is_level="none"))
    assert plain.item() == pytest.approx(-1.15, abs=1e-6)


def test_behaviour_trust_region_clips_the_ratio_to_the_sampler():
    # the numbers above, clipped around the behaviour policy (PPO with the sampler as the old policy):
    #   r = current / behaviour = [3 x 1.5, 0.5 x 1.1] = [4.5, 0.55]; no w
    #   A = 1: min(r, clip(r, 0.8, 1.2)) = [1.2, 0.55] -> loss = -(1.2 + 0.55) / 2 = -0.875
    # gradient: token 1 already rose past 1.2 since it was sampled: clipped, none (the proximal form
    # above still pushed it, through w = 2); token 2: -0.55 / 2 = -0.275
    current, proximal, behaviour, adv, mask, norm = three_policies()
    loss, stats = decoupled_loss(current, proximal, behaviour, adv, mask, norm, algo_for(is_level="none", trust_region="behaviour"))
    assert loss.item() == pytest.approx(-0.875, abs=1e-6)
    assert stats["clipped_tokens"].item() == 1.0
    loss.backward()
    torch.testing.assert_close(current.grad, torch.tensor([[0.0, -0.275]]))
    # auto picks it for a stale batch without an is_level, and the proximal form otherwise
    auto, _ = decoupled_loss(current, proximal, behaviour, adv, mask, norm, algo_for(is_level="none", trust_region="auto"))
    assert auto.item() == pytest.approx(-0.875, abs=1e-6)
    assert trust_region("auto", 1, "none") == "behaviour"
    assert trust_region("auto", 0, "none") == "proximal"  # the synchronous loop: unchanged
    assert trust_region("auto", 2, "token") == "proximal"  # an explicit correction: decoupled PPO
    assert trust_region("behaviour", 0, "none") == "behaviour"


def test_behaviour_clip_eps_sets_the_band_around_the_sampler_only():
    # sampler logprobs 0, current = [ln 1.15, ln 1.05], A = 1, bnpo over 2 tokens: r = [1.15, 1.05]
    #   band 0.2 (clip_eps; behaviour_clip_eps=None): both inside -> -(1.15 + 1.05) / 2 = -1.1,
    #     gradient -r / 2 = [-0.575, -0.525]
    #   band 0.1: 1.15 is past 1.1 -> clipped, no gradient -> -(1.1 + 1.05) / 2 = -1.075, [0, -0.525]
    sampler = torch.zeros(1, 2)

    def loss_and_grad(proximal=None, **algo):
        current = torch.tensor([[math.log(1.15), math.log(1.05)]], requires_grad=True)
        proximal = current.detach() if proximal is None else proximal
        loss, _ = decoupled_loss(current, proximal, sampler, torch.ones(1), torch.ones(1, 2), NORM_1x2,
                                 algo_for(is_level="none", **algo))
        loss.backward()
        return loss.item(), current.grad

    loss, grad = loss_and_grad(trust_region="behaviour")
    assert loss == pytest.approx(-1.1, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.575, -0.525]]))
    loss, grad = loss_and_grad(trust_region="behaviour", behaviour_clip_eps=0.1)
    assert loss == pytest.approx(-1.075, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.525]]))
    # the proximal form (the synchronous loop) keeps clip_eps and never reads behaviour_clip_eps at
    # k = 0: with the proximal policy at the sampler's logprobs, r = current / proximal = [1.15, 1.05]
    # is inside clip_eps' 0.2 (-1.1, both gradients); the 0.1 band would clip 1.15 (-1.075, [0, ...])
    loss, grad = loss_and_grad(sampler, trust_region="auto", max_staleness=0, behaviour_clip_eps=0.1)
    assert loss == pytest.approx(-1.1, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.575, -0.525]]))


def test_sampled_kl_is_k3_over_the_sampled_tokens():
    # trainer - sampler = [ln 2, 0, ln 5 (masked out)]: r - 1 - ln r = 2 - 1 - 0.693147 = 0.306853, then 0
    sampler = torch.tensor([[-1.0, -2.0, -3.0]])
    trainer = sampler + torch.tensor([[math.log(2.0), 0.0, math.log(5.0)]])
    total, tokens = sampled_kl(sampler, trainer, torch.tensor([[1.0, 1.0, 0.0]]))
    assert float(total) == pytest.approx(0.306853, abs=1e-6) and float(tokens) == 2.0
    # symmetric case r = 1/2: 0.5 - 1 + 0.693147 = 0.193147 (k3 is not symmetric in r)
    assert float(sampled_kl(trainer[:, :1], sampler[:, :1], torch.ones(1, 1))[0]) == pytest.approx(0.193147, abs=1e-6)


def test_batches_in_flight_never_exceed_the_staleness_bound():
    assert list(batches_to_submit(1, 0, 0, 10)) == [1]  # synchronous: this step's batch only
    assert list(batches_to_submit(1, 0, 1, 10)) == [1, 2]  # k = 1: the next one too, sampled by version 0
    assert list(batches_to_submit(2, 2, 1, 10)) == [3]
    assert list(batches_to_submit(1, 0, 2, 10)) == [1, 2, 3]
    assert list(batches_to_submit(9, 10, 2, 10)) == []  # never past the last step
    assert list(batches_to_submit(4, 3, 0, 3)) == []
    # walk a run: each batch is submitted at step s with the engines at version s - 1 and trained at
    # its own step j with the trainer at version j - 1: behind by at most k
    for k in range(4):
        submitted, behind = 0, []
        for step in range(1, 21):
            for j in batches_to_submit(step, submitted, k, 20):
                behind.append(staleness(j - 1, step - 1))
                submitted = j
        assert submitted == 20 and max(behind) == k and behind[: k + 1] == list(range(k + 1))


@pytest.mark.starts_process
def test_batch_scaled_advantages_are_the_same_on_one_and_two_processes(tmp_path):
    """adv_scale=batch divides by the std of the whole batch, every rank's rewards included:
    1 process x 4 groups and 2 real gloo processes x 2 groups give the same advantages."""
    import torch.multiprocessing as mp

    from grpo.batch import batch_advantages

    rewards_PG = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    one = batch_advantages(rewards_PG, "batch")
    mp.spawn(_advantages_on_rank, args=(2, str(tmp_path / "init"), rewards_PG, str(tmp_path)), nprocs=2)
    two = torch.cat([torch.load(tmp_path / "adv0.pt"), torch.load(tmp_path / "adv1.pt")])
    torch.testing.assert_close(two, one, rtol=0, atol=1e-6)
    # and not the per-rank std: the second rank's rewards alone have another std
    assert not torch.allclose(group_advantages(rewards_PG[2:], "batch"), one[2:])


def test_completion_logits_only_give_the_same_logprobs(tiny_lm):
    """forward_logprobs sends only the completion's positions through the LM head and takes
    logit - logsumexp instead of a full log_softmax: the same numbers as every position's logits
    through log_softmax (to 1e-6), and the same entropy."""
    from grpo.rollout.base import Rollouts
    from grpo.batch import collate
    from grpo.update.forward import batch_logprobs

    model, tok = tiny_lm
    prompts = [[tok.bos_token_id, 5, 6, 7, 8, 9], [tok.bos_token_id, 5]]
    rollouts = Rollouts([[10, 11, 12], [13]], [[0.0] * 3, [0.0]], ["length", "stop"], 0)
    batch = collate(prompts, rollouts, torch.zeros(2), tok.pad_token_id, False)
    logp, ent = batch_logprobs(model, batch, temperature=0.7, with_entropy=True)
    full = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                 position_ids=batch.position_ids_BL).logits[:, batch.prompt_width - 1 : -1].float() / 0.7
    ref_logp = torch.log_softmax(full, -1).gather(-1, batch.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)


def assert_gradients_close(got: dict, want: dict, bf16: bool) -> None:
    """fp32: each element within 1e-5 (summation order). bf16: each tensor's difference within 0.6% of
    its norm (rounding measured at 0.24-0.4% on the tiny model; a recompute whose logits are 1% off
    gives 1.1%)."""
    assert got.keys() == want.keys() and len(want) > 10
    for n in want:
        if bf16:
            rel = ((got[n] - want[n]).norm() / want[n].norm()).item()
            assert rel < 6e-3, (n, rel)
        else:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-5 * max(want[n].abs().max().item(), 1.0),
                                       msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_in_pieces_gives_the_same_logprobs_and_gradients(tiny_lm, monkeypatch, dtype):
    """The LM head run on pieces of 2 tokens, each recomputed in backward, against the whole
    completion's logits at once: the same logprobs, entropies and gradients, in fp32 (to rounding) and
    bf16 (the recompute's logits are the forward's, bit for bit; the pieces' matmuls round apart)."""
    import copy

    from grpo.update import forward as logprobs
    from grpo.rollout.base import Rollouts
    from grpo.batch import collate
    from grpo.update.forward import batch_logprobs

    base, tok = tiny_lm
    batch = collate([[tok.bos_token_id, 5, 6, 7]] * 3, Rollouts([[10, 11, 12], [12], [13, 14]], [[0.0] * 3, [0.0], [0.0] * 2],
                                                             ["length"] * 3, 0), torch.zeros(3), tok.pad_token_id, False)
    results = []
    for piece_bytes in (2**30, 2 * 4 * len(tok)):  # one piece; pieces of 2 tokens (5 pieces for 9)
        monkeypatch.setattr(logprobs, "LOGIT_CHUNK_BYTES", piece_bytes)
        assert logprobs.pieces_for(9, len(tok)) == (1 if piece_bytes == 2**30 else 5)
        model = copy.deepcopy(base).to(dtype).train()
        logp, ent = batch_logprobs(model, batch, 0.7, with_entropy=True)
        (logp * batch.mask_BT * torch.arange(1.0, 4.0)).sum().backward()
        results.append((logp.detach(), ent, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}))
    (logp1, ent1, g1), (logp5, ent5, g5) = results
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(logp5, logp1, rtol=0, atol=2e-2 if bf16 else 1e-6)  # bf16: equal here, within a logit's rounding
    torch.testing.assert_close(ent5, ent1, rtol=0, atol=2e-2 if bf16 else 1e-5)
    assert_gradients_close(g5, g1, bf16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_frozen_head_gives_autograds_logprobs_and_gradients(tiny_lm, monkeypatch, dtype):
    """A frozen head (LoRA's) takes its gradient to the hidden states in the forward
    (grpo/update/frozen_head.py), on pieces of 2 tokens: the same logprobs, entropies and gradients as
    autograd through the model's own logits, in fp32 to rounding. In bf16 both are about 0.75% (a
    tensor's median) from the fp32 gradient of the same bf16 weights, and 0.8% from each other: the
    frozen path must be as close to fp32 as autograd's bf16 is (measured 0.78% against 0.75%, the
    worst tensor 1.8% against 1.4%)."""
    import copy

    from grpo.batch import collate
    from grpo.rollout.base import Rollouts
    from grpo.update import forward, frozen_head

    base, tok = tiny_lm
    batch = collate([[tok.bos_token_id, 5, 6, 7]] * 3, Rollouts([[10, 11, 12], [12], [13, 14]], [[0.0] * 3, [0.0], [0.0] * 2],
                                                             ["length"] * 3, 0), torch.zeros(3), tok.pad_token_id, False)
    monkeypatch.setattr(forward, "LOGIT_CHUNK_BYTES", 2 * 4 * len(tok))  # 5 pieces for 9 tokens
    calls = []
    monkeypatch.setattr(frozen_head, "piece", lambda *a, _real=frozen_head.piece: (calls.append(1), _real(*a))[1])
    weights_BT = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.0, 0.0], [-1.0, 2.0, 0.0]])

    def run(mine: bool, dtype: torch.dtype):
        model = copy.deepcopy(base).to(torch.bfloat16).to(dtype).train()  # bf16's weights either way
        model.get_output_embeddings().requires_grad_(False)  # tied: the input embedding is frozen with it
        if mine:
            logp, ent = forward.batch_logprobs(model, batch, 0.7, with_entropy=True)
        else:  # autograd through the whole completion's logits, the head run by the model
            logits = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                           position_ids=batch.position_ids_BL).logits[:, batch.prompt_width - 1 : -1].float() / 0.7
            logp = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
            ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).detach()
        (logp * batch.mask_BT * weights_BT).sum().backward()
        return (logp.detach() * batch.mask_BT, ent * batch.mask_BT,
                {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})

    (logp_a, ent_a, g_a), (logp_b, ent_b, g_b) = run(True, dtype), run(False, dtype)
    assert len(calls) == 5  # every piece took the frozen head's path
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: equal here; a logit's rounding where matmuls differ
    torch.testing.assert_close(logp_a, logp_b, rtol=0, atol=atol)
    torch.testing.assert_close(ent_a, ent_b, rtol=0, atol=atol)
    assert g_a.keys() == g_b.keys() and len(g_a) > 10 and not any("embed" in n for n in g_a)
    if dtype == torch.float32:
        assert_gradients_close(g_a, g_b, bf16=False)
        return
    truth = run(False, torch.float32)[2]
    errors = [sorted(((g[n] - truth[n]).norm() / truth[n].norm()).item() for n in truth) for g in (g_a, g_b)]
    (median_a, worst_a), (median_b, worst_b) = ((e[len(e) // 2], e[-1]) for e in errors)
    assert median_a < 1.25 * median_b and worst_a < 2 * worst_b, (errors[0], errors[1])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_frozen_head_with_a_bias_gives_autograds_gradient(temperature):
    """frozen_head.piece on a frozen linear head with a bias (the tiny model's has none), at
    temperature 1 (no division) and 0.7: autograd's logprobs, entropies and gradient to the hidden
    states, and no gradient to the head."""
    from grpo.update import frozen_head

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50).requires_grad_(False)
    with torch.no_grad():
        head.bias.mul_(20.0)  # large enough that dropping it moves every number
    hidden = torch.randn(6, 8, requires_grad=True)
    tokens = torch.tensor([0, 7, 49, 3, 3, 21])
    upstream = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, -1.0])
    assert frozen_head.applies(head)
    logp, ent = frozen_head.piece(head, hidden, tokens, temperature, True)
    (grad,) = torch.autograd.grad((logp * upstream).sum(), hidden)
    logp_all = torch.log_softmax(head(hidden) / temperature, -1)
    want = logp_all.gather(-1, tokens[:, None])[:, 0]
    (want_grad,) = torch.autograd.grad((want * upstream).sum(), hidden)
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, -(logp_all.exp() * logp_all).sum(-1).detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-6)
    assert head.weight.grad is None and head.bias.grad is None


class ScaledHead(torch.nn.Module):
    """A model whose logits are not its head's output (as Gemma's soft-capping or Cohere's scale)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kw):
        out = self.inner(**kw)
        out.logits = out.logits * 3.0
        return out


def test_a_head_of_its_own_takes_the_models_logits(tiny_lm):
    """has_plain_head finds that a model's logits are not lm_head(hidden) and forward_logprobs takes the
    model's own logits; a plain model is found plain."""
    from grpo.update.support import has_plain_head
    from grpo.rollout.base import Rollouts
    from grpo.batch import collate
    from grpo.update.forward import batch_logprobs

    model, tok = tiny_lm
    scaled = ScaledHead(model)
    batch = collate([[tok.bos_token_id, 5, 6]] * 2, Rollouts([[10, 11], [12]], [[0.0] * 2, [0.0]], ["length"] * 2, 0),
                    torch.zeros(2), tok.pad_token_id, False)
    assert has_plain_head(model) and not has_plain_head(scaled)
    logp, _ = batch_logprobs(scaled, batch, 1.0)
    logits = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                   position_ids=batch.position_ids_BL).logits[:, batch.prompt_width - 1 : -1] * 3.0
    ref = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)


def test_a_head_of_its_own_gives_the_tempered_logprobs_and_entropy(tiny_lm):
    """At temperature 0.7 a head of its own (the model's logits x 3) gives log_softmax(3 logits / 0.7)
    and that distribution's entropy, as the plain head's pieces do."""
    from grpo.rollout.base import Rollouts
    from grpo.batch import collate
    from grpo.update.forward import batch_logprobs

    model, tok = tiny_lm
    scaled = ScaledHead(model)
    batch = collate([[tok.bos_token_id, 5, 6]] * 2, Rollouts([[10, 11], [12]], [[0.0] * 2, [0.0]], ["length"] * 2, 0),
                    torch.zeros(2), tok.pad_token_id, False)
    with torch.no_grad():
        logp, ent = batch_logprobs(scaled, batch, 0.7, with_entropy=True)
        logits = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                       position_ids=batch.position_ids_BL).logits[:, batch.prompt_width - 1 : -1].float() * 3.0 / 0.7
    ref_logp = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    _, plain_ent = batch_logprobs(model, batch, 0.7 / 3.0, with_entropy=True)  # the same distribution
    torch.testing.assert_close(ent, plain_ent, rtol=0, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_lm):
    """model.gradient_checkpointing=true recomputes activations in the backward pass: same gradients."""
    import copy

    from grpo.models import enable_gradient_checkpointing
    from grpo.rollout.base import Rollouts
    from grpo.batch import collate
    from grpo.update.forward import batch_logprobs

    base, tok = tiny_lm
    batch = collate([[tok.bos_token_id, 5, 6, 7]] * 2, Rollouts([[10, 11], [12]], [[0.0, 0.0], [0.0]], ["length"] * 2, 0),
                    torch.zeros(2), tok.pad_token_id, False)
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base).train()
        if checkpointing:
            enable_gradient_checkpointing(model)
        logp, _ = batch_logprobs(model, batch, 1.0)
        (logp * batch.mask_BT).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-6, msg=n)


# ---- variants: RLOO, REINFORCE++, GSPO, CISPO ----


def test_rloo_leave_one_out_baseline():
    # [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_1 = 0 - (1 + 0 + 1) / 3 = -2/3 (= 4/3 x (r - 0.5))
    # [1, NaN, 0, 0]: 3 scored, sum 1: A_0 = 1 - 0 / 2 = 1, A_2 = A_3 = 0 - 1 / 2 = -0.5; NaN gets 0
    # [1, NaN, NaN, NaN]: one scored reward, no baseline -> 0; [0.1] x 4 (float32 noise): flat -> exactly 0
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, NAN, 0.0, 0.0], [1.0, NAN, NAN, NAN], [0.1] * 4])
    r[3] = r[3] + torch.tensor(0.7) - torch.tensor(0.7)
    adv = rloo_advantages(r)
    torch.testing.assert_close(adv[:2], torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1.0, 0.0, -0.5, -0.5]]))
    assert torch.equal(adv[2:], torch.zeros(2, 4))


def test_reinforce_pp_divides_centred_rewards_by_their_batch_std():
    # groups [1, 0, 0, 1] and [1, 1, 1, 0]: means 0.5 and 0.75 -> centred [.5, -.5, -.5, .5], [.25, .25, .25, -.75]
    # their sum is 0, squares 4 x .25 + 3 x .0625 + .5625 = 1.75 -> sample var 1.75 / 7 = 0.25, std 0.5
    # -> [1, -1, -1, 1], [.5, .5, .5, -1.5]. (adv_scale=batch would use the raw rewards' std:
    # 5 ones of 8 -> var (5 - 25/8) / 7 = 0.268, std 0.5175, and give 0.966 instead of 1.)
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    adv = reinforce_pp_advantages(r, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.5, 0.5, 0.5, -1.5]]))
    assert group_advantages(r, "batch", eps=0.0)[0, 0].item() == pytest.approx(0.5 / 0.5175, abs=1e-3)
    # NaN and flat groups: exactly 0; the std is given (the whole batch's over every rank)
    flat = torch.tensor([[0.1, 0.1, 0.1], [1.0, NAN, 0.0]]) + torch.tensor(0.7) - torch.tensor(0.7)
    adv = reinforce_pp_advantages(flat, batch_std=0.25, eps=0.0)  # [1, NaN, 0]: centred +-0.5 -> +-2
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, -2.0]]))


@pytest.mark.starts_process
def test_reinforce_pp_std_is_the_same_on_one_and_two_processes(tmp_path):
    """The batch std of the centred rewards is summed over ranks: 1 x 4 groups == 2 x 2 groups."""
    import torch.multiprocessing as mp

    from grpo.batch import batch_advantages

    rewards_PG = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    one = batch_advantages(rewards_PG, "none", "reinforce_pp")
    mp.spawn(_advantages_on_rank, args=(2, str(tmp_path / "init"), rewards_PG, str(tmp_path), "none", "reinforce_pp"),
             nprocs=2)
    two = torch.cat([torch.load(tmp_path / "adv0.pt"), torch.load(tmp_path / "adv1.pt")])
    torch.testing.assert_close(two, one, rtol=0, atol=1e-6)
    assert not torch.allclose(reinforce_pp_advantages(rewards_PG[2:]), one[2:])  # not one rank's own std


def test_gspo_sequence_ratio_is_the_geometric_mean_and_clips_per_sequence():
    # token log ratios [ln 4, 0] and a masked third token (ln 100, ignored): mean ln 2 -> ratio 2 = sqrt(4 x 1)
    logp = torch.tensor([[math.log(4.0), 0.0, math.log(100.0)]], requires_grad=True)
    old, mask = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]])
    assert sequence_ratio(logp, old, mask).item() == pytest.approx(2.0)
    # A = +1: -min(2, clip 1.2) = -1.2 on each token; loss_type=grpo: the sequence's mean -> -1.2;
    # clipped, so no gradient; both loss tokens count as clipped. (Per token it would be
    # -(min(4, 1.2) + min(1, 1.2)) / 2 = -1.1.)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, NORM1, clip_eps=0.2, ratio_level="sequence")
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 3)) and stats["clipped_tokens"].item() == 2.0
    token_loss, _ = policy_loss(logp, old, torch.tensor([1.0]), mask, NORM1, clip_eps=0.2)
    assert token_loss.item() == pytest.approx(-1.1)
    # A = -1: -min(-2, -1.2) = 2, unclipped; d/dlogp_t of ratio = ratio x (1 / 2 tokens) = 1 on each
    # loss token, 0 on the masked one
    logp.grad = None
    loss, stats = policy_loss(logp, old, torch.tensor([-1.0]), mask, NORM1, clip_eps=0.2, ratio_level="sequence")
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0, 1.0, 0.0]]))
    assert stats["clipped_tokens"].item() == 0.0


def test_gspo_paper_clip_range():
    # mean log ratio 1e-3 -> ratio e^0.001 = 1.0010005 > 1 + 4e-4: A = +1 clipped to -1.0004
    logp = torch.tensor([[1e-3, 1e-3]])
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), NORM1, clip_eps=3e-4,
                          clip_eps_high=4e-4, ratio_level="sequence")
    assert loss.item() == pytest.approx(-1.0004, abs=1e-7)


def test_cispo_clips_the_detached_weight_but_keeps_every_gradient():
    # ratio 1.5, A = +1, bounds [1 - 1.0, 1 + 0.2] = [0, 1.2]: weight 1.2 (detached)
    # loss = -1.2 x 1 x ln 1.5 = -1.2 x 0.405465 = -0.486558; d loss / d logp = -1.2 (PPO: 0, clipped)
    logp, old = one_token(math.log(1.5))
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), NORM1, clip_eps=1.0,
                              clip_eps_high=0.2, pg_loss="cispo")
    assert loss.item() == pytest.approx(-0.486558, abs=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.2)
    assert stats["clipped_tokens"].item() == 1.0
    # ratio 0.5, A = -1, bounds [0.8, 1.2]: weight 0.8; loss = -0.8 x -1 x ln 0.5 = -0.554518, gradient +0.8
    # (PPO: -min(-0.5, -0.8) = 0.8 through the clipped term, gradient 0)
    logp, old = one_token(math.log(0.5))
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), NORM1, clip_eps=0.2, pg_loss="cispo")
    assert loss.item() == pytest.approx(-0.554518, abs=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.8)
    # on-policy (ratio 1) its gradient is the policy gradient, -A, as PPO's
    logp, old = one_token(0.0)
    policy_loss(logp, old.clone(), torch.tensor([2.0]), torch.ones(1, 1), NORM1, pg_loss="cispo")[0].backward()
    assert logp.grad.item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="ratio_level=token"):
        policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), NORM1, pg_loss="cispo", ratio_level="sequence")
