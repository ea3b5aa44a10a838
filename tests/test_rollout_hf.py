"""The hf backend: the batch contract, and parity of its sampler logprobs with the trainer's."""

import torch

from grpo.rollout import Sampling
from grpo.rollout.hf import HFBackend
from grpo.update import collate, score_tokens


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
