"""Evaluation: the pass@k estimator by hand, `python -m grpo.eval`, and in-loop evaluation."""

import json
import os
import subprocess
import sys

import pytest

from grpo.dist import DistInfo
from grpo.eval import evaluate, pass_at_k
from grpo.rollout.base import RolloutBackend, Rollouts
from grpo.tasks.base import Sample, Task
from grpo.train import train
from tests.conftest import ROOT, compose_cfg


def test_pass_at_k_by_hand():
    # n=4, c=1: pass@1 = 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0


class Scripted(RolloutBackend):
    """An in-process backend whose completions are written in the test, keyed by the prompt's text: the
    greedy turn (temperature 0) says `greedy[prompt]`, the n sampled ones `sampled[prompt][:n]` in order.
    Records each request (prompts, n, temperature)."""

    def __init__(self, tok, greedy=None, sampled=None, policy=None, episodes=None):
        self.tok, self.greedy, self.sampled, self.policy, self.episodes = tok, greedy, sampled, policy, episodes
        self.requests = []

    def generate(self, prompt_ids, n, sampling):
        keys = [self.tok.decode(p, skip_special_tokens=True) for p in prompt_ids]
        self.requests.append((keys, n, sampling.temperature))
        if self.policy is not None:  # a turn of an episode: what the policy says after the prompt so far
            texts = [self.policy(p) for p in prompt_ids for _ in range(n)]
        else:
            texts = [t for k in keys for t in ([self.greedy[k]] * n if sampling.temperature == 0 else self.sampled[k][:n])]
        ids = [self.tok(t, add_special_tokens=False).input_ids + [self.tok.eos_token_id] for t in texts]
        return Rollouts(ids, [[-0.5] * len(i) for i in ids], ["stop"] * len(ids), 0)

    def update_weights(self, buckets, version):
        pass


SUMS = [Sample("1+1=", "2"), Sample("2+2=", "4"), Sample("3+3=", "6")]


def test_evaluate_scores_greedy_accuracy_and_pass_at_k_by_hand(tiny_lm):
    """Greedy says 2 (right), 5 (wrong), 6 (right): accuracy 2/3, from a temperature-0 request. The 4
    samples per prompt hold c = 1, 2, 0 right ones, each prompt's samples in a row: pass@1 = (1/4 + 2/4 + 0)/3
    = 1/4; pass@2 = ((1 - C(3,2)/C(4,2)) + (1 - C(2,2)/C(4,2)) + 0)/3 = (1/2 + 5/6)/3 = 4/9; pass@4 = 2/3.
    Every sample's first answer is wrong, so a greedy pass that sampled scores 0."""
    _, tok = tiny_lm
    backend = Scripted(tok, greedy={"1+1=": "2", "2+2=": "5", "3+3=": "6"},
                       sampled={"1+1=": ["3", "2", "3", "3"], "2+2=": ["0", "4", "4", "0"], "3+3=": ["0", "0", "0", "0"]})
    cfg = compose_cfg("eval_samples=4", "rollout.temperature=0.7")
    metrics = evaluate(backend, tok, Task("sums", SUMS, SUMS, chat_template="never"), cfg, DistInfo())
    assert metrics == pytest.approx({"eval/accuracy": 2 / 3, "eval/pass@1": 1 / 4, "eval/pass@2": 4 / 9, "eval/pass@4": 2 / 3})
    assert backend.requests == [(["1+1=", "2+2=", "3+3="], 1, 0.0), (["1+1=", "2+2=", "3+3="], 4, 0.7)]


def test_a_completion_math_verify_cannot_judge_in_time_counts_wrong_and_is_counted(tiny_lm, monkeypatch):
    """A completion whose answer math-verify cannot read within its time (here 1 s; this 800-term sum takes
    about 14 s) twice is counted wrong and counted, with a warning: it was read as no answer, wrong with
    nothing said. Greedy: 2 (right), the sum, 6 (right): accuracy 2/3. The 2 samples a prompt hold c = 1, 1
    (its sum uncounted), 0 right ones: pass@1 = (1/2 + 1/2 + 0)/3 = 1/3, pass@2 = 2/3; 2 unjudged."""
    from grpo.rewards import math_answer

    monkeypatch.setattr(math_answer, "TIMEOUT_S", 1)
    _, tok = tiny_lm
    long = "\\boxed{" + "+".join(f"x_{{{i}}}^{{{i}}}" for i in range(800)) + "}"
    backend = Scripted(tok, greedy={"1+1=": "2", "2+2=": long, "3+3=": "6"},
                       sampled={"1+1=": ["2", "3"], "2+2=": ["4", long], "3+3=": ["0", "0"]})
    task = Task("sums", SUMS, SUMS, chat_template="never",
                is_correct=lambda completion, s: math_answer.is_equivalent(completion, s.answer))
    with pytest.warns(UserWarning, match=r"2 eval completions could not be judged and were counted wrong, so "
                      r"eval/accuracy \(and pass@k\) is a lower bound; math-verify ran out of its 1 s twice (reading|comparing)"):
        metrics = evaluate(backend, tok, task, compose_cfg("eval_samples=2", "rollout.temperature=0.7"), DistInfo())
    assert metrics == pytest.approx({"eval/accuracy": 2 / 3, "eval/unjudged": 2, "eval/pass@1": 1 / 3, "eval/pass@2": 2 / 3})


def test_each_rank_evaluates_its_own_share_of_the_prompts(tiny_lm):
    """Rank 1 of 2 plays prompts 1, 3, ... of the held-out split (here the second of three), rank 0 the others:
    a rank that played from its index on would count prompt 3 twice across the ranks."""
    _, tok = tiny_lm
    backend = Scripted(tok, greedy={"1+1=": "2", "2+2=": "4", "3+3=": "0"})
    cfg = compose_cfg("eval_samples=1")
    task = Task("sums", SUMS, SUMS, chat_template="never")
    assert evaluate(backend, tok, task, cfg, DistInfo(rank=1, world_size=2)) == {"eval/accuracy": 1.0}
    assert evaluate(backend, tok, task, cfg, DistInfo(rank=0, world_size=2)) == {"eval/accuracy": 0.5}
    assert [keys for keys, _, _ in backend.requests] == [["2+2="], ["1+1=", "3+3="]]



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
