"""Multi-turn episodes: the driver (grpo/rollout/episodes.py), environments (grpo/envs/), observation
rendering (grpo/rollout/render.py), the loss mask through collate and the loss, and a training run.

The driver's unit tests drive it with `Scripted`, a generate function whose turns are written in the
test, since what is under test there is the driver (budgets, masks, faults, lockstep); the real
backends run the same driver below (hf) and in tests/test_remote.py, test_rollout_vllm.py and
test_dedicated.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
import warnings
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo.metrics import resolve
from grpo.envs import CalcEnv, GuessEnv, RetryEnv, Step, TextEnv, calculator
from grpo.errors import ConfigError
from grpo.envs.guess import binary_search_turns
from grpo.rollout.base import RolloutBackend, Rollouts, Sampling
from grpo.rollout.episodes import Budget, EpisodeRunner, cut_middle, reset_seed, turn_seed
from grpo.rollout.render import ChatRender, RawRender
from grpo.tasks.base import Sample
from tests.parity import EndsAtTurnOne
from tests.conftest import compose_cfg, measured

GUESS = [Sample("Guess 1-15:", str(s)) for s in range(1, 16)]


class Scripted:
    """generate(prompt_ids, n, sampling) whose turn is `policy(prompt_ids) -> text` (tokenized and
    ended by <eos>, or cut at max_new_tokens as an engine would), logprob -0.5 per token. Records
    every request and fails on one beyond `max_context`."""

    def __init__(self, tok, policy, max_context: int = 10_000, ids=None):
        self.tok, self.policy, self.max_context, self.ids = tok, policy, max_context, ids
        self.requests: list[tuple[list[list[int]], int, int]] = []

    def __call__(self, prompt_ids, n, sampling: Sampling) -> Rollouts:
        self.requests.append(([list(p) for p in prompt_ids], n, sampling.max_new_tokens))
        out_ids, reasons = [], []
        for p in prompt_ids:
            assert len(p) + sampling.max_new_tokens <= self.max_context, "a request beyond the engine's context"
            for _ in range(n):
                ids = self.ids(p) if self.ids else list(self.tok(self.policy(p), add_special_tokens=False).input_ids)
                ids = ids + [self.tok.eos_token_id]
                if len(ids) > sampling.max_new_tokens:
                    ids, reason = ids[: sampling.max_new_tokens], "length"
                else:
                    reason = "stop"
                out_ids.append(ids)
                reasons.append(reason)
        return Rollouts(out_ids, [[-0.5] * len(i) for i in out_ids], reasons, weight_version=7)


def binary_search_policy(tok):
    """Plays binary search by reading the observations in its own prompt: it sees them or fails."""
    def policy(prompt_ids):
        text = tok.decode(prompt_ids, skip_special_tokens=True)
        low, high = 1, 15
        for ch in text.split(":", 1)[1]:
            if ch in "<>":
                mid = (low + high) // 2
                low, high = (low, mid - 1) if ch == "<" else (mid + 1, high)
        return str((low + high) // 2)
    return policy


def runner(tok, make_env=GuessEnv, max_turns=4, max_new=3, total=100, obs=4, context=None, timeout=5.0, render=None,
           max_concurrency=32):
    return EpisodeRunner(make_env, tok, render or RawRender(tok), Budget(max_turns, max_new, total, obs, context),
                         timeout, [tok.eos_token_id], "test-env", max_concurrency)


def prompts_of(tok, samples):
    return [tok(s.prompt).input_ids for s in samples]


def test_dr_grpo_budget_counts_every_turn_of_an_episode(tiny_lm):
    """The loss's constant (algo.loss_norm=dr_grpo) is the most tokens one completion can sample: one
    turn's max_new_tokens without an environment, every turn's with one (4 turns of 3 here)."""
    _, tok = tiny_lm
    single, episodic = SimpleNamespace(episodes=None), SimpleNamespace(episodes=runner(tok, max_turns=4, max_new=3))
    assert RolloutBackend.sampled_budget(single, 3) == 3
    assert RolloutBackend.sampled_budget(episodic, 3) == 12


def test_guess_episodes_put_masked_observations_between_turns(tiny_lm):
    _, tok = tiny_lm
    gen = Scripted(tok, binary_search_policy(tok))
    out = runner(tok).run(gen, prompts_of(tok, GUESS), GUESS, 2, Sampling(3, seed=5))
    assert len(out.completion_ids) == 30 and out.weight_version == 7
    assert all(e.finish == "stop" and e.env_reward == 1.0 for e in out.episodes)  # every secret, both copies
    assert sum(e.turns for e in out.episodes) / 30 == pytest.approx(49 / 15)  # binary search: 3.27 guesses
    # secret 7: 8 < 4 > 6 > 7, as tokens: "8" eos "<" "4" eos ">" "6" eos ">" "7" eos
    i = 6 * 2
    span, mask, lps = out.completion_ids[i], out.loss_masks[i], out.logprobs[i]
    eos = tok.eos_token_id
    expected = [tok.convert_tokens_to_ids(c) if c != "E" else eos for c in "8E<4E>6E>7E"]
    assert span == expected
    assert mask == [1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert lps == [-0.5 if m else 0.0 for m in mask]
    assert out.episodes[i].transcript == "8<4>6>7" and out.episodes[i].final_text == "7"
    assert out.episodes[i].observation_tokens == 3 and out.episodes[i].sampled_tokens == 8
    # turn 1 is one request for the prompts, n each; later turns send prompt + span, n = 1
    first, n, _ = gen.requests[0]
    assert n == 2 and len(first) == 15
    assert gen.requests[1][1] == 1 and gen.requests[1][0][0][-2:] == [eos, tok.convert_tokens_to_ids("<")]
    assert len(gen.requests) == 4  # the most turns any episode took


def test_turn_seeds_keep_turn_one_and_the_run_seeds_bits():
    seed = (12345 << 32) + 678
    assert turn_seed(seed, 1) == seed and turn_seed(None, 3) is None
    later = {turn_seed(seed, t) for t in range(2, 6)}
    assert len(later) == 4 and all(s >> 32 == 12345 and s != seed for s in later)


def test_an_episode_ending_at_turn_one_is_exactly_generate_on_hf(tiny_lm):
    """env done after the first turn: the driver's ids, logprobs and finish reasons are generate's own."""
    from grpo.rollout.hf import HFBackend

    model, tok = tiny_lm
    backend = HFBackend(None, model, tok)
    prompts = [tok("12+34=").input_ids, tok("7=").input_ids]
    samples = [Sample("12+34=", "046"), Sample("7=", "7")]
    sampling = Sampling(max_new_tokens=6, temperature=1.0)
    torch.manual_seed(3)
    plain = backend.generate(prompts, 4, sampling)
    torch.manual_seed(3)
    one = runner(tok, make_env=lambda: EndsAtTurnOne(), max_new=6).run(backend.generate, prompts, samples, 4, sampling)
    assert one.completion_ids == plain.completion_ids and one.logprobs == plain.logprobs
    assert one.finish_reasons == [("length" if r == "length" else "stop") for r in plain.finish_reasons]
    assert all(m == [1] * len(ids) for m, ids in zip(one.loss_masks, one.completion_ids))


class FailsOnOdd(GuessEnv):
    """Its sandbox is down for the odd secrets: reset raises."""

    def reset(self, sample, seed):
        if int(sample.answer) % 2:
            raise RuntimeError("sandbox down")
        return super().reset(sample, seed)


def test_an_evaluation_counts_the_episodes_whose_environment_failed(tiny_lm):
    """An episode whose environment failed is judged as "" (wrong): evaluation lowered accuracy without
    a count, so a broken sandbox read as a worse policy. `eval/episode_errors` counts them (3 odd secrets
    of 1-6), on the hf backend's real generate."""
    from grpo.dist import DistInfo
    from grpo.eval import evaluate
    from grpo.rollout.hf import HFBackend
    from grpo.tasks.base import Task

    model, tok = tiny_lm
    backend = HFBackend(None, model, tok)
    backend.episodes = runner(tok, make_env=FailsOnOdd)
    cfg = compose_cfg("task=guess", "env=guess", "eval_samples=1", "rollout.max_new_tokens=3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each failed reset's warning
        metrics = evaluate(backend, tok, Task("guess", GUESS, GUESS[:6], chat_template="never"), cfg, DistInfo())
    assert metrics["eval/episode_errors"] == 3 and 0 <= metrics["eval/accuracy"] <= 0.5


class InitRaises(GuessEnv):
    def __init__(self, url: str = "http://sandbox"):
        raise RuntimeError(f"cannot connect to {url}")


def forgets_return(**_):
    GuessEnv()


@pytest.mark.parametrize("name, message", [
    ("tests.test_episodes.InitRaises", r"env.name='tests.test_episodes.InitRaises' with env.kwargs=\{'url': 'x'\} raised "
                                       r"when built: RuntimeError: cannot connect to x. Check env.kwargs"),
    ("tests.test_episodes.forgets_return", r"env.name='tests.test_episodes.forgets_return' built NoneType 'None', which "
                                           r"has no reset, step, close"),
])
def test_an_environment_that_cannot_be_built_stops_naming_it(name, message):
    """A constructor that raised (a sandbox it cannot reach) was a bare traceback naming neither env.name nor
    its kwargs; a factory that forgot its `return` failed every episode's reset with an AttributeError."""
    from grpo.envs import env_factory

    kwargs = {"url": "x"} if "InitRaises" in name else {}
    make = env_factory(SimpleNamespace(name=name, kwargs=kwargs), task=None)
    with pytest.raises(ConfigError, match=message):
        make()


class Recording(GuessEnv):
    seen: list = []

    def step(self, action):
        Recording.seen.append(action)
        return super().step(action)


def test_budgets_end_episodes_as_length_and_a_cut_turn_never_reaches_the_env(tiny_lm):
    _, tok = tiny_lm
    Recording.seen = []
    always_8 = Scripted(tok, lambda p: "8")
    # span budget 7: turn 1 (2) + obs (1) + turn 2 (2) + obs (1) = 6, no room for a 3-token turn: "length"
    out = runner(tok, make_env=Recording, total=7, context=None).run(always_8, prompts_of(tok, GUESS[:3]), GUESS[:3], 1,
                                                                     Sampling(3))
    assert [e.finish for e in out.episodes] == ["length", "length", "length"]
    assert all(e.out_of_budget for e in out.episodes) and all(len(ids) <= 7 for ids in out.completion_ids)
    # the engine's context: prompt (12) + span + a whole turn (3) within 20 -> 2 turns at most
    out = runner(tok, context=20).run(Scripted(tok, lambda p: "8", max_context=20), prompts_of(tok, GUESS[:2]), GUESS[:2], 1,
                                      Sampling(3))
    assert [e.turns for e in out.episodes] == [2, 2] and {e.finish for e in out.episodes} == {"length"}
    # a turn cut at max_new_tokens ("123" + eos > 3 tokens) ends the episode before the environment sees it
    Recording.seen = []
    out = runner(tok, make_env=Recording).run(Scripted(tok, lambda p: "123"), prompts_of(tok, GUESS[:2]), GUESS[:2], 1,
                                              Sampling(3))
    assert [e.finish for e in out.episodes] == ["length", "length"] and Recording.seen == []
    assert not any(e.out_of_budget for e in out.episodes)  # cut mid-turn, not out of budget
    # the turn cap
    out = runner(tok, max_turns=2).run(always_8, prompts_of(tok, GUESS[:1]), GUESS[:1], 1, Sampling(3))
    assert out.episodes[0].finish == "turns" and out.episodes[0].turns == 2


class Verbose(GuessEnv):
    """Secret 1 answers with a 12-character observation, past the runner's 4 tokens."""

    def step(self, action):
        step = super().step(action)
        return replace(step, observation="lower, lower") if self.secret == 1 and not step.done else step


def test_long_observations_are_cut_in_the_middle_and_counted(tiny_lm):
    """Cut to env.max_observation_tokens, as the docs say, and counted (`episode/observations_cut`): a
    tool whose output is always cut read the same as one that fits, in every metric."""
    assert cut_middle(list(range(10)), 10, [99]) == list(range(10))
    assert cut_middle(list(range(10)), 5, [99]) == [0, 1, 99, 8, 9]
    _, tok = tiny_lm
    out = runner(tok, make_env=Verbose, max_turns=3).run(Scripted(tok, lambda p: "8"), prompts_of(tok, GUESS[:3]),
                                                          GUESS[:3], 1, Sampling(3))
    assert [e.observations_cut for e in out.episodes] == [2, 0, 0]  # turns 1 and 2 observed; turn 3 is the last
    assert resolve(out.metrics())["episode/observations_cut"] == 2


class Hangs(GuessEnv):
    def step(self, action):
        if self.secret == 2:
            time.sleep(30)
        if self.secret == 3:
            raise RuntimeError("tool crashed")
        return super().step(action)


def test_an_env_that_hangs_or_raises_ends_its_episode_as_error_within_its_timeout(tiny_lm):
    _, tok = tiny_lm
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 3 s: on a loaded machine a trivial step's thread can wait a second for a core, and miss a shorter timeout
        out = runner(tok, make_env=Hangs, timeout=3.0).run(Scripted(tok, binary_search_policy(tok)), prompts_of(tok, GUESS[:4]),
                                                           GUESS[:4], 1, Sampling(3))
    assert [e.finish for e in out.episodes] == ["stop", "error", "error", "stop"]
    assert out.episodes[1].env_s < 3 + 10  # the hung step was waited for its timeout, not its 30 s
    assert time.perf_counter() - t0 < 20  # the whole batch too, on a loaded machine
    assert out.episodes[1].env_reward is None and "3s" in out.episodes[1].error
    assert "tool crashed" in out.episodes[2].error
    messages = [str(w.message) for w in caught]
    assert sum("'test-env'" in m and "error" in m for m in messages) == 2, messages


class HangsForGood(GuessEnv):
    release = threading.Event()

    def step(self, action):
        self.release.wait(60)
        return super().step(action)


def test_an_environment_hung_for_good_stops_the_run_at_scoring_where_every_rank_stops(tiny_lm, monkeypatch):
    """Calls of an environment's code abandoned past env.step_timeout_s pile up as threads; past MAX_HUNG
    (3 here) the run stops. It stopped inside the episode driver, on that rank alone, while the others
    waited in their next collective for the peer watchdog. The episodes now end as errors, and the stop
    comes at scoring, as a RewardStop that failure_streak.stop_together raises on every rank."""
    import grpo.timeouts
    from grpo.errors import RewardStop
    from grpo.rewards import score

    _, tok = tiny_lm
    monkeypatch.setattr(grpo.timeouts, "MAX_HUNG", 3)
    monkeypatch.setattr(grpo.timeouts, "_hung", [])  # not another test's sleepers
    HangsForGood.release.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):  # 6 hung calls, past MAX_HUNG, and the last batches still ran their episodes
                out = runner(tok, make_env=HangsForGood, timeout=0.2).run(
                    Scripted(tok, binary_search_policy(tok)), prompts_of(tok, GUESS[:2]), GUESS[:2], 1, Sampling(3))
                assert [e.finish for e in out.episodes] == ["error", "error"]
        with pytest.raises(RewardStop, match=r"^6 calls of user code are still running past their timeout \(6 of them "
                                             r"past env.step_timeout_s\).*or raise env.step_timeout_s"):
            score([("r", lambda completions, samples, **_: [1.0] * len(completions), 1.0)], ["a"], [GUESS[0]])
    finally:
        HangsForGood.release.set()
    for t, _ in list(grpo.timeouts._hung):
        t.join(10)


def test_a_tool_hung_for_good_ends_its_calls_as_errors_and_stops_the_run_at_scoring(monkeypatch):
    """The same for a tool of a ToolEnv: its calls past tool_timeout_s return tool errors, also past
    MAX_HUNG (raised from env.step, the stop came inside the episode driver on one rank); scoring stops."""
    import grpo.timeouts
    from grpo.envs.tools import ToolEnv
    from grpo.errors import RewardStop
    from grpo.rewards import score

    monkeypatch.setattr(grpo.timeouts, "MAX_HUNG", 3)
    monkeypatch.setattr(grpo.timeouts, "_hung", [])
    release = threading.Event()
    env = ToolEnv({"slow": lambda arg: release.wait(60)}, tool_timeout_s=0.1)
    try:
        for _ in range(5):
            assert env.step("slow: x").info["tool_error"]
        with pytest.raises(RewardStop, match=r"^5 calls of user code are still running past their timeout"):
            score([("r", lambda completions, samples, **_: [1.0] * len(completions), 1.0)], ["a"], [None])
    finally:
        release.set()
    for t, _ in list(grpo.timeouts._hung):
        t.join(10)


class WrongTypes(GuessEnv):
    """The guess game answering by secret: 1 an int observation, 2 a dict, 3 None (allowed: nothing
    shown), 4 a bare string instead of a Step; 5 opens its episode with an int at reset; 7 a reward
    that is text, 8 an info that is None; 9 a 0-d tensor reward, 10 a bool one (allowed: numbers); 11 a
    NaN reward (the environment's fault, not the reward function's), 12 a done that is the text "False"
    (truthy: it ended every episode as "stop", silently); 13 numpy's True (a gym-style done: allowed)."""

    def reset(self, sample, seed):
        text = super().reset(sample, seed)
        return 7 if self.secret == 5 else text

    def step(self, action):
        bad = {1: Step(42, 0.0, False), 2: Step({"board": "<"}, 0.0, False), 3: Step(None, 0.0, False), 4: "<",
               7: Step("<", "miss", False), 8: Step("<", 0.0, False, None), 9: Step("<", torch.tensor(0.25), False),
               10: Step("<", False, False), 11: Step("<", math.nan, False), 12: Step("<", 0.0, "False"),
               13: Step("<", 0.0, np.True_)}
        return bad.get(self.secret) or super().step(action)


def test_an_env_answering_with_a_non_string_ends_its_episode_as_a_counted_error_naming_what_to_return(tiny_lm):
    """An observation that is not text (an int, a dict, at reset or in a Step) or a step that returns no
    Step ends that episode as "error" with a warning naming the environment and what it must return;
    the other episodes are whole, and None stays an empty observation. Never a TypeError deep in the
    tokenizer that ends the run."""
    _, tok = tiny_lm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = runner(tok, make_env=WrongTypes, max_turns=2).run(Scripted(tok, binary_search_policy(tok)),
                                                                prompts_of(tok, GUESS[:13]), GUESS[:13], 1, Sampling(3))
    assert [e.finish for e in out.episodes] == ["error", "error", "turns", "error", "error", "turns",
                                                "error", "error", "turns", "turns", "error", "error", "stop"]
    assert all(out.episodes[i].env_reward is None for i in (0, 1, 3, 4, 6, 7))
    assert "int" in out.episodes[0].error and "dict" in out.episodes[1].error and "str" in out.episodes[3].error
    assert "Step.reward=a str ('miss')" in out.episodes[6].error and "Step.info=a NoneType" in out.episodes[7].error
    assert out.episodes[8].env_reward == 0.5 and out.episodes[9].env_reward == 0.0  # two 0-d tensors of 0.25; False, False
    assert "Step.reward=a float ('nan'); it must be a finite number or None" in out.episodes[10].error
    assert "Step.done=a str ('False'); it must be a bool" in out.episodes[11].error
    messages = [str(w.message) for w in caught if "'test-env'" in str(w.message)]
    assert len(messages) == 8 and all("str or None" in m or "a Step" in m or "must be a" in m for m in messages), messages
    assert "reset failed" in messages[0] and "int" in messages[0]  # the resets come before any turn


def test_lockstep_keeps_calling_generate_while_another_rank_is_active(tiny_lm):
    """This rank's episodes end at turn 1; another rank's go on to turn 4: this rank joins every turn."""
    _, tok = tiny_lm
    gen, turns = Scripted(tok, lambda p: "8"), []

    def lockstep(value):  # the other rank: no split at turn 1 (call 2), then active for turns 2-4 (calls 3-5)
        turns.append(value)
        return value > 0 or 3 <= len(turns) <= 5

    out = runner(tok, make_env=lambda: EndsAtTurnOne()).run(gen, prompts_of(tok, GUESS[:2]), GUESS[:2], 1, Sampling(3), lockstep)
    assert len(gen.requests) == 4 and turns == [2, 0, 0, 0, 0, 0]
    assert [len(r[0]) for r in gen.requests[1:]] == [1, 1, 1]  # throwaway requests: one prompt each,
    assert [r[2] for r in gen.requests] == [3, 3, 3, 3]  # with the others' sampling (one engine schedule under TP)
    assert [e.turns for e in out.episodes] == [1, 1]


def test_a_rank_with_no_prompts_joins_the_others_turns(tiny_lm):
    """Evaluation gives ranks task.eval[rank::world]: with fewer prompts than ranks one has none, while
    another plays its episodes on. The empty rank joins each of their turns with an empty request
    (hf's synced generate turns [] into its dummy forward), never an IndexError on prompt_ids[0]."""
    _, tok = tiny_lm
    gen, calls = Scripted(tok, lambda p: "8"), []

    def lockstep(value):  # the other rank: active at turns 1-3 (call 2 is turn 1's request shape: shared)
        calls.append(value)
        return len(calls) != 2 and len(calls) <= 4

    out = runner(tok).run(gen, [], [], 1, Sampling(3), lockstep)
    assert out.completion_ids == [] and calls == [0, 0, 0, 0, 0]
    assert [r[0] for r in gen.requests] == [[], [], []]  # turn 1's generate(prompts, n), then two throwaways


def test_an_opening_observation_under_chat_rendering_is_refused(smollm2_tokenizer):
    """The prompt ends with the chat template's generation prompt (an open assistant turn); an opening
    observation rendered after it as a user message makes a conversation no template renders, on
    which the policy would be sampled and trained. It is a ConfigError naming what to change."""
    tok = smollm2_tokenizer

    class Opening(RetryEnv):
        def reset(self, sample, seed):
            super().reset(sample, seed)
            return "The board: X.O"

    sample = Sample("Play tic-tac-toe.", "x")
    prompt = tok.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    run = runner(tok, make_env=lambda: Opening(lambda a, s: True), max_turns=2, max_new=10, obs=64,
                 render=ChatRender(tok))
    with pytest.raises(ConfigError, match=r"env.render=chat: environment 'test-env' opened the episode .*env.render=raw"):
        run.run(Scripted(tok, lambda p: "B2"), [prompt], [sample], 1, Sampling(10))
    out = runner(tok, make_env=lambda: Opening(lambda a, s: True), max_turns=2, max_new=10, obs=64).run(
        Scripted(tok, lambda p: "B2"), [prompt], [sample], 1, Sampling(10))  # raw: the text as it is
    assert tok.decode(out.completion_ids[0]).startswith("The board: X.O")


def test_the_turn_one_request_shape_is_collective(tiny_lm):
    """Every trajectory here is active and has no opening observation, so alone this rank would send
    generate(prompts, n=2); another rank had a failed reset (it answers "split" at turn 1), so every
    rank sends one request per trajectory instead: under ZeRO-3's synced generate and a tensor-parallel
    engine, ranks issuing different requests hang or hand completions to the wrong trajectories."""
    _, tok = tiny_lm
    gen, calls = Scripted(tok, lambda p: "8"), []

    def lockstep(value):  # call 1: any rank active; call 2: any rank must split (the other one must)
        calls.append(value)
        return True if len(calls) == 2 else value > 0

    out = runner(tok, make_env=lambda: EndsAtTurnOne()).run(gen, prompts_of(tok, GUESS[:2]), GUESS[:2], 2, Sampling(3), lockstep)
    assert calls[:2] == [4, 0]
    assert [(len(r[0]), r[1]) for r in gen.requests[:1]] == [(4, 1)]  # 4 trajectories, n=1 each; not 2 prompts x 2
    assert [e.turns for e in out.episodes] == [1] * 4


def test_reset_seeds_fit_every_seeding_api(tiny_lm):
    """A run seed >= 1 makes sampling seeds >= 2**32 (grpo.train.sampling_seed), which numpy's legacy
    seeding refuses: every episode of such an environment ended as "error"."""
    import numpy as np

    from grpo.train import sampling_seed

    seeds = [reset_seed(sampling_seed(s, step, 0, 1, 8, 4), i) for s in (0, 1, 2**31 - 1) for step in (1, 2) for i in range(32)]
    assert all(0 <= x < 2**31 for x in seeds) and len(set(seeds)) == len(seeds)
    for x in seeds[:5]:
        np.random.seed(x)
    assert reset_seed(sampling_seed(1, 3, 0, 1, 8, 4), 5) == reset_seed(sampling_seed(1, 3, 0, 1, 8, 4), 5)


class SeededSecret(GuessEnv):
    """The guess game whose secret comes from the reset's seed, not the sample (as an OpenEnv server
    that picks its puzzle from the seed, with no `reset_fields`); records the seed it got."""

    def reset(self, sample, seed):
        super().reset(sample, seed)
        self.seed, self.secret = seed, 1 + seed % 15
        return None


def test_a_groups_trajectories_reset_with_one_seed_and_groups_with_different_ones(tiny_lm):
    """2 prompts x n = 3: each group plays one task instance, so its mean (GRPO's baseline) compares
    attempts at the same secret. Seeded per trajectory, the 3 members of a group played 3 different
    secrets under one prompt and the advantage mixed in how hard each one's secret was."""
    _, tok = tiny_lm
    built = []

    def make():
        built.append(SeededSecret())
        return built[-1]

    runner(tok, make_env=make).run(Scripted(tok, lambda p: "8"), prompts_of(tok, GUESS[:2]), GUESS[:2], 3, Sampling(3, seed=5))
    seeds = [env.seed for env in built]  # built in the trajectories' order: completion k of prompt i is i * 3 + k
    assert seeds == [reset_seed(5, 0)] * 3 + [reset_seed(5, 1)] * 3
    assert reset_seed(5, 0) != reset_seed(5, 1)


def test_observation_logits_leave_loss_and_gradients_exactly_equal(tiny_lm):
    """Noise added to the hidden states that predict observation tokens (logits there change) leaves the
    loss and every gradient bit-for-bit equal; the token normaliser counts sampled tokens only."""
    import copy

    from omegaconf import OmegaConf

    from grpo.config import AlgoConfig
    from grpo.parallel.single import SingleStrategy
    from grpo.update import accumulate_gradients, loss_norm
    from grpo.batch import collate

    model, tok = copy.deepcopy(tiny_lm[0]), tiny_lm[1]
    out = runner(tok).run(Scripted(tok, binary_search_policy(tok)), prompts_of(tok, GUESS[4:8]), GUESS[4:8], 1, Sampling(3))
    prompts = prompts_of(tok, GUESS[4:8])
    batch = collate(prompts, out, torch.tensor([1.0, -0.5, 0.25, 0.8]), tok.pad_token_id, False)
    assert int(batch.mask_BT.sum()) == sum(e.sampled_tokens for e in out.episodes)
    assert loss_norm(batch, 12, 1.0).num_tokens == sum(e.sampled_tokens for e in out.episodes)
    # padded rows: the hook below finds the positions in the B x L layout
    algo = OmegaConf.structured(AlgoConfig(lr=1e-3, batch_size=4, group_size=4, packing=False))
    strategy = SingleStrategy(None, model, algo, total_steps=10)
    width = batch.prompt_width
    observed_BT = (batch.mask_BT == 0) & (batch.attention_mask_BL[:, width:] == 1)
    assert observed_BT.sum() == sum(e.observation_tokens for e in out.episodes) > 0

    def grads(noise: bool):
        handle = None
        if noise:
            def hook(module, inputs, output):  # the hidden state at position p predicts token p + 1
                bump = torch.zeros_like(output)
                bump[:, width - 1 : width - 1 + observed_BT.shape[1]][observed_BT] = 5.0
                return output + bump
            handle = unwrap(model).model.norm.register_forward_hook(hook)
        model.zero_grad(set_to_none=True)
        sums, _ = accumulate_gradients(strategy, batch, algo, loss_norm(batch, 12, 1.0), 1.0)
        if handle:
            handle.remove()
        return float(sums["loss"]), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_a, grads_a = grads(False)
    loss_b, grads_b = grads(True)
    assert loss_a == loss_b and grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    # the hook can change what it touches: the same noise on the sampled tokens' positions moves the
    # gradients (the on-policy loss value is sum(A) / n whatever the logits: its ratio is exactly 1)
    observed_BT = batch.mask_BT == 1
    _, grads_c = grads(True)
    assert not all(torch.equal(grads_a[k], grads_c[k]) for k in grads_a)


def unwrap(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    import importlib.util

    from transformers import AutoTokenizer

    from grpo.packaged import PACKAGED

    module, filename, _ = PACKAGED["smollm2-135m"]
    folder = list(importlib.util.find_spec(module).submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=filename)


def test_sampled_ids_reach_the_trainer_verbatim(smollm2_tokenizer):
    """A sampler may emit a non-canonical tokenization ("he" + "llo" where the tokenizer says
    "hello"): the span and the trainer's input ids keep the sampled ids, never a re-encoding."""
    from grpo.batch import collate

    tok = smollm2_tokenizer
    he, llo = tok("he", add_special_tokens=False).input_ids, tok("llo", add_special_tokens=False).input_ids
    canonical = tok("hello", add_special_tokens=False).input_ids
    assert he + llo != canonical  # precondition: the two tokenizations differ
    gen = Scripted(tok, None, ids=lambda p: he + llo)
    sample = Sample("Say hello", "hello")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    run = runner(tok, make_env=lambda: RetryEnv(lambda a, s: False), max_turns=2, max_new=10, obs=32,
                 render=ChatRender(tok))
    out = run.run(gen, [prompt], [sample], 1, Sampling(10))
    span = out.completion_ids[0]
    assert span[: len(he + llo) + 1] == he + llo + [tok.eos_token_id]
    assert out.episodes[0].final_text == "hello" and out.episodes[0].turns == 2
    batch = collate([prompt], out, torch.zeros(1), tok.pad_token_id, False)
    row = batch.input_ids_BL[0, batch.prompt_width:].tolist()
    assert row[: len(span)] == span


def test_chat_rendering_equals_the_template_of_the_whole_conversation(smollm2_tokenizer):
    """prompt + (sampled turn + <|im_end|> + rendered observation) x k == apply_chat_template of the
    conversation, on 200 random conversations of 1-5 turns."""
    import random

    tok = smollm2_tokenizer
    render = ChatRender(tok)
    rng = random.Random(0)
    words = ["the", "answer", "is", "42", "wrong", ",", "try", "again", "calc", ":", "12+7", "=", " 19", "Hello", "!",
             "über", "naïve", "\t", "  ", "x", "(", ")", "<b>", "🙂"]
    def text():
        return "".join(rng.choice(words) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 12))).strip() or "ok"

    def ids(s):
        return list(tok(s, add_special_tokens=False).input_ids)

    for _ in range(200):
        messages = [{"role": "user", "content": text()}]
        seq = ids(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        for _ in range(rng.randint(1, 5)):
            reply, observation = text(), text()
            seq += ids(reply) + [tok.eos_token_id]  # a sampled turn, ended by the end-of-turn token
            seq += render(observation, after_eos=True)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
        whole = ids(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        assert seq == whole, messages


def test_a_long_chat_observation_is_cut_in_its_text_never_in_the_template(smollm2_tokenizer):
    """An observation over env.max_observation_tokens loses the middle of its text; the message's header,
    its end token and the generation prompt stay, so the next turn is still sampled after
    `<|im_end|>\n<|im_start|>assistant\n` (cutting the rendered ids' middle dropped the `<|im_end|>`), and a
    limit too small for the template's own tokens plus some text is refused at setup."""
    from grpo.rollout.episodes import build_episodes

    tok = smollm2_tokenizer
    message = " = 12345678901234567890"
    prompt = list(tok(tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False).input_ids)
    run = runner(tok, make_env=lambda: RetryEnv(lambda a, s: False, message), max_turns=2, max_new=10, obs=12,
                 render=ChatRender(tok))
    out = run.run(Scripted(tok, lambda p: "no"), [prompt], [Sample("q", "a")], 1, Sampling(10))
    observation = [i for i, m in zip(out.completion_ids[0], out.loss_masks[0]) if m == 0]
    assert len(observation) == 12 and out.episodes[0].observations_cut == 1
    text = tok.decode(observation)
    assert text.startswith("\n<|im_start|>user\n = ") and text.endswith("<|im_end|>\n<|im_start|>assistant\n"), text
    env = SimpleNamespace(name="retry", kwargs={}, render="chat", role="user", max_turns=2, max_total_tokens=0,
                          max_observation_tokens=12, step_timeout_s=5.0, max_concurrency=1)
    with pytest.raises(ConfigError, match="env.max_observation_tokens=12 leaves no room"):
        build_episodes(env, 10, SimpleNamespace(is_correct=lambda a, s: False), tok, None)
    assert build_episodes(replace_ns(env, max_observation_tokens=16), 10, SimpleNamespace(is_correct=lambda a, s: False),
                          tok, None) is not None


def replace_ns(ns, **changes):
    return SimpleNamespace(**{**vars(ns), **changes})


def test_a_turn_ends_on_every_id_the_engines_stop_on(tiny_lm, tmp_path):
    """A model folder whose generation_config.json lists a second EOS (Qwen2.5-Instruct: <|im_end|> and
    <|endoftext|>): the engines stop on both, and the episode runner took only the tokenizer's as a turn's
    end, so a turn that ended on the other got no separator before its observation under env.render=chat."""
    from transformers import GenerationConfig

    from grpo.rollout import build_rollout
    from grpo.rollout.hf import folder_stop_ids
    from grpo.tasks import build_task

    model, tok = tiny_lm
    assert folder_stop_ids(tok.eos_token_id, str(tmp_path)) == [tok.eos_token_id]  # no generation_config.json
    GenerationConfig(eos_token_id=[tok.eos_token_id, 7]).save_pretrained(tmp_path)
    assert folder_stop_ids(tok.eos_token_id, str(tmp_path)) == [tok.eos_token_id, 7]
    cfg = compose_cfg("task=guess", "env=guess")
    backend = build_rollout(cfg.rollout, model, tok, str(tmp_path), env=cfg.env, task=build_task(cfg.task))
    try:
        assert backend.episodes.stop_ids == {tok.eos_token_id, 7}
    finally:
        backend.close()


def test_chat_rendering_without_a_template_is_an_error(tiny_lm):
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="env.render=raw"):
        ChatRender(tiny_lm[1])


def test_calculator_walks_the_syntax_tree_and_never_evaluates_code():
    assert calculator("123+456") == "579" and calculator("-(7*6)//4") == "-11"
    for bad in ["__import__('os')", "2**100000", "1.5+1", "open('x')", "9" * 300]:
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


def test_tool_env_calls_the_tool_and_ends_on_an_answer():
    env = CalcEnv(tool_timeout_s=1.0)
    env.reset(Sample("123+456=", "579"), 0)
    step = env.step("calc: 123+456")
    assert (step.observation, step.done, step.info["tool_call"]) == (" = 579", False, True)
    step = env.step("calc: 1/0")
    assert step.observation.startswith(" error: ") and step.info["tool_error"]
    step = env.step("579")
    assert step.done and not step.info["tool_call"]


def test_a_tool_spec_the_env_can_never_call_is_refused_and_a_dotted_path_is_resolved():
    """A tool name the `name: argument` syntax cannot match made every call of it a final answer, and a
    tool given by the config (a string) failed every call with "'str' object is not callable"."""
    from grpo.envs import ToolEnv, env_factory
    from omegaconf import OmegaConf

    for name in ["web-search", "python3.11", "2fa"]:
        with pytest.raises(ConfigError, match="rename it"):
            ToolEnv({name: calculator})
    with pytest.raises(ConfigError, match="not a function"):
        ToolEnv({"calc": 42})
    cfg = OmegaConf.create({"name": "grpo.envs.tools.ToolEnv", "kwargs": {"tools": {"calc": "grpo.envs.tools.calculator"}}})
    env = env_factory(cfg, task=None)()
    env.reset(Sample("1+2=", "3"), 0)
    step = env.step("calc: 1+2")
    assert (step.observation, step.info["tool_error"]) == (" = 3", None)


class Opens(GuessEnv):
    """An opening observation whose length depends on the reset's seed (0-4 characters): the same for
    a group's trajectories, which share their seed (`reset_seed`)."""

    def reset(self, sample, seed):
        super().reset(sample, seed)
        return "<" * (seed % 5)


def test_a_trajectory_with_no_room_for_its_first_turn_is_an_error_not_an_empty_answer(tiny_lm):
    """The prompt (12 tokens) and its opening observation leave no room for a 3-token turn within a
    context of 17 for the trajectories whose observation is 3 or 4 long: they never sampled a token.
    Ended as "length", their empty final answer was scored beside the group's real ones; now they end
    as "error" (withheld from the rewards) with a warning, and the others play. 5 prompts (the same
    text) x n = 2: the lengths vary by group, each group's two trajectories alike."""
    _, tok = tiny_lm
    prompts = prompts_of(tok, GUESS[:5])
    with pytest.warns(UserWarning, match="budget failed .*leave no room for a turn of rollout.max_new_tokens=3"):
        out = runner(tok, make_env=Opens, context=17).run(Scripted(tok, lambda p: "8", max_context=17), prompts,
                                                          GUESS[:5], 2, Sampling(3, seed=5))
    opening = [reset_seed(5, i) % 5 for i in range(5) for _ in range(2)]  # each trajectory's observation length
    assert len(prompts[0]) == 12 and {3, 4} <= set(opening) and set(opening) - {3, 4}, opening  # [3, 3, 2, ..., 4, 4]
    assert len(out.episodes) == 10
    for e, obs, ids in zip(out.episodes, opening, out.completion_ids):
        if len(prompts[0]) + obs + 3 > 17:
            assert (e.finish, e.turns, e.env_reward) == ("error", 0, None) and "no room" in e.error, e
        else:
            assert e.finish != "error" and e.turns >= 1, e


def test_a_guess_in_other_digits_is_an_invalid_guess_not_an_environment_error():
    """"²".isdigit() is true and int("²") raises: the driver ended the episode as an environment error."""
    env = GuessEnv()
    env.reset(Sample("Guess 1-15:", "7"), 0)
    assert env.step("²").info == {"invalid": True} and env.step("٣").info == {"invalid": True}
    assert env.step("7").done


def test_binary_search_solves_every_secret_in_four_guesses():
    lengths = [len(binary_search_turns(s)) for s in range(1, 16)]
    assert max(lengths) == 4 and sum(lengths) == 49


def test_env_config_is_checked(make_cfg):
    from grpo.config import validate
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="env=none"):
        validate(make_cfg("reward=env"))
    with pytest.raises(ConfigError, match="env.name='nope'"):
        validate(make_cfg("env=guess", "env.name=nope"))
    with pytest.raises(ConfigError, match="max_total_tokens=2"):
        validate(make_cfg("task=guess", "env=guess", "env.max_total_tokens=2"))
    with pytest.raises(ConfigError, match=r"env.max_concurrency=0: .* must be >= 1 \(1 calls them one after another"):
        validate(make_cfg("experiment=guess_tiny", "env.max_concurrency=0"))
    validate(make_cfg("experiment=guess_tiny", "env.max_concurrency=1"))
    validate(make_cfg("experiment=guess_tiny"))
    # env.kwargs bound to the environment now, not at its first episode after the model and engines load
    with pytest.raises(ConfigError, match=r"env.kwargs=\{'max_guess': 9\} do not fit env.name='guess'.*max_guess"):
        validate(make_cfg("experiment=guess_tiny", "+env.kwargs.max_guess=9"))
    validate(make_cfg("experiment=guess_tiny", "+env.kwargs.high=9"))
    with pytest.raises(ConfigError, match="env.kwargs=.* with env=none"):
        validate(make_cfg("+env.kwargs.high=9"))
    with pytest.raises(ConfigError, match=r"env.kwargs=\{'mesage': ' no: '\} do not fit env.name='retry'"):
        validate(make_cfg("task=arithmetic", "env=guess", "env.name=retry", "+env.kwargs.mesage=' no: '"))
    validate(make_cfg("task=arithmetic", "env=guess", "env.name=retry", "+env.kwargs.message=' no: '"))
    with pytest.raises(ConfigError, match=r"do not fit env.name='openenv'.*base_ur"):
        validate(make_cfg("task=guess", "env=guess", "env.name=openenv", "+env.kwargs.base_ur=http://x"))


@pytest.mark.parametrize("task", ["addition", "arithmetic", "countdown"])
def test_an_env_that_plays_its_own_task_refuses_another(task):
    """env=guess with the default task=addition played guess-the-number on addition prompts, the
    secret read from an answer such as "85" (outside 1..15): episodes the prompts never asked for."""
    from grpo import envs

    with pytest.raises(ConfigError, match=re.escape(f"env=guess plays only task=guess's samples, not task={task}'s "
                                                    f"(see grpo/envs/guess.py): use task=guess")):
        envs.check(compose_cfg(f"task={task}", "env=guess", "reward=env"))
    envs.check(compose_cfg("task=guess", "env=guess", "reward=env"))
    envs.check(compose_cfg(f"task={task}", "env=retry"))  # an env that takes any task


class BreaksOnOdd(GuessEnv):
    """Raises on every odd secret: the run goes on without those episodes' rewards."""

    def step(self, action):
        if self.secret % 2:
            raise ValueError("odd secrets are not allowed")
        return super().step(action)


@pytest.mark.starts_process
def test_guess_training_run_on_hf(make_cfg):
    """3 steps of task=guess env=guess: the trainer scores the sampler's tokens across turns (sampler_diff
    <= 1e-3 with observations in the sequence), and the episode metrics are written."""
    from grpo.train import train

    cfg = make_cfg("experiment=guess_tiny", "steps=3", "eval_every=0", "checkpoint_every=0", "logger.sample_every=1")
    summary = train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 3 and all(d <= 1e-3 for d in measured(trained)), [r["sampler_diff"] for r in trained]
    assert max(r["episode/turns_max"] for r in trained) > 1 and all(r["episode/observation_tokens"] > 0 for r in trained)
    assert all(abs(sum(r[f"episode/finish_{k}"] for k in ("stop", "length", "turns", "error")) - 1) < 1e-9 for r in trained)
    assert 0 <= summary["eval_after"] <= 1


@pytest.mark.starts_process
def test_an_env_that_raises_in_training_ends_only_its_episodes(make_cfg):
    from grpo.train import train

    cfg = make_cfg("experiment=guess_tiny", "steps=2", "eval_every=0", "checkpoint_every=0",
                   "env.name=tests.test_episodes.BreaksOnOdd", "env.step_timeout_s=2")
    with pytest.warns(UserWarning, match="BreaksOnOdd"):
        train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 2 and sum(r["episode/errors"] for r in trained) > 0


class Misconfigured(GuessEnv):
    """Trajectory 3's reset raises a ConfigError; those after it take 0.3 s (still running when it
    raises, with env.max_concurrency > 1). Counts builds, resets, closes, and closes during a reset."""

    built = resets = closed = closed_early = 0
    lock = threading.Lock()  # resets and closes run concurrently (env.max_concurrency)

    def __init__(self):
        super().__init__()
        # which trajectory: the runner builds every environment, in the trajectories' order, before any
        # reset (the reset's seed is its group's, shared by the group's trajectories: no way to tell them)
        self.index, Misconfigured.built = Misconfigured.built, Misconfigured.built + 1

    def reset(self, sample, seed):
        with Misconfigured.lock:
            Misconfigured.resets += 1
        if self.index == 3:
            raise ConfigError("env.kwargs.url is wrong; set it to the server's")
        self.resetting = True
        time.sleep(0.3 if self.index > 3 else 0.0)
        self.resetting = False
        return super().reset(sample, seed)

    def close(self):
        with Misconfigured.lock:
            Misconfigured.closed += 1
            Misconfigured.closed_early += getattr(self, "resetting", False)


@pytest.mark.parametrize("concurrency", [1, 8])
def test_a_config_error_from_an_env_stops_the_run_and_every_env_is_closed(tiny_lm, concurrency):
    """A setup mistake (grpo/envs/openenv.py: a server admitting too few sessions) is no episode's
    fault: it stops the run, where ending the episodes as "error" would train on nothing. Called one
    at a time, the resets after trajectory 3's never start; called at once, the run waits for the
    calls still running before it closes their environments, then shuts its pool down."""
    _, tok = tiny_lm
    Misconfigured.built = Misconfigured.resets = Misconfigured.closed = Misconfigured.closed_early = 0
    with pytest.raises(ConfigError, match="env.kwargs.url"):
        runner(tok, make_env=Misconfigured, max_concurrency=concurrency).run(
            Scripted(tok, lambda p: "8"), prompts_of(tok, GUESS[:4]), GUESS[:4], 2, Sampling(3))
    assert Misconfigured.closed == 8  # every environment is built before the resets
    if concurrency == 1:
        assert Misconfigured.resets == 4
    else:  # those a worker had not yet taken when the error came are cancelled
        assert 4 <= Misconfigured.resets <= 8
    assert Misconfigured.closed_early == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("grpo-env")]


class RankTurns(GuessEnv):
    """Rank 0's episodes end at turn 1; every other rank's go on to the turn cap."""

    def step(self, action):
        from grpo import dist

        return Step(None, 0.0, True) if dist.rank() == 0 else Step("<", 0.0, False)


@pytest.mark.starts_process
def test_zero3_ranks_whose_episodes_end_at_turns_1_and_4_stay_in_lockstep(tmp_path, cache_dir):
    """Under ZeRO-3 every `generate` is a collective (synced_gpus): rank 0 finishes every episode at
    turn 1 and must still join rank 1's turns 2-4, or both hang."""
    from tests.conftest import FAST
    from tests.test_parallel import TORCHRUN, run

    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, "experiment=guess_tiny",
         "parallel=zero3", "rollout=hf", "env.name=tests.test_episodes.RankTurns", "eval_every=0", "checkpoint_every=0",
         "rollout.max_new_tokens=2", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 3
    # the mean over ranks of each rank's longest episode: rank 0's 1, rank 1's up to 4
    assert all(r["episode/turns_max"] > 1 for r in trained), [r["episode/turns_max"] for r in trained]


def test_weights_that_change_between_turns_are_an_error(tiny_lm):
    """An episode batch is one unit of engine work: every turn from the weight version of turn 1."""
    _, tok = tiny_lm
    gen = Scripted(tok, lambda p: "8")
    versions = iter([3, 3, 4, 4])

    def drifting(prompt_ids, n, sampling):
        out = gen(prompt_ids, n, sampling)
        out.weight_version = next(versions)
        return out

    with pytest.raises(RuntimeError, match="turn 3 came from weight version 4, turn 1 from 3"):
        runner(tok).run(drifting, prompts_of(tok, GUESS[:1]), GUESS[:1], 1, Sampling(3))


class ResetFails(GuessEnv):
    def reset(self, sample, seed):
        raise RuntimeError("env down")


def test_a_batch_without_a_turn_reports_the_version_the_backend_holds(tiny_lm):
    """Every reset failed, so no turn was sampled: the batch reports the weight version the backend
    holds (9, passed in), not 0, which the loop logged as step - 1 versions stale (at step 10,
    staleness 9 for a fresh batch). Where a turn was sampled, its own version (Scripted's 7) wins."""
    _, tok = tiny_lm
    gen = Scripted(tok, lambda p: "8")
    with pytest.warns(UserWarning, match="reset failed"):
        out = runner(tok, make_env=ResetFails).run(gen, prompts_of(tok, GUESS[:2]), GUESS[:2], 2, Sampling(3), version=9)
    assert out.finish_reasons == ["error"] * 4 and gen.requests == []
    assert out.weight_version == 9
    out = runner(tok).run(gen, prompts_of(tok, GUESS[:2]), GUESS[:2], 2, Sampling(3), version=9)
    assert gen.requests and out.weight_version == 7
    # hf and colocated: the backend's own version goes in (RolloutBackend.submit_episodes)
    backend = SimpleNamespace(generate=Scripted(tok, lambda p: "8"), generate_is_collective=False, weight_version=9)
    with pytest.warns(UserWarning, match="reset failed"):
        out = RolloutBackend.submit_episodes(backend, prompts_of(tok, GUESS[:2]), GUESS[:2], 2, Sampling(3),
                                             runner(tok, make_env=ResetFails)).result()
    assert out.weight_version == 9


def test_a_tool_episode_calls_the_calculator_then_answers(tiny_lm):
    """A policy that asks `calc: a+b`, reads ` = sum` from its prompt and answers it: two turns, the
    tool's result in the sequence (masked), one call and no failure in the metrics; one that asks
    `calc: 1/0` gets the error as its observation and counts as a failed call."""
    _, tok = tiny_lm

    def policy(prompt_ids):
        text = tok.decode(prompt_ids, skip_special_tokens=True)
        question = text.split("=")[0]
        return text.rsplit("= ", 1)[1] if " = " in text else ("calc: 1/0" if "error" not in text and question == "1+0" else
                                                               "0" if "error" in text else f"calc: {question}")

    samples = [Sample("123+456=", "579"), Sample("1+0=", "1")]
    out = runner(tok, make_env=CalcEnv, max_turns=3, max_new=16, total=80, obs=16).run(
        Scripted(tok, policy), prompts_of(tok, samples), samples, 1, Sampling(16))
    first, second = out.episodes
    assert (first.final_text, first.turns, first.finish, first.tool_calls, first.tool_errors) == ("579", 2, "stop", 1, 0)
    assert first.transcript == "calc: 123+456 = 579579"
    assert (second.tool_calls, second.tool_errors, second.final_text) == (1, 1, "0")
    metrics = resolve(out.metrics())
    assert metrics["episode/tool_calls"] == 1.0 and metrics["episode/tool_failure_rate"] == 0.5
    assert metrics["episode/finish_stop"] == 1.0 and metrics["episode/turns_mean"] == 2.0
    # what the loop reads: the final turn as text, and so does a rank's share (`slice`, as dedicated and
    # colocated hand it out), not the whole span decoded
    assert out.texts(tok) == ["579", "0"] and out.turns() == [2, 2]
    share = out.slice(1, 2)
    assert share.texts(tok) == ["0"] and share.reward_info()["turns"] == [2] and share.metrics()["episode/tool_calls"] == 1.0


def test_guess_shaping_counts_the_secrets_still_possible_and_every_miss():
    """Secret 12, miss_reward -0.1, narrow_reward 1: 8 leaves 9..15 (rules out 8 of 15), 10 leaves 11..15
    (2 of the 7 left), 14 leaves 11..13 (2 of 5); "x" and "10000" (5 digits) are invalid guesses, misses
    that rule out nothing; 100 is a guess above the interval ("<", none ruled out)."""
    env = GuessEnv(miss_reward=-0.1, narrow_reward=1.0)
    env.reset(Sample("Guess 1-15:", "12"), 0)
    steps = [env.step(a) for a in ["8", "10", "14", "x", "100", "10000", "12"]]
    assert [s.observation for s in steps] == [">", ">", "<", "?", "<", "?", None]
    assert [s.reward for s in steps] == pytest.approx([-0.1 + 8 / 15, -0.1 + 2 / 7, -0.1 + 2 / 5, -0.1, -0.1, -0.1, 1.0])
    assert [s.done for s in steps] == [False] * 6 + [True]


def test_a_tool_timeout_not_below_the_step_timeout_is_refused():
    """env=calc's tool_timeout_s (default 5 s) at or past env.step_timeout_s: a slow tool call ended the whole
    episode as "error" (the step's timeout came first), never the tool error the policy reads; refused."""
    from grpo import envs

    with pytest.raises(ConfigError, match=r"env.kwargs.tool_timeout_s=5 is not below env.step_timeout_s=3"):
        envs.check(compose_cfg("task=arithmetic", "env=guess", "env.name=calc", "env.step_timeout_s=3"))
    with pytest.raises(ConfigError, match=r"env.kwargs.tool_timeout_s=20 is not below env.step_timeout_s=10"):
        envs.check(compose_cfg("task=arithmetic", "env=guess", "env.name=calc", "+env.kwargs.tool_timeout_s=20"))
    envs.check(compose_cfg("task=arithmetic", "env=guess", "env.name=calc"))
    envs.check(compose_cfg("task=arithmetic", "env=guess", "env.name=calc", "env.step_timeout_s=3",
                           "+env.kwargs.tool_timeout_s=2"))


@pytest.mark.parametrize("setting", ["env.max_turns=0", "env.max_observation_tokens=0", "env.step_timeout_s=0"])
def test_env_budgets_that_leave_no_turn_are_refused(setting):
    from grpo import envs

    refusal = r"env.max_turns and env.max_observation_tokens must be >= 1 and env.step_timeout_s > 0"
    with pytest.raises(ConfigError, match=refusal):
        envs.check(compose_cfg("task=guess", "env=guess", setting))
    envs.check(compose_cfg("task=guess", "env=guess", setting.replace("=0", "=1")))


class AlwaysHigher(TextEnv):
    """Answers every turn with an observation only: Step's `done` left at its default."""

    def step(self, action):
        return Step(">")


def test_a_step_that_does_not_say_done_lets_the_episode_go_on(tiny_lm):
    """Step(observation) without `done` goes on to the next turn: the episode plays all 4 turns and ends "turns"."""
    _, tok = tiny_lm
    out = runner(tok, make_env=AlwaysHigher).run(Scripted(tok, lambda p: "8"), prompts_of(tok, GUESS[:1]), GUESS[:1], 1,
                                                 Sampling(3, seed=1))
    assert (out.episodes[0].turns, out.episodes[0].finish, out.episodes[0].transcript) == (4, "turns", "8>8>8>8")


class ScriptedBackend(RolloutBackend):
    """An in-process backend whose turns are `Scripted`'s (the policy written in the test)."""

    def __init__(self, generate, episodes):
        self.scripted, self.episodes = generate, episodes

    def generate(self, prompt_ids, n, sampling):
        return self.scripted(prompt_ids, n, sampling)

    def update_weights(self, buckets, version):
        pass


class RaisesOnHit(GuessEnv):
    def step(self, action):
        if action.strip() == str(self.secret):
            raise RuntimeError("sandbox down")
        return super().step(action)


def test_an_evaluation_counts_the_turns_of_solved_episodes_and_judges_failed_ones_wrong(tiny_lm):
    """Binary search within 3 turns hits 7 of the 15 secrets (8 in turn 1, 4 and 12 in 2, 2 6 10 14 in 3):
    accuracy 7/15, 17 turns over the 7 solves (the 8 unsolved episodes' 3 turns each count nowhere). An
    environment that fails at each hit fails all 15 episodes: their final turn says the secret, but a failed
    episode is judged as "" (accuracy 0) and counted."""
    from grpo.dist import DistInfo
    from grpo.eval import evaluate
    from grpo.tasks.base import Task

    _, tok = tiny_lm
    cfg = compose_cfg("task=guess", "env=guess", "eval_samples=1", "rollout.max_new_tokens=3")
    task = Task("guess", GUESS, GUESS, chat_template="never")
    backend = ScriptedBackend(Scripted(tok, binary_search_policy(tok)), runner(tok, max_turns=3))
    assert evaluate(backend, tok, task, cfg, DistInfo()) == pytest.approx(
        {"eval/accuracy": 7 / 15, "eval/turns_per_solve": 17 / 7, "eval/episode_errors": 0})
    backend = ScriptedBackend(Scripted(tok, binary_search_policy(tok)), runner(tok, make_env=RaisesOnHit))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each failed step's warning
        metrics = evaluate(backend, tok, task, cfg, DistInfo())
    assert metrics == pytest.approx({"eval/accuracy": 0.0, "eval/turns_per_solve": math.nan, "eval/episode_errors": 15},
                                    nan_ok=True)


def test_a_guess_secret_above_env_kwargs_high_stops_the_run():
    """env.kwargs.high=9 on task=guess (secrets 1..15): secret 12 lies outside the interval the shaping counts,
    and a miss's share ruled out came out 10/9, then -1 (10, 13, 11 against 12), without a word. Reset refuses it."""
    env = GuessEnv(narrow_reward=1.0, high=9)
    with pytest.raises(ConfigError, match=r"env.kwargs.high=9: the task's secret 12 is outside 1..9"):
        env.reset(Sample("Guess 1-15:", "12"), 0)
    env.reset(Sample("Guess 1-15:", "9"), 0)
    assert env.step("5").reward == pytest.approx(5 / 9)  # 1..5 ruled out of 1..9


def test_calculator_refuses_products_past_10_to_the_30_and_booleans():
    """10^16 x 10^14 = 10^30 is the largest product taken; x10 more is refused (a chain of products would
    grow without bound); True is no integer literal."""
    assert calculator("10000000000000000*100000000000000") == str(10**30)
    for bad in ["10000000000000000*100000000000000*10", "True+1"]:
        with pytest.raises(ValueError):
            calculator(bad)


def test_a_tool_call_may_span_lines_and_a_wrong_retry_scores_zero():
    """`calc:` followed by an expression over two lines is one call (the argument runs to the end of the
    turn); RetryEnv answers a wrong answer with its message and reward 0 (not None: the episode is scored)."""
    env = CalcEnv()
    env.reset(Sample("(1+2)*3=", "9"), 0)
    assert env.step("calc: (1+\n2)*3") == Step(" = 9", None, False, {"tool_call": True, "tool_error": None})
    retry = RetryEnv(lambda text, sample: text.strip() == sample.answer, " no: ")
    retry.reset(Sample("1+1=", "2"), 0)
    assert [retry.step(a) for a in ["3", " 2"]] == [Step(" no: ", 0.0, False), Step(None, 1.0, True)]
