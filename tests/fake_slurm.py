"""Stand-ins for SLURM's commands (sbatch, srun, squeue, scontrol, scancel) where there is no SLURM: each
an executable Python script on PATH, for the tests of grpo.launch and the sbatch files without a
cluster (tests/test_launch.py). The real commands are exercised in the `slurm` tier (tests/test_slurm.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def recording(calls: Path) -> str:
    """A stand-in's body that appends `<command> <arguments>` to `calls`, one line per call."""
    return f'open({str(calls)!r}, "a").write(" ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")'


def fake_slurm(bin_dir: Path, bodies: dict[str, str]) -> str:
    """Write each command of `bodies` into `bin_dir` as a script running its body (json, os and sys
    imported); returns a PATH that finds them first."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for command, body in bodies.items():
        script = bin_dir / command
        script.write_text(f"#!{sys.executable}\nimport json, os, sys\n{body}\n")
        script.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def fake_scontrol(tmp_path, monkeypatch, rc: int) -> Path:
    """A stand-in `scontrol` on PATH that appends its arguments ("scontrol requeue 41") to the returned file
    and exits `rc`, in a job 41 (no array): what grpo.preempt's requeue calls."""
    calls = tmp_path / "calls"
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "scontrol $*" >> {calls}\nexit {rc}\n')
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    return calls
