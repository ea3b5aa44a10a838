"""Every experiment that runs on a CPU, run for one step with its own config (model, task, reward,
backend, strategy, LoRA), as lightning-hydra-template smoke-runs its experiments: a file that
composes but breaks at run time fails here. Only the step count, the held-out set and the
checkpoints are cut down. The GPU experiments are composed and validated in tests/test_config.py."""

import json
import os

import pytest

from grpo.train import train
from tests.test_config import EXPERIMENTS

CPU_EXPERIMENTS = {  # name -> pytest marks: the SmolLM2 ones convert a 135M model (slow tier)
    "addition_tiny": [],
    "addition_tiny_colocated": [],
    "addition_tiny_moe": [pytest.mark.slow],  # warm-starts the tiny MoE (~2.5 min); tests/test_moe_model.py runs it
    "addition_tiny_rm": [pytest.mark.slow],  # builds the full tiny RM (~2 min); the default tier runs it in test_reward_model.py
    "addition_smollm2_judge": [pytest.mark.slow],  # its judge server (SmolLM2-135M) is started below
    "guess_tiny": [],
    "shapes_tiny_vlm": [pytest.mark.slow],  # warm-starts the tiny VLM (~1.5 min); tests/test_vision.py runs it short
    "smollm2_arithmetic_cpu": [pytest.mark.slow],
    "smollm2_arithmetic_lora_cpu": [pytest.mark.slow],
}


def test_cpu_experiments_are_those_without_a_gpu():
    """Every experiment is either smoke-run here or needs a GPU by its own header."""
    from tests.conftest import ROOT

    for name in EXPERIMENTS:
        resources = next(line for line in (ROOT / "experiments" / f"{name}.yaml").read_text().splitlines() if "Resources:" in line)
        assert (name in CPU_EXPERIMENTS) == ("GPU" not in resources), (name, resources)


@pytest.fixture
def judge_url(request, tmp_path_factory, monkeypatch):
    """For an experiment scored by a judge: `grpo.serve` of SmolLM2-135M (its URL), as the experiment's
    header says to start it, on a port it finds free itself and guarded by a token the judge reads from
    its environment; None for the others."""
    if request.node.callspec.params["name"] != "addition_smollm2_judge":
        yield None
        return
    from grpo.auth import JUDGE_TOKEN_ENV
    from tests.conftest import serve_tiny, stop_served

    token = "experiment-judge-token"
    monkeypatch.setenv(JUDGE_TOKEN_ENV, token)
    proc, url = serve_tiny("smollm2-135m", tmp_path_factory.mktemp("judge") / "serve.log", token,
                           max_model_len=512, start_timeout_s=600)
    yield url
    stop_served(proc)


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, m in CPU_EXPERIMENTS.items()])
def test_cpu_experiment_runs_one_step(make_cfg, learning_policy, name, judge_url):
    judge = [f"reward.judge.urls=[{judge_url}]"] if judge_url else []
    size = [] if name == "guess_tiny" else ["task.eval_size=8"]  # guess evaluates its 15 secrets, no other size
    cfg = make_cfg(f"experiment={name}", "steps=1", *size, "checkpoint_every=0", "eval_every=0", *judge, fast=False)
    summary = train(cfg)
    assert summary["steps"] == 1 and 0 <= summary["eval_after"] <= 1
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    step = next(r for r in rows if "reward/mean" in r)
    assert step["step"] == 1 and step["completion_len"] > 0
