"""What a kill, a resume or a stop signal may leave, and what the next save, resume or requeue makes of it
(grpo/checkpoint.py, grpo/preempt.py, grpo/scratch.py): the cases a mutation test found unguarded."""

import copy
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from grpo.checkpoint import DONE, latest_checkpoint, load_checkpoint, save_checkpoint, set_aside_checkpoints
from tests.conftest import ROOT
from tests.fake_slurm import fake_scontrol
from tests.test_checkpoint import killed_while_replacing_step_2, strategy_for


def test_a_step_saved_again_after_a_kill_during_its_own_save_replaces_the_partial_folder(tmp_path, tiny_lm, monkeypatch):
    """Killed while saving step 2 (a 2-rank run: rank 1's state and part of trainer.pt written), the run
    resumes from step 1 and saves step 2 again into the same temporary name: the leftover must go first,
    or the save fails (FileExistsError) or publishes the killed save's files (rank 1's state, which a
    later 2-rank resume would read)."""
    strategy = strategy_for(copy.deepcopy(tiny_lm[0]))
    save_checkpoint(str(tmp_path), 1, strategy, {"sampler": {"pos": 1}})

    def dies_half_way(folder):
        for name in ("trainer.pt", "state_rank1.pt"):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(b"partial")
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(strategy, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 2, strategy, {"sampler": {"pos": 2}})
    monkeypatch.undo()
    assert os.path.isdir(tmp_path / "checkpoints" / ".tmp-step_00000002")

    path = save_checkpoint(str(tmp_path), 2, strategy, {"sampler": {"pos": 2}})
    assert sorted(os.listdir(path)) == [DONE, "state_rank0.pt", "trainer.pt"]
    assert latest_checkpoint(str(tmp_path)) == path
    assert load_checkpoint(path, strategy_for(copy.deepcopy(tiny_lm[0])))["sampler"] == {"pos": 2}


def test_pruning_never_removes_the_checkpoint_just_saved(tmp_path, tiny_lm, monkeypatch):
    """A kill after step 5's folder was renamed into place but before `latest` named it: the resume
    starts from step 3 and saves step 4 while the killed run's step_5 is still there. With
    keep_checkpoints=1 the oldest by name are [3, 4]: step 4, the one `latest` now names, must stay."""
    strategy = strategy_for(tiny_lm[0])
    save_checkpoint(str(tmp_path), 3, strategy, {}, keep=5)
    real_replace = os.replace

    def dies_before_the_pointer(src, dst):
        if os.path.basename(dst) == "latest":
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_before_the_pointer)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 5, strategy, {}, keep=5)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(str(tmp_path)) == str(root / "step_00000003")  # latest still names step 3

    four = save_checkpoint(str(tmp_path), 4, strategy, {}, keep=1)
    assert latest_checkpoint(str(tmp_path)) == four == str(root / "step_00000004")
    assert sorted(os.listdir(root)) == ["latest", "step_00000004", "step_00000005"]


def test_the_next_save_removes_what_a_kill_while_replacing_a_step_left(tmp_path, tiny_lm, monkeypatch):
    """Killed between moving the old step 2 aside (.old-step_2-<pid>) and renaming the new one into place:
    the next save removes both leftovers (a real model's: gigabytes each)."""
    strategy = strategy_for(tiny_lm[0])
    killed_while_replacing_step_2(tmp_path, strategy, monkeypatch)
    root = tmp_path / "checkpoints"
    assert sorted(d[:5] for d in os.listdir(root)) == [".old-", ".tmp-", "lates", "step_"]
    save_checkpoint(str(tmp_path), 2, strategy, {}, keep=5)
    assert sorted(os.listdir(root)) == ["latest", "step_00000001", "step_00000002"]


def test_latest_naming_a_folder_without_its_complete_marker_is_not_resumed(tmp_path):
    """`latest` names step 3, whose folder is there but lacks COMPLETE (its files never reached the disk
    whole): the newest complete checkpoint is step 2, and an mtime does not decide which is newest."""
    root = tmp_path / "checkpoints"
    for step in ("step_00000001", "step_00000002", "step_00000003"):
        (root / step).mkdir(parents=True)
        (root / step / "state_rank0.pt").write_bytes(b"")
    for step in ("step_00000001", "step_00000002"):
        (root / step / DONE).write_text("")
    (root / "latest").write_text("step_00000003")
    later = time.time() + 100
    os.utime(root / "step_00000001", (later, later))  # touched last (a copy, a backup tool): still the older step
    assert latest_checkpoint(str(tmp_path)) == str(root / "step_00000002")


def test_a_set_aside_beside_an_earlier_one_of_the_same_second_takes_the_next_number(tmp_path):
    """Two resume=false starts within one second: the second's `replaced-<time>-0` exists already; it
    takes -1 rather than failing (FileExistsError) before the run starts."""
    now = time.time()
    for t in (now, now + 1, now + 2):  # the call below comes within these seconds
        (tmp_path / f"replaced-{time.strftime('%Y%m%d-%H%M%S', time.localtime(t))}-0").mkdir(exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    aside = set_aside_checkpoints(str(tmp_path))
    assert aside.endswith("-1") and os.listdir(aside) == ["metrics.jsonl"]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_resume_restores_the_rng_and_each_rank_reads_its_own_state(tmp_path, tiny_lm, monkeypatch):
    """The checkpoint's RNG state (torch, python, numpy) is this rank's draw position: a resume draws what
    the unbroken run drew next. A rank reads its own state_rank<r>.pt (rank 0's only where the run grew)."""
    import grpo.dist

    strategy = strategy_for(copy.deepcopy(tiny_lm[0]))
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    path = save_checkpoint(str(tmp_path), 1, strategy, {"data": "rank 0"})
    unbroken = (torch.rand(3), random.random(), np.random.rand(2))
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    load_checkpoint(path, strategy_for(copy.deepcopy(tiny_lm[0])))
    resumed = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(resumed[0], unbroken[0]) and resumed[1] == unbroken[1] and np.array_equal(resumed[2], unbroken[2])

    torch.manual_seed(5)
    from grpo.checkpoint import rng_state

    torch.save({"data": "rank 1", "step": 1, "rng": rng_state()}, os.path.join(path, "state_rank1.pt"))  # as rank 1 writes it
    after_5 = torch.rand(2)
    monkeypatch.setattr(grpo.dist, "rank", lambda: 1)
    assert load_checkpoint(path, strategy_for(copy.deepcopy(tiny_lm[0])))["data"] == "rank 1"
    assert torch.equal(torch.rand(2), after_5)
    monkeypatch.setattr(grpo.dist, "rank", lambda: 2)  # the run grew: rank 0's
    assert load_checkpoint(path, strategy_for(copy.deepcopy(tiny_lm[0])))["data"] == "rank 0"


def test_submitits_time_limit_warning_sigusr2_is_caught_and_given_back():
    """submitit's `--signal=USR2@...`: a real SIGUSR2 must reach StopSignal (its default action ends the
    process, no checkpoint) and ask for a requeue; close() gives the handler before it back."""
    from grpo.preempt import StopSignal

    got = []

    def before(signum, frame):
        got.append(signum)

    previous = signal.signal(signal.SIGUSR2, before)
    try:
        stop_signal = StopSignal()
        try:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop_signal.requested() and stop_signal.requeue and got == []
        finally:
            stop_signal.close()
        assert signal.getsignal(signal.SIGUSR2) is before
    finally:
        signal.signal(signal.SIGUSR2, previous)



def test_a_sigterm_under_slurm_exits_without_requeueing(monkeypatch, tmp_path):
    """scancel or preemption (SIGTERM): exit 143 after the checkpoint; `scontrol requeue` here would
    undo a cancel and race SLURM's own requeue of a preempted job."""
    from grpo.preempt import stop

    calls = fake_scontrol(tmp_path, monkeypatch, rc=1)  # a requeue by mistake would fail, not wait 300 s
    said = []
    with pytest.raises(SystemExit) as e:
        stop(7, log=said.append, requeue=False)
    assert e.value.code == 143 and not calls.exists()
    assert "Not requeued here" in said[-1]


def test_any_failure_of_before_requeue_still_requeues(monkeypatch, tmp_path):
    """before_requeue (grpo.launch cancelling its companions) failing with any error, not only an
    OSError: the checkpoint is written, and the requeue must still be asked for."""
    from grpo.preempt import stop

    calls = fake_scontrol(tmp_path, monkeypatch, rc=1)

    def broken():
        raise RuntimeError("squeue said nonsense")

    said = []
    with pytest.raises(SystemExit):
        stop(7, log=said.append, requeue=True, before_requeue=broken)
    assert calls.read_text().splitlines() == ["scontrol requeue 41"]
    assert said[1] == "before requeueing job 41: RuntimeError: squeue said nonsense"


@pytest.mark.starts_process
def test_after_its_requeue_a_run_is_ended_by_slurms_sigterm(tmp_path):
    """Requeued, the run waits for SLURM to end the allocation (SIGTERM, then SIGKILL after KillWait).
    StopSignal still owns SIGTERM there: unless stop() gives it back, the SIGTERM is only recorded and
    the process sleeps on to SIGKILL."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "scontrol").chmod(0o755)
    code = ("from grpo.preempt import StopSignal, stop\n"
            "s = StopSignal(); s.training()\n"
            "stop(3, log=lambda line: print(line, flush=True), requeue=True)\n")
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "41", "PYTHONPATH": ROOT}
    env.pop("SLURM_ARRAY_JOB_ID", None), env.pop("SLURM_ARRAY_TASK_ID", None)
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert "requeueing job 41" in line, line
        for _ in range(120):  # no output marks the moment past scontrol: signal until it ends (its sleep is 300 s)
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                pass
    finally:
        child.kill()
    assert child.returncode == -signal.SIGTERM


def test_a_scratch_folder_whose_socket_path_is_exactly_the_limit_stays_in_the_temporary_directory(monkeypatch):
    """A uuid socket path of exactly 107 bytes fits sockaddr_un: the folder stays under TMPDIR (the
    job's, removed with it), not in /tmp."""
    import tempfile

    from grpo.scratch import SOCKET_NAME, SOCKET_PATH_MAX, scratch_folder

    top = tempfile.mkdtemp(prefix="grpo-test-", dir="/tmp")
    try:
        prefix = "grpo-engine-"
        spare = SOCKET_PATH_MAX - len(os.path.join(top, "", prefix + "x" * 8, "x" * SOCKET_NAME)) - 1  # less its "/"
        base = os.path.join(top, "d" * spare)
        os.mkdir(base)
        assert len(os.path.join(base, prefix + "x" * 8, "x" * SOCKET_NAME)) == SOCKET_PATH_MAX
        monkeypatch.setattr(tempfile, "tempdir", base)
        folder = scratch_folder(prefix)
        assert os.path.dirname(folder) == base
    finally:
        import shutil

        shutil.rmtree(top, ignore_errors=True)


def test_a_config_write_that_fails_half_way_leaves_the_earlier_config_yaml(tmp_path):
    """config.yaml is written beside and renamed into place: a write that stops part way (here a value
    YAML cannot hold; a kill does the same) leaves the earlier file whole, not truncated."""
    from omegaconf.errors import UnsupportedValueType

    from grpo.checkpoint import record_config

    record_config(str(tmp_path), {"algo": {"lr": 1e-3}}, resuming=False)
    with pytest.raises(UnsupportedValueType):
        record_config(str(tmp_path), {"algo": {"lr": object()}}, resuming=False)
    assert (tmp_path / "config.yaml").read_text() == "algo:\n  lr: 0.001\n"


def test_a_resumes_config_write_that_fails_keeps_the_earlier_config_yaml_for_the_next_resume(tmp_path):
    """On a resume with a changed config the earlier config.yaml was moved aside before the new one was
    written: a write that failed (a full disk; here a value YAML cannot hold) left no config.yaml, and the
    next resume, compared with nothing, warned of no change however its config differed."""
    from omegaconf.errors import UnsupportedValueType

    from grpo.checkpoint import record_config

    record_config(str(tmp_path), {"algo": {"lr": 1e-3}}, resuming=False)
    with pytest.raises(UnsupportedValueType):
        record_config(str(tmp_path), {"algo": {"lr": object()}}, resuming=True)
    assert (tmp_path / "config.yaml").read_text() == "algo:\n  lr: 0.001\n"
    assert record_config(str(tmp_path), {"algo": {"lr": 5e-3}}, resuming=True) == ["algo.lr"]
