"""Preemption and time limits: finish the step, checkpoint on every rank, requeue, resume.

SLURM warns a job before it ends it: SIGTERM on preemption or `scancel --signal=TERM`, and the signal
the job asked for before its time limit (`#SBATCH --signal=TERM@120` in slurm/*.sbatch; SIGUSR2,
submitit's `--signal=USR2@<signal_delay_s>`, under `grpo.launch` and the submitit launcher).

The handler only sets a flag; the training loop asks `requested()` once per step. All ranks agree
through one tiny all-reduce, so ranks signalled at slightly different moments stop after the same
step. The loop then saves a checkpoint on every rank and calls `stop()`: rank 0 asks SLURM to requeue
the job (`scontrol requeue`), which runs the same command again with the same run folder, where
`resume=true` (the default) picks up the checkpoint. Nothing trained is lost.

We do not use submitit's own `Checkpointable`: submitit calls `checkpoint()` from its signal handler
on rank 0 alone, in the middle of a step, then exits; the other ranks would be left mid-collective.
Under submitit the requeued job simply runs the same pickled `grpo.launch.TrainJob` again.

Outside SLURM the run stops after the checkpoint; running it again with the same folder resumes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from grpo import dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class StopSignal:
    """Catches SLURM's warning signals; `requested()` is True on every rank once any rank got one."""

    def __init__(self):
        self.signum: int | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def close(self) -> None:
        """Give the signals back (to a caller that runs `train` in-process, such as a test)."""
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def requested(self) -> bool:
        return dist.all_reduce_sum([1.0 if self.signum else 0.0])[0] > 0


def stop(step: int, log=print) -> None:
    """After the checkpoint of `step` is written on every rank: requeue the SLURM job and wait for
    SLURM to end this allocation, or, outside SLURM, exit. Never returns."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        log(f"stopped after step {step} on a signal; checkpoint written. Run again with the same run folder to resume.")
        raise SystemExit(143)
    if dist.rank() == 0:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if out.returncode:
            log(
                f"stopped after step {step}; checkpoint written, but `scontrol requeue {job}` failed: "
                f"{out.stderr.strip()}. Submit the job again with the same run folder to resume "
                "(and give it `--requeue` if the cluster sets JobRequeue=0)."
            )
            raise SystemExit(1)
        log(f"stopped after step {step}; checkpoint written, job {job} requeued: it resumes from step {step}.")
    dist.barrier()
    # SLURM now ends this allocation (SIGTERM, then SIGKILL after KillWait). Let its SIGTERM end us
    # here rather than returning, so no launcher mistakes this run for a finished or failed one.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(300)
    raise SystemExit(1)
