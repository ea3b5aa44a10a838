"""Stop signals as SLURM and its users mean them: finish the step, checkpoint on every rank, then
exit (SIGTERM) or requeue (the time-limit warning).

What each event sends, and what the run does:

  - `scancel <job>` (a user): SIGTERM to every task. The run finishes its step, writes a checkpoint
    on every rank and exits with 143. It does NOT requeue: a cancelled job stays cancelled (sacct:
    CANCELLED). To continue it, submit again with the same run folder; it resumes from the checkpoint.
  - Preemption (a job of a higher-priority partition needs the nodes; PreemptMode=REQUEUE): also
    SIGTERM, then GraceTime (the partition's) and KillWait before SIGKILL. The same as above: the run
    checkpoints and exits; SLURM itself requeues the job (sacct: PREEMPTED, then PENDING), which
    resumes from the checkpoint when it runs again. Requeueing here too would race SLURM's own.
  - The time-limit warning: SIGUSR1 (`#SBATCH --signal=USR1@120` in slurm/train.sbatch, as
    Lightning's SLURM environment uses it; slurm/train_remote.sbatch forwards its batch shell's
    `B:USR1` to the trainer step only) or SIGUSR2 (submitit's `--signal=USR2@<signal_delay_s>`, under
    `grpo.launch` and the Hydra SLURM launcher). The run finishes its step, checkpoints on every rank,
    and rank 0 requeues the job with `scontrol requeue` (the job's own id; an array task's own
    `<array job>_<task>` id, never the whole array). Just before that it runs the caller's
    `before_requeue` (`grpo.launch` cancels its server and judge jobs there: the requeued trainer
    starts new ones, and the old ones would otherwise hold their nodes until it does). SLURM then ends
    this allocation, and the requeued job runs the same command in the same run folder, where it
    picks up the checkpoint, `resume=false` or not (SLURM_RESTART_COUNT > 0: grpo/train.py's setup;
    `resume=false` sets an earlier run aside on a job's first start only). Nothing trained is lost and
    no step is logged twice.

The handlers only record the signal; the training loop asks `requested()` once per step. All ranks
agree through one tiny all-reduce, so ranks signalled at slightly different moments stop after the
same step, and a SIGTERM on any rank wins over a time-limit warning (a cancel is final).

We do not use submitit's own `Checkpointable`: submitit calls `checkpoint()` from its signal handler
on rank 0 alone, in the middle of a step, then exits; the other ranks would be left mid-collective.
While `train` runs, `StopSignal` owns SIGTERM, SIGUSR1 and SIGUSR2; under submitit the requeued job
simply runs the same pickled `grpo.launch.TrainJob` (or Hydra job) again.

Outside SLURM every signal stops the run after the checkpoint; running it again with the same folder
resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Callable

from grpo import dist

EXIT = signal.SIGTERM  # scancel, preemption: checkpoint and exit
REQUEUE = (signal.SIGUSR1, signal.SIGUSR2)  # time-limit warning (sbatch templates, submitit): checkpoint and requeue


class StopSignal:
    """Catches SLURM's stop signals. `requested()` is True on every rank once any rank got one;
    `requeue` then says whether the run should requeue itself (a time-limit warning and no SIGTERM).

    `in_setup`: until `training()` is called a SIGTERM ends the process at once (exit 143, through the
    caller's cleanup, as Ctrl-C does): before the first step there is nothing to checkpoint, and setup
    can wait minutes (a remote server's health, an engine's start, the first evaluation). A time-limit
    warning during setup still waits for step 1, whose checkpoint the requeued job resumes from."""

    def __init__(self, in_setup: bool = False):
        self.received: set[int] = set()
        self.requeue = False
        self.in_setup = in_setup
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self.previous = {s: signal.signal(s, self._handle) for s in (EXIT, *REQUEUE)}

    def close(self) -> None:
        """Give the signals back (to a caller that runs `train` in-process, such as a test). A
        time-limit warning after the run has ended finds nothing left to save: where its default
        action would end the process (and turn a finished job into FAILED), it is ignored instead."""
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_IGN if s in REQUEUE and handler == signal.SIG_DFL else handler)
        self.previous = {}

    def training(self) -> None:
        """Setup is over: from now on a SIGTERM is honoured after the step, with its checkpoint."""
        self.in_setup = False

    def _handle(self, signum, frame) -> None:
        self.received.add(signum)
        if self.in_setup and signum == EXIT:
            self.in_setup = False  # a second SIGTERM (srun and torchrun both forward one) must not cut the cleanup short
            # os.write: a print could land inside the main thread's own write to stderr (a reentrant call)
            os.write(2, b"stopped during setup on SIGTERM: nothing trained in this process, no checkpoint written. "
                        b"Run again with the same run folder to start (or resume) there.\n")
            raise SystemExit(143)

    def requested(self) -> bool:
        exits, requeues = dist.all_reduce_sum([
            1.0 if EXIT in self.received else 0.0,
            1.0 if self.received & set(REQUEUE) else 0.0,
        ])
        self.requeue = exits == 0 and requeues > 0
        return exits + requeues > 0


@contextlib.contextmanager
def sigterm_exits(what: str):
    """While open, a SIGTERM (scancel, preemption) ends the process with exit 143 (SystemExit), through
    the caller's cleanup, as `StopSignal` does during setup. For waits before `train` owns the signals
    (`grpo.launch` waiting for its server jobs, up to server_wait_s): submitit's own handler only logs a
    SIGTERM ("Bypassing signal SIGTERM"), so the wait went on until SLURM's SIGKILL, which skips the
    cleanup (the server jobs kept their nodes). `what`: what is being waited for, for the message. The
    previous handler is back on the way out; after a SIGTERM further ones are ignored instead, so a
    second (srun forwards one too) cannot cut the cleanup short. Off the main thread nothing changes
    (signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handle(signum, frame):
        fired.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # os.write: a print could land inside the main thread's own write to stderr (a reentrant call)
        os.write(2, f"stopped on SIGTERM while waiting for {what}: nothing trained in this process. Run again "
                    f"with the same run folder to start (or resume) there.\n".encode())
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        if not fired:
            signal.signal(signal.SIGTERM, previous)


def restarts(env=None) -> int:
    """How many times SLURM requeued this job: SLURM_RESTART_COUNT, set from the first requeue on
    (preemption, the time-limit warning's `scontrol requeue`, a node failure under `--requeue`); 0
    outside SLURM and on a job's first start. A requeued job runs the same command (the same
    overrides, `resume=false` among them) to continue the run its first start began."""
    env = os.environ if env is None else env
    return int(env.get("SLURM_RESTART_COUNT") or 0)


def own_job_id(env=None) -> str | None:
    """This job's id for `scontrol`: `<array job>_<task>` for an array task (its SLURM_JOB_ID may
    equal the array's id, and `scontrol requeue <array id>` requeues every task of the array, failing
    on a sibling that is pending), else SLURM_JOB_ID; None outside SLURM."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def stop(step: int, log=print, requeue: bool = False, before_requeue: Callable[[], None] | None = None,
         resume: bool = True) -> None:
    """After the checkpoint of `step` is written on every rank: exit, or with `requeue` (the
    time-limit warning) requeue the SLURM job and wait for SLURM to end this allocation. Rank 0 runs
    `before_requeue` first (a failure there is logged; the requeue goes on). `resume`: the run's
    setting, for the advice (a new start with resume=false sets the checkpoint aside; a requeue of
    this job resumes either way). Never returns."""
    job = own_job_id()
    resume_hint = "" if resume else " and resume=true"
    if not job:
        log(f"stopped after step {step} on a signal; checkpoint written. Run again with the same run folder{resume_hint} to resume.")
        raise SystemExit(143)
    if not requeue:
        log(f"stopped after step {step} on SIGTERM (scancel or preemption); checkpoint written. Not requeued here: "
            f"a preempted job {job} is requeued by SLURM and resumes from step {step}; a cancelled one stays "
            f"cancelled (submit again with the same run folder{resume_hint} to resume).")
        raise SystemExit(143)
    if dist.rank() == 0:
        # Said before the requeue: SLURM cancels this step as it requeues the job, and srun can drop
        # output still on its way (CI, 2026-11-28: the line printed after `scontrol requeue` was lost).
        log(f"stopped after step {step} before the time limit; checkpoint written, requeueing job {job}: it resumes from step {step}.")
        if before_requeue is not None:
            try:
                before_requeue()
            except Exception as e:  # the checkpoint is written: requeueing matters more
                log(f"before requeueing job {job}: {type(e).__name__}: {e}")
        try:
            out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            failure = out.stderr.strip() if out.returncode else None
        except OSError as e:  # a container (pyxis, enroot) without SLURM's tools, though SLURM_JOB_ID is set
            failure = f"{type(e).__name__}: {e}"
        if failure is not None:
            log(
                f"`scontrol requeue {job}` failed: {failure}. The job is NOT requeued; its checkpoint "
                f"of step {step} is written. Submit the job again with the same run folder to resume "
                "(and give it `--requeue` if the cluster sets JobRequeue=0)."
            )
            raise SystemExit(1)
    dist.barrier()
    # SLURM now ends this allocation (SIGTERM, then SIGKILL after KillWait). Let its SIGTERM end us
    # here rather than returning, so no launcher mistakes this run for a finished or failed one.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(300)
    raise SystemExit(1)
