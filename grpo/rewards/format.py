"""Shape rewards: the reasoning/answer tag format, and DAPO's soft overlong penalty."""

from __future__ import annotations

import re

# the opening <think> may be the prompt's: chat templates of reasoning models (DeepSeek-R1-Distill, QwQ)
# end the generation prompt with "<think>\n", and then no completion wrote it and every one scored 0
FORMAT = re.compile(r"^\s*(?:<think>)?.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The text inside the last <answer>...</answer>, or None."""
    found = ANSWER.findall(completion)
    return found[-1].strip() if found else None


def answer_format(completions: list[str], samples: list, **_) -> list[float]:
    """1.0 for `<think>...</think> <answer>...</answer>` and nothing else (the opening `<think>` may be
    the chat template's), else 0.0."""
    return [float(bool(FORMAT.match(c))) for c in completions]


def overlong_penalty(completions: list[str], samples: list, completion_ids=None, max_new_tokens=None,
                     buffer: int | None = None, **_) -> list[float]:
    """DAPO's soft overlong punishment on token length L, with Lmax = max_new_tokens and a buffer
    zone of `buffer` tokens (default a quarter of Lmax):
        0                          if L <= Lmax - buffer
        (Lmax - buffer - L)/buffer if Lmax - buffer < L <= Lmax   (from 0 down to -1)
    """
    if completion_ids is None or max_new_tokens is None:
        raise ValueError("overlong needs completion_ids and max_new_tokens (the trainer passes both)")
    buffer = buffer or max(1, max_new_tokens // 4)
    free = max_new_tokens - buffer
    return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / buffer) for ids in completion_ids]
