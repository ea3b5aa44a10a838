"""Reward functions against hand-checked cases, and a reward that raises or hangs not stopping the run."""

import json
import math
import os
import re
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from grpo.algorithm import combine_rewards
from grpo.errors import ConfigError, RewardStop
from grpo.rewards import REWARDS, check_rewards, score
from grpo.rewards.countdown import NotAnEquation, countdown, evaluate
from grpo.rewards.format import answer_format, extract_answer, overlong_penalty
from grpo.rewards.math_answer import is_equivalent, math_verify
from grpo.tasks import Sample
from tests.conftest import compose_cfg


def marked(rewards_FB: list[list]) -> list[list]:
    """rewards_FB with each FAILED (NaN, which equals nothing) written "failed"."""
    return [["failed" if v is not None and math.isnan(v) else v for v in row] for row in rewards_FB]


def cd(numbers, target):
    return Sample(prompt="", answer=str(target), meta={"numbers": numbers, "target": target})


def test_countdown_checks_numbers_and_target():
    s = cd([3, 5, 7], 22)
    completions = [
        "<think>..</think><answer>3 * 5 + 7</answer>",  # 15 + 7 = 22, each number once -> 1
        "(7 - 3) * 5 + 2",  # uses 2, not in the numbers -> 0
        "3 * 5 + 7 + 0",  # extra 0 -> 0
        "<answer>5 * 3 + 7 = 22</answer>",  # the `= 22` tail is ignored -> 1
        "<answer>7 * 5 - 3</answer>",  # 32 -> 0
        "<answer>7 / (5 - 5) + 3</answer>",  # division by zero -> 0, no crash
        "<answer>__import__('os').system('true')</answer>",  # never evaluated -> 0
        "<answer>22 = 3 * 5 + 7</answer>",  # the target first: read as the equation, 22 alone -> 0 before
        "<answer>22 = 7 * 5 - 3</answer>",  # 32 either way -> 0
    ]
    assert countdown(completions, [s] * len(completions)) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_a_countdown_answer_whose_sides_of_equals_differ_scores_0():
    """Each side of `=` was checked alone, so a false equation (`3 * 5 + 7 = 21`) scored 1, and so did
    guesses joined by `=`: one answer could list every arrangement of the numbers and score 1."""
    s = cd([3, 5, 7], 22)
    completions = [
        "<answer>3 * 5 + 7 = 21</answer>",  # 22 = 21 -> 0
        "<answer>21 = 3 * 5 + 7</answer>",
        "<answer>(3 + 5) * 7 = 3 * 5 + 7 = 3 * 7 + 5</answer>",  # 56 = 22 = 26: guesses -> 0
        "<answer>3 * 5 + 7 = 15 + 7 = 22</answer>",  # worked and true -> 1
        "<answer>15 + 7 = 22</answer>",  # true, but no side uses the numbers -> 0
    ]
    assert countdown(completions, [s] * len(completions)) == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_an_answer_longer_than_its_numbers_allow_scores_0_with_no_retry():
    """3 numbers, each used once, take 2 operators, and a minus sign on each of the 5 terms (3 numbers, 2
    operations): 7 at most. 1000 chained terms (or 1000 signs) are wrong, but the recursive walk raised
    RecursionError: score() retried the batch one completion at a time and the answer FAILED (NaN,
    excluded, advantage 0) where a wrong answer scores 0."""
    s = cd([3, 5, 7], 8)
    # the bound itself: 2 operators, 5 signs: -3 * -5 = 15, negated -15; -15 - -7 = -8, negated 8
    assert countdown(["<answer>-(-(-3 * -5) - -7)</answer>"], [s]) == [1.0]
    chained, signs = "+".join(["1"] * 1000), "-" * 1000 + "3"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no retry warning
        rewards_FB, stats = score([("countdown", countdown, 1.0)], [chained, signs, "3 * 5 - 7"], [s] * 3, timeout_s=30)
    assert rewards_FB == [[0.0, 0.0, 1.0]] and stats["countdown/completions_failed"] == 0


def test_safe_evaluation_refuses_everything_but_arithmetic():
    assert evaluate("(1 + 2) * -3 / 4") == (-2.25, [1, 2, 3, 4])
    for bad in ("2 ** 10", "abs(-3)", "x + 1", "[1][0]", "1 if 1 else 2", "'a' * 3", "True * 5"):  # True: no number 1
        with pytest.raises(NotAnEquation):
            evaluate(bad)


def test_format_reward_and_answer_extraction():
    good = "<think>add the tens</think>\n<answer>52</answer>"
    assert answer_format([good, "<answer>52</answer>", good + " trailing", "<think>x</think><answer></answer>"], []) == [1.0, 0.0, 0.0, 1.0]
    # a template that opens <think> itself (DeepSeek-R1-Distill): every completion scored 0
    assert answer_format(["I add 3*5 and 7.</think>\n<answer>3 * 5 + 7</answer>", "I add.</think>"], []) == [1.0, 0.0]
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("no tags") is None


def test_overlong_penalty_by_token_length():
    # Lmax 8, buffer 2: lengths up to 6 free; 7 -> (6 - 7) / 2 = -0.5; 8 -> -1
    ids = [[0] * n for n in (3, 6, 7, 8)]
    assert overlong_penalty([""] * 4, [], completion_ids=ids, max_new_tokens=8, buffer=2) == [0.0, 0.0, -0.5, -1.0]


def test_a_reward_that_raises_on_one_completion_excludes_only_it():
    def picky(completions, samples, **_):
        if any("boom" in c for c in completions):
            raise RuntimeError("cannot parse")
        return [1.0] * len(completions)

    with pytest.warns(UserWarning, match="'picky' failed on completion 1 'boom' .*RuntimeError: cannot parse"):
        rewards, stats = score([("picky", picky, 1.0)], ["ok", "boom", "ok"], [None] * 3, timeout_s=5)
    assert marked(rewards) == [[1.0, "failed", 1.0]] and stats["time/reward_picky_s"] > 0


def test_a_reward_that_returns_a_non_number_excludes_only_that_completion():
    def sloppy(completions, samples, **_):
        return ["1.0" if c == "text" else 0.5 for c in completions]  # a string where a number belongs

    with pytest.warns(UserWarning, match="'sloppy' failed on completion 1 'text' .*returned '1.0', not a finite number or None"):
        rewards, _ = score([("sloppy", sloppy, 1.0)], ["a", "text", "b"], [None] * 3, timeout_s=5)
    assert marked(rewards) == [[0.5, "failed", 0.5]]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_reward_that_is_not_finite_fails_that_completion_with_a_warning(bad):
    """A NaN was taken as "no function scored" without a word, and an inf turned its whole group's
    advantages into NaN (the step guard then stopped the run blaming the learning rate)."""
    def overflows(completions, samples, **_):
        return [bad if c == "big" else 1.0 for c in completions]

    with pytest.warns(UserWarning, match=f"'overflows' failed on completion 1 'big' .*returned {bad!r}, not a finite"):
        rewards, _ = score([("overflows", overflows, 1.0)], ["a", "big", "b"], [None] * 3, timeout_s=5)
    assert marked(rewards) == [[1.0, "failed", 1.0]]


@pytest.mark.parametrize("kind", ["numpy float32", "numpy int64", "0-d torch tensor", "bool"])
def test_numpy_and_torch_scalars_are_scores(kind):
    """A rule reward built on numpy or torch (np.mean over a float32 array, a tensor's entries) was
    FAILED on every completion: its values were not Python ints or floats. They count, as floats."""
    make = {"numpy float32": np.float32, "numpy int64": np.int64, "0-d torch tensor": torch.tensor, "bool": bool}[kind]

    def right(completions, samples, **_):
        return [make(c == s.answer) for c, s in zip(completions, samples)]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not one completion retried or excluded
        rewards, _ = score([("right", right, 1.0)], ["2", "3"], [Sample("1+1=", "2")] * 2, timeout_s=5)
    assert rewards == [[1.0, 0.0]] and all(type(v) is float for v in rewards[0])


@pytest.mark.parametrize("bad", [np.float32("nan"), torch.tensor(float("inf")), torch.tensor([1.0]), "1.0"])
def test_a_numpy_or_torch_value_that_is_not_one_finite_number_still_fails(bad):
    def odd(completions, samples, **_):
        return [bad if c == "odd" else 1.0 for c in completions]

    with pytest.warns(UserWarning, match="'odd' failed on completion 1 'odd' .*not a finite number or None"):
        rewards, _ = score([("odd", odd, 1.0)], ["a", "odd"], [None] * 2, timeout_s=5)
    assert marked(rewards) == [[1.0, "failed"]]


@pytest.mark.parametrize("container, kind", [(lambda v: dict(enumerate(v)), "dict"), (set, "set"),
                                             (lambda v: "".join("1" if x else "0" for x in v), "str")])
def test_a_reward_returning_a_dict_set_or_string_fails_not_read_as_its_keys_or_characters(container, kind):
    """{i: score} was scored by its keys (0, 1, 2), a set in hash order (and fewer values), a string
    "101" as its characters: each silently. Now the batch fails with what was returned, and one at a
    time every completion fails too (excluded and counted)."""
    def scores_in(completions, samples, **_):
        return container([1.0 if c == "right" else 0.0 for c in completions])

    with pytest.warns(UserWarning, match=rf"'boxed' failed on the batch \(TypeError: returned a {kind}, not a list of "
                                         r"scores in the completions' order\)"):
        rewards, stats = score([("boxed", scores_in, 1.0)], ["right", "wrong", "right"], [None] * 3, timeout_s=5)
    assert marked(rewards) == [["failed"] * 3] and stats["boxed/completions_failed"] == 3


def trl_style(prompts, completions, **_):
    return [1.0] * len(completions)


def texts_then_completions(texts, completions, **_):
    return [1.0] * len(completions)


def test_a_reward_taking_prompts_first_is_refused_at_validate():
    """TRL's reward signature, (prompts, completions, **kwargs), got the completions as `prompts` and the
    samples as `completions`, and scored them silently (1.0 each here); so would any first name with
    `completions` second."""
    with pytest.raises(ConfigError, match=r"reward 'tests.test_rewards.trl_style' takes \(prompts, completions, \.\.\.\), "
                                          r"but a reward is called as fn\(completions, samples, \*\*info\).*Reorder"):
        check_rewards(compose_cfg("reward.funcs=[{name: tests.test_rewards.trl_style, weight: 1.0}]"))
    with pytest.raises(ConfigError, match=r"takes \(texts, completions, \.\.\.\)"):
        check_rewards(compose_cfg("reward.funcs=[{name: tests.test_rewards.texts_then_completions, weight: 1.0}]"))
    check_rewards(compose_cfg("reward.funcs=[{name: tests.test_rewards.abstains, weight: 1.0}]"))  # (completions, samples)
    # a C or pybind11 function has no signature to read: nothing to check, not inspect's ValueError
    check_rewards(compose_cfg("reward.funcs=[{name: math.hypot, weight: 1.0}]"))


def test_a_reward_returning_a_value_short_is_scored_one_completion_at_a_time_with_its_own_info():
    """A rule reward that returns 2 values for 3 completions (here: it drops the last) is a failed batch,
    not 2 scores zipped onto 3 completions; the retry one completion at a time hands it that completion's
    own slice of every per-completion list (completion_ids), and other info (max_new_tokens) as it is."""
    seen = []

    def drops_the_last(completions, samples, completion_ids=None, max_new_tokens=None, **_):
        seen.append((list(completions), completion_ids, max_new_tokens))
        values = [float(len(ids)) for ids in completion_ids]
        return values[:-1] if len(completions) > 1 else values

    with pytest.warns(UserWarning, match=r"'short' failed on the batch \(returned 2 values for 3 completions\); scoring "
                                         r"its completions one at a time"):
        rewards, stats = score([("short", drops_the_last, 1.0)], ["a", "b", "c"], [None] * 3, timeout_s=5,
                               completion_ids=[[1], [1, 2], [1, 2, 3]], max_new_tokens=8)
    assert rewards == [[1.0, 2.0, 3.0]] and stats["short/completions_failed"] == 0
    assert seen[1:] == [(["a"], [[1]], 8), (["b"], [[1, 2]], 8), (["c"], [[1, 2, 3]], 8)]


def test_a_completion_one_function_failed_on_is_not_scored_by_the_others():
    """With reward=[judge-like, format]: the first fails on completion 0 (raises), the second gives
    every completion 1. Scored by `format` alone, completion 0 got 0.1 against its group's 1.1 and a
    strongly negative advantage; it is excluded (NaN), as documented. An abstaining function (None)
    still lets the others count: completion 3."""
    def flaky(completions, samples, **_):
        if "a" in completions:
            raise RuntimeError("boom")
        return [None if c == "d" else 1.0 for c in completions]

    def fmt(completions, samples, **_):
        return [1.0] * len(completions)

    with pytest.warns(UserWarning, match="'flaky' failed on completion 0 'a'"):
        rewards, _ = score([("flaky", flaky, 1.0), ("format", fmt, 0.1)], list("abcd"), [None] * 4, timeout_s=5)
    assert marked(rewards) == [["failed", 1.0, 1.0, None], [1.0] * 4]
    r = combine_rewards(rewards, [1.0, 0.1])
    assert math.isnan(r[0]) and r[1:].tolist() == pytest.approx([1.1, 1.1, 0.1])


def test_a_reward_that_hangs_is_cut_off():
    def hangs_on_slow(completions, samples, **_):
        if "slow" in completions:
            time.sleep(30)
        return [0.5] * len(completions)

    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="no answer within reward.timeout_s=0.5s"):
        rewards, _ = score([("hangs", hangs_on_slow, 1.0)], ["a", "slow", "b"], [None] * 3, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert marked(rewards) == [[0.5, "failed", 0.5]]


def test_a_model_reward_is_called_once_in_the_callers_thread_and_not_retried():
    """A reward that holds a model (here under the name `judge`) is not abandoned on a thread nor
    retried one completion at a time (B more forwards or requests): one call, in this thread; when it
    fails, its batch is excluded with one warning."""
    calls = []

    def judge(completions, samples, **_):
        calls.append((len(completions), threading.get_ident()))
        raise RuntimeError("server gone")

    with pytest.warns(UserWarning, match="'judge' failed on the batch \\(RuntimeError: server gone\\); its 3 completions"):
        rewards, _ = score([("judge", judge, 1.0)], ["a", "b", "c"], [None] * 3, timeout_s=5)
    assert marked(rewards) == [["failed"] * 3] and calls == [(3, threading.get_ident())]


def test_a_model_rewards_unscored_and_non_finite_completions_fail_alone():
    """A model reward never abstains: its None (a judge's failed request, a text past a reward
    model's context: the function warns and counts them) fails that completion; a score that is not
    finite (an RM forward that overflowed in bf16) fails it with a warning here. The batch's others
    keep their scores."""
    def rm(completions, samples, **_):
        return [None, math.inf, 0.5, math.nan]

    with pytest.warns(UserWarning, match=r"'rm' gave 2 of 4 completions a score that is not finite \(inf for completion 1\)"):
        rewards, _ = score([("rm", rm, 1.0)], list("abcd"), [None] * 4, timeout_s=5)
    assert marked(rewards) == [["failed", "failed", 0.5, "failed"]]


# per registered reward: (a completion it should score higher, its token count; one it should score lower, its count)
PAIRS = {
    "exact_match": ("3", 1, "4", 1),
    "format": ("<think>add</think> <answer>1 + 2</answer>", 4, "<answer>1 + 2</answer>", 2),
    "countdown": ("<answer>1 + 2</answer>", 2, "<answer>1 - 2</answer>", 2),
    "overlong": ("<answer>3</answer>", 2, "3 3 3 3 3 3 3 3", 8),  # 8 of max_new_tokens=8: past the soft buffer
    "math_verify": ("The answer is $\\boxed{3}$.", 4, "The answer is $\\boxed{4}$.", 4),
    "env": ("3", 1, "4", 1),  # with the environment's rewards for the two episodes below
}


def test_every_registered_reward_takes_the_trainer_call_and_tells_right_from_wrong():
    """Each reward, called as the trainer calls it (a batch, samples, completion ids, the token
    budget), gives one number per completion and scores the right completion above the wrong one."""
    assert set(PAIRS) == set(REWARDS), "add the new reward to PAIRS"
    s = cd([1, 2], 3)
    for name, fn in REWARDS.items():
        good, good_len, bad, bad_len = PAIRS[name]
        values = fn([good, bad], [s, s], completion_ids=[[5] * good_len, [5] * bad_len], max_new_tokens=8,
                    env_rewards=[1.0, 0.0])  # what an environment's episodes add (env=...): `env` reads it
        assert len(values) == 2 and all(isinstance(v, float) for v in values), (name, values)
        assert values[0] > values[1], (name, values)


def test_env_reward_scores_an_unfinished_episode_the_environment_never_rewarded_as_0():
    """reward=env alone: a first turn cut at max_new_tokens (or the token budget, or the turn cap)
    never reached the environment, so no step rewarded it. It is a failure like a cut after a miss
    (0.0), not an abstention, which `combine_rewards` turns into NaN and the batch excludes (a policy
    rambling past its first turn would never be penalised). A finished episode without a step reward
    still abstains; an error's None is the trainer's to withhold."""
    env_rewards = [None, None, None, 0.5, None, -0.1]
    finishes = ["length", "turns", "stop", "length", "error", "turns"]
    values = REWARDS["env"](["x"] * 6, [None] * 6, env_rewards=env_rewards, finish_reasons=finishes)
    assert values == [0.0, 0.0, None, 0.5, None, -0.1]
    rewards_B = combine_rewards([values], [1.0])
    assert rewards_B[:2].tolist() == [0.0, 0.0] and rewards_B[2:3].isnan().all()


def test_an_environments_rewards_no_reward_reads_are_named():
    """A custom environment that rewards its steps, run with the default reward.funcs (exact_match):
    its rewards were dropped without a word. A warning says to add `env`; none when it is there, or
    when the environment gave no reward."""
    exact = [("exact_match", REWARDS["exact_match"], 1.0)]
    with pytest.warns(UserWarning, match=r"the environment gives its episodes rewards \(Step.reward\), but reward.funcs "
                                         r"has no `env`, so nothing trains on them.*reward=env"):
        score(exact, ["5", "6"], [Sample("2+3=", "5")] * 2, env_rewards=[None, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score(exact + [("env", REWARDS["env"], 1.0)], ["5", "6"], [Sample("2+3=", "5")] * 2, env_rewards=[None, 1.0])
        score(exact, ["5", "6"], [Sample("2+3=", "5")] * 2, env_rewards=[None, None])


@pytest.mark.parametrize(
    "completion, answer, value",
    [
        ("The answer is 85.", "85", 1.0),  # the last number
        ("37 + 48 = 86", "85", 0.0),
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # equal by value: 1/2 = 0.5
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("step 1: 3 + 4 = 7. #### 72", "72", 1.0),  # gsm8k's style
        ("\\boxed{x^2}", "x^{2}", 1.0),
        ("no answer here", "3", 0.0),
        ("#### 72", "72", 1.0),
        ("The answer is 1,000.", "1000", 1.0),
        # the answer must be written: math-verify evaluates what it reads, so restating the question's sum
        # (arithmetic: "What is 7 + 1?") or a gsm8k solution cut off before its result scored 1
        ("7 + 1", "8", 0.0),
        ("7+1", "8", 0.0),
        ("\\boxed{7+1}", "8", 0.0),
        ("To find 7 + 1, we", "8", 0.0),
        ("The sum of 7 + 1", "8", 0.0),
        ("7 + 1 =", "8", 0.0),
        ("\\boxed{x = 7+1}", "8", 0.0),
        ("\\boxed{9 - 1}", "8", 0.0),
        ("\\boxed{3 \\cdot 6}", "18", 0.0),
        ("\\boxed{2^{10}}", "1024", 0.0),  # a whole power
        ("\\boxed{3^2}", "9", 0.0),  # a square too
        ("In May she sold 48/2 = 24 clips. Altogether she sold 48 + 24", "72", 0.0),
        ("In May she sold 48/2", "24", 0.0),  # a division that comes out whole
        ("\\boxed{48/2}", "24", 0.0),  # ... in LaTeX too, which math-verify hands back evaluated (24): read from its text
        ("\\boxed{\\dfrac{48}{2}}", "24", 0.0),
        ("\\boxed{-48/2}", "-24", 0.0),  # ... with a sign too, which math-verify's text moves inside: \frac{-48}{2}
        ("\\boxed{\\frac{48}{-2}}", "-24", 0.0),
        ("\\boxed{-\\frac{7}{2}}", "-3.5", 1.0),  # a negative fraction that does not come out whole is a value
        ("The answer is \\(48 \\div 2\\)", "24", 0.0),
        ("\\boxed{\\frac{48}{2}}", "\\frac{48}{2}", 1.0),  # written as the ground truth writes it
        ("\\boxed{\\frac{7}{2}}", "3.5", 1.0),  # a fraction that does not come out whole is a value
        ("7 + 1 = 8", "8", 1.0),  # the result after the working counts
        ("The answer is $48 + 24 = 72$.", "72", 1.0),  # in LaTeX too: the last relation's right-hand side
        ("Therefore the total is $\\boxed{48 + 24 = 72}$", "72", 1.0),
        ("So the area is $\\frac{1}{2} \\cdot 6 \\cdot 4 = 12$.", "12", 1.0),
        ("Thus $x = 2 + 3 = 5$.", "5", 1.0),
        ("She sold $48/2 = 24$ clips.", "24", 1.0),  # a whole division in the working, not after the last =
        ("$\\frac{48}{2} = 24$", "24", 1.0),
        ("\\boxed{x = 7+1}", "8", 0.0),  # ... and what follows the last = must be written
        ("In May she sold 48 - 24", "24", 0.0),  # a subtraction of written numbers
        ("\\boxed{9 - 1}", "8", 0.0),
        ("\\boxed{1 - \\sqrt{2}}", "1-\\sqrt{2}", 1.0),
        ("\\boxed{3 - 4i}", "3-4i", 1.0),
        ("\\boxed{(-1, 2)}", "(-1,2)", 1.0),
        ("\\boxed{-3}", "-3", 1.0),  # a sign, a fraction, a root, pi, scientific notation: values as written
        ("1/2", "0.5", 1.0),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        ("\\boxed{2\\sqrt{3}+5}", "5+2\\sqrt{3}", 1.0),
        ("\\boxed{3\\pi}", "3\\pi", 1.0),
        ("\\boxed{3 \\times 10^5}", "300000", 1.0),
        ("\\boxed{-x^2-2x+1}", "-x^2-2x+1", 1.0),  # an expression in a variable is the answer itself
        ("\\boxed{2^{10}}", "2^{10}", 1.0),  # written as the ground truth writes it
        # a MATH ground truth with an escaped dollar (last \boxed{} of "... = \boxed{\$18.90}$.") raised
        ("The total is \\boxed{18.90}", "\\$18.90", 1.0),
        ("\\boxed{\\$18.90}", "\\$18.90", 1.0),
        ("\\boxed{7}", "\\$18.90", 0.0),
        ("18", "$18$", 1.0),
        # gsm8k's "#### <number>" decides, not the last number written after it (the task's prompt asks for it)
        ("Altogether she sold 48+24 = 72 clips.\n#### 72\nThat took her 2 months.", "72", 1.0),
        ("#### 72 (over 2 months)", "72", 1.0),
        ("Altogether she sold 70 clips.\n#### 70\nWith the bonus it would be 72.", "72", 0.0),
        ("#### -1,234.", "-1234", 1.0),
        ("#### -5 (a loss, over 2 months)", "-5", 1.0),  # a negative final answer, not the 2 after it
        ("#### 1 000 000", "1000000", 1.0),  # a number in groups is read whole, not as its first group 1
        ("First try:\n#### 70\nNo, recount: 48 + 24 = 72.\n#### 72", "72", 1.0),  # the last `####` decides
        ("First try:\n#### 70\nNo, recount: 48 + 24 = 72.\n#### 72", "70", 0.0),
        # ... but not a markdown heading, a number written otherwise after it, or beside a \boxed{} (which wins)
        ("#### 1. Set up\n#### 2. Solve\nx=42.\n\nThe answer is \\boxed{42}.", "42", 1.0),
        ("#### 3. Compute the total\nSo she has 7 apples.", "3", 0.0),
        ("#### 72\nWait, the total is 80.\nFinal answer: \\boxed{80}", "72", 0.0),
        ("The answer is 1/2.\n#### 1/2", "1/2", 1.0),
        ("#### 10^6", "1000000", 1.0),
        ("#### 10^{6}", "1000000", 1.0),  # a braced power: read as plain text, 10 scored and 1000000 did not
        ("#### 10^{6}", "10", 0.0),
        ("#### 10^{-3}", "0.001", 1.0),
        ("#### 10^-3", "0.001", 1.0),
        ("#### 10^6\nThat took 2 months.", "1000000", 1.0),  # the `####`, not the last number after it
        ("#### 2^{10}", "1024", 0.0),  # a whole power, as in \boxed{2^{10}}
        # a worked equation after `####` is judged by what follows its last `=`, as without `####`; its first
        # number was read (48), so the right result scored 0 and a question's operand copied scored 1
        ("#### 48 + 24 = 72", "72", 1.0),
        ("#### 48 + 24 = 72", "48", 0.0),
        ("#### 20-5=15", "15", 1.0),
        ("#### 20-5=15", "20", 0.0),
        ("#### 3 * (4 + 5) = 27", "27", 1.0),
        ("#### 5 x 4 = 20", "20", 1.0),
        ("#### $48 + $24 = $72", "72", 1.0),
        ("#### 48 + 24 = 72\nThat took her 2 months.", "72", 1.0),  # the line's `=`, not the 2 after it
        ("#### 48 + 24 = 72 (over 2 months)", "72", 1.0),
        ("First try:\n#### 70\nNo, recount:\n#### 48 + 24 = 72", "72", 1.0),  # still the last `####`
        ("#### 48 + 24", "48", 0.0),  # arithmetic with no `=` is written arithmetic: no answer
        ("#### 48 + 24", "72", 0.0),
        ("#### 48/2", "24", 0.0),  # a whole division, as in \boxed{48/2}
        # scientific notation after `####` is a value as written; read as plain text it was its last term, 10^6
        ("#### 1.5 \\times 10^6", "1500000", 1.0),
        ("#### 1.5 \\times 10^6", "1000000", 0.0),
        ("#### 1.5 x 10^6", "1500000", 1.0),
        ("#### -5", "-5", 1.0),  # a sign is no operator
        ("#### -$5", "-5", 1.0),  # a sign before the dollar sign, as after it: nothing was read (0)
        ("#### - \\$5", "-5", 1.0),
        ("#### -$5", "5", 0.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 1e6", "1000000", 1.0),  # E notation: read as its first number, 1
        ("#### 1e6", "1", 0.0),
        ("#### 2.5e-3", "0.0025", 1.0),
        ("#### 72 - that is the total", "72", 1.0),  # a dash before words is no subtraction
        ("#### 72** (over 2 months)", "72", 1.0),  # markdown bold closed after it is no multiplication
        # forms math-verify misreads, put in the forms it reads (math_answer.normalize)
        ("The balance went from 20 to \u221215.", "-15", 1.0),  # a Unicode minus was skipped: 20 scored
        ("The balance went from 20 to \u221215.", "20", 0.0),
        ("\\boxed{50\\%}", "50", 1.0),  # not read at all
        ("\\boxed{26\\%}", "25", 0.0),
        ("\\boxed{10\\,000}", "10000", 1.0),  # 10 x 0
        ("\\boxed{10 000}", "10000", 1.0),
        ("The answer is 10\u202f000.", "10000", 1.0),
        ("I have 3 100-dollar bills, so 300", "300", 1.0),  # a plain space in prose joins nothing
        ("\\boxed{10000}", "10 000", 1.0),  # a ground truth's groups: it read as 10 x 0 = 0 ...
        ("\\boxed{0}", "10 000", 0.0),  # ... so 0 scored
        ("\\boxed{5.5}", "5 1/2", 1.0),  # a mixed number read as (5 + 1)/2 ...
        ("\\boxed{3}", "5 1/2", 0.0),  # ... so 3 scored
        ("It takes 5 1/2 cups", "5.5", 1.0),
        # digits of another script read as nothing (0 for a right answer): as ASCII digits now
        ("The answer is \uff17\uff12.", "72", 1.0),  # full-width
        ("#### \uff17\uff12", "72", 1.0),
        ("\\boxed{\u0667\u0662}", "72", 1.0),  # Arabic-Indic
        ("\\boxed{\u0967\u0968}", "12", 1.0),  # Devanagari
        ("\\boxed{\u0667\u066b\u0665}", "7.5", 1.0),  # the Arabic decimal separator
        ("\\boxed{\uff17\uff0e\uff15}", "7.5", 1.0),  # full-width point
        ("\\boxed{\uff17\uff12}", "71", 0.0),
        ("\\boxed{72}", "\uff17\uff12", 1.0),  # in a ground truth too
        ("\\boxed{x^2}", "x\u00b2", 1.0),  # a superscript is a power (read as the text x²), not a digit
        ("\\boxed{x2}", "x\u00b2", 0.0),
        ("The answer is 10\u2076.", "1000000", 1.0),  # 10⁶
        ("\\boxed{3 \\times 10\u2075}", "300000", 1.0),  # scientific notation: a value as written
        ("\\boxed{2\u207b\u00b9}", "0.5", 1.0),  # 2⁻¹
        ("The answer is 10\u207b\u00b3.", "0.001", 1.0),  # 10⁻³ in prose
        ("The answer is 10\u00b9\u00b2.", "1000000000000", 1.0),
    ],
)
def test_math_verify(completion, answer, value):
    assert math_verify([completion], [Sample(prompt="", answer=answer)]) == [value]
    assert is_equivalent(completion, answer) == bool(value)  # the tasks' eval check: the same rule


def test_a_ground_truth_in_e_notation_is_the_number_not_eulers_e():
    """str() of a float answer column (1e-05) and a JSON number written 1e5 (kept as written): math-verify
    read the lowercase e as Euler's number (5e, e - 5), which no right answer equals."""
    for answer, written in (("1e5", "100000"), ("1e-05", "0.00001"), ("2.5e3", "2500"), ("-1e-05", "-0.00001"),
                            ("1.5e+16", "15000000000000000"), ("1E5", "100000")):
        assert is_equivalent(f"\\boxed{{{written}}}", answer), answer
        assert not is_equivalent("\\boxed{e}", answer), answer


def test_math_verify_refuses_a_ground_truth_it_cannot_read():
    with pytest.raises(ValueError, match=r"could not parse the ground truth '\\\\text\{\}'"):
        is_equivalent("\\boxed{3}", "\\text{}")


def test_a_ground_truth_past_math_verifys_timeout_is_tried_twice_and_said_to_have_timed_out(monkeypatch, caplog):
    """A ground truth whose parse runs out of math-verify's time (here 1 s; an 800-term sum takes about 14 s)
    is parsed once more, then refused saying it timed out, not that it cannot be read (a loaded machine
    held a plain `(-1,2)` past the 5 s: "could not parse" sent its user to the dataset)."""
    import logging

    from grpo.rewards import math_answer

    monkeypatch.setattr(math_answer, "TIMEOUT_S", 1)
    long = "+".join(f"x_{{{i}}}^{{{i}}}" for i in range(800))
    with caplog.at_level(logging.WARNING, logger="math_verify"):
        with pytest.raises(ValueError, match=r"ran out of its 1 s twice parsing the ground truth 'x_\{0\}"):
            math_answer.parse_gold(long)
    assert sum("Timeout during parsing" in r.getMessage() for r in caplog.records) == 2
    assert math_answer.parse_gold("(-1,2)")[1] == "(-1,2)"  # in time: read as before


def test_a_comparison_past_math_verifys_timeout_is_tried_twice_then_unjudged(monkeypatch, caplog):
    """A completion's answer math-verify reads but cannot compare with the ground truth within its time (here
    1 s; two 2000-factor products take about 36 s, 2 s once sympy has cached them) is compared once more,
    then `Unjudged`: math-verify answers a comparison past its time False, a right answer read as wrong
    with nothing said (evaluation counts it, test_eval)."""
    import logging

    from grpo.errors import Unjudged
    from grpo.rewards import math_answer

    monkeypatch.setattr(math_answer, "TIMEOUT_S", 1)
    with caplog.at_level(logging.WARNING, logger="math_verify"):
        with pytest.raises(Unjudged, match=r"ran out of its 1 s twice comparing the completion's answer with '\\\\prod"):
            math_answer.is_equivalent("\\boxed{\\prod_{k=1}^{2000} (x+k+1)}", "\\prod_{k=1}^{2000} (x+k)")
    assert sum("Timeout during comparison" in r.getMessage() for r in caplog.records) == 2
    assert math_answer.is_equivalent("\\boxed{\\frac{1}{2}}", "0.5")  # in time: judged as before


@pytest.mark.parametrize("override, message", [
    ("reward.rm.path=tiny_rm", "reward.rm.path='tiny_rm': reward.funcs has no rm, so nothing reads the setting"),
    ("reward.rm.tiny.steps=5", "reward.rm.tiny.steps=5: reward.funcs has no rm"),
    ("reward.judge.urls=[http://127.0.0.1:8100]", "reward.judge.urls=['http://127.0.0.1:8100']: reward.funcs has no judge"),
])
def test_a_model_rewards_setting_without_that_reward_is_refused(override, message):
    """reward.rm.* and reward.judge.* with no rm (judge) in reward.funcs: validate passed and the run
    was scored by exact_match alone."""
    with pytest.raises(ConfigError) as e:
        check_rewards(compose_cfg(override))
    assert message in str(e.value) and "Add the reward (reward=" in str(e.value)
    reader = ["reward=rm", "reward.rm.path=tiny_rm"] if ".rm." in override else ["reward=judge"]
    check_rewards(compose_cfg(*reader, override))  # read there: accepted


def test_math_verify_runs_in_the_reward_thread():
    """math-verify's own timeouts use SIGALRM (main thread only); score() calls it in a worker thread."""
    rewards_FB, stats = score([("math_verify", math_verify, 1.0)], ["\\boxed{3}", "4"], [Sample("", "3")] * 2, timeout_s=30)
    assert rewards_FB == [[1.0, 0.0]]
    assert list(stats) == ["math_verify/completions_failed", "math_verify/completions_tried", "time/reward_math_verify_s"]


def test_user_code_that_calls_sys_exit_is_an_error_not_a_none_result():
    """call_with_timeout ran user code (rewards, env steps, tools) catching Exception only: sys.exit() or
    KeyboardInterrupt ended its thread with no value and no error, read as a None result (an env reset
    with no opening observation, a tool's ' = None')."""
    import sys

    from grpo.timeouts import call_with_timeout

    assert call_with_timeout(lambda: 3, 5.0, "reward.timeout_s") == (3, None)
    for fn in (lambda: sys.exit(0), lambda: (_ for _ in ()).throw(KeyboardInterrupt())):
        value, error = call_with_timeout(fn, 5.0, "reward.timeout_s")
        assert value is None and error is not None and "user code must return or raise an Exception" in error


def takes_no_samples(completions):  # the signature a user wrote: no samples, no **kwargs
    return [1.0] * len(completions)


def always_nan(completions, samples, **_):
    return [math.nan] * len(completions)


@pytest.mark.parametrize("fn, error", [
    (takes_no_samples, r"TypeError: takes_no_samples\(\) takes 1 positional argument but 2 were given"),
    (always_nan, r"returned nan, not a finite number or None"),
    (countdown, r"KeyError: 'numbers'"),  # reward=countdown on task=addition's samples, which have no numbers
])
def test_a_reward_that_fails_on_every_completion_is_counted_and_warned_per_completion(fn, error):
    """score() fails each completion (FAILED, with a warning naming the error) and counts them: all 4
    tried, all 4 failed. Whether the run stops is FailureStreak's decision, over every rank (below)."""
    addition = [Sample("What is 2 + 3?", "5")] * 4
    with pytest.warns(UserWarning) as seen:
        rewards, stats = score([("mine", fn, 1.0)], ["5", "6", "5", "2 + 3"], addition, timeout_s=5)
    assert marked(rewards) == [["failed"] * 4]
    assert (stats["mine/completions_failed"], stats["mine/completions_tried"]) == (4, 4)
    assert any(re.search(rf"reward 'mine' failed on completion 0 '5' \({error}", str(w.message)) for w in seen)


def other_rank(*counts: float, stopped: float = 0, outcome=(0, 0, 0)):
    """An all-reduce over this rank and another whose (failed, tried) counts per reward are `counts`
    (and which stopped, 1, or not, 0; `outcome`: its completions rewarded, episodes errored, completions)."""
    return lambda mine: [a + b for a, b in zip(mine, (stopped, *counts, *outcome), strict=True)]


def stats_of(**counts):
    return {f"{name}/completions_{key}": v for name, (failed, tried) in counts.items()
            for key, v in (("failed", failed), ("tried", tried))}


def test_a_rule_reward_failing_throughout_two_batches_in_a_row_on_every_rank_stops_the_run():
    """By value, with two ranks (the other's counts added as the all-reduce would). Before, one rank's
    batch decided alone: a rank whose share was one prompt with a malformed reference answer stopped the
    run (and its resume, which draws that batch again), while the other ranks waited in a collective."""
    from grpo.rewards.failure_streak import FailureStreak

    # one bad row on this rank (8 of 8 failed), the other rank scored its 8: no stop, however often
    streak = FailureStreak(["mine"], reduce=other_rank(0, 8))
    for _ in range(3):
        streak.observe(stats_of(mine=(8, 8)))
    # both ranks failed throughout: the first batch may be one bad row each; the second in a row stops
    streak = FailureStreak(["mine"], reduce=other_rank(8, 8))
    streak.observe(stats_of(mine=(8, 8)))
    with pytest.raises(RewardStop, match=r"reward 'mine' failed on every completion it was tried on in 2 batch\(es\) in "
                                         r"a row, on every rank \(16 of 16 in the last.*a reward takes \(completions, samples"):
        streak.observe(stats_of(mine=(8, 8)))
    # a batch it scored in between starts the count again, and the run's end finds a reward that scored
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0))
    for counts in ((4, 4), (3, 4), (4, 4)):
        streak.observe(stats_of(mine=counts))
    streak.finish()
    # a run too short for two batches (steps=1) whose one batch failed throughout stops at its end
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0))
    streak.observe(stats_of(mine=(4, 4)))
    with pytest.raises(RewardStop, match=r"in 1 batch\(es\) in a row, on every rank \(every batch this run scored, 1;"):
        streak.finish()
    # per reward: another reward failing elsewhere does not add up; untried (0 of 0) is no failure
    streak = FailureStreak(["a", "b"], reduce=other_rank(0, 0, 0, 0))
    for counts in (dict(a=(4, 4), b=(0, 4)), dict(a=(0, 4), b=(4, 4)), dict(a=(0, 0), b=(0, 0)), dict(a=(0, 0), b=(0, 0))):
        streak.observe(stats_of(**counts))


def test_a_step_where_no_completion_got_a_reward_two_batches_in_a_row_stops_the_run():
    """By value, two ranks. Every episode's environment failed, or every function abstained (None
    everywhere): every advantage is 0, and before, the run trained nothing and exited 0, since neither
    counts as a rule reward's failure. One completion rewarded on either rank keeps it going."""
    from grpo.rewards.failure_streak import FailureStreak

    # a rule reward "mine" that abstained, never failed (0 of 0 tried: its stats hold no count)

    nan, none_of_4, errors = math.nan, [math.nan] * 4, ["error"] * 4
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0, outcome=(1, 0, 4)))  # the other rank rewarded one of its 4
    for _ in range(3):
        streak.observe({}, None, none_of_4, errors)
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0, outcome=(0, 4, 4)))
    streak.observe({}, None, none_of_4, errors)
    streak.observe({}, None, [nan, 1.0, nan, nan], errors[:1])  # one rewarded here: the count starts again
    streak.observe({}, None, none_of_4, errors)
    with pytest.raises(RewardStop, match=r"every episode ended in 'error' in 2 batch\(es\) in a row, on every rank \(8 "
                                         r"of 8 episodes ended in error in the last\): its environment failed.*step\(action\)"):
        streak.observe({}, None, none_of_4, errors)
    # abstained (none errored on this rank): the message names the rewards, not the environment
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0, outcome=(0, 4, 4)))
    streak.observe({}, None, none_of_4, errors)
    with pytest.raises(RewardStop, match=r"no completion got a reward in 2 batch\(es\) in a row, on every rank \(4 of 8 "
                                         r"episodes ended in error in the last\): every reward function abstained"):
        streak.observe({}, None, none_of_4, ["stop"] * 4)
    # abstained first, then errored: not "every episode" (the environment is not the whole story)
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0))
    streak.observe({}, None, none_of_4, ["stop"] * 4)
    with pytest.raises(RewardStop, match=r"^no completion got a reward in 2 batch\(es\) in a row, on every rank \(4 of 4 "):
        streak.observe({}, None, none_of_4, errors)
    # a one-step run that rewarded nothing stops at its end; one that rewarded something does not
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0))
    streak.observe({}, None, none_of_4, ["length"] * 4)
    with pytest.raises(RewardStop, match=r"no completion got a reward in 1 batch\(es\) in a row, on every rank \(every "
                                         r"batch this run scored, 1\)"):
        streak.finish()
    streak = FailureStreak(["mine"], reduce=other_rank(0, 0))
    streak.observe({}, None, [0.0, nan, nan, nan], ["stop"] * 4)  # a reward of 0 is a reward
    streak.finish()
    # model rewards alone (no rule reward's name) decide their own stop (reward.judge.min_scored=0: go on)...
    streak = FailureStreak([], reduce=other_rank())
    for _ in range(3):
        streak.observe({}, None, none_of_4, ["stop"] * 4)
    streak.finish()
    # ...but not for an environment that failed every episode
    streak = FailureStreak([], reduce=other_rank())
    streak.observe({}, None, none_of_4, errors)
    with pytest.raises(RewardStop, match=r"^every episode ended in 'error' in 2 batch"):
        streak.observe({}, None, none_of_4, errors)


def test_episodes_that_ended_in_error_are_not_counted_as_failed():
    """A reward that cannot read an empty final turn fails on the 3 episodes whose environment failed
    ("error"; `withhold_errored` gives them no reward anyway): 0 of 3 counted failed, not 3 of 6, and a
    batch of nothing but errored episodes is 0 tried (no failure streak). Before, they counted, and two
    such batches in a row stopped the run with advice about the reward."""
    def needs_text(completions, samples, **_):
        return [float(int(c)) for c in completions]

    counted = [True, False, True, False, True, False]
    with pytest.warns(UserWarning):
        rewards, stats = score([("num", needs_text, 1.0)], ["1", "", "0", "", "1", ""], [None] * 6, counted=counted)
    assert marked(rewards) == [[1.0, "failed", 0.0, "failed", 1.0, "failed"]]
    assert (stats["num/completions_failed"], stats["num/completions_tried"]) == (0, 3)
    with pytest.warns(UserWarning):
        _, stats = score([("num", needs_text, 1.0)], ["", ""], [None] * 2, counted=[False, False])
    assert (stats["num/completions_failed"], stats["num/completions_tried"]) == (0, 0)
    # scored as a batch: only the counted ones are tried
    _, stats = score([("num", needs_text, 1.0)], ["1", "2"], [None] * 2, counted=[True, False])
    assert (stats["num/completions_failed"], stats["num/completions_tried"]) == (0, 1)


def test_a_reward_stop_on_one_rank_stops_every_rank():
    """A model reward's own stop (a judge's min_scored, a refusing server) raised on one rank: every
    rank raises, the others with its reason, in the failure streak's all-reduce. Before, the rank
    raised alone and the others waited in their next collective until the peer watchdog."""
    from grpo.rewards.failure_streak import FailureStreak

    asked = []

    def gather(mine):
        asked.append(mine)
        return [mine, "reward `judge` scored 0 of 8 completions"]

    streak = FailureStreak(["mine"], reduce=other_rank(0, 8, stopped=1), gather=gather)  # the other rank stopped
    with pytest.raises(RewardStop, match=r"^rank 1 stopped the run: reward `judge` scored 0 of 8"):
        streak.observe(stats_of(mine=(0, 8)))
    assert asked == [None]
    # this rank stopped: its own exception, not a copy
    mine = RewardStop("reward 'rm': refused")
    streak = FailureStreak([], reduce=other_rank(), gather=lambda m: [m, None])
    with pytest.raises(RewardStop) as raised:
        streak.observe({}, mine)
    assert raised.value is mine
    # no rank stopped: no gather (a collective only when one did)
    FailureStreak(["mine"], reduce=other_rank(0, 8), gather=lambda m: pytest.fail("gathered")).observe(stats_of(mine=(0, 8)))


def _stop_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as tdist

    from grpo.rewards.failure_streak import FailureStreak

    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    stopped = RewardStop("reward `judge` scored 1 of 8 completions") if rank == 1 else None
    try:
        FailureStreak(["mine"]).observe(stats_of(mine=(0, 4)), stopped)
        outcome = "went on"
    except RewardStop as e:
        outcome = str(e)
    open(f"{out_dir}/rank{rank}", "w").write(outcome)
    tdist.destroy_process_group()


@pytest.mark.starts_process
def test_a_reward_stop_on_one_of_two_real_ranks_stops_both(tmp_path):
    """The same through a real gloo all-reduce and all_gather_object between two processes."""
    import torch.multiprocessing as mp

    mp.spawn(_stop_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    assert (tmp_path / "rank0").read_text() == "rank 1 stopped the run: reward `judge` scored 1 of 8 completions"
    assert (tmp_path / "rank1").read_text() == "reward `judge` scored 1 of 8 completions"


def test_completions_skipped_after_the_hang_limit_are_not_counted_as_failed():
    """3 of 8 completions hang first; the other 5 are skipped (MAX_HANGS) and were never tried: 3 of 3
    tried failed, not 8 of 8. Before, the skipped ones counted as failures, and the batch stopped the run."""
    from grpo.rewards import MAX_HANGS

    def hangs_on_loop(completions, samples, **_):
        if any("loop" in c for c in completions):
            time.sleep(30)
        return [1.0] * len(completions)

    with pytest.warns(UserWarning):
        rewards, stats = score([("code", hangs_on_loop, 1.0)], ["loop"] * MAX_HANGS + ["ok"] * 5, [None] * 8, timeout_s=0.3)
    assert marked(rewards) == [["failed"] * 8]
    assert (stats["code/completions_failed"], stats["code/completions_tried"]) == (MAX_HANGS, MAX_HANGS)


def test_a_reward_that_hangs_for_good_stops_the_run_before_its_threads_pile_up(monkeypatch):
    """Each call past reward.timeout_s is abandoned on a thread Python cannot stop: a reward hanging for
    good on some inputs kept 4 more a step (30 -> 222 threads in 60 steps), until the process could start
    none. Past MAX_HUNG still running (6 here) the run stops naming the setting; calls that ended are
    forgotten, so a function that only hung a while goes on."""
    import grpo.timeouts

    monkeypatch.setattr(grpo.timeouts, "MAX_HUNG", 6)
    monkeypatch.setattr(grpo.timeouts, "_hung", [])  # not another test's sleepers
    release = threading.Event()

    def hangs_on_loop(completions, samples, **_):
        if any("loop" in c for c in completions):
            release.wait(60)
        return [1.0] * len(completions)

    fns, batch = [("code", hangs_on_loop, 1.0)], ["loop"] * 3 + ["ok"]
    try:
        with pytest.warns(UserWarning):
            score(fns, batch, [None] * 4, timeout_s=0.2)  # the batch and 3 completions: 4 abandoned
        with pytest.raises(RewardStop, match=r"^reward 'code': 6 calls of user code are still running past their "
                                             r"timeout \(6 of them past reward.timeout_s\).*or raise reward.timeout_s"), \
                pytest.warns(UserWarning):
            score(fns, batch, [None] * 4, timeout_s=0.2)
    finally:
        release.set()
    for t, _ in list(grpo.timeouts._hung):
        t.join(10)
    rewards, _ = score(fns, batch, [None] * 4, timeout_s=5)  # they ended: nothing held
    assert marked(rewards) == [[1.0] * 4]


def abstains(completions, samples, **_):
    return [None] * len(completions)


@pytest.mark.starts_process
@pytest.mark.parametrize("fn, steps, stop", [
    ("takes_no_samples", 3, r"reward 'tests.test_rewards.takes_no_samples' failed on every completion it was tried on in 2 "),
    ("takes_no_samples", 1, r"reward 'tests.test_rewards.takes_no_samples' failed on every completion it was tried on in 1 "),
    ("abstains", 3, r"no completion got a reward in 2 batch\(es\) in a row, on every rank \(0 of \d+ episodes ended in"),
])
def test_a_run_whose_rule_reward_fails_throughout_stops(make_cfg, fn, steps, stop):
    """A reward that takes no samples (a wrong signature): a RewardStop at step 2, after the first
    batch's warnings, or at the end of a one-step run, not a run that trains nothing and exits 0. The
    same for one that abstains (None) on every completion, which is no failure of its own."""
    from grpo.train import train

    cfg = make_cfg(f"reward.funcs=[{{name: tests.test_rewards.{fn}, weight: 1.0}}]", f"steps={steps}",
                   "checkpoint_every=0", "eval_every=0")
    with pytest.raises(RewardStop, match=stop), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg)
    assert [json.loads(line)["step"] for line in open(f"{cfg.run_dir}/metrics.jsonl") if '"loss"' in line] == [1]
    assert not os.path.exists(f"{cfg.run_dir}/summary.json")


def test_a_reward_that_abstains_on_every_completion_does_not_stop_the_run():
    """None is no failure: a function that applies to none of this batch's completions lets the others count."""
    def never_applies(completions, samples, **_):
        return [None] * len(completions)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rewards, _ = score([("never", never_applies, 1.0)], ["a", "b"], [None] * 2, timeout_s=5)
    assert rewards == [[None, None]]


@pytest.mark.parametrize("override, message", [
    ("reward.funcs=[{weight:1}]", r"reward.funcs\[0\] has no name: give each entry one, e.g. reward.funcs=\[\{name: exact_match"),
    ("reward.funcs=[{name:exact_match},{name:format},{name:exact_match}]",
     "reward.funcs lists 'exact_match' twice, so its reward would count twice: list it once with weight: 2"),
    ("reward.timeout_s=0", r"reward.timeout_s=0.0: give a number of seconds > 0"),
    ("reward.timeout_s=-1", r"reward.timeout_s=-1.0: give a number of seconds > 0"),
    ("reward.timeout_s=inf", r"reward.timeout_s=inf: give a number of seconds > 0"),
])
def test_reward_funcs_without_a_name_listed_twice_or_without_time_are_refused(override, message):
    """A nameless entry raised OmegaConf's MissingMandatoryValue; a name listed twice silently doubled
    its reward; reward.timeout_s=0 made every call time out at once (join(0)), so slow rewards dropped."""
    with pytest.raises(ConfigError, match=message):
        check_rewards(compose_cfg(override))
    check_rewards(compose_cfg("reward.funcs=[{name:exact_match,weight:2}]", "reward.timeout_s=0.5"))  # accepted


def test_a_model_rewards_own_stop_stops_the_run_not_only_its_batch():
    """A model reward (here under the name `judge`) that raises RewardStop (a refusing server, a batch
    below min_scored) stops the run with its own reason. Were it caught with every other exception,
    the batch would only be marked failed with a warning, and a judge whose token is wrong would fail
    every batch of the run without stopping it."""
    def judge(completions, samples, **_):
        raise RewardStop("the judge refused the token")

    with pytest.raises(RewardStop, match="the judge refused the token"):
        score([("judge", judge, 1.0)], ["a"], [None], timeout_s=5)


def test_a_rule_rewards_own_stop_is_raised_from_its_thread():
    """A rule reward runs on a thread under reward.timeout_s; a RewardStop it raises there (a setup
    mistake it detects itself) is raised again in the caller with its reason. Were it dropped in the
    thread, the call would seem to return nothing, and scoring would fail on that with an unrelated
    TypeError (len of None) instead of the reward's own stop."""
    def rule(completions, samples, **_):
        raise RewardStop("bad reference answers")

    with pytest.raises(RewardStop, match="bad reference answers"):
        score([("rule", rule, 1.0)], ["a", "b"], [None] * 2, timeout_s=5)


def test_a_weight_of_0_beside_a_positive_one_is_refused():
    """reward.funcs=[exact_match: 1, format: 0]: the 0 changes nothing, so the user who wrote it meant
    something else (to drop the function, or a small weight). A check that refused only weights all
    <= 0 would let it pass silently; a 0 is refused on its own."""
    with pytest.raises(ConfigError, match="a weight of 0 changes nothing"):
        check_rewards(compose_cfg("reward.funcs=[{name:exact_match,weight:1},{name:format,weight:0}]"))
    check_rewards(compose_cfg("reward.funcs=[{name:exact_match,weight:1},{name:format,weight:0.1}]"))  # accepted


@pytest.mark.parametrize("weight", ["inf", "nan", "-inf"])
def test_a_weight_that_is_not_finite_is_refused(weight):
    """weight: inf passed (max > 0), and combine_rewards gave a completion that scored 1 the reward inf
    and one that scored 0 the reward inf * 0 = NaN (excluded): every advantage of the group NaN or 0.
    weight: nan passed too (NaN > 0 and NaN == 0 are both false) and excluded every completion."""
    with pytest.raises(ConfigError, match=f"reward.funcs weights .*'exact_match': {weight}.* finite number"):
        check_rewards(compose_cfg(f"reward.funcs=[{{name:exact_match,weight:{weight}}},{{name:format,weight:0.1}}]"))


def test_a_run_that_scored_nothing_does_not_stop_at_its_end():
    """A resume of a finished run (or a run stopped before its first scored batch) calls `finish`
    with no batch observed: every reward's streak is 0 of 0 batches, which is no failure. Compared
    without the `observed` count, 0 == 0 would read as "failed throughout every batch" and raise a
    false RewardStop at the end of a run that did nothing wrong."""
    from grpo.rewards.failure_streak import FailureStreak

    FailureStreak(["mine"], reduce=other_rank(0, 0)).finish()  # nothing observed: no stop


def test_a_reward_value_is_a_number_only_where_it_is_real():
    """grpo/rewards as_number: ints, floats, bools, numpy scalars and 0-d tensors (of any real dtype) are
    scores; a complex 0-d tensor or array (its .item() a complex: float() of it raises), a tensor of
    several values, a string are not (None: the batch check then names the value)."""
    from grpo.rewards import as_number

    real = [1, 0.5, True, np.float32(0.25), np.int64(2), torch.tensor(0.75), torch.tensor(3), np.array(1.5),
            torch.tensor(1.0, dtype=torch.bfloat16)]
    assert [as_number(v) for v in real] == [1.0, 0.5, 1.0, 0.25, 2.0, 0.75, 3.0, 1.5, 1.0]
    not_real = [torch.tensor(1 + 2j), np.array(1 + 2j), 1 + 2j, torch.tensor([1.0, 2.0]), "1", None]
    assert [as_number(v) for v in not_real] == [None] * len(not_real)
