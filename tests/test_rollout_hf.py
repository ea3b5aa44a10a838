"""The hf backend: the batch contract, and parity of its sampler logprobs with the trainer's."""

import pytest
import torch

from grpo.rollout import Sampling
from grpo.rollout.hf import HFBackend, completion_budgets
from grpo.batch import collate
from grpo.update import score_tokens
from grpo.verify import TOLERANCES


def test_generate_contract_and_logprob_parity(tiny_lm):
    model, tok = tiny_lm
    backend = HFBackend(None, model, tok)
    # prompts of different lengths: left padding must not shift the trainer's positions
    prompts = [tok("1+2=").input_ids, tok("12+34=").input_ids, tok("7=").input_ids]
    out = backend.generate(prompts, n=4, sampling=Sampling(max_new_tokens=6, temperature=1.0))
    assert len(out.completion_ids) == len(out.logprobs) == len(out.finish_reasons) == 12
    assert out.weight_version == 0
    for ids, lps, reason in zip(out.completion_ids, out.logprobs, out.finish_reasons):
        assert len(ids) == len(lps) >= 1
        assert reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
        assert reason == "stop" or len(ids) == 6
    batch = collate([p for p in prompts for _ in range(4)], out, torch.zeros(12), tok.pad_token_id, False)
    trainer_BT = score_tokens(model, batch, temperature=1.0, max_tokens=10_000)
    diff = ((trainer_BT - batch.sampler_logprobs_BT).abs() * batch.mask_BT).max().item()
    print(f"hf sampler vs trainer logprob max |diff| = {diff:.2e}")
    assert diff < 1e-4


def test_greedy_is_deterministic_and_temperature_is_respected(tiny_lm):
    model, tok = tiny_lm
    backend = HFBackend(None, model, tok)
    prompts = [tok("3+4=").input_ids]
    a = backend.generate(prompts, 2, Sampling(max_new_tokens=5, temperature=0.0))
    b = backend.generate(prompts, 2, Sampling(max_new_tokens=5, temperature=0.0))
    assert a.completion_ids == b.completion_ids and a.completion_ids[0] == a.completion_ids[1]
    # at temperature 0.5 the sampler's logprobs are those of softmax(logits / 0.5)
    out = backend.generate(prompts, 4, Sampling(max_new_tokens=5, temperature=0.5))
    batch = collate(prompts * 4, out, torch.zeros(4), tok.pad_token_id, False)
    trainer_BT = score_tokens(model, batch, temperature=0.5, max_tokens=10_000)
    assert ((trainer_BT - batch.sampler_logprobs_BT).abs() * batch.mask_BT).max() < 1e-4


def test_sampled_logprobs_are_recorded_one_step_behind():
    """The recorder sees step t's scores, then the token drawn from them in step t + 1's input ids:
    by hand, scores [0, ln 3] give logprobs [ln 1/4, ln 3/4]."""
    import math

    from grpo.rollout.hf import SampledLogprobs

    rec = SampledLogprobs()
    scores = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    rec(torch.tensor([[0], [0]]), scores)  # step 0: nothing drawn yet
    rec(torch.tensor([[0, 1], [0, 0]]), scores.flip(-1))  # row 0 drew 1, row 1 drew 0
    lp = rec.logprobs(torch.tensor([[1, 1], [0, 1]]))  # step 1: row 0 drew 1, row 1 drew 1
    expected = torch.tensor([[math.log(0.75), math.log(0.25)], [math.log(0.25), math.log(0.25)]])
    torch.testing.assert_close(lp, expected)
    assert rec.last_BV.shape == (2, 2)  # one step's row, never the whole B x T x V


def test_bf16_generates_under_the_trainers_autocast(tiny_lm):
    """model.dtype=bfloat16 trains fp32 masters under bf16 autocast: the hf sampler does the same,
    so its logprobs are the autocast trainer's (the fp32 module alone gives others)."""
    from grpo.parallel.single import Autocast

    model, tok = tiny_lm
    prompts = [tok("12+34=").input_ids, tok("7+8=").input_ids]
    head_dtypes = set()  # what the LM head computed in while the sampler ran: the autocast's bf16, not fp32
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: head_dtypes.add(out.dtype))
    try:
        out = HFBackend(None, model, tok, dtype="bfloat16").generate(prompts, 4, Sampling(max_new_tokens=5, temperature=1.0))
    finally:
        hook.remove()
    assert head_dtypes == {torch.bfloat16}
    # Parity within what bf16 rounding gives (grpo.verify's bound), not a kernel set's own agreement: the
    # KV-cache decode and the trainer's full forward take other bf16 kernels, equal to 5e-7 under AVX-512
    # and 2.1e-3 apart under ATEN_CPU_CAPABILITY=avx2 (where fp32 scoring is 3.6e-3 away: too close to
    # tell apart by value, hence the dtype check above).
    batch = collate([p for p in prompts for _ in range(4)], out, torch.zeros(8), tok.pad_token_id, False)
    bf16_BT = score_tokens(Autocast(model, torch.bfloat16), batch, temperature=1.0, max_tokens=10_000)
    mask = batch.mask_BT.bool()
    assert (bf16_BT - batch.sampler_logprobs_BT)[mask].abs().max() < TOLERANCES["bfloat16"][0]


def test_update_weights_sets_version_without_touching_buckets(tiny_lm):
    model, tok = tiny_lm
    backend = HFBackend(None, model, tok)

    def never():
        raise AssertionError("the hf backend shares the module and must not gather weights")
        yield

    backend.update_weights(never(), version=7)
    out = backend.generate([tok("1=").input_ids], 1, Sampling(max_new_tokens=2))
    assert out.weight_version == 7


def test_collate_masks_truncated_completions(tiny_lm):
    from grpo.rollout.base import Rollouts

    _, tok = tiny_lm
    r = Rollouts([[5, 6, 2], [7, 8, 9]], [[-1.0] * 3, [-1.0] * 3], ["stop", "length"], 0)
    kept = collate([[1, 4], [1]], r, torch.zeros(2), tok.pad_token_id, mask_truncated=False)
    dropped = collate([[1, 4], [1]], r, torch.zeros(2), tok.pad_token_id, mask_truncated=True)
    assert kept.mask_BT.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert dropped.mask_BT.tolist() == [[1, 1, 1], [0, 0, 0]]
    # second prompt is left-padded by one: positions 0.. start at its first real token
    assert kept.position_ids_BL[1].tolist()[1:] == [0, 1, 2, 3]
    assert kept.input_ids_BL[1, 0].item() == tok.pad_token_id


def test_shared_prefill_samples_what_the_plain_prefill_does(tiny_lm, monkeypatch):
    """Each prompt's forward once, its cache repeated for its n samples: the same tokens and
    logprobs as n prefills of it, under the same seed (prompts of unequal lengths, left-padded)."""
    import grpo.rollout.hf as hf

    model, tok = tiny_lm
    backend = HFBackend(None, model, tok)
    prompts = [tok("1+2=").input_ids, tok("12+34=").input_ids, tok("7=").input_ids]
    calls = []
    shared = hf.shared_prefill
    monkeypatch.setattr(hf, "shared_prefill", lambda *a: calls.append(a[1].shape) or shared(*a))
    torch.manual_seed(0)
    once = backend.generate(prompts, n=4, sampling=Sampling(max_new_tokens=6, temperature=1.0))
    assert calls == [torch.Size([3, 7])]  # three prompts, not twelve rows (7: the widest prompt)
    monkeypatch.setattr(hf, "shared_prefill", lambda *a: None)
    torch.manual_seed(0)
    each = backend.generate(prompts, n=4, sampling=Sampling(max_new_tokens=6, temperature=1.0))
    assert once.completion_ids == each.completion_ids and len(set(map(tuple, once.completion_ids))) > 3
    for a, b in zip(once.logprobs, each.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_collate_keeps_rewardless_completions_out_of_the_loss_normalisers(tiny_lm):
    """A 4-trajectory group, one ended in an environment error (reward None -> NaN): advantage 0 alone
    left its 3 tokens in num_tokens and its sequence in num_seqs (diluting every token's weight by the
    error fraction, and adding KL). With mask_truncated, an episode that ran out of budget between
    turns ("length", out_of_budget) was not cut and keeps its tokens; one cut mid-turn does not."""
    from grpo.rollout.base import Rollouts
    from grpo.rollout.episodes import Episode
    from grpo.train import withhold_errored
    from grpo.update import loss_norm

    _, tok = tiny_lm
    finish = ["stop", "error", "length", "length"]
    episodes = [Episode(finish=f, out_of_budget=(i == 2)) for i, f in enumerate(finish)]
    r = Rollouts([[5, 6, 2]] * 4, [[-1.0] * 3] * 4, finish, 0, episodes=episodes)
    rewards_FB = [[1.0, 1.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]
    withhold_errored(rewards_FB, finish)
    assert [row[1] for row in rewards_FB] == [None, None]
    rewards_B = torch.tensor([float("nan") if any(row[i] is None for row in rewards_FB) else 1.0 for i in range(4)])
    batch = collate([[1, 4]] * 4, r, torch.zeros(4), tok.pad_token_id, mask_truncated=True,
                    excluded_B=torch.isnan(rewards_B))
    assert batch.mask_BT.tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]]
    norm = loss_norm(batch, max_len=3, gen_tokens_per_step=6.0)
    assert (norm.num_seqs, norm.num_tokens) == (2, 6)
    # an episode the turn cap ended was not cut either: only "length" is (truncated_frac, the mask)
    capped = Rollouts([[5, 6, 2]] * 3, [[-1.0] * 3] * 3, ["turns", "error", "length"], 0,
                      episodes=[Episode(finish=f) for f in ("turns", "error", "length")])
    assert capped.cut() == [False, False, True]


def test_a_rank_with_no_prompts_generates_nothing(tiny_lm):
    """Evaluation with task.eval_size below the world size leaves some rank no prompts (task.eval[rank::world]):
    it gets empty rollouts, not max() of an empty list (REVIEW finding 21)."""
    model, tok = tiny_lm
    out = HFBackend(None, model, tok).generate([], 4, Sampling(max_new_tokens=3))
    assert (out.completion_ids, out.logprobs, out.finish_reasons) == ([], [], [])


def test_completions_stop_at_the_models_context_and_say_length(tiny_lm):
    """vLLM stops a sequence at max_model_len and marks it 'length'; transformers generated on past the
    tiny model's 256 positions. A 252-token prompt leaves 4 of them: its rows are cut there, the short
    prompt's keep rollout.max_new_tokens (12)."""
    model, tok = tiny_lm
    assert model.config.max_position_embeddings == 256
    long, short = tok("12+" * 83 + "1=").input_ids, tok("7=").input_ids
    assert (len(long), len(short)) == (252, 3)
    assert completion_budgets([252, 3], 12, 256) == [4, 12] and completion_budgets([252], 12, None) == [12]
    torch.manual_seed(0)
    out = HFBackend(None, model, tok).generate([long, short], 4, Sampling(max_new_tokens=12, temperature=1.0))
    for i, (ids, reason) in enumerate(zip(out.completion_ids, out.finish_reasons)):
        budget = 4 if i < 4 else 12
        assert len(out.logprobs[i]) == len(ids) <= budget
        assert (reason, len(ids)) == (("stop", len(ids)) if ids[-1] == tok.eos_token_id else ("length", budget))
    assert [len(c) for c in out.completion_ids[:4]] == [4, 4, 4, 4]  # no EOS in 4 draws here: 252 + 4 = 256
    with pytest.raises(ValueError, match="a prompt of 256 tokens leaves no room for a completion in the model's context "
                                         "of 256 tokens"):
        completion_budgets([3, 256], 12, 256)
