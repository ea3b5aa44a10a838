"""The same optimizer batch cut into 1, 2 or 4 micro-batches gives the same gradient, per loss type.

TRL and ms-swift both shipped loss-scale bugs here: normalising by a micro-batch's own token count
makes the gradient depend on the split. Every normaliser here is a count over the whole batch.
"""

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import AlgoConfig
from grpo.parallel.single import SingleStrategy
from grpo.rollout.base import Rollouts
from grpo.update import accumulate_gradients, loss_norm, score_tokens
from grpo.batch import collate


def make_batch(tok, seed=0, B=8, T=6, group=1):
    """B completions; each prompt serves `group` consecutive ones."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[tok.bos_token_id] + torch.randint(4, 20, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B // group)]
    prompts = [p for p in prompts for _ in range(group)]
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()  # ragged completions
    comps = [torch.randint(4, 20, (n,), generator=g).tolist() for n in lengths]
    logps = [(-torch.rand(n, generator=g)).tolist() for n in lengths]
    reasons = ["length" if n == T else "stop" for n in lengths]
    adv = torch.randn(B, generator=g)
    return collate(prompts, Rollouts(comps, logps, reasons, 0), adv, tok.pad_token_id, mask_truncated=False)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gradient_is_invariant_to_micro_batching(tiny_lm, loss_type):
    model, tok = tiny_lm
    batch = make_batch(tok)
    algo = OmegaConf.structured(AlgoConfig(loss_type=loss_type, beta=0.05, clip_eps=0.1, is_level="token"))
    # off-policy old logprobs (ratio != 1, some tokens clipped) and a reference for the KL term
    noise = 0.3 * torch.randn(batch.completion_ids_BT.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs_BT = score_tokens(model, batch, 1.0, 10_000) + noise
    batch.ref_logprobs_BT = batch.old_logprobs_BT - 0.2
    norm = loss_norm(batch, max_len=6, gen_tokens_per_step=float(batch.mask_BT.sum()))
    L = batch.input_ids_BL.shape[1]

    grads, clipped = [], []
    for n_micro in (1, 2, 4):
        m = copy.deepcopy(model)
        algo.micro_batch_tokens = L * batch.size // n_micro
        strategy = SingleStrategy(None, m, algo, total_steps=1)
        stats, _ = accumulate_gradients(strategy, batch, algo, norm, temperature=1.0)
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
        clipped.append(stats["clipped_tokens"])
    assert clipped[0] > 0, "the test batch should exercise clipping"
    assert grads[0].abs().sum() > 0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], atol=1e-6, rtol=1e-4)


def test_micro_batch_normaliser_would_break_invariance(tiny_lm):
    """Control: normalising by each micro-batch's own tokens (the anchors' bug) does change it."""
    model, tok = tiny_lm
    batch = make_batch(tok)
    algo = OmegaConf.structured(AlgoConfig(loss_type="bnpo"))
    L = batch.input_ids_BL.shape[1]
    grads = []
    for n_micro in (1, 4):
        m = copy.deepcopy(model)
        algo.micro_batch_tokens = L * batch.size // n_micro
        strategy = SingleStrategy(None, m, algo, total_steps=1)
        for i in range(n_micro):
            mb = batch.select(slice(i * batch.size // n_micro, (i + 1) * batch.size // n_micro))
            accumulate_gradients(strategy, mb, algo, loss_norm(mb, 6, 1.0), temperature=1.0)
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert not torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("minibatches", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skipping_flat_groups_leaves_the_update_as_it_was(tiny_lm, loss_type, minibatches, dtype):
    """algo.zero_std_groups=drop leaves the groups whose rewards are all equal (advantage 0; beta 0) out of
    every forward. It must only save their compute: their sequences and tokens still count in the
    loss's normalisers, so loss and gradient norm are those of the whole batch. Counted after the drop,
    the gradient was 1 / (1 - zero_std_frac) times larger (2x with half the groups flat), a step size
    that followed the batch's share of informative groups."""
    from grpo.update import policy_update

    model, tok = tiny_lm
    G = 2
    batch = make_batch(tok, seed=3, B=8, T=6, group=G)
    flat_P = torch.tensor([False, True, False, True])
    batch.advantages_B = torch.where(flat_P.repeat_interleave(G), 0.0, batch.advantages_B)  # as step_advantages gives
    algo = OmegaConf.structured(AlgoConfig(loss_type=loss_type, batch_size=8, group_size=G, beta=0.0,
                                           num_minibatches=minibatches, warmup_steps=0))
    stats = []
    for skip in (None, flat_P):
        strategy = SingleStrategy(None, copy.deepcopy(model).to(dtype), algo, total_steps=2)
        stats.append(policy_update(strategy, batch, algo, max_len=6, temperature=1.0, skip_P=skip))
    kept, skipped = stats
    assert kept["trained_completions"] == 8 and skipped["trained_completions"] == 4
    assert kept["grad_norm"] > 0
    assert skipped["grad_norm"] == pytest.approx(kept["grad_norm"], rel=1e-4)
    assert skipped["loss"] == pytest.approx(kept["loss"], rel=1e-4, abs=1e-7)


def test_a_step_of_skipped_groups_leaves_the_sampler_difference_unmeasured_not_0(tiny_lm):
    """Every group flat (skipped): no sampled token is scored, so |trainer - sampler| was not measured.
    It read 0, which the sampler watch takes for perfect parity; it is NaN (the watch skips it). A
    first minibatch of skipped groups alone is measured on the later ones (test_pinned_values)."""
    from grpo.update import policy_update

    model, tok = tiny_lm
    G = 2
    batch = make_batch(tok, seed=3, B=8, T=6, group=G)
    algo = OmegaConf.structured(AlgoConfig(batch_size=8, group_size=G, num_minibatches=2, warmup_steps=0))
    kept = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=2), batch, algo, 6, 1.0)
    skipped = policy_update(SingleStrategy(None, copy.deepcopy(model), algo, total_steps=2), batch, algo, 6, 1.0,
                            skip_P=torch.ones(4, dtype=torch.bool))
    assert kept["sampler_diff"] > 0 and skipped["trained_completions"] == 0
    assert math.isnan(skipped["sampler_diff"]) and math.isnan(skipped["sampler_diff_mean"])


def test_a_moes_router_loss_is_shared_by_the_tokens_the_update_trains():
    """A MoE's load-balancing loss is added per micro-batch, weighted by its share of the tokens. With
    flat groups skipped the shares must still sum to 1 over the trained tokens: counted over the whole
    batch they summed to the kept fraction, and the router loss shrank with it. Advantages 0 here, so
    the router loss is the whole gradient: skipping half the groups equals training the other half."""
    from grpo.config import TinyModelConfig
    from grpo.tiny.moe import build_tiny_moe
    from grpo.tiny.text import build_char_tokenizer
    from grpo.update import policy_update

    tok = build_char_tokenizer()
    model = build_tiny_moe(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    G = 2
    batch = make_batch(tok, seed=3, B=8, T=6, group=G)
    batch.advantages_B = torch.zeros(8)
    skip_P = torch.tensor([False, True, False, True])
    algo = OmegaConf.structured(AlgoConfig(batch_size=8, group_size=G, warmup_steps=0, router_aux_loss_coef=1.0))
    grads = []
    for b, skip in ((batch, skip_P), (batch.select((~skip_P).repeat_interleave(G)), None)):
        m = copy.deepcopy(model)
        algo.batch_size = b.size
        stats = policy_update(SingleStrategy(None, m, algo, total_steps=2), b, algo, 6, 1.0, skip_P=skip)
        grads.append(stats["grad_norm"])
    assert grads[0] > 0 and grads[0] == pytest.approx(grads[1], rel=1e-4)


def test_a_step_of_only_flat_groups_moves_the_weights_as_keep_does(tiny_lm):
    """zero_std_groups=drop skips an all-flat step's backward, so no parameter got a gradient and AdamW
    (which skips a grad of None) took no momentum step; keep's zero gradients did (weights 6.7e-3 apart
    after it, 2.2e-2 after the next step). The single strategy zero-fills, as DDP's ranks do."""
    from grpo.update import policy_update

    model, tok = tiny_lm
    G = 2
    informative = make_batch(tok, seed=3, B=8, T=6, group=G)
    flat = make_batch(tok, seed=4, B=8, T=6, group=G)
    flat.advantages_B = torch.zeros(8)
    algo = OmegaConf.structured(AlgoConfig(batch_size=8, group_size=G, warmup_steps=0, lr=1e-2, lr_schedule="constant"))
    weights = []
    for skip in (None, torch.ones(4, dtype=torch.bool)):
        m = copy.deepcopy(model)
        strategy = SingleStrategy(None, m, algo, total_steps=3)
        policy_update(strategy, informative, algo, 6, 1.0)
        before = [p.detach().clone() for p in m.parameters()]
        stats = policy_update(strategy, flat, algo, 6, 1.0, skip_P=skip)
        assert stats["grad_norm"] == 0.0
        assert max(float((p - q).abs().max()) for p, q in zip(m.parameters(), before)) > 1e-3  # momentum moved them
        weights.append([p.detach().clone() for p in m.parameters()])
    for kept, skipped in zip(*weights):
        torch.testing.assert_close(skipped, kept, atol=1e-6, rtol=1e-5)


def test_a_step_that_trains_no_token_logs_its_statistics_as_unknown_not_0(tiny_lm):
    """Every group flat and skipped: no forward ran, so sampler_diff, clip_frac, kl and entropy were not
    measured (0 read as perfect parity, no clipping, zero entropy), and a MoE's routing entropy 0 and
    aux loss 0 read as a collapsed router. Each is NaN; loss and grad_norm stay 0."""
    from grpo.config import TinyModelConfig
    from grpo.tiny.moe import build_tiny_moe
    from grpo.update import policy_update

    model, tok = tiny_lm
    moe = build_tiny_moe(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    G = 2
    batch = make_batch(tok, seed=3, B=8, T=6, group=G)
    batch.advantages_B = torch.zeros(8)
    algo = OmegaConf.structured(AlgoConfig(batch_size=8, group_size=G, warmup_steps=0))
    for m in (model, moe):
        stats = policy_update(SingleStrategy(None, copy.deepcopy(m), algo, total_steps=1), batch, algo, 6, 1.0,
                              skip_P=torch.ones(4, dtype=torch.bool))
        unknown = ["sampler_diff", "sampler_diff_mean", "sampler_kl", "clip_frac", "kl", "entropy"]
        if m is moe:
            unknown += ["moe/aux_loss", "moe/expert_load_max", "moe/routing_entropy"]
        assert all(math.isnan(stats[k]) for k in unknown), {k: stats[k] for k in unknown}
        assert stats["loss"] == 0.0 and stats["grad_norm"] == 0.0
        kept = policy_update(SingleStrategy(None, copy.deepcopy(m), algo, total_steps=1), batch, algo, 6, 1.0)
        assert all(math.isfinite(kept[k]) for k in unknown)
