"""reward=rm: score normalisation against numbers worked by hand, batching by tokens, the tiny reward
model telling correct sums from wrong ones, and a short run on its score alone."""

import copy
import json
import math
import os
import threading
import time

import pytest
import torch

import grpo.train
from grpo.errors import ConfigError
from grpo.parallel import sequence
from grpo.rewards import score
from grpo.rewards.reward_model import RewardModel, ScoreNormaliser, load_reward_model, token_batches
from grpo.tasks import Sample, build_task
from tests.conftest import compose_cfg

RM_STEPS = "reward.rm.tiny.steps=60"  # the default tier's tiny RM: 60 steps (~20 s); the full recipe's 400 in the slow tier


def test_running_normalisation_by_hand():
    norm = ScoreNormaliser("running")
    # one score: its own mean, std 0 -> only centred
    assert norm([5.0]) == [0.0]
    norm = ScoreNormaliser("running")
    # [1, 2, 3]: mean 2, population variance (1 + 0 + 1) / 3 = 2/3, std 0.8165 -> -1.2247, 0, 1.2247
    assert norm([1.0, 2.0, 3.0]) == pytest.approx([-1 / math.sqrt(2 / 3), 0.0, 1 / math.sqrt(2 / 3)])
    # then [6]: the stats of all four, [1, 2, 3, 6]: mean 3, variance (4 + 1 + 0 + 9) / 4 = 3.5 -> (6 - 3) / 1.8708 = 1.6036
    assert norm([6.0]) == pytest.approx([3 / math.sqrt(3.5)])
    assert (norm.count, norm.mean, norm.std) == (4, pytest.approx(3.0), pytest.approx(math.sqrt(3.5)))


def test_fixed_and_no_normalisation():
    # (score - offset) / scale with offset 2, scale 4: 6 -> 1, -2 -> -1, 2 -> 0
    assert ScoreNormaliser("fixed", offset=2.0, scale=4.0)([6.0, -2.0, 2.0]) == [1.0, -1.0, 0.0]
    assert ScoreNormaliser("none")([6.0, -2.0]) == [6.0, -2.0]


def test_a_text_without_a_score_stays_none_and_counts_in_no_statistic():
    # running over the scored [1, 3] only: mean 2, std 1 -> -1, 1; None stays None
    assert ScoreNormaliser("running")([1.0, None, 3.0]) == [-1.0, None, 1.0]
    assert ScoreNormaliser("fixed", offset=1.0, scale=2.0)([None, 5.0]) == [None, 2.0]
    # a NaN or inf score (a forward that overflowed) counts in no statistic: one NaN made the running
    # mean NaN for the rest of the run (and its checkpoints); it comes back as it was, and
    # grpo.rewards fails its completion
    running = ScoreNormaliser("running")
    out = running([1.0, math.nan, 3.0, math.inf])
    assert out[0] == -1.0 and math.isnan(out[1]) and out[2] == 1.0 and out[3] == math.inf
    assert running.state_dict() == {"count": 2, "mean": 2.0, "m2": 2.0}
    assert running([2.0], update=False) == [0.0]


def test_token_batches_by_hand():
    # lengths 3, 10, 4, 7 under a cap of 14 padded tokens, longest first: 10 alone (2 x 10 > 14);
    # 7 and 4 (2 x 7 = 14); 3 would make 3 x 7 = 21, so alone
    assert token_batches([3, 10, 4, 7], 14) == [[1], [3, 2], [0]]
    assert token_batches([3, 10, 4, 7], 1) == [[1], [3], [2], [0]]  # a text past the cap goes alone
    assert token_batches([3, 10, 4, 7], 10_000) == [[1, 3, 2, 0]]


def test_scores_are_the_same_whatever_the_cap(random_rm):
    """Each text scored alone (no padding) is the reference; batched under any cap, in any order of
    lengths, every text keeps its own score (the batch's order restored, padding on the right)."""
    model, tok = random_rm
    texts = ["07+45=052", "1+1=2", "99+99=198 and more", "3", "12+34=046", "a much longer text than the others"]
    with torch.no_grad():
        alone = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    assert len(set(round(a, 4) for a in alone)) == len(texts)  # precondition: a mix-up would show
    for cap in (1, 40, 100, 10_000):
        assert RewardModel(model, tok, max_tokens=cap).scores(texts) == pytest.approx(alone, abs=1e-5), cap


def test_the_reward_reads_prompt_and_completion(random_rm):
    model, tok = random_rm
    rm = RewardModel(model, tok, max_tokens=64, normaliser=ScoreNormaliser("fixed", offset=1.0, scale=2.0))
    samples = [Sample(prompt="07+45=", answer="052"), Sample(prompt="10+10=", answer="020")]
    raw = rm.scores(["07+45=052", "10+10=021"])
    assert rm(["052", "021"], samples, completion_ids=[[1], [2]]) == pytest.approx([(r - 1.0) / 2.0 for r in raw])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reward=rm"], "reward `rm` needs reward.rm.path"),
        (["reward=rm", "reward.rm.path=tiny_rm", "task=arithmetic"], "reward.rm.path=tiny_rm is trained on the addition task"),
        (["reward=rm", "reward.rm.path=/no/such/folder"], "reward.rm.path='/no/such/folder' is neither tiny_rm"),
        (["reward=rm", "reward.rm.path=tiny_rm", "reward.rm.normalise=zscore"], "reward.rm.normalise='zscore' is not one of"),
        (["reward=rm", "reward.rm.path=tiny_rm", "reward.rm.normalise=fixed", "reward.rm.scale=0"], "give a scale other than 0"),
        (["reward=rm", "reward.rm.path=tiny_rm", "reward.rm.max_tokens=0"], "reward.rm.max_tokens=0 must be >= 1"),
        (["reward=rm", "reward.rm.path=tiny_rm", "reward.rm.urls=[node7:8001]"], "reward.rm.urls: 'node7:8001' is not an http(s)://host:port URL; write http://node7:8001"),
        (["reward=rm", "reward.rm.path=tiny_rm", "reward.rm.urls=[http://node7:99999]"], "reward.rm.urls: 'http://node7:99999' is not"),
        (["reward=rm", "reward.rm.path=tiny_rm", "reward.rm.urls=[http://node7:8001]", "reward.rm.request_timeout_s=0"],
         "reward.rm.request_timeout_s=0.0 must be > 0"),
        (["reward=rm", "reward.rm.path=tiny_rm", "reward.rm.timeout_s_per_1k_tokens=0"],
         "reward.rm.timeout_s_per_1k_tokens=0.0 must be > 0, or null"),
        (["reward=rm", "reward.rm.path=tiny_rm", "reward.rm.urls=[http://node7:8001]", "reward.rm.token_file=/no/such/token"],
         "reward.rm.token_file: token file /no/such/token cannot be read"),
    ],
)
def test_validate_says_what_to_set(overrides, message):
    from grpo.config import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(*overrides))
    assert message in str(e.value)


@pytest.fixture(scope="session")
def tiny_rm(cache_dir, learning_policy):
    """The tiny reward model of the default tier (60 steps), built once in the session's cache."""
    from grpo.tiny.rm import ensure_tiny_rm

    cfg = compose_cfg("experiment=addition_tiny_rm", RM_STEPS, cache=cache_dir)
    return ensure_tiny_rm(cfg, build_task(cfg.task))


def test_tiny_rm_scores_correct_sums_above_wrong_ones(tiny_rm):
    """Loaded as the reward loads it, on held-out prompts it never saw: correct sums above wrong answers
    (near misses, one digit changed, any number, wrong forms) in >= 75% of pairs (60 steps: 0.81)."""
    from grpo.rewards.reward_model import load_reward_model
    from grpo.tiny.rm import pairwise_accuracy
    from grpo.tasks import build_task

    rm = RewardModel(*load_reward_model(tiny_rm, "float32"), max_tokens=4096)
    task = build_task(compose_cfg().task)
    accuracy = pairwise_accuracy(rm.scores, task.eval)
    assert accuracy >= 0.75, accuracy
    assert json.load(open(os.path.join(tiny_rm, "grpo_tiny_rm.json")))["heldout_pairwise_accuracy"] == pytest.approx(accuracy, abs=0.01)


@pytest.mark.starts_process
def test_a_run_on_the_rm_score_logs_it_and_loads_the_model_once(make_cfg, tiny_rm, monkeypatch):
    import grpo.rewards.rm as reward_model  # where build looks load_reward_model up
    from grpo.train import train

    loads = []
    real_load = reward_model.load_reward_model
    monkeypatch.setattr(reward_model, "load_reward_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    cfg = make_cfg("experiment=addition_tiny_rm", RM_STEPS)
    assert cfg.rollout.backend == "hf" and [f.name for f in cfg.reward.funcs] == ["rm"]
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # the only reward: its mean is the step's
        assert math.isfinite(r["reward/rm"]) and r["reward/rm"] == pytest.approx(r["reward/mean"], abs=1e-5)
    assert len(loads) == 1 and loads[0][0] == tiny_rm  # built once, for every step and both evaluations


@pytest.mark.slow
def test_the_full_tiny_rm_and_the_learning_bar(tmp_path, cache_dir, learning_policy):
    """experiment=addition_tiny_rm: the full tiny RM (400 steps) ranks held-out correct sums above wrong
    ones and first among every possible sum most of the time; GRPO on its score alone raises held-out
    exact-match accuracy by >= 0.20."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    cmd = [sys.executable, "-m", "grpo.train", "experiment=addition_tiny_rm", f"hydra.run.dir={tmp_path}",
           f"model.cache_dir={cache_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    from grpo.tiny.rm import ensure_tiny_rm

    cfg = compose_cfg("experiment=addition_tiny_rm", cache=cache_dir)
    info = json.load(open(os.path.join(ensure_tiny_rm(cfg, build_task(cfg.task)),
                                       "grpo_tiny_rm.json")))
    assert info["heldout_pairwise_accuracy"] >= 0.95 and info["heldout_top1_accuracy"] >= 0.5, info
    summary = json.load(open(tmp_path / "summary.json"))
    print(summary, info)
    assert summary["eval_after"] - summary["eval_before"] >= 0.20


def sums(n: int) -> tuple[list[str], list[Sample]]:
    """n completions of distinct sums and their samples."""
    return [f"{i:03d}" for i in range(n)], [Sample(prompt=f"{i}+0=", answer=f"{i:03d}") for i in range(n)]


def test_a_slow_reward_model_runs_in_the_callers_thread_and_counts_each_score_once(random_rm):
    """A forward slower than reward.timeout_s: the model is not abandoned on a thread and retried one
    completion at a time (orphans kept running on the device, the running statistics counted twice);
    score() returns with no thread left behind, every completion scored once."""
    model, tok = random_rm
    rm = RewardModel(model, tok, max_tokens=4096, normaliser=ScoreNormaliser("running"))
    completions, samples = sums(4)
    hook = model.register_forward_hook(lambda *_: time.sleep(1.0))  # one forward for the batch (cap 4096)
    before = set(threading.enumerate())
    try:
        rewards, _ = score([("rm", rm, 1.0)], completions, samples, timeout_s=0.1)
        left = [t for t in threading.enumerate() if t not in before]
    finally:
        hook.remove()
    assert left == []
    assert rm.normaliser.count == 4 and None not in rewards[0]


def test_a_reward_model_past_its_token_budget_scores_the_rest_none_and_says_so(random_rm):
    """reward.rm.timeout_s_per_1k_tokens bounds a batch by its tokens, checked between forwards in the
    caller's thread: with a budget of ~0 the first forward (one text each at cap 1) runs, the other
    three texts score None with a warning, counted, and stay out of the running statistics."""
    model, tok = random_rm
    rm = RewardModel(model, tok, max_tokens=1, normaliser=ScoreNormaliser("running"), timeout_s_per_1k_tokens=1e-9)
    completions, samples = sums(4)
    with pytest.warns(UserWarning, match="3 of 4 texts were not scored within reward.rm.timeout_s_per_1k_tokens"):
        values = rm(completions, samples)
    assert sum(v is None for v in values) == 3 and rm.stats["over_budget"] == 3 and rm.normaliser.count == 1


def test_a_text_longer_than_the_reward_models_context_scores_none_with_a_warning(random_rm):
    """random_rm holds 256 positions (char tokenizer: a token per character): a 300-character text is
    not fed past them (an out-of-range index on learned positions, extrapolated scores on RoPE)."""
    model, tok = random_rm
    rm = RewardModel(model, tok, max_tokens=4096)
    with pytest.warns(UserWarning, match="1 texts are longer than the reward model's context \\(256 tokens\\)"):
        values = rm(["1" * 300, "052"], [Sample(prompt="07+45=", answer="052")] * 2)
    assert rm.stats["too_long"] == 1
    assert values[0] is None and values[1] == pytest.approx(rm.scores(["07+45=052"])[0])


def test_a_folder_without_a_one_label_score_head_is_refused_at_load(random_rm, tmp_path):
    """Two labels, or a folder with no score head at all (a policy's: its head would start at random and
    score noise), is refused with what to give instead."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    model, tok = random_rm
    config = copy.deepcopy(model.config)
    config.num_labels = 2
    two = Qwen2ForSequenceClassification(config)
    policy = Qwen2ForCausalLM(model.config)  # num_labels=1 in its config, no score weights
    for name, m in (("two", two), ("policy", policy)):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(ConfigError, match="num_labels=2.*save it with num_labels=1"):
        load_reward_model(str(tmp_path / "two"), "float32")
    with pytest.raises(ConfigError, match="has no trained score head.*score.weight"):
        load_reward_model(str(tmp_path / "policy"), "float32")


def test_a_folder_whose_config_names_another_pad_id_than_its_tokenizer_scores_each_text_as_alone(random_rm, tmp_path):
    """A reward model whose config.pad_token_id (here <unk>) is not its tokenizer's pad token (<pad>): the
    rows are padded with the tokenizer's, so the model must look for that one, else a short row's score is
    read at a pad token and depends on its batch."""
    model, tok = random_rm
    config = copy.deepcopy(model.config)
    config.pad_token_id = tok.unk_token_id
    torch.manual_seed(0)
    from transformers import Qwen2ForSequenceClassification

    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_reward_model(str(tmp_path), "float32")
    texts = ["1+1=2", "a much longer text than the others"]
    with torch.no_grad():
        alone = [loaded(**loaded_tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    assert RewardModel(loaded, loaded_tok, max_tokens=10_000).scores(texts) == pytest.approx(alone, abs=1e-5)


def test_an_attention_call_from_another_thread_is_not_routed_into_an_active_split(random_rm):
    """While the trainer's thread runs a split micro-batch, a forward from any other thread (an
    abandoned reward model's) takes the model's own attention: the split's all-to-alls are the group's
    and must not be entered from elsewhere. The split's attention here returns zeros, so the owner's
    own forward, routed into it, scores differently (the precondition)."""
    model, tok = random_rm
    rm = RewardModel(model, tok, max_tokens=4096)
    texts = ["07+45=052", "1+1=2"]
    alone = rm.scores(texts)

    class ZeroSplit:  # what the split's attention returns: zeros, [rows, columns, heads, head dim]
        def ulysses(self, rows):
            return lambda module, query, *_, **__: (torch.zeros_like(query).transpose(1, 2), None)

    sequence.install()
    other: list = []
    with sequence.active(ZeroSplit(), None):
        owner = rm.scores(texts)
        thread = threading.Thread(target=lambda: other.append(rm.scores(texts)))
        thread.start()
        thread.join()
    assert owner != pytest.approx(alone, abs=1e-4)  # precondition: the owner's call went into the split
    assert other == [pytest.approx(alone, abs=1e-6)]


def test_a_backward_is_seen_as_one_wherever_it_runs():
    """The split's own backward (on CUDA: autograd's device threads) still routes into it: the graph
    task that `in_backward` reads is torch's, and an upgrade that moves it fails here."""
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(sequence.in_backward()))
    y.sum().backward()
    assert seen == [True] and not sequence.in_backward()


@pytest.mark.starts_process
def test_running_normalisation_learns_from_training_only_and_resumes(make_cfg, rm_dir, monkeypatch):
    """normalise=running, one step of 32 completions, evaluated (16 held-out prompts) before and after:
    the statistics count the 32 trained completions only (not 32 + 2 x 16), the checkpoint holds
    them, and a resumed second step goes on from them (64), not from zero. Step 1's batch, its own
    first statistics, is normalised to mean 0: with normalise=none it is the raw scores' mean."""
    built = []
    real = grpo.train.build_rewards
    monkeypatch.setattr(grpo.train, "build_rewards", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    rm_args = ("reward=rm", f"reward.rm.path={rm_dir}", "reward.rm.normalise=running", "eval_every=1",
               "task.eval_size=16")
    cfg = make_cfg(*rm_args, "steps=1")
    grpo.train.train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    # the batch's own statistics: mean 0, population std 1, so the logged (sample) std is sqrt(32 / 31)
    assert [(r["reward/rm"], r["reward/std"]) for r in rows if "reward/rm" in r] == [
        (pytest.approx(0.0, abs=1e-5), pytest.approx(math.sqrt(32 / 31), rel=1e-4))]
    normaliser = built[-1][0][1].normaliser
    assert normaliser.count == 32
    saved = torch.load(os.path.join(cfg.run_dir, "checkpoints", "step_00000001", "state_rank0.pt"), weights_only=False)
    assert saved["rewards"]["rm"] == {"count": 32, "mean": normaliser.mean, "m2": normaliser.m2}
    grpo.train.train(make_cfg(*rm_args, "steps=2", "resume=true"))
    assert built[-1][0][1].normaliser.count == 64
