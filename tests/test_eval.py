"""Evaluation: the pass@k estimator by hand, `python -m grpo.eval`, and in-loop evaluation."""

import json
import os
import subprocess
import sys

import pytest

from grpo.eval import pass_at_k
from grpo.train import train
from tests.conftest import ROOT


def test_pass_at_k_by_hand():
    # n=4, c=1: pass@1 = 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0


@pytest.mark.starts_process
def test_cli_writes_eval_json(tmp_path, cache_dir):
    cmd = [sys.executable, "-m", "grpo.eval", "eval_samples=4", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.load(open(tmp_path / "eval.json"))
    assert set(result) >= {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@4"}
    assert result["eval_size"] == 256 and "eval/accuracy" in out.stdout
    # the CLI's greedy accuracy is the model's: the same folder scored by a second path, transformers'
    # plain generate and an exact string match (grpo.tiny.text.greedy_accuracy, the warm start's)
    from grpo.models import load_model
    from grpo.tiny.text import greedy_accuracy
    from grpo.tasks import build_task
    from tests.conftest import compose_cfg

    cfg = compose_cfg(cache=cache_dir)
    model, tok = load_model(result["model_path"])
    expected = greedy_accuracy(model, tok, build_task(cfg.task).eval, cfg.rollout.max_new_tokens)
    assert result["eval/accuracy"] == pytest.approx(expected, abs=1e-9), (result, expected)
    assert 0 < expected < 1  # a warm-started policy: some right, some wrong, so a scoring bug would show


@pytest.mark.starts_process
def test_in_loop_evaluation_goes_to_metrics(make_cfg):
    cfg = make_cfg("steps=4", "eval_every=2", "eval_samples=2")
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all("eval/pass@2" in r for r in evals)
