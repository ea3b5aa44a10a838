"""Rollout behaviours pinned by value, each one a gap a mutation test found (a change of the code that no
fast test noticed): the episode driver (grpo/rollout/episodes.py), the per-trajectory driver
(grpo/rollout/trajectories.py), dynamic sampling's refill, the environments and their config check, the
train sampler, and Rollouts' counts. No servers, no subprocesses: scripted turns and fake pools.
"""

from __future__ import annotations

import threading
import warnings
from types import SimpleNamespace

import pytest

from grpo.dynamic_sampling import refill
from grpo.envs import CalcEnv, GuessEnv, RetryEnv, Step, TextEnv, check, env_factory
from grpo.rollout.base import Rollouts, Sampling
from grpo.rollout.episodes import episode_span
from grpo.rollout.render import ChatRender
from grpo.rollout.trajectories import episode_driver
from grpo.tasks.base import Sample, TrainSampler
from tests.conftest import compose_cfg
from tests.test_dynamic_sampling import scored
from tests.test_episodes import Scripted, prompts_of, runner
from tests.test_render import CHATML, chat_tokenizer
from tests.test_trajectories import HeldPool

SECRET_9 = [Sample("Guess 1-15:", "9")]


def test_a_failed_reset_sends_turn_one_per_trajectory_each_with_its_own_prompt(tiny_lm):
    """No environment opens with text, but one reset failed: turn 1 must go out as one request per
    remaining trajectory (n=1), each with its own prompt. Sending generate(prompts, n) anyway returned
    P * n completions for fewer trajectories, so they were handed out shifted: a "B:" trajectory got
    the turn sampled for prompt "A:"."""
    _, tok = tiny_lm
    built = []

    class FirstResetFails(TextEnv):
        def __init__(self):
            built.append(self)
            self.k = len(built)

        def reset(self, sample, seed):
            if self.k == 1:
                raise RuntimeError("reset down")
            return None

        def step(self, action):
            return Step(None, 1.0, True)

    samples = [Sample("A:", "1"), Sample("B:", "2")]
    prompts = prompts_of(tok, samples)
    gen = Scripted(tok, lambda p: tok.decode(p, skip_special_tokens=True)[0].lower())  # its prompt's letter
    with pytest.warns(UserWarning, match="reset failed"):
        out = runner(tok, make_env=FirstResetFails).run(gen, prompts, samples, 2, Sampling(3))
    assert out.finish_reasons == ["error", "stop", "stop", "stop"]
    assert [e.final_text for e in out.episodes] == ["", "a", "b", "b"]
    assert gen.requests == [([prompts[0], prompts[1], prompts[1]], 1, 3)]


def test_refill_scores_each_function_from_the_batch_its_group_came_from():
    """After dynamic sampling's refill, every reward function's values (rewards_FB, logged as
    reward/<name>) must be those of the batches the trained groups were drawn from, as rewards_PG is.
    Taking them all from the first batch logged the first batch's rewards for groups of later draws."""
    first = scored("a", [[1, 1], [0, 1], [0, 0]])
    second = scored("b", [[0, 1], [1, 0], [1, 0]])
    out, _ = refill(first, lambda k: {1: second}[k], max_draws=4, still_short=lambda n: n)
    assert out.samples == ["a1", "b0", "b1"]
    assert out.rewards_FB["f"] == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert out.rewards_FB["f"] == out.rewards_PG.flatten().tolist()


def test_refill_with_more_informative_groups_than_p_trains_exactly_the_first_p():
    """Draws can bring more informative groups than the P a step trains (here 4 for P = 3): exactly the
    first P are trained and no flat group is added. Topping up with `P - len(informative)` (negative
    here, so a slice from the end) appended a flat group of the first batch: P + 1 groups."""
    first = scored("a", [[1, 1], [0, 1], [0, 0]])
    second = scored("b", [[0, 1], [1, 0], [1, 0]])
    out, _ = refill(first, lambda k: {1: second}[k], max_draws=4, still_short=lambda n: n)
    assert out.samples == ["a1", "b0", "b1"]
    assert tuple(out.rewards_PG.shape) == (3, 2)
    assert out.rewards_PG.tolist() == [[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]]
    assert len(out.completions) == 6


def test_a_turn_that_decodes_to_nothing_still_reaches_the_env_and_counts_toward_max_turns(tiny_lm):
    """A turn of only <eos> decodes to "": it is still a turn, handed to the environment, and the
    max_turns cap ends the episode as "turns". Skipping "" (falsy) left such a trajectory active
    without an env step, so it went on sampling past max_turns until the token budget ended it."""
    _, tok = tiny_lm
    actions = []

    class Recording(GuessEnv):
        def step(self, action):
            actions.append(action)
            return super().step(action)

    out = runner(tok, make_env=Recording, max_turns=2, max_new=3, total=40).run(
        Scripted(tok, lambda p: ""), prompts_of(tok, SECRET_9), SECRET_9, 1, Sampling(3))
    e = out.episodes[0]
    assert actions == ["", ""]  # the second step's answer is not observed: the cap ends the episode
    assert e.turns == 2 and out.finish_reasons == ["turns"]
    assert out.completion_ids[0][0] == tok.eos_token_id and out.loss_masks[0] == [1, 0, 1]


def test_a_prompt_with_no_room_for_a_first_turn_sends_no_request_on_the_trajectory_driver(tiny_lm):
    """rollout.schedule=trajectories: a prompt that leaves the engine's context no room for one turn of
    max_new_tokens ends every trajectory of its group as "error" before any request. Sending the shared
    turn-1 request without checking room asked the engine beyond its context (a server error there)."""
    _, tok = tiny_lm
    prompt = tok("7+1=").input_ids
    ready = threading.Event()
    ready.set()
    pool = HeldPool(tok, {tuple(prompt[:4]): ready})
    r = runner(tok, max_turns=1, max_new=4, total=64, obs=4, context=len(prompt) + 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = episode_driver("trajectories", r, pool, 0)([prompt], [Sample("7+1=", "8")], 2, Sampling(4, seed=1))
    assert not pool.entered  # no request reached the server
    assert out.finish_reasons == ["error", "error"] and [e.turns for e in out.episodes] == [0, 0]
    assert sum("budget failed" in str(w.message) for w in caught) == 2


def test_the_default_episode_span_counts_every_turn_and_observation():
    """env.max_total_tokens=0 means room for every turn and its observation: max_turns x (max_new_tokens
    + max_observation_tokens), 4 x (3 + 4) = 28. Counting the turns only (12) cut episodes short as
    "length" before their last turns."""
    env = SimpleNamespace(max_total_tokens=0, max_turns=4, max_observation_tokens=4)
    assert episode_span(env, 3) == 28
    assert episode_span(SimpleNamespace(max_total_tokens=50, max_turns=4, max_observation_tokens=4), 3) == 50


def test_chat_rendering_keeps_the_separator_after_each_turns_eos_in_a_driven_episode():
    """With ChatRender, a 2-turn episode's prompt + span decodes to the chat template's rendering of the
    same conversation (but the newline the template puts after the last <|im_end|>). The separator goes
    in where the turn ended with <eos>: checked on the turn's first token instead, it was dropped, and
    the policy trained on '<|im_end|><|im_start|>' that the template never writes."""
    tok = chat_tokenizer(CHATML)
    convo = [{"role": "user", "content": "Q"}]
    prompt = tok(tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    out = runner(tok, make_env=lambda: RetryEnv(lambda a, s: False, " no"), max_turns=2, max_new=5, obs=32,
                 render=ChatRender(tok)).run(Scripted(tok, lambda p: "a"), [prompt], [Sample("Q", "b")], 1, Sampling(5))
    assert out.finish_reasons == ["turns"]
    whole = tok.apply_chat_template(convo + [{"role": "assistant", "content": "a"}, {"role": "user", "content": " no"},
                                             {"role": "assistant", "content": "a"}], tokenize=False)
    assert tok.decode(prompt + out.completion_ids[0]) + "\n" == whole


def test_reward_info_gives_the_last_turns_ids_only(tiny_lm):
    """Reward functions get each episode's last turn as completion_ids (its final answer), not the
    whole span nor every turn's ids joined: with two turns of "8" <eos>, just [8, eos]."""
    _, tok = tiny_lm
    out = runner(tok, max_turns=2, max_new=3, total=40).run(
        Scripted(tok, lambda p: "8"), prompts_of(tok, SECRET_9), SECRET_9, 1, Sampling(3))
    eight, eos = tok.convert_tokens_to_ids("8"), tok.eos_token_id
    assert out.episodes[0].turns == 2
    assert out.reward_info()["completion_ids"] == [[eight, eos]]
    assert out.completion_ids[0][:2] == [eight, eos] and out.completion_ids[0][-2:] == [eight, eos]


def test_calc_env_ends_the_episode_on_an_answer_line_whose_name_is_no_tool():
    """CalcEnv reads "name: argument" as a tool call only when the name is one of its tools; "Answer: 42"
    is the final answer and ends the episode. Parsing any such line as a call made it a failing call of
    an unknown tool "Answer" (a tool error and another turn)."""
    env = CalcEnv()
    env.reset(None, 0)
    assert env.step("Answer: 42") == Step(None, None, True, {"tool_call": False})
    step = env.step("calc: 2+3")
    assert (step.observation, step.done, step.info["tool_call"], step.info["tool_error"]) == (" = 5", False, True, None)


def test_the_train_sampler_reshuffles_each_epoch():
    """Each pass over the train split is a new order (seeded by the run's seed and the epoch): shuffling
    with the seed alone repeated epoch 0's order every epoch."""
    s = TrainSampler([Sample(str(i), str(i)) for i in range(6)], seed=1)
    epoch0, epoch1 = [x.prompt for x in s.next(6)], [x.prompt for x in s.next(6)]
    assert sorted(epoch0) == sorted(epoch1) == [str(i) for i in range(6)]
    assert epoch0 != epoch1
    assert (epoch0, epoch1) == (["3", "0", "5", "1", "2", "4"], ["2", "0", "5", "4", "1", "3"])


def test_env_retry_factory_builds_a_retry_env_with_the_tasks_check():
    """env=retry's factory takes the run's task (its is_correct judges each answer); env_factory must
    pass it. Without it, building the first environment raised a TypeError (task missing)."""
    cfg = compose_cfg("env=retry")
    task = SimpleNamespace(is_correct=lambda answer, sample: answer.strip() == sample.answer)
    env = env_factory(cfg.env, task)()
    assert isinstance(env, RetryEnv) and env.is_correct is task.is_correct
    env.reset(Sample("1+1=", "2"), 0)
    assert env.step(" 2") == Step(None, 1.0, True)


def test_env_max_total_tokens_equal_to_one_turn_is_accepted():
    """env.max_total_tokens equal to rollout.max_new_tokens leaves room for exactly one turn: the config
    check accepts it (refusing only less). A check with <= refused a valid one-turn budget."""
    check(compose_cfg("env=guess", "task=guess", "rollout.max_new_tokens=4", "env.max_total_tokens=4"))
    with pytest.raises(Exception, match="leaves no room"):
        check(compose_cfg("env=guess", "task=guess", "rollout.max_new_tokens=4", "env.max_total_tokens=3"))


def test_sampled_lengths_count_the_loss_masks_ones():
    """Rollouts.sampled_lengths is the tokens the sampler drew: a loss mask's ones, not the span's length
    (which counts the observation tokens too): [1, 1, 0, 0, 1] -> 3."""
    ids, lps = [[1, 2, 3, 4, 5]], [[-0.5, -0.5, 0.0, 0.0, -0.5]]
    assert Rollouts(ids, lps, ["stop"], 0, loss_masks=[[1, 1, 0, 0, 1]]).sampled_lengths() == [3]
    assert Rollouts(ids, lps, ["stop"], 0).sampled_lengths() == [5]


def test_observation_tokens_count_tokens_kept_after_a_cut(tiny_lm):
    """An observation longer than env.max_observation_tokens is cut to it: the episode's
    observation_tokens counts the tokens that went into the span (10), not the observation's
    characters (50)."""
    _, tok = tiny_lm

    class Long(TextEnv):
        def reset(self, sample, seed):
            return None

        def step(self, action):
            return Step("x" * 50, None, False)

    out = runner(tok, make_env=Long, max_turns=2, max_new=3, total=100, obs=10).run(
        Scripted(tok, lambda p: "8"), prompts_of(tok, SECRET_9), SECRET_9, 1, Sampling(3))
    e = out.episodes[0]
    assert out.loss_masks[0].count(0) == 10
    assert e.observation_tokens == 10 and e.observations_cut == 1
