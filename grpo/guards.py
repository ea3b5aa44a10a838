"""Guards every run carries, cheap enough to stay on: a non-finite step is skipped and counted, and a
run of them stops the run with what to try.

Where the skip happens: the strategy's `step` (grpo/parallel/single.py, and DDP through it) reads the
gradient norm after the cross-rank reduction, so every rank sees the same norm and skips together:
gradients dropped, no optimizer step, the learning-rate schedule still advanced (the step is spent,
as a step on an empty batch is). DeepSpeed's bf16/fp32 step applies what it is given; under ZeRO the
norm is read after it (a skip there is counted and stops the run the same way, but the step was
taken: docs/verify.md).
"""

from __future__ import annotations

import math
import warnings

from grpo.errors import ConfigError


class NonFiniteSteps(ConfigError):
    """A run of non-finite steps: stops the run (a user-fixable error: the message says what to try)."""


def finite(x: float) -> bool:
    return math.isfinite(x)


class StepGuard:
    """Counts steps whose loss or gradient norm is not finite; `max_in_a_row` of them in a row stop."""

    def __init__(self, max_in_a_row: int = 3):
        self.max_in_a_row, self.skipped, self.in_a_row = max_in_a_row, 0, 0

    def check(self, step: int, stats: dict, layout: str) -> dict[str, float]:
        bad = [k for k in ("loss", "grad_norm") if not finite(stats.get(k, 0.0))]
        if not bad:
            self.in_a_row = 0
            return {"guard/skipped_steps": self.skipped}
        self.skipped += 1
        self.in_a_row += 1
        what = ", ".join(f"{k} {stats[k]}" for k in bad)
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteSteps(
                f"{self.in_a_row} steps in a row (to step {step}) had a non-finite {what}; their updates were skipped. "
                f"The micro-batches ran the {layout!r} layout. Try: a lower algo.lr or algo.max_grad_norm; "
                f"model.dtype=float32 to rule out overflow; algo.packing=false (or algo.shared_prompt=false) to rule out "
                f"the attention kernel on masked rows (cuDNN's SDPA on H100 returns NaN gradients for some widths); "
                f"python -m grpo.verify with the same overrides.")
        warnings.warn(f"step {step}: non-finite {what} ({layout} layout): the optimizer step was skipped "
                      f"({self.skipped} so far, {self.in_a_row} in a row; {self.max_in_a_row} in a row stop the run)",
                      stacklevel=2)
        return {"guard/skipped_steps": self.skipped}
