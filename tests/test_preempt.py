"""Stop signals outside SLURM: the run finishes its step, checkpoints, stops; started again, it resumes
with every step logged once; which signal exits and which requeues. (Under SLURM: tests/test_slurm.py.)"""

import json
import os
import signal
import socket
import threading
import time

import pytest

from tests.fake_slurm import fake_scontrol
from tests.test_checkpoint import run_train


def steps_logged(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.mark.starts_process
def test_sigterm_checkpoints_after_the_step_and_resumes(tmp_path, cache_dir):
    run_dir, args = tmp_path / "run", ["steps=200", "checkpoint_every=0"]
    victim = run_train(run_dir, cache_dir, *args)
    deadline = time.time() + 300
    while max(steps_logged(run_dir), default=0) < 3 and time.time() < deadline and victim.poll() is None:
        time.sleep(0.05)
    victim.send_signal(signal.SIGTERM)
    out, _ = victim.communicate(timeout=120)
    assert victim.returncode == 143, out
    stopped = int((run_dir / "checkpoints" / "latest").read_text().split("_")[1])
    assert 3 <= stopped < 200 and f"stopped after step {stopped} on a signal; checkpoint written" in out
    assert steps_logged(run_dir)[-1] == stopped  # the step in progress was finished, not cut

    resumed = run_train(run_dir, cache_dir, "steps=12" if stopped < 12 else f"steps={stopped + 2}", "checkpoint_every=0")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == stopped
    assert steps_logged(run_dir) == [0, *range(1, summary["steps"] + 1), summary["steps"]]


@pytest.mark.starts_process
def test_a_stop_during_the_last_step_keeps_it_and_the_resumed_run_only_evaluates(tmp_path, cache_dir):
    """SIGTERM while the last step (3 of 3) scores: the step finishes, its checkpoint is written before
    the final evaluation and the run exits 143 without a summary; run again, it trains nothing, evaluates,
    and every step is logged once."""
    run_dir = tmp_path / "run"
    fault = "reward.funcs=[{name: tests.faults.sigterm_on_third_call, weight: 1.0}]"
    victim = run_train(run_dir, cache_dir, "steps=3", fault)
    out, _ = victim.communicate(timeout=300)
    assert victim.returncode == 143, out
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith("step_00000003")
    assert "stopped after step 3 on a signal; checkpoint written" in out
    assert not (run_dir / "summary.json").exists() and steps_logged(run_dir) == [0, 1, 2, 3]

    resumed = run_train(run_dir, cache_dir, "steps=3")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == 3
    assert steps_logged(run_dir) == [0, 1, 2, 3, 3]  # the final evaluation's row, once


@pytest.mark.starts_process
def test_a_requeued_job_started_with_resume_false_resumes(make_cfg, monkeypatch):
    """A job SLURM requeues runs the same overrides again: with `resume=false` among them, each
    requeue set the run's checkpoints aside and trained from step 1 (a run longer than one allocation
    never finished). `resume=false` acts on a job's first start only: the requeue resumes."""
    from grpo.train import train

    first = make_cfg("steps=2", "resume=false")
    train(first)  # the job's first start (its checkpoint of step 2 is what a stop signal would leave)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # SLURM requeued it: the same overrides
    summary = train(make_cfg("steps=3", "resume=false"))
    assert summary["resumed_from"] == 2
    assert not [d for d in os.listdir(first.run_dir) if d.startswith("replaced-")]
    monkeypatch.delenv("SLURM_RESTART_COUNT")  # a new job (or a run outside SLURM): resume=false starts over
    assert train(make_cfg("steps=2", "resume=false"))["resumed_from"] == 0
    assert [d for d in os.listdir(first.run_dir) if d.startswith("replaced-")]


def test_sigterm_exits_and_the_time_limit_warning_requeues():
    """What each signal asks for, decided on (here: one) rank: SIGTERM (scancel, preemption) exits,
    SIGUSR1/SIGUSR2 (the time-limit warning of the sbatch templates / submitit) requeue, and a
    SIGTERM wins over a warning that came with it (a cancel is final)."""
    from grpo.preempt import StopSignal

    before = signal.getsignal(signal.SIGUSR1)
    stop_signal = StopSignal()
    try:
        assert not stop_signal.requested()
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, through the real handler
        assert stop_signal.requested() and stop_signal.requeue
        stop_signal.received = {signal.SIGUSR2}
        assert stop_signal.requested() and stop_signal.requeue
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_signal.requested() and not stop_signal.requeue
    finally:
        stop_signal.close()
    # after the run: a late warning must not end a finished job (SIGUSR1's default action would)
    assert signal.getsignal(signal.SIGUSR1) == (signal.SIG_IGN if before == signal.SIG_DFL else before)
    os.kill(os.getpid(), signal.SIGUSR1)  # with SIG_DFL this would end pytest


@pytest.mark.starts_process
def test_two_ranks_agree_on_a_signal_one_got_and_on_a_run_folder_in_use(tmp_path):
    """Two ranks (torchrun, gloo), tests/rank_agreement.py: rank 1 alone gets the time-limit warning, and
    both must stop and requeue after the step (one deciding alone would wait in the next collective for a
    peer that saved and left); then another process holds the run folder's .lock, and both must refuse it
    (rank 0 alone refusing would leave rank 1 going on without it)."""
    import fcntl
    import subprocess
    import sys

    from tests.conftest import ROOT

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run's
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "tests/rank_agreement.py", str(tmp_path), str(run_dir)], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    stops = [(s["requested"], s["requeue"]) for s in seen]
    assert stops == [(True, True)] * 2, f"(stop, requeue) on ranks 0 and 1: {stops}"
    refused = ["in use by another run" in (s["refused"] or "") for s in seen]
    assert refused == [True, True], f"ranks 0 and 1 refused the held folder: {refused}"


def test_a_sigterm_during_setup_exits_at_once_and_a_warning_waits_for_step_1():
    """Setup (a remote server's health wait, an engine's start, the first evaluation) can take minutes
    with nothing to checkpoint: a SIGTERM then ends the process at once (143), while a time-limit warning
    is kept for the loop, whose step 1 checkpoint the requeued job resumes from. Once training, a SIGTERM
    is only recorded."""
    from grpo.preempt import StopSignal

    stop_signal = StopSignal(in_setup=True)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop_signal.requested() and stop_signal.requeue  # kept, not raised
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler raises at once
            time.sleep(5)  # not reached
        assert e.value.code == 143
        os.kill(os.getpid(), signal.SIGTERM)  # a second one (srun and torchrun both forward it) during the cleanup:
        assert stop_signal.received == {signal.SIGUSR1, signal.SIGTERM}  # recorded, not raised mid-cleanup
        stop_signal.received.clear()
        stop_signal.training()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_signal.requested() and not stop_signal.requeue
    finally:
        stop_signal.close()


@pytest.mark.starts_process
def test_sigterm_while_waiting_for_a_dead_server_ends_the_run_at_once(tmp_path, cache_dir):
    """A run whose remote server never answers waits up to health_timeout_s (300 s) before step 1;
    `kill` (or scancel) then waited all of it. Now it ends within seconds, saying nothing was trained."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    victim = run_train(run_dir, cache_dir, "rollout=remote", f"rollout.remote.urls=[http://127.0.0.1:{port}]",
                       "rollout.remote.health_timeout_s=300")
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(victim.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 240
    while time.time() < deadline and victim.poll() is None and not any("to answer /health" in x for x in lines):
        time.sleep(0.2)  # the wait's first progress line comes 15 s in
    assert victim.poll() is None, "".join(lines)
    victim.send_signal(signal.SIGTERM)
    try:
        victim.wait(timeout=60)  # it waited the whole 300 s before
    finally:
        victim.kill()  # a no-op once it has exited
    reader.join(timeout=10)
    out = "".join(lines)
    assert victim.returncode == 143, out
    assert "stopped during setup on SIGTERM: nothing trained" in out
    assert not (run_dir / "checkpoints").exists()


def test_an_array_task_requeues_its_own_id_not_the_array():
    from grpo.preempt import own_job_id

    # task 0 of array 12 has SLURM_JOB_ID 12, the array's own id: `scontrol requeue 12` would requeue both tasks
    assert own_job_id({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "0"}) == "12_0"
    assert own_job_id({"SLURM_JOB_ID": "13", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "1"}) == "12_1"
    assert own_job_id({"SLURM_JOB_ID": "7"}) == "7"
    assert own_job_id({}) is None


def test_a_requeue_without_scontrol_says_the_job_is_not_requeued(monkeypatch, tmp_path):
    """A container (pyxis, enroot) often lacks SLURM's tools while SLURM_JOB_ID is set: the missing
    scontrol was a FileNotFoundError traceback, not the message that says to submit again."""
    from grpo.preempt import stop

    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol on it
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    said = []
    with pytest.raises(SystemExit) as e:
        stop(7, log=said.append, requeue=True)
    assert e.value.code == 1
    assert said[-1].startswith("`scontrol requeue 41` failed: FileNotFoundError: ") and "The job is NOT requeued" in said[-1]


def test_before_requeue_runs_on_rank_0_before_scontrol_and_a_failure_there_still_requeues(monkeypatch, tmp_path):
    """grpo.launch cancels its server and judge jobs in `before_requeue`: that must come before
    `scontrol requeue` (after it SLURM may end the allocation at once), and its failure must not keep
    the job from being requeued (the checkpoint is written). A stand-in scontrol records its call and
    fails, so `stop` returns (SystemExit 1) instead of waiting for SLURM to end the allocation."""
    from grpo.preempt import stop

    calls = fake_scontrol(tmp_path, monkeypatch, rc=1)

    def cancel():
        with open(calls, "a") as f:
            f.write("cancel companions\n")

    def broken():
        cancel()
        raise OSError("squeue: not found")

    for before, extra in ((cancel, []), (broken, ["before requeueing job 41: OSError: squeue: not found"])):
        calls.unlink(missing_ok=True)
        said = []
        with pytest.raises(SystemExit):
            stop(7, log=said.append, requeue=True, before_requeue=before)
        assert calls.read_text().splitlines() == ["cancel companions", "scontrol requeue 41"]
        assert said[1:-1] == extra
