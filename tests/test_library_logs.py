"""Logs a person can read (grpo/library_logs.py): a library's repeating warning appears once per run,
ranks other than 0 print only grpo's warnings and errors, a real 2-process ZeRO-3 run's log repeats no
line, and healthy colocated and dedicated runs (tests/test_dedicated.py) print no WARNING and repeat no
line, the engine's own log included."""

import re
import subprocess
import sys
from collections import Counter

import pytest

from tests.conftest import FAST, ROOT
from tests.test_parallel import TORCHRUN


def unreadable(log: str) -> tuple[list[str], dict[str, int]]:
    """A log's lines at WARNING level (logging's and DeepSpeed's forms), and its lines repeated more than
    3 times once their times and pids are set aside (a line per weight sync shows as a repeat; grpo's
    progress lines, "waiting ... 15 s of 600 s", do not); the step lines are the log's own."""
    lines = [line for line in log.splitlines() if line.strip() and not line.startswith("step ")]
    level = r"^\(\w+ pid=\d+\) WARNING |\[WARNING\]|^WARNING\b"  # vLLM's, DeepSpeed's and hydra's, Python's forms
    warned = [line for line in lines if re.search(level, line)]
    stamp = r"\d{4}-\d\d-\d\d [\d:,.]+|\d\d-\d\d \d\d:\d\d:\d\d|pid=\d+|\d+\.\d+ seconds"
    counts = Counter(re.sub(stamp, "N", line) for line in lines)
    return warned, {line: n for line, n in counts.items() if n > 3}


def assert_readable(log: str, what: str) -> None:
    warned, repeated = unreadable(log)
    assert not warned, f"WARNING lines in {what}: {warned}"
    assert not repeated, f"lines repeated in {what}: {repeated}"


def emit(code: str) -> str:
    """Run `code` in a fresh interpreter (warning filters are process-wide); returns its stderr."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stderr


# torch's own deprecation warning, raised as DeepSpeed's ZeRO-3 raises it (through the deprecated
# function, attributed to torch.distributed), with a filter change between calls as the libraries
# make them (each `catch_warnings` block clears Python's per-location records).
REPEAT = """
import warnings, torch.distributed.c10d_logger as where
from grpo.library_logs import quiet_library_logs
{setup}
for _ in range(5):
    with warnings.catch_warnings():
        pass
    exec(compile('import warnings; warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Use x.", FutureWarning)',
                 where.__file__, 'exec'), {{'__name__': 'torch.distributed.c10d_logger'}})
"""


@pytest.mark.starts_process
def test_known_repeater_appears_once_not_every_call():
    assert emit(REPEAT.format(setup="")).count("all_gather_into_tensor` is deprecated") == 5  # what the logs were
    assert emit(REPEAT.format(setup="quiet_library_logs(0)")).count("all_gather_into_tensor` is deprecated") == 1


@pytest.mark.starts_process
def test_other_warnings_are_not_silenced_on_rank_0():
    err = emit("import warnings\nfrom grpo.library_logs import quiet_library_logs\nquiet_library_logs(0)\n"
               "warnings.warn('something new', UserWarning)")
    assert "UserWarning: something new" in err


@pytest.mark.starts_process
def test_ranks_other_than_0_print_grpo_warnings_and_errors_only():
    code = """
import logging, warnings
from grpo.library_logs import quiet_library_logs
quiet_library_logs(1)
exec(compile('import warnings; warnings.warn("library chatter", UserWarning)', 'lib.py', 'exec'), {'__name__': 'deepspeed.runtime'})
exec(compile('import warnings; warnings.warn("this rank ran out of data", UserWarning)', 'g.py', 'exec'), {'__name__': 'grpo.tasks'})
logging.basicConfig()
logging.getLogger("deepspeed.runtime").warning("library info on every rank")
logging.getLogger("deepspeed.runtime").error("a library error")
"""
    err = emit(code)
    assert "library chatter" not in err and "library info on every rank" not in err
    assert "this rank ran out of data" in err and "a library error" in err


@pytest.mark.starts_process
def test_two_process_zero3_log_repeats_no_line(tmp_path, cache_dir):
    """A short 2-process ZeRO-3 run: no line of its console output appears more than 3 times (before
    the filter: torch's all_gather_into_tensor deprecation warning on every parameter gather)."""
    out = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, "steps=6",
                          "parallel=zero3", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert (tmp_path / "summary.json").exists(), log[-4000:]
    repeated = {line: n for line, n in Counter(line for line in log.splitlines() if line.strip()).items() if n > 3}
    assert not repeated, f"lines repeated in a 6-step 2-process ZeRO-3 run: {repeated}"


@pytest.mark.starts_process
def test_a_colocated_runs_log_warns_nothing_and_repeats_nothing(tmp_path, cache_dir):
    """vLLM in the training process: its per-sync lines (`RotaryEmbedding: Failed to load weights`,
    `Successfully reset prefix cache`: 1,200 of a 600-step run's 1,932 lines) and its CPU start-up
    warnings appear once, at INFO, with what they mean; DeepSpeed's accelerator line and transformers'
    "generation flags are not valid" are gone at their cause."""
    out = subprocess.run([sys.executable, "-m", "grpo.train", *FAST, "steps=6", "rollout=colocated",
                          f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert (tmp_path / "summary.json").exists(), log[-4000:]
    assert_readable(log, "a 6-step colocated run")
    assert log.count("Successfully reset prefix cache") == 1 and "shown once" in log  # the note, not silence
