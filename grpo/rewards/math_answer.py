"""Math correctness through HuggingFace's `math-verify`: the completion's final answer (a
`\\boxed{}`, a LaTeX expression, or the last number) is parsed to sympy and compared with the
ground truth by value, so `\\frac{1}{2}`, `1/2` and `0.5` all match `0.5`.

math-verify's own timeouts use SIGALRM, which works only in the main thread; rewards run in a
worker thread (grpo.rewards cuts them off with `reward.timeout_s`), so its timeouts are off here.
"""

from __future__ import annotations

import logging


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's notice that its timeouts are off (on every call): that is deliberate here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def _parse(text: str):
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def is_equivalent(completion: str, answer: str) -> bool:
    """True when math-verify finds the completion's final answer equal to `answer` (plain or LaTeX)."""
    from math_verify import verify

    gold = _parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    if not gold:
        raise ValueError(f"math-verify could not parse the ground truth {answer!r}")
    pred = _parse(completion)
    return bool(pred) and verify(gold, pred, timeout_seconds=None)


def math_verify(completions: list[str], samples: list, **_) -> list[float]:
    """1.0 when the completion's final answer equals the sample's answer by value, else 0.0."""
    return [float(is_equivalent(c, s.answer)) for c, s in zip(completions, samples)]
