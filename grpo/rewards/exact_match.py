from __future__ import annotations


def exact_match(completions: list[str], samples: list, **_) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer, else 0.0."""
    return [float(c.strip() == s.answer.strip()) for c, s in zip(completions, samples)]
