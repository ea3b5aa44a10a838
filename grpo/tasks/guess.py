"""Guess the number (use with env=guess): the secret 1..15 is the sample's answer, never shown; every
prompt is the same. Eval plays each of the 15 secrets once; the train split is the 15 secrets, 64
times over. The tiny model's warm start imitates binary search (grpo/envs/guess.py), trained on the
guesses only, the observations masked as in GRPO, and is checked by playing episodes greedily
(grpo/tiny/guess.py: the episode driver, which a task does not import)."""

from __future__ import annotations

from grpo.envs.guess import binary_search_turns
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


def build_guess(cfg) -> Task:
    secrets = [Sample(prompt=PROMPT, answer=str(s)) for s in range(1, HIGH + 1)]
    return Task("guess", train=secrets * 64, eval=list(secrets), chat_template=cfg.chat_template,
                system_prompt=cfg.system_prompt, demonstration=demonstration)
