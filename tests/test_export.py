"""`grpo.export.export_hf`: the exported folder is the policy's, down to its generation_config.json."""

import copy
import json
import os
import shutil

import pytest
from omegaconf import OmegaConf
from transformers import GenerationConfig

from grpo.config import AlgoConfig, ParallelConfig, TinyModelConfig
from grpo.export import export_hf, exported_step
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


class Drops(SingleStrategy):
    """A strategy whose export buckets leave out the final norm's weight and add a name the model lacks."""

    def __init__(self, *args, drop: bool, extra: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.drop, self.extra = drop, extra

    def export_buckets(self, bucket_bytes):
        for bucket in super().export_buckets(bucket_bytes):
            bucket = [(name, t) for name, t in bucket if not (self.drop and name == "model.norm.weight")]
            yield bucket + ([("model.extra.weight", bucket[0][1])] if self.extra and bucket else [])


def test_an_export_whose_weights_do_not_fit_the_model_is_refused_and_leaves_no_folder(tmp_path):
    """A weight missing from the buckets would be saved as from_config's random init, a name the model
    lacks would be dropped: both raise, naming the weight, and write no model folder."""
    import pytest

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    for drop, extra, message in [(True, False, r"missing \['model.norm.weight'\], unexpected \[\]"),
                                 (False, True, r"missing \[\], unexpected \['model.extra.weight'\]")]:
        strategy = Drops(OmegaConf.structured(ParallelConfig()), model, OmegaConf.structured(AlgoConfig()), total_steps=1,
                         drop=drop, extra=extra)
        with pytest.raises(RuntimeError, match=message):
            export_hf(strategy, tok, str(tmp_path / "model"))
        assert not (tmp_path / "model").exists()


def test_exported_step_is_none_where_the_record_is_missing_torn_or_without_a_step(tmp_path):
    from grpo.export import EXPORTED, exported_step

    assert exported_step(str(tmp_path)) is None  # no record (an export from before it existed)
    for text, step in [('{"step": 3}', 3), ("{}", None), ('{"step": ', None)]:
        (tmp_path / EXPORTED).write_text(text)
        assert exported_step(str(tmp_path)) == step, text


def test_a_kill_while_replacing_an_earlier_export_never_leaves_half_a_model_under_its_name(tmp_path, tiny_lm, monkeypatch):
    """The earlier model/ was removed in place (rmtree) before the new one was renamed in: a kill during the
    removal (a scancel while a finished run exports on its next start) left config.json and grpo_export.json
    without model.safetensors under the final name, which transformers and vLLM cannot load."""
    model, tok = tiny_lm
    strategy = SingleStrategy(None, copy.deepcopy(model), OmegaConf.structured(AlgoConfig()), total_steps=10)
    folder = tmp_path / "model"
    export_hf(strategy, tok, str(folder), step=2)
    real = shutil.rmtree

    def killed_half_way(path, *args, **kwargs):  # whichever folder is being removed, the kill comes half way
        files = sorted(os.listdir(path))
        os.remove(os.path.join(path, files[len(files) // 2]))
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(shutil, "rmtree", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        export_hf(strategy, tok, str(folder), step=4)
    monkeypatch.setattr(shutil, "rmtree", real)
    assert exported_step(str(folder)) == 4 and "model.safetensors" in os.listdir(folder)
