"""The `slurm` tier: sweeps, multi-task jobs and requeue on a real SLURM (`slurm/dev-cluster.sh up`),
through real sbatch, srun, squeue and scancel. Run with `make test-slurm` (pytest -m slurm).

A cluster that does not answer is a failure here, not a skip: CI brings it up before this tier.
The cluster's errors (absent, unknown partition, too big) are checked in the default tier too where
they need no cluster (tests/test_launch.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT

pytestmark = pytest.mark.slurm
DEV_CONF = os.path.join(os.environ.get("GRPO_SLURM_DIR", "/tmp/grpo-slurm"), "slurm.conf")


@pytest.fixture(scope="module")
def slurm_env():
    """The environment for SLURM commands: SLURM_CONF of the dev cluster unless one is set."""
    env = dict(os.environ)
    if "SLURM_CONF" not in env and os.path.exists(DEV_CONF):
        env["SLURM_CONF"] = DEV_CONF
    out = subprocess.run(["sinfo", "-h", "-o", "%P %a %D %T"], env=env, capture_output=True, text=True)
    if out.returncode or "up" not in out.stdout:
        pytest.fail(f"no SLURM cluster answers (sinfo: {out.stdout}{out.stderr}); start one: slurm/dev-cluster.sh up")
    return env


@pytest.fixture(scope="module")
def model_cache(cache_dir):
    """Build the tiny model once here, so the jobs only load it."""
    from grpo.models import ensure_tiny_model
    from grpo.tasks import build_task
    from tests.conftest import compose_cfg

    cfg = compose_cfg(*FAST, cache=cache_dir)
    ensure_tiny_model(cfg.model, cfg.task, build_task(cfg.task), cfg.rollout.max_new_tokens)
    return cache_dir


def run(cmd, env, timeout=600):
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"{' '.join(cmd[:4])}...: {time.time() - t0:.1f} s")
    return out


def steps_logged(run_dir) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["step"] for line in open(path).read().splitlines() if line.endswith("}")]


def wait_gone(job: str, env, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
        if out.returncode or not out.stdout.strip():
            return
        time.sleep(2)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job} still queued or running after {timeout:.0f} s")


def test_sweep_of_two_runs_on_slurm(tmp_path, slurm_env, model_cache):
    sweep = tmp_path / "sweep"
    out = run([sys.executable, "-m", "grpo.train", "-m", "hydra/launcher=slurm", "algo.lr=1e-3,2e-3", *FAST,
               f"model.cache_dir={model_cache}", f"hydra.sweep.dir={sweep}"], slurm_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lrs = set()
    for num in ("0", "1"):
        summary = json.load(open(sweep / num / "summary.json"))
        assert summary["steps"] == 3 and summary["world_size"] == 1
        assert steps_logged(sweep / num) == [0, 1, 2, 3, 3]  # before, 3 steps, after
        lrs.add(open(sweep / num / "config.yaml").read().split("\n  lr: ")[1].split("\n")[0])
    assert lrs == {"0.001", "0.002"}
    assert len(list((sweep / ".submitit").iterdir())) >= 2  # the jobs really went through submitit/sbatch


@pytest.mark.parametrize("parallel", ["ddp", "zero3"])
def test_two_task_job_trains_with_two_ranks(tmp_path, slurm_env, model_cache, parallel):
    """Rank and world size from SLURM's variables, under DDP and under DeepSpeed ZeRO-3."""
    run_dir = tmp_path / "run"
    out = run([sys.executable, "-m", "grpo.launch", "nodes=1", "tasks_per_node=2", "wait=true", f"parallel={parallel}", *FAST,
               f"model.cache_dir={model_cache}", f"run_dir={run_dir}"], slurm_env)
    # The trainer's outputs decide, not only the exit code: with gloo on torch 2.13 a rank sometimes
    # aborts at interpreter exit after its work is done (see tests/ddp_step.py: exit_process).
    assert (run_dir / "summary.json").exists(), out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert steps_logged(run_dir) == [0, 1, 2, 3, 3]
    job = out.stdout.split("submitted training: job ")[1].split(",")[0]
    logs = "".join(p.read_text() for p in (run_dir / "slurm" / job).glob("*_log.out"))
    assert "global_rank=0(2)" in logs and "global_rank=1(2)" in logs  # two SLURM tasks, one rank each


def submitted_job(out) -> str:
    return out.stdout.split("submitted training: job ")[1].split(",")[0]


def launch_and_wait_for_step(run_dir, env, first_step, *args, model_cache):
    """`grpo.launch` a 2-rank DDP run; returns its job id once it has logged `first_step`."""
    out = run([sys.executable, "-m", "grpo.launch", "nodes=1", "tasks_per_node=2", "parallel=ddp", *FAST, *args,
               f"model.cache_dir={model_cache}", f"run_dir={run_dir}"], env)
    assert out.returncode == 0, out.stdout + out.stderr
    job = submitted_job(out)
    wait_for_step(run_dir, first_step, job, env)
    return job


def wait_for_step(run_dir, step, job, env, timeout=300) -> int:
    deadline = time.time() + timeout
    while max(steps_logged(run_dir), default=0) < step and time.time() < deadline:
        time.sleep(0.2)
    reached = max(steps_logged(run_dir), default=0)
    if reached < step:
        subprocess.run(["scancel", job], env=env)
        pytest.fail(f"job {job} logged up to step {reached}, not {step}, within {timeout} s")
    return reached


def sacct_states(job: str, env, timeout: float = 60) -> list[str]:
    """The job's state in every record accounting holds (--duplicates: one per start), oldest first,
    once the newest is final (the accounting record may trail the job's end by a few seconds)."""
    deadline = time.time() + timeout
    while True:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "--duplicates", "-j", job, "-o", "State"], env=env,
                             capture_output=True, text=True)
        assert out.returncode == 0, f"sacct does not answer (is slurmdbd up?): {out.stderr}"
        states = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]  # "CANCELLED by 0" -> CANCELLED
        if (states and states[-1] in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT")) or time.time() > deadline:
            return states
        time.sleep(1)


def job_logs(run_dir, job) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "slurm" / job).glob("*_log.*")))


def checkpointed_step(run_dir) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().split("_")[1])


def assert_resumed_and_finished(run_dir, steps, world_size, stopped_at_least):
    summary = json.load(open(run_dir / "summary.json"))
    assert stopped_at_least <= summary["resumed_from"] < steps  # the step it stopped at, nothing before it lost
    assert summary["steps"] == steps and summary["world_size"] == world_size
    assert steps_logged(run_dir) == [0, *range(1, steps + 1), steps]  # every step once: none lost, none twice
    return summary


def test_scancel_checkpoints_on_every_rank_and_stays_cancelled(tmp_path, slurm_env, model_cache):
    """A user's `scancel`: SIGTERM; the run finishes its step, checkpoints on both ranks and exits.
    No copy comes back: accounting holds one record, CANCELLED (SLURM never requeues a cancelled
    job), and nothing is queued."""
    run_dir = tmp_path / "run"
    job = launch_and_wait_for_step(run_dir, slurm_env, 3, "steps=400", model_cache=model_cache)
    subprocess.run(["scancel", job], env=slurm_env, check=True)
    wait_gone(job, slurm_env, timeout=120)

    logs = job_logs(run_dir, job)
    stopped = checkpointed_step(run_dir)
    assert f"stopped after step {stopped} on SIGTERM (scancel or preemption); checkpoint written" in logs, logs[-4000:]
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert {p.name for p in latest.glob("state_rank*.pt")} == {"state_rank0.pt", "state_rank1.pt"}
    assert steps_logged(run_dir)[-1] == stopped  # the step in progress was finished, not cut
    assert "before the time limit" not in logs and not (run_dir / "summary.json").exists()  # no self-requeue
    time.sleep(12)  # past cred_expire (10 s), when a requeued job could start again
    assert sacct_states(job, slurm_env) == ["CANCELLED"]
    assert subprocess.run(["squeue", "-h", "-j", job], env=slurm_env, capture_output=True, text=True).stdout.strip() == ""


@pytest.mark.parametrize("how", ["train.sbatch", "grpo.launch"])
def test_time_limit_warning_checkpoints_requeues_and_finishes(tmp_path, slurm_env, model_cache, how):
    """The signal SLURM sends before the time limit: SIGUSR1 (train.sbatch's --signal=USR1@120) or
    SIGUSR2 (submitit's, under grpo.launch), sent here by hand. The run checkpoints after its step,
    requeues itself, resumes from the checkpoint and finishes, every step logged once."""
    run_dir, steps = tmp_path / "run", 150
    if how == "train.sbatch":
        signal_name, world = "USR1", 1
        log = tmp_path / "job.out"
        env = {**slurm_env, "RUN_DIR": str(run_dir), "PYTHON": sys.executable}
        out = run(["sbatch", "--parsable", f"--output={log}", "slurm/train.sbatch", *FAST, f"steps={steps}",
                   f"model.cache_dir={model_cache}"], env)
        assert out.returncode == 0, out.stderr
        job = out.stdout.strip().split(";")[0]
        wait_for_step(run_dir, 5, job, slurm_env)
    else:
        signal_name, world = "USR2", 2
        job = launch_and_wait_for_step(run_dir, slurm_env, 5, f"steps={steps}", model_cache=model_cache)
        log = None
    signalled_at = max(steps_logged(run_dir))
    assert signalled_at < steps, "the run finished before the signal; give it more steps"
    subprocess.run(["scancel", f"--signal={signal_name}", job], env=slurm_env, check=True)

    wait_gone(job, slurm_env, timeout=480)
    logs = log.read_text() if log else job_logs(run_dir, job)
    assert (run_dir / "summary.json").exists(), logs[-4000:]
    assert f"before the time limit; checkpoint written, job {job} requeued" in logs
    assert_resumed_and_finished(run_dir, steps, world, signalled_at)
    assert sacct_states(job, slurm_env) == ["REQUEUED", "COMPLETED"]


def test_preempted_job_is_requeued_by_slurm_and_resumes(tmp_path, slurm_env, model_cache):
    """A job in the higher-priority partition `urgent` preempts the training job (2 ranks, both
    CPUs): SIGTERM, checkpoint on every rank, exit; SLURM requeues it (PreemptMode=REQUEUE) and it
    resumes after the urgent job, finishing with every step logged once."""
    run_dir, steps = tmp_path / "run", 150
    job = launch_and_wait_for_step(run_dir, slurm_env, 5, f"steps={steps}", model_cache=model_cache)
    signalled_at = max(steps_logged(run_dir))
    urgent = run(["sbatch", "--parsable", "--partition=urgent", "--cpus-per-task=1", f"--output={tmp_path / 'urgent.out'}",
                  "--wrap", "sleep 5"], slurm_env).stdout.strip()

    wait_gone(urgent, slurm_env, timeout=120)
    wait_gone(job, slurm_env, timeout=480)
    logs = job_logs(run_dir, job)
    assert (run_dir / "summary.json").exists(), logs[-4000:]
    assert "on SIGTERM (scancel or preemption); checkpoint written" in logs
    assert "requeued: it resumes" not in logs  # SLURM requeued it, not the run
    assert_resumed_and_finished(run_dir, steps, 2, signalled_at)
    assert sacct_states(job, slurm_env) == ["PREEMPTED", "COMPLETED"]
    assert sacct_states(urgent, slurm_env) == ["COMPLETED"]


def start_sweep(sweep, env, model_cache, steps):
    """`-m hydra/launcher=slurm` of two runs (one CPU each: together they fill the node), running;
    returns the multirun process and the array's task ids once both runs have logged step 5."""
    proc = subprocess.Popen([sys.executable, "-m", "grpo.train", "-m", "hydra/launcher=slurm", "algo.lr=1e-3,2e-3", *FAST,
                             f"steps={steps}", f"model.cache_dir={model_cache}", f"hydra.sweep.dir={sweep}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while min(max(steps_logged(sweep / n), default=0) for n in "01") < 5:
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"the sweep's runs did not both reach step 5: {proc.communicate()[0][-3000:]}")
        time.sleep(0.2)
    tasks = sorted(d.name for d in (sweep / ".submitit").iterdir() if d.is_dir() and "_" in d.name)
    if not (len(tasks) == 2 and tasks[0].split("_")[0] == tasks[1].split("_")[0]):  # one array, two tasks
        subprocess.run(["scancel", *tasks], env=env)
        proc.kill()
        pytest.fail(f"expected the two tasks of one array in {sweep / '.submitit'}, found {tasks}")
    return proc, tasks


def finish_sweep(proc, sweep, steps, tasks):
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    logs = {n: "".join(p.read_text() for p in sorted((sweep / ".submitit" / t).glob("*_log.*"))) for n, t in zip("01", tasks)}
    for n in "01":
        assert (sweep / n / "summary.json").exists(), logs[n][-3000:]
        assert steps_logged(sweep / n) == [0, *range(1, steps + 1), steps]  # every step once
    return {n: json.load(open(sweep / n / "summary.json")) for n in "01"}, logs


def test_sweep_tasks_requeue_themselves_by_their_own_ids(tmp_path, slurm_env, model_cache):
    """The time-limit warning (submitit's SIGUSR2) reaches both tasks of a sweep's array at once:
    each requeues its own `<array>_<task>` id, not the array (whose id is also task 0's job id, and
    requeueing it raced with the sibling: `scontrol requeue 1 failed: 1_0: Job is pending execution`)."""
    sweep, steps = tmp_path / "sweep", 150
    proc, tasks = start_sweep(sweep, slurm_env, model_cache, steps)
    signalled_at = {n: max(steps_logged(sweep / n)) for n in "01"}
    subprocess.run(["scancel", "--signal=USR2", tasks[0].split("_")[0]], env=slurm_env, check=True)  # the whole array

    summaries, logs = finish_sweep(proc, sweep, steps, tasks)
    for n, task in zip("01", tasks):
        assert f"checkpoint written, job {task} requeued" in logs[n], logs[n][-3000:]
        assert signalled_at[n] <= summaries[n]["resumed_from"] < steps
        assert sacct_states(task, slurm_env) == ["REQUEUED", "COMPLETED"]


def test_sweep_task_is_preempted_requeued_and_resumes(tmp_path, slurm_env, model_cache):
    """A job in `urgent` takes one CPU: SLURM preempts one task of the sweep's array; it checkpoints,
    is requeued by SLURM, resumes after the urgent job and finishes; the sweep then ends normally."""
    sweep, steps = tmp_path / "sweep", 150
    proc, tasks = start_sweep(sweep, slurm_env, model_cache, steps)
    urgent = run(["sbatch", "--parsable", "--partition=urgent", "--cpus-per-task=1", f"--output={tmp_path / 'urgent.out'}",
                  "--wrap", "sleep 5"], slurm_env).stdout.strip()

    summaries, logs = finish_sweep(proc, sweep, steps, tasks)
    states = {n: sacct_states(task, slurm_env) for n, task in zip("01", tasks)}
    preempted = [n for n in "01" if states[n] == ["PREEMPTED", "COMPLETED"]]
    assert len(preempted) == 1 and states[{"0": "1", "1": "0"}[preempted[0]]] == ["COMPLETED"], states
    n = preempted[0]
    assert "on SIGTERM (scancel or preemption); checkpoint written" in logs[n]
    assert 5 <= summaries[n]["resumed_from"] < steps
    assert sacct_states(urgent, slurm_env) == ["COMPLETED"]


@pytest.mark.parametrize("args, message", [
    (["partition=nope"], "error: partition 'nope' does not exist on this cluster; pick one of ['debug', 'urgent']"),
    (["nodes=2", "parallel=ddp"], "error: the job asks for 2 node(s) with 1 task(s) x 1 CPU(s) each, but partition 'debug' has 1 node(s)"),
    ([f"cpus_per_task={os.cpu_count() + 1}"], "0 of them big enough"),
])
def test_impossible_requests_fail_before_anything_is_submitted(tmp_path, slurm_env, args, message):
    jobs = lambda: subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True, text=True).stdout
    before = jobs()
    out = run([sys.executable, "-m", "grpo.launch", *args, f"run_dir={tmp_path / 'run'}"], slurm_env, timeout=120)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert jobs() == before and not (tmp_path / "run").exists()


def sbatch(script, run_dir, env, *overrides, sbatch_args=(), extra_env=None):
    """Submit a template from slurm/ and wait for it; returns its log."""
    log = run_dir.parent / f"{run_dir.name}.out"
    env = {**env, "RUN_DIR": str(run_dir), "PYTHON": sys.executable, **(extra_env or {})}
    out = run(["sbatch", "--parsable", f"--output={log}", *sbatch_args, f"slurm/{script}", *FAST, *overrides], env)
    assert out.returncode == 0, out.stderr
    wait_gone(out.stdout.strip().split(";")[0], env, timeout=480)
    return log.read_text()


def test_train_sbatch_two_tasks_in_an_explicit_run_folder(tmp_path, slurm_env, model_cache):
    run_dir = tmp_path / "run"
    log = sbatch("train.sbatch", run_dir, slurm_env, "parallel=ddp", f"model.cache_dir={model_cache}", sbatch_args=["--ntasks-per-node=2"])
    assert (run_dir / "summary.json").exists(), log[-4000:]  # outputs decide (see the 2-task test above)
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["world_size"] == 2 and steps_logged(run_dir) == [0, 1, 2, 3, 3]


def shm_files() -> set[str]:
    """vLLM's shared-memory queues: a server killed instead of shut down leaves them in /dev/shm."""
    return {p.name for p in Path("/dev/shm").glob("psm_*")}


def test_train_remote_sbatch_starts_a_server_and_trains_against_it(tmp_path, slurm_env, model_cache):
    run_dir = tmp_path / "run"
    shm_before = shm_files()
    log = sbatch("train_remote.sbatch", run_dir, slurm_env, extra_env={"GRPO_CACHE": model_cache})
    assert (run_dir / "summary.json").exists(), log[-4000:]
    urls = [p.read_text().strip() for p in (run_dir / "servers").glob("*.url")]
    assert len(urls) == 1 and urls[0].startswith("http://")
    config = (run_dir / "config.yaml").read_text()
    assert "backend: remote" in config and urls[0] in config  # the trainer used the URL the server wrote
    assert "POST /update_weights" in log and steps_logged(run_dir) == [0, 1, 2, 3, 3]
    assert shm_files() - shm_before == set(), "the server was killed, not shut down: its shared memory leaked"


def test_launch_with_servers_runs_a_companion_server_job(tmp_path, slurm_env, model_cache):
    run_dir = tmp_path / "run"
    shm_before = shm_files()
    out = run([sys.executable, "-m", "grpo.launch", "nodes=1", "servers=1", "wait=true", "rollout=remote", *FAST,
               f"model.cache_dir={model_cache}", f"run_dir={run_dir}"], slurm_env)
    assert (run_dir / "summary.json").exists(), out.stdout[-3000:] + out.stderr[-3000:]
    server_job = out.stdout.split("submitted rollout servers: job ")[1].split(" ")[0]
    urls = [p.read_text().strip() for p in (run_dir / "servers").glob("*.url")]
    assert len(urls) == 1 and urls[0] in (run_dir / "config.yaml").read_text()  # found, not configured
    assert steps_logged(run_dir) == [0, 1, 2, 3, 3]
    wait_gone(server_job, slurm_env, timeout=60)  # the trainer cancelled its servers at the end
    assert shm_files() - shm_before == set(), "the server was killed, not shut down: its shared memory leaked"
