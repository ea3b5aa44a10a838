"""Math correctness through HuggingFace's `math-verify`: the completion's final answer (a
`\\boxed{}`, a LaTeX expression, or the last number) is parsed to sympy and compared with the
ground truth by value, so `\\frac{1}{2}`, `1/2` and `0.5` all match `0.5`.

math-verify's own timeouts use SIGALRM, which works only in the main thread. Rewards run in a
worker thread (grpo.rewards cuts them off with `reward.timeout_s`), so there its timeouts are off;
evaluation (`Task.is_correct`) runs in the main thread and keeps them (5 s per parse or compare).
"""

from __future__ import annotations

import logging
import threading

TIMEOUT_S = 5  # math-verify's own limit, main thread only


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's notice that its timeouts are off (on every call): that is deliberate here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(text: str):
    from math_verify import parse  # local: math_verify is heavy (sympy); grpo.config imports the reward registry

    return parse(text, parsing_timeout=_timeout())


def is_equivalent(completion: str, answer: str) -> bool:
    """True when math-verify finds the completion's final answer equal to `answer` (plain or LaTeX)."""
    from math_verify import verify  # local: as in _parse

    gold = _parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    if not gold:
        raise ValueError(f"math-verify could not parse the ground truth {answer!r}")
    pred = _parse(completion)
    return bool(pred) and verify(gold, pred, timeout_seconds=_timeout())


def math_verify(completions: list[str], samples: list, **_) -> list[float]:
    """1.0 when the completion's final answer equals the sample's answer by value, else 0.0."""
    return [float(is_equivalent(c, s.answer)) for c, s in zip(completions, samples)]
