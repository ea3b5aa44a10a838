"""Library output a person can read: a warning a library repeats every step appears once per run,
and ranks other than 0 print only warnings of their own (grpo's) and errors.

Known repeaters are filtered by category, message and the module Python attributes them to, each
with its reason; every other warning is shown as Python shows it by default (no blanket silence).
Why Python's default is not enough: it shows a warning once per code location, but any change to
the warning filters (every `warnings.catch_warnings()` block, which the libraries enter on every
step) clears those records, so the same warning came back on every call: 2,408 lines of
`torch.distributed.all_gather_into_tensor is deprecated` in a 600-step 2-process ZeRO-3 run. The
"once" action is keyed on the message text in a registry that filter changes do not clear.

On ranks other than 0 the libraries' warnings and info lines are rank 0's again, N times over: they
are dropped there (Python warnings from any module but grpo's, and the libraries' loggers below
ERROR). Errors and grpo's own warnings still print on every rank.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Repeater:
    category: type[Warning]
    message: str  # regex matched at the start of the message
    module: str  # regex matched at the start of the module the warning is attributed to
    why: str


REPEATERS = (
    Repeater(
        FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|_all_gather_base|reduce_scatter_tensor|_reduce_scatter_base)` is",
        r"torch\.distributed\.", "DeepSpeed's ZeRO-3 gathers and reduces through these on every parameter fetch",
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
    for r in REPEATERS:
        warnings.filterwarnings("once", message=r.message, category=r.category, module=r.module)
