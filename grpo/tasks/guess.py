"""Guess the number (use with env=guess): the secret 1..15 is the sample's answer, never shown; every
prompt is the same. Eval plays each of the 15 secrets once; the train split is the 15 secrets, 64
times over. The tiny model's warm start imitates binary search (grpo/envs/guess.py), trained on the
guesses only, the observations masked as in GRPO, and is checked by playing episodes greedily."""

from __future__ import annotations

from grpo.envs.guess import GuessEnv, binary_search_turns
from grpo.tasks.base import Sample, Task

HIGH = 15
PROMPT = f"Guess 1-{HIGH}:"


def demonstration(sample: Sample) -> list[tuple[str, bool]]:
    """Binary search against the sample's secret as (text, trained) segments: each guess is trained
    (and followed by the end token), each observation is not."""
    segments = []
    for guess, observation in binary_search_turns(int(sample.answer), 1, HIGH):
        segments.append((guess, True))
        if observation is not None:
            segments.append((observation, False))
    return segments


def solve_rate(model, tokenizer, samples: list, max_new_tokens: int, max_turns: int = 4) -> float:
    """Greedy episodes of `samples` against GuessEnv, through the episode driver on `model`."""
    from grpo.rollout.base import Sampling
    from grpo.rollout.episodes import Budget, EpisodeRunner
    from grpo.rollout.hf import HFBackend
    from grpo.rollout.render import RawRender

    backend = HFBackend(None, model, tokenizer)
    budget = Budget(max_turns, max_new_tokens, max_turns * (max_new_tokens + 4), 4, backend.max_context)
    runner = EpisodeRunner(GuessEnv, tokenizer, RawRender(tokenizer), budget, 10.0, backend.stop_ids, "guess")
    prompt_ids = [tokenizer(s.prompt).input_ids for s in samples]
    out = runner.run(backend.generate, prompt_ids, samples, 1, Sampling(max_new_tokens, temperature=0.0))
    return sum(e.finish == "stop" and e.env_reward == 1.0 for e in out.episodes) / len(samples)


def build_guess(cfg) -> Task:
    secrets = [Sample(prompt=PROMPT, answer=str(s)) for s in range(1, HIGH + 1)]
    return Task("guess", train=secrets * 64, eval=list(secrets), chat_template=cfg.chat_template,
                system_prompt=cfg.system_prompt, demonstration=demonstration, play=solve_rate)
