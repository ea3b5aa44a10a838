"""Library output a person can read: a warning a library repeats every step appears once per run,
and ranks other than 0 print only warnings of their own (grpo's) and errors.

Known repeaters are matched by category, message and the library file Python attributes them to,
each with its reason; every other warning is shown as Python shows it by default (no blanket
silence). Why Python's own filters are not enough: they show a warning once per code location, but
any change to the warning filters (every `warnings.catch_warnings()` block, which the libraries
enter on every step) clears those records, so the same warning came back on every call: 2,408
lines of `torch.distributed.all_gather_into_tensor is deprecated` in a 600-step 2-process ZeRO-3
run. The "once" action does not help: CPython's C implementation keeps it in the same per-module
record. So the known repeaters go through `warnings.showwarning` (the hook Python documents for
replacing how warnings are shown), which remembers what it has shown for the whole run.

On ranks other than 0 the libraries' warnings and info lines are rank 0's again, N times over: they
are dropped there (Python warnings from any module but grpo's, and the libraries' loggers below
ERROR). Errors and grpo's own warnings still print on every rank.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Repeater:
    category: type[Warning]
    message: str  # regex matched at the start of the message
    module: str  # the library the warning is attributed to, as a path fragment of its file
    why: str

    def matches(self, category, message: str, filename: str) -> bool:
        return issubclass(category, self.category) and re.match(self.message, message) is not None and self.module in filename


REPEATERS = (
    Repeater(
        FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|_all_gather_base|reduce_scatter_tensor|_reduce_scatter_base)` is",
        "torch/distributed/", "DeepSpeed's ZeRO-3 gathers and reduces through these on every parameter fetch",
    ),
)

# Loggers of the libraries a training process drives; on ranks other than 0 they print errors only.
LIBRARY_LOGGERS = ("DeepSpeed", "deepspeed", "torch", "transformers", "vllm", "datasets", "accelerate", "submitit")


def quiet_library_logs(rank: int) -> None:
    """Install the filters for this process (rank from grpo.dist); call once, before the libraries run."""
    if rank != 0:
        warnings.filterwarnings("ignore")
        warnings.filterwarnings("default", module=r"grpo(\.|$)")  # checked first: grpo's own still print
        for name in LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        return
    if not isinstance(warnings.showwarning, ShowRepeatersOnce):  # once per process, however often train() runs
        warnings.showwarning = ShowRepeatersOnce(warnings.showwarning)


class ShowRepeatersOnce:
    """`warnings.showwarning` that shows each known repeater's message once per process."""

    def __init__(self, show):
        self.show, self.shown = show, set()

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if any(r.matches(category, text, filename) for r in REPEATERS):
            if (category, text) in self.shown:
                return
            self.shown.add((category, text))
        self.show(message, category, filename, lineno, file, line)
