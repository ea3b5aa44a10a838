"""Numbers no other test pinned in grpo/guards.py, grpo/eval.py, grpo/rewards/judge.py (its score readers
and settings check) and grpo/rewards/failure_streak.py: each test here was written against a mutation of
the code (a plausible bug) that every existing fast test let through. The expected values are worked out
by hand in the comments. Another rank is put in as the all-reduce would put it (tests/test_guards.py and
tests/test_rewards.py do the same); nothing starts a process."""

import math
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from grpo import eval as grpo_eval
from grpo import guards
from grpo.dist import DistInfo
from grpo.errors import ConfigError, RewardStop
from grpo.eval import agreement, evaluate
from grpo.guards import Parity, RankCheck, RanksDiverged, RunGuards, SamplerWatch, healthy, ranks_fingerprints
from grpo.reward_config import JudgeConfig
from grpo.rewards.failure_streak import FailureStreak
from grpo.rewards.judge import check, edit_distance, judge_prompt, meant_field
from grpo.tasks.base import Task
from tests.conftest import compose_cfg
from tests.test_eval import SUMS, Scripted
from tests.test_rewards import other_rank, stats_of


# --- grpo/guards.py -------------------------------------------------------------------------------------


def two_ranks(monkeypatch, me: int, theirs: float) -> None:
    """This process is rank `me` of 2; the other rank's fingerprint `theirs` is added in its own slot."""
    monkeypatch.setattr(guards.dist, "world_size", lambda: 2)
    monkeypatch.setattr(guards.dist, "rank", lambda: me)
    other = 1 - me
    monkeypatch.setattr(guards.dist, "all_reduce_sum", lambda v: [x + (theirs if i == other else 0.0) for i, x in enumerate(v)])


def test_rank_1_names_itself_when_its_weights_differ_from_rank_0s(monkeypatch):
    """Every rank compares every fingerprint with rank 0's, so all ranks name the same one. Rank 1
    holds 27, rank 0 holds 26: on rank 1 the answer is ([26, 27], [1]). Comparing with its own
    fingerprint instead, rank 1 would name rank 0, and the two ranks' messages would disagree."""
    two_ranks(monkeypatch, me=1, theirs=26.0)
    assert ranks_fingerprints(27.0) == ([26.0, 27.0], [1])
    assert ranks_fingerprints(26.0) == ([26.0, 26.0], [])


def test_fingerprints_near_zero_are_compared_with_an_absolute_floor(monkeypatch):
    """The tolerance is 1e-9 x max(|rank 0's|, 1): for a fingerprint of 0 (weights that sum to 0 on the
    ramp) it is 1e-9, so rank 1's 1e-12 (float64 summation order) agrees and rank 1's 1e-6 does not.
    A purely relative tolerance, 1e-9 x 0 = 0, flagged the summation noise as diverged weights."""
    two_ranks(monkeypatch, me=0, theirs=1e-12)
    assert ranks_fingerprints(0.0) == ([0.0, 1e-12], [])
    two_ranks(monkeypatch, me=0, theirs=1e-6)
    assert ranks_fingerprints(0.0) == ([0.0, 1e-6], [1])


def test_a_non_finite_rank_0_is_the_only_rank_named(monkeypatch):
    """Rank 0's weights hold a NaN, rank 1's are 0..5 (fingerprint 26: 0..5 weighted by 1, 1.2, ..., 2).
    Compared with rank 0's NaN every rank "differs" ([0, 1]), but only rank 0 lost its weights: the
    message names [0], the non-finite ones, not every rank that differs."""
    two_ranks(monkeypatch, me=0, theirs=26.0)
    nan_weights = torch.tensor([0.0, 1.0, float("nan"), 3.0, 4.0, 5.0])
    with pytest.raises(RanksDiverged, match=re.escape("after step 7 ranks [0] hold non-finite weights (fingerprints nan, 26)")):
        RankCheck(every=1, world=2).check(7, [[("w", nan_weights)]])


def test_a_statistic_exactly_at_its_bound_holds():
    """`Parity`: "at most `bound`". fp32 on CPU's watch is 0.05 (WATCH_FLOOR), bf16's a mean of
    2 x 0.1 = 0.2 (exactly the float 0.2): a step exactly at the bound is healthy, and three of them in
    a row do not warn. With `<` they counted as off-parity and warned."""
    assert Parity("max", 0.05).holds(0.05) and not Parity("max", 0.05).holds(0.050000001)
    assert healthy("bfloat16", "cpu", {}) == Parity("mean", 0.2)
    assert not Parity("max", 0.05).holds(math.nan)
    for watch, stats in ((SamplerWatch(healthy("float32", "cpu", {})), {"sampler_diff": 0.05}),
                         (SamplerWatch(healthy("bfloat16", "cpu", {})), {"sampler_diff_mean": 0.2})):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(1, 6):
                watch.check(step, stats, 0)
        assert watch.count == 0


def test_a_non_finite_sampler_statistic_neither_counts_nor_resets_the_watch():
    """A NaN sampler_diff (a step whose logprobs went non-finite: the step guard's business) says nothing
    about the sampler: the watch leaves its count as it was. 0.2, 0.2, NaN, 0.2 above fp32's 0.05: the
    count goes 1, 2, 2, 3, so the warning comes at step 4, not at step 3 (NaN counted as off-parity)
    and not never (NaN taken as a reset)."""
    watch = SamplerWatch(healthy("float32", "cpu", {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, diff in ((1, 0.2), (2, 0.2), (3, math.nan)):
            watch.check(step, {"sampler_diff": diff}, 0)
    assert watch.count == 2
    with pytest.warns(UserWarning, match="step 4: sampler_diff 0.2 > 0.05 for 3 on-policy steps"):
        watch.check(4, {"sampler_diff": 0.2}, 0)
    nan_only = SamplerWatch(healthy("float32", "cpu", {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(1, 5):
            nan_only.check(step, {"sampler_diff": math.nan}, 0)
    assert nan_only.count == 0


def test_the_guards_state_round_trips_each_count_under_its_own_key():
    """A checkpoint's guard state {skipped 5, in_a_row 1, sampler_count 2} comes back as saved (the
    resume test's state had skipped == in_a_row == 2, so a swapped key passed). Then, as in the unbroken
    run: one more non-finite step warns with 6 skipped and 2 in a row (a third would stop), and one
    more drifted step is the sampler watch's third in a row, so it warns."""
    state = {"skipped": 5, "in_a_row": 1, "sampler_count": 2}
    run_guards = RunGuards(None, 0, healthy("float32", "cpu", {}), check_ranks_every=0, world=1)
    run_guards.load_state_dict(state)
    assert run_guards.state_dict() == state
    with pytest.warns(UserWarning) as said:
        assert run_guards.after_update(9, {"loss": math.nan, "grad_norm": 1.0, "sampler_diff": 0.9,
                                           "trained_completions": 4}, 0) == {"guard/skipped_steps": 6}
    messages = [str(w.message) for w in said]
    assert any("(6 so far; 2 steps in a row, 3 in a row stop the run)" in m for m in messages), messages
    assert any(m.startswith("step 9: sampler_diff 0.9 > 0.05 for 3 on-policy steps") for m in messages), messages


# --- grpo/eval.py ---------------------------------------------------------------------------------------

GREEDY = {"1+1=": "2", "2+2=": "5", "3+3=": "6"}  # right, wrong, right
SAMPLED = {"1+1=": ["3", "2", "3", "3"], "2+2=": ["0", "4", "4", "0"], "3+3=": ["0", "0", "0", "0"]}  # c = 1, 2, 0


def sums_task() -> Task:
    return Task("sums", SUMS, SUMS, chat_template="never")


def test_accuracy_and_pass_at_k_divide_every_ranks_sums_by_every_ranks_prompts(tiny_lm, monkeypatch):
    """Rank 0's 3 prompts (tests/test_eval.py's: greedy 2 of 3; pass@1, @2, @4 sums 1/4 + 2/4 + 0 = 3/4,
    1/2 + 5/6 + 0 = 4/3, 1 + 1 + 0 = 2) and another rank's one prompt, solved greedily and by all 4
    samples ([1 solved, 1 prompt, 1 turn, 0 errors, 0 unjudged, 1, 1, 1]): accuracy (2 + 1) / 4 = 3/4, pass@1
    (3/4 + 1) / 4 = 7/16, pass@2 (4/3 + 1) / 4 = 7/12, pass@4 (2 + 1) / 4 = 3/4. Dividing by this
    rank's own count (3 prompts), or reading this rank's sums, gave each rank its own figures."""
    _, tok = tiny_lm
    other = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    monkeypatch.setattr(grpo_eval, "all_reduce_sum", lambda v: [a + b for a, b in zip(v, other, strict=True)])
    cfg = compose_cfg("eval_samples=4", "rollout.temperature=0.7")
    metrics = evaluate(Scripted(tok, greedy=GREEDY, sampled=SAMPLED), tok, sums_task(), cfg, DistInfo())
    assert metrics == pytest.approx({"eval/accuracy": 3 / 4, "eval/pass@1": 7 / 16, "eval/pass@2": 7 / 12,
                                     "eval/pass@4": 3 / 4})


class NormalisingRM:
    """A reward model as the eval sees one: called, it scores for training and moves its running
    normalisation (recorded in `trained`, scoring 0); `score_only` scores as it is: a digit d -> d / 10."""

    def __init__(self):
        self.trained = []

    def __call__(self, completions, samples, **_):
        self.trained.append(list(completions))
        return [0.0] * len(completions)

    def score_only(self, completions, samples, **_):
        return [int(c) / 10 if c.isdigit() else None for c in completions]


def test_a_model_rewards_agreement_scores_the_greedy_completions_over_every_rank(tiny_lm, monkeypatch):
    """eval_samples=2, so sampled texts exist beside the greedy ones. The reward model scores the greedy
    "2", "5", "6" with `score_only` (0.2, 0.5, 0.6; its running normalisation untouched), and another
    rank adds one wrong completion scored 0.9 (the all-gather). Right [0.2, 0.6], wrong [0.5, 0.9]:
    of the 4 pairs only 0.6 > 0.5 is ordered right, AUC 1/4; means 0.4 and 0.7. The rule reward
    (exact_match) gets no agreement: it is the rule. Scoring the sampled texts, calling the model as in
    training, or leaving the other rank's pairs out, each changes these numbers."""
    _, tok = tiny_lm
    monkeypatch.setattr(grpo_eval, "all_gather", lambda mine: [mine, [(0.9, False)]])
    rm = NormalisingRM()
    rule = ("exact_match", lambda completions, samples, **_: [1.0] * len(completions), 1.0)
    sampled = {"1+1=": ["3", "3"], "2+2=": ["1", "1"], "3+3=": ["0", "0"]}  # none right: pass@1 = pass@2 = 0
    cfg = compose_cfg("eval_samples=2", "rollout.temperature=0.7")
    metrics = evaluate(Scripted(tok, greedy=GREEDY, sampled=sampled), tok, sums_task(), cfg, DistInfo(),
                       reward_fns=[rule, ("rm", rm, 1.0)])
    assert metrics == pytest.approx({"eval/accuracy": 2 / 3, "eval/pass@1": 0.0, "eval/pass@2": 0.0, "eval/rm_auc": 0.25,
                                     "eval/rm_mean_correct": 0.4, "eval/rm_mean_wrong": 0.7})
    assert rm.trained == []


def test_a_model_reward_stopped_on_another_rank_stops_the_evaluation_here(tiny_lm, monkeypatch):
    """The reward model scored here, but another rank's raised RewardStop: the stop count is
    all-reduced (1 rank stopped), so this rank raises too, with that rank's reason, instead of going on
    to the all-gather where the stopped rank never arrives."""
    _, tok = tiny_lm
    monkeypatch.setattr(grpo_eval, "all_reduce_sum", lambda v: [x + 1.0 for x in v] if len(v) == 1 else list(v))
    real = grpo_eval.stop_together
    monkeypatch.setattr(grpo_eval, "stop_together",
                        lambda stopped, n: real(stopped, n, gather=lambda mine: [mine, "reward 'rm': refused"]))
    monkeypatch.setattr(grpo_eval, "all_gather", lambda mine: pytest.fail("gathered the pairs after a stop"))
    cfg = compose_cfg("eval_samples=1")
    with pytest.raises(RewardStop, match=r"^rank 1 stopped the run: reward 'rm': refused$"):
        evaluate(Scripted(tok, greedy=GREEDY), tok, sums_task(), cfg, DistInfo(), reward_fns=[("rm", NormalisingRM(), 1.0)])


def test_agreement_leaves_an_unscored_wrong_completion_out_and_averages_each_side_over_its_own():
    """Correct [0.9, 0.5], wrong [NaN (a failed request), 0.1]: the NaN is no score, so the wrong side is
    [0.1]: AUC 2/2 = 1 (0.9 > 0.1, 0.5 > 0.1), means 0.7 and 0.1 (the wrong side's sum over its own 1,
    not over the 2 correct: 0.05). Kept, the NaN made two pairs neither above nor tied (AUC 2/4) and a
    NaN mean. (tests/test_judge.py's case has 2 on each side, so the counts could be swapped.)"""
    assert agreement("rm", [0.9, math.nan, 0.5, 0.1], [True, False, True, False]) == pytest.approx({
        "eval/rm_auc": 1.0, "eval/rm_mean_correct": 0.7, "eval/rm_mean_wrong": 0.1})


def test_a_folder_with_checkpoints_alone_is_a_training_folder(tmp_path):
    """A run stopped before its summary.json has checkpoints only: grpo.eval must still leave its
    metrics.jsonl alone (a step-0 row after step N)."""
    from grpo.eval import is_training_folder

    (tmp_path / "checkpoints").mkdir()
    assert is_training_folder(str(tmp_path))


# --- grpo/rewards/judge.py: the score readers and the settings check ------------------------------------

def test_choices_written_with_the_tokenizers_leading_space_match_its_tokens():
    """Both sides are compared stripped and lowercased: choices written as the judge's tokens are,
    {" Yes": 1, " No": 0} (a leading-space tokenizer's), match the top tokens "yes" (p 0.5) and "No"
    (p 0.25): (0.5 x 1 + 0.25 x 0) / 0.75 = 2/3. Stripping the token alone left such choices never
    matched: every answer garbage."""
    from grpo.rewards.judge import expected_score

    top = {"yes": math.log(0.5), "No": math.log(0.25), "The": math.log(0.25)}
    assert expected_score(top, {" Yes": 1.0, " No": 0.0}) == pytest.approx(2 / 3)


def test_edit_distance_counts_a_substitution_as_one_edit():
    """Levenshtein by hand: kitten -> sitting is 2 substitutions (k/s, e/i) and an insertion (g): 3;
    answer -> amswex 2 substitutions. With a substitution costed as a deletion and an insertion (2),
    amswex came out 4 and {amswex} (6 letters: up to 2 edits) went to the judge as text."""
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("answer", "amswex") == 2
    assert edit_distance("", "prompt") == 6 and edit_distance("prompt", "prompt") == 0
    assert meant_field("amswex") == "answer"


def test_a_long_name_three_edits_from_a_field_is_text():
    """The edits allowed are len // 3 but at most 2: {completed} and {collection} (9 and 10 letters, 3
    edits from completion) are words of the judge's text, not a misspelled field; {compilation} is 2
    edits (i/e, a dropped) and is refused. Capped at 3, the two words were refused."""
    from grpo.rewards.judge import misspelled_fields

    assert edit_distance("completed", "completion") == 3 and edit_distance("collection", "completion") == 3
    assert misspelled_fields("{completion} was {completed}: {collection}") == {}
    assert misspelled_fields("{completion} {compilation}") == {"{compilation}": "completion"}


def test_a_sample_without_a_reference_answer_fills_answer_with_nothing():
    """A task whose samples carry no reference (answer None): {answer} becomes "", not the text "None"
    shown to the judge as if it were the reference."""
    assert judge_prompt("[{answer}] {prompt} {completion}", "1+1=", "2", None) == "[] 1+1= 2"
    assert judge_prompt("[{answer}]", "p", "c", "4") == "[4]"


def judge_settings(**settings):
    """A config holding reward.judge only (all check() reads), the schema's defaults but `settings`."""
    jc = OmegaConf.structured(JudgeConfig(urls=["http://127.0.0.1:1"], **settings))
    return SimpleNamespace(reward=SimpleNamespace(judge=jc))


@pytest.mark.parametrize("settings", [
    {"min_scored": 0.0},  # never stop on the judge's misses (docs: reward.judge.min_scored=0 asks to go on)
    {"min_scored": 1.0},  # every completion must be scored
    {"retries": 0},  # each request sent once
    {"max_tokens": 1},  # score=logprobs reads one token
    {"min_choice_mass": 0.0},  # read whatever mass the choices hold (tests/test_judge.py's judge_cfg)
    {"min_choice_mass": 1.0},
    {"top_logprobs": 1, "max_concurrency": 1},
], ids=["min_scored=0", "min_scored=1", "retries=0", "max_tokens=1", "min_choice_mass=0", "min_choice_mass=1",
        "top_logprobs=max_concurrency=1"])
def test_the_settings_check_accepts_each_bound_it_names(settings, monkeypatch):
    """check() refuses min_scored outside 0..1, retries < 0, max_tokens < 1, ...: the bounds themselves
    are settings a run can want. A check one off (0 < min_scored, retries >= 1, max_tokens > 1,
    min_choice_mass < 1) refused them."""
    monkeypatch.delenv("GRPO_JUDGE_TOKEN", raising=False)
    check(judge_settings(**settings))


@pytest.mark.parametrize("settings, message", [
    ({"batch_timeout_s": 0.0}, "reward.judge.request_timeout_s and batch_timeout_s must be > 0"),
    ({"request_timeout_s": 0.0}, "reward.judge.request_timeout_s and batch_timeout_s must be > 0"),
    ({"retries": -1}, "reward.judge needs max_tokens >= 1 (or null), top_logprobs >= 1, max_concurrency >= 1 and retries >= 0"),
    ({"max_tokens": 0}, "reward.judge needs max_tokens >= 1 (or null)"),
    ({"min_scored": 1.5}, "reward.judge.min_scored=1.5 is a fraction of a batch: 0 to 1"),
    ({"min_scored": -0.5}, "reward.judge.min_scored=-0.5 is a fraction of a batch: 0 to 1"),
], ids=["batch_timeout_s=0", "request_timeout_s=0", "retries=-1", "max_tokens=0", "min_scored=1.5", "min_scored=-0.5"])
def test_the_settings_check_refuses_just_past_each_bound(settings, message, monkeypatch):
    """A batch_timeout_s of 0 gives every batch no time (its requests past the deadline at once, their
    completions None); it is checked beside request_timeout_s. The others: just outside their bounds."""
    monkeypatch.delenv("GRPO_JUDGE_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check(judge_settings(**settings))


# --- grpo/rewards/failure_streak.py ---------------------------------------------------------------------


def test_each_rule_rewards_counts_are_read_from_its_own_pair():
    """score()'s counts reach the all-reduce as [stopped, a failed, a tried, b failed, b tried, ...]: reward
    i's pair sits at 2i, 2i + 1. Here a scores 3 of 3 and b fails 4 of 4, twice: b stops the run, named,
    with "4 of 4". Reading b's pair at i, i + 1 gave it (a tried, b failed) = (3, 4): never a streak."""
    streak = FailureStreak(["a", "b"], reduce=other_rank(0, 0, 0, 0))
    streak.observe(stats_of(a=(0, 3), b=(4, 4)))
    assert streak.streak == {"a": 0, "b": 1}
    with pytest.raises(RewardStop, match=r"^reward 'b' failed on every completion it was tried on in 2 batch\(es\) in a "
                                         r"row, on every rank \(4 of 4 in the last"):
        streak.observe(stats_of(a=(0, 3), b=(4, 4)))


def test_a_run_that_rewarded_something_before_its_last_batch_does_not_stop_at_its_end():
    """finish() stops a run too short for two batches in a row only when every batch it scored was
    unrewarded: a rewarded batch (one completion scored 0.5) then an unrewarded one is 1 of 2, which is
    no stop (the next batch decides); a streak of 1 at the end is not "every batch this run scored"."""
    nan = math.nan
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0))
    streak.observe({}, None, [0.5, nan, nan, nan], ["stop"] * 4)
    streak.observe({}, None, [nan] * 4, ["stop"] * 4)
    assert (streak.observed, streak.unrewarded) == (2, 1)
    streak.finish()


def test_of_several_stopped_ranks_the_first_is_named():
    """Three ranks, ranks 1 and 2 stopped (the all-reduced count 2): rank 0, which did not, raises the
    first stopped rank's reason, as the docstring says (every rank names the same one)."""
    from grpo.rewards.failure_streak import stop_together

    with pytest.raises(RewardStop, match=r"^rank 1 stopped the run: reward 'rm': refused$"):
        stop_together(None, 2.0, gather=lambda mine: [mine, "reward 'rm': refused", "reward 'judge': scored 0 of 8"])


def test_a_failure_streak_goes_on_across_a_resume():
    """The checkpoint held no streak: a run resumed from the checkpoint after a reward's first batch of
    failures built a fresh one and trained on past the batch where the unbroken run stopped."""
    from grpo.errors import RewardStop
    from grpo.rewards.failure_streak import FailureStreak

    failed = {"mine/completions_failed": 8.0, "mine/completions_tried": 8.0}
    same = dict(reduce=lambda values: values, gather=lambda mine: [mine])
    before = FailureStreak(["mine"], **same)
    before.observe(failed, None, [math.nan] * 8, ["stop"] * 8)  # the unbroken run's first failed batch, then its checkpoint
    resumed = FailureStreak(["mine"], **same)
    resumed.load_state_dict(before.state_dict())
    with pytest.raises(RewardStop, match="in 2 batch"):
        resumed.observe(failed, None, [math.nan] * 8, ["stop"] * 8)  # where the unbroken run stops
