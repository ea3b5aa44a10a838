"""`grpo.export.export_hf`: the exported folder is the policy's, down to its generation_config.json."""

import json

from omegaconf import OmegaConf
from transformers import GenerationConfig

from grpo.config import AlgoConfig, ParallelConfig, TinyModelConfig
from grpo.export import export_hf
from grpo.models import load_model
from grpo.parallel.single import SingleStrategy
from grpo.rollout.hf import base_model, stop_token_ids
from grpo.tiny.text import build_char_tokenizer, build_tiny_model


def test_the_export_keeps_the_folders_generation_config(tmp_path):
    """A folder whose generation_config.json lists a second EOS (as Qwen2.5-Instruct's does): the export
    keeps it, so an engine or rollout=hf on the exported folder stops where the policy did (from_config's
    own, from config.json alone, kept one EOS: [2] where the policy stopped on [2, 7])."""
    tok = build_char_tokenizer()
    source = tmp_path / "source"
    build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id).save_pretrained(source)
    tok.save_pretrained(source)
    GenerationConfig(eos_token_id=[tok.eos_token_id, 7], bos_token_id=tok.bos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(source)
    model, tokenizer = load_model(str(source))
    strategy = SingleStrategy(OmegaConf.structured(ParallelConfig()), model, OmegaConf.structured(AlgoConfig()), total_steps=1)
    out = export_hf(strategy, tokenizer, str(tmp_path / "model"))
    assert json.load(open(f"{out}/generation_config.json"))["eos_token_id"] == [tok.eos_token_id, 7]
    exported, exported_tok = load_model(out)
    assert stop_token_ids(exported_tok.eos_token_id, base_model(exported).generation_config) == [tok.eos_token_id, 7]
