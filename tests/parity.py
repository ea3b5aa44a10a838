"""Shared check for every engine backend: sampler vs trainer logprobs before and after a sync, and
greedy generations that change once the new weights arrive."""

import torch

from grpo.weights import group_by_size
from grpo.rollout import Sampling
from grpo.batch import collate
from grpo.update import score_tokens
from grpo.guards import parity
from tests.conftest import measured

# fp32, max |sampler - trainer| logprob over all sampled tokens: on the CPU tighter than the doctor's
# 1e-3 (measured 5e-6); with a GPU the engine is vLLM's CUDA build, whose fp32 attention is TF32: the
# bound the doctor and the `gpu` tier use (grpo.guards.parity)
PARITY_TOL = parity("float32", "cuda").bound if torch.cuda.is_available() else 1e-4


def max_logprob_diff(backend, model, tok, prompts, n=4, seed=1) -> tuple[float, object]:
    out = backend.generate(prompts, n, Sampling(max_new_tokens=6, temperature=1.0, seed=seed))
    batch = collate([p for p in prompts for _ in range(n)], out, torch.zeros(len(prompts) * n), tok.pad_token_id, False)
    trainer_BT = score_tokens(model, batch, temperature=1.0, max_tokens=100_000)
    return ((trainer_BT - batch.sampler_logprobs_BT).abs() * batch.mask_BT).max().item(), out


def sync_round_trip(backend, model, tok, noise: float = 0.2, bucket_bytes: int = 256 * 1024) -> dict:
    """Parity before, perturb the trainer's weights, sync in buckets, parity after."""
    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids, tok("99+99=").input_ids]
    before, out = max_logprob_diff(backend, model, tok, prompts)
    assert len(out.completion_ids) == 12 and out.weight_version == 0
    for ids, lps, reason in zip(out.completion_ids, out.logprobs, out.finish_reasons):
        assert len(ids) == len(lps) >= 1
        assert reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    old = backend.generate(prompts, 1, greedy).completion_ids
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    named = ((n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False))
    backend.update_weights(group_by_size(named, bucket_bytes), version=1)
    new = backend.generate(prompts, 1, greedy).completion_ids
    after, out = max_logprob_diff(backend, model, tok, prompts)
    return {"before": before, "after": after, "changed": new != old, "version": out.weight_version}


def lora_round_trip(backend, model, tok, noise: float = 0.2, bucket_bytes: int = 256 * 1024) -> dict:
    """As sync_round_trip for a LoRA policy (a peft model): only the adapter is perturbed and only
    the adapter is synced, in peft's saved names; the engine keeps its base weights."""
    from grpo import lora

    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids, tok("99+99=").input_ids]
    before, out = max_logprob_diff(backend, model, tok, prompts)
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    old = backend.generate(prompts, 1, greedy).completion_ids
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for _, p in lora.adapter_parameters(model):
            p.add_(noise * torch.randn(p.shape, generator=g))
    adapter = ((n, p.detach()) for n, p in lora.adapter_parameters(model))
    backend.update_weights(group_by_size(adapter, bucket_bytes), version=1)
    new = backend.generate(prompts, 1, greedy).completion_ids
    after, out = max_logprob_diff(backend, model, tok, prompts)
    return {"before": before, "after": after, "changed": new != old, "version": out.weight_version}


def assert_round_trip(result: dict, name: str) -> None:
    print(f"{name} parity: max |sampler - trainer| logprob = {result['before']:.2e} before, {result['after']:.2e} after sync")
    assert result["before"] < PARITY_TOL and result["after"] < PARITY_TOL, result
    assert result["changed"], "generations did not change: the weights did not arrive"
    assert result["version"] == 1


class EndsAtTurnOne:
    """An environment that ends every episode after the first turn."""

    def reset(self, sample, seed):
        return None

    def step(self, action):
        from grpo.envs import Step

        return Step(None, 0.0, True)

    def close(self):
        pass


def assert_turn_one_is_generate(backend, tok) -> None:
    """Episodes that end at turn 1 are exactly `generate`'s ids, logprobs and finish reasons (same
    seed), every token in the loss (mask 1): the driver adds nothing to a single-turn batch."""
    from grpo.rollout.episodes import Budget, EpisodeRunner
    from grpo.rollout.render import RawRender
    from grpo.tasks.base import Sample

    texts = ["12+34=", "7+1=", "99+99="]
    prompts, samples = [tok(t).input_ids for t in texts], [Sample(t, "0") for t in texts]
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=77)
    plain = backend.generate(prompts, 2, sampling)
    runner = EpisodeRunner(EndsAtTurnOne, tok, RawRender(tok), Budget(4, 6, 64, 8, backend.max_context), 5.0,
                           [tok.eos_token_id])
    one = backend.submit_episodes(prompts, samples, 2, sampling, runner).result()
    assert one.completion_ids == plain.completion_ids
    assert one.logprobs == plain.logprobs
    assert one.finish_reasons == plain.finish_reasons and one.weight_version == plain.weight_version
    assert one.loss_masks == [[1] * len(ids) for ids in plain.completion_ids]
    assert [e.turns for e in one.episodes] == [1] * 6


def assert_guess_run_scores_the_samplers_tokens(run_dir) -> None:
    """A 3-step experiment=guess_tiny run: weights synced every step, the trainer scoring the engine's
    tokens across turns (sampler_diff within the doctor's fp32 bound, 1e-3 on CPU, with observations in the
    sequence), several turns."""
    import json
    import os

    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    assert [r["weight_version"] for r in trained] == [0, 1, 2]
    bound = parity("float32", "cuda" if torch.cuda.is_available() else "cpu").bound
    assert all(d <= bound for d in measured(trained)), [r["sampler_diff"] for r in trained]
    assert max(r["episode/turns_max"] for r in trained) > 1
