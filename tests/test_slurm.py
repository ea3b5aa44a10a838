"""The `slurm` tier: sweeps, multi-node jobs and requeue on a real two-node SLURM
(`slurm/dev-cluster.sh up --nodes 2`: nodes grpo-n1 and grpo-n2, each its own slurmd, address and
share of the CPUs), through real sbatch, srun, squeue and scancel. Run with `make test-slurm`
(pytest -m slurm). Every job that matters spans both nodes; where a test needs a node or the whole
cluster filled (preemption), it asks for every slot the cluster reports.

A cluster that does not answer is a failure here, not a skip: CI brings it up before this tier.
The cluster's errors (absent, unknown partition, too big) are checked in the default tier too where
they need no cluster (tests/test_launch.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT

pytestmark = pytest.mark.slurm
DEV_CONF = os.path.join(os.environ.get("GRPO_SLURM_DIR", "/tmp/grpo-slurm"), "slurm.conf")
# Steps of a run that a test signals (time limit, preemption) once it has logged a few: long enough
# that the signal lands before the run ends (the sweeps keep 150: start_sweep holds each of its runs at step 5
# until both are there). On an idle machine the tiny model's steps take 0.02 s:
# 150 steps were over in 3 s and the run finished before its USR1 arrived (CI, 2026-11-25).
SIGNALLED_RUN_STEPS = 1000


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
def cluster(slurm_env):
    """(node names, task slots per node) of partition debug; the tier needs two nodes."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %c"], env=slurm_env, capture_output=True, text=True)
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    if len(rows) < 2:
        pytest.fail(f"the slurm tier runs on two nodes, this cluster has {len(rows)}: slurm/dev-cluster.sh up --nodes 2")
    return [name for name, _ in rows], min(int(cpus) for _, cpus in rows)


@pytest.fixture(scope="module")
def model_cache(cache_dir):
    """Build the tiny model once here, so the jobs only load it."""
    from grpo.tasks import build_task
    from grpo.tiny.warm_start import ensure_tiny_model
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


def test_sweep_of_two_runs_each_on_two_nodes(tmp_path, slurm_env, model_cache, cluster):
    """`-m hydra/launcher=slurm` with hydra.launcher.nodes=2: each run is one job of 2 ranks, one per node."""
    sweep = tmp_path / "sweep"
    out = run([sys.executable, "-m", "grpo.train", "-m", "hydra/launcher=slurm", "hydra.launcher.nodes=2", "parallel=ddp",
               "algo.lr=1e-3,2e-3", *FAST, f"model.cache_dir={model_cache}", f"hydra.sweep.dir={sweep}"], slurm_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lrs = set()
    for num in ("0", "1"):
        summary = json.load(open(sweep / num / "summary.json"))
        assert summary["steps"] == 3 and summary["world_size"] == 2
        assert summary["nodes"] == cluster[0][:2]  # rank 0 on the first node, rank 1 on the second
        assert steps_logged(sweep / num) == [0, 1, 2, 3, 3]  # before, 3 steps, after
        lrs.add(open(sweep / num / "config.yaml").read().split("\n  lr: ")[1].split("\n")[0])
    assert lrs == {"0.001", "0.002"}
    assert len(list((sweep / ".submitit").iterdir())) >= 2  # the jobs really went through submitit/sbatch


def launch_cmd(run_dir, model_cache, *args):
    return [sys.executable, "-m", "grpo.launch", "wait=true", *FAST, f"model.cache_dir={model_cache}", f"run_dir={run_dir}", *args]


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]


# slow (make test-slurm ARGS="-m slurm" runs it): zero3 alone, which zero3-sequence2 runs across the nodes too
@pytest.mark.parametrize("parallel", [["parallel=ddp"], pytest.param(["parallel=zero3"], marks=pytest.mark.slow),
                                      ["parallel=zero3", "parallel.sequence_parallel=2"]], ids=["ddp", "zero3", "zero3-sequence2"])
def test_two_node_job_learns_as_its_one_node_twin(tmp_path, slurm_env, model_cache, cluster, parallel):
    """2 ranks on 2 nodes (one run folder, one summary.json, MASTER_ADDR the first node's name) and
    2 ranks on 1 node, the same seed, side by side: the same losses, rewards and accuracy. With
    parallel.sequence_parallel=2 the two ranks share every row of the update: across the nodes, the
    all-to-alls of each attention go between them."""
    t0 = time.time()
    jobs = {shape: subprocess.Popen(launch_cmd(tmp_path / shape, model_cache, *parallel, *layout), cwd=ROOT,
                                    env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for shape, layout in {"two_nodes": ["nodes=2", "tasks_per_node=1"], "one_node": ["nodes=1", "tasks_per_node=2"]}.items()}
    outs = {shape: proc.communicate(timeout=600)[0] for shape, proc in jobs.items()}
    print(f"both jobs: {time.time() - t0:.1f} s")
    summaries = {}
    for shape, out in outs.items():
        # The trainer's outputs decide, not only the exit code: with gloo on torch 2.13 a rank sometimes
        # aborts at interpreter exit after its work is done (see tests/ddp_step.py: exit_process).
        assert (tmp_path / shape / "summary.json").exists(), out[-4000:]
        summaries[shape] = json.load(open(tmp_path / shape / "summary.json"))
        assert summaries[shape]["world_size"] == 2 and steps_logged(tmp_path / shape) == [0, 1, 2, 3, 3]
        print(f"{shape}: {summaries[shape]['wall_s']:.1f} s in the run, eval {summaries[shape]['eval_before']:.3f} -> "
              f"{summaries[shape]['eval_after']:.3f}, nodes {summaries[shape]['nodes']}")
    two, one = summaries["two_nodes"]["nodes"], summaries["one_node"]["nodes"]
    assert two[0] != two[1] and set(two) <= set(cluster[0]) and one[0] == one[1]
    for key in ("eval_before", "eval_after"):
        assert summaries["two_nodes"][key] == summaries["one_node"][key]
    rows = {shape: metric_rows(tmp_path / shape) for shape in outs}
    for a, b in zip(rows["two_nodes"], rows["one_node"]):
        for key in ("reward/mean", "loss", "grad_norm", "entropy"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a, b)


def submitted_job(out) -> str:
    return out.stdout.split("submitted training: job ")[1].split(",")[0]


def launch_and_wait_for_step(run_dir, env, first_step, *args, model_cache):
    """`grpo.launch` a 2-node DDP run (one rank per node); returns its job id once it has logged `first_step`."""
    out = run([sys.executable, "-m", "grpo.launch", "nodes=2", "tasks_per_node=1", "parallel=ddp", *FAST, *args,
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
    """A user's `scancel` of a 2-node job: SIGTERM on both nodes; the run finishes its step,
    checkpoints on both ranks and exits.
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


# slow (make test-slurm ARGS="-m slurm" runs it): grpo.launch's SIGUSR2, which the requeued trainer's time-limit case
# sends under grpo.launch too (requeue, resume, finish, REQUEUED then COMPLETED); a 2-node resume: the preempted job
@pytest.mark.parametrize("how", ["train.sbatch", pytest.param("grpo.launch", marks=pytest.mark.slow)])
def test_time_limit_warning_checkpoints_requeues_and_finishes(tmp_path, slurm_env, model_cache, how):
    """The signal SLURM sends before the time limit: SIGUSR1 (train.sbatch's --signal=USR1@120) or
    SIGUSR2 (submitit's, under grpo.launch), sent here by hand. The run checkpoints after its step,
    requeues itself, resumes from the checkpoint and finishes, every step logged once."""
    run_dir, steps = tmp_path / "run", SIGNALLED_RUN_STEPS
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
    assert f"before the time limit; checkpoint written, requeueing job {job}:" in logs
    assert_resumed_and_finished(run_dir, steps, world, signalled_at)
    assert sacct_states(job, slurm_env) == ["REQUEUED", "COMPLETED"]


def test_preempted_job_is_requeued_by_slurm_and_resumes(tmp_path, slurm_env, model_cache, cluster):
    """A job in the higher-priority partition `urgent` that asks for every slot of both nodes
    preempts the 2-node training job: SIGTERM on both nodes, checkpoint on every rank, exit; SLURM
    requeues it (PreemptMode=REQUEUE) and it resumes across both nodes after the urgent job,
    finishing with every step logged once."""
    run_dir, steps = tmp_path / "run", SIGNALLED_RUN_STEPS
    job = launch_and_wait_for_step(run_dir, slurm_env, 5, f"steps={steps}", model_cache=model_cache)
    signalled_at = max(steps_logged(run_dir))
    names, slots = cluster
    urgent = run(["sbatch", "--parsable", "--partition=urgent", f"--nodes={len(names)}", f"--ntasks-per-node={slots}",
                  f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 5"], slurm_env).stdout.strip()

    wait_gone(urgent, slurm_env, timeout=120)
    wait_gone(job, slurm_env, timeout=480)
    logs = job_logs(run_dir, job)
    assert (run_dir / "summary.json").exists(), logs[-4000:]
    assert "on SIGTERM (scancel or preemption); checkpoint written" in logs
    assert "requeueing job" not in logs  # SLURM requeued it, not the run
    summary = assert_resumed_and_finished(run_dir, steps, 2, signalled_at)
    assert summary["nodes"][0] != summary["nodes"][1]  # resumed across both nodes
    assert sacct_states(job, slurm_env) == ["PREEMPTED", "COMPLETED"]
    assert sacct_states(urgent, slurm_env) == ["COMPLETED"]


def start_sweep(sweep, env, model_cache, steps, slots):
    """`-m hydra/launcher=slurm` of two runs (each asking for a whole node's slots: one per node),
    running; returns the multirun process and the array's task ids once both runs have logged step 5.
    The runs do not start together (imports, model load; a node freed late): each is stopped
    (`scancel --signal=STOP`) at step 5 until the other is there too, so neither has finished when the test
    signals (CI, 2026-11-26: one task's 150 steps took 4 s and were over before the signal came).
    Not `scontrol suspend`: sacct then says SUSPENDED, which submitit counts as finished, and the
    sweep gave up on the task's result (CI, 2026-11-26); a stopped task stays RUNNING in sacct."""
    proc = subprocess.Popen([sys.executable, "-m", "grpo.train", "-m", "hydra/launcher=slurm", "algo.lr=1e-3,2e-3", *FAST,
                             f"hydra.launcher.cpus_per_task={slots}",
                             f"steps={steps}", f"model.cache_dir={model_cache}", f"hydra.sweep.dir={sweep}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, tasks, held = time.time() + 300, [], {}
    while len(held) < 2:
        if time.time() > deadline or proc.poll() is not None:
            if held:
                subprocess.run(["scancel", "--signal=CONT", *held], env=env)
            subprocess.run(["scancel", *tasks], env=env)
            proc.kill()
            pytest.fail(f"the sweep's runs did not both reach step 5: {proc.communicate()[0][-3000:]}")
        tasks = sorted(d.name for d in (sweep / ".submitit").iterdir() if d.is_dir() and "_" in d.name) if (sweep / ".submitit").is_dir() else []
        for n, task in zip("01", tasks if len(tasks) == 2 else []):
            if task not in held and max(steps_logged(sweep / n), default=0) >= 5:
                subprocess.run(["scancel", "--signal=STOP", task], env=env, check=True)
                held[task] = max(steps_logged(sweep / n))
        time.sleep(0.2)
    # Both go on together; signalled only once each has logged a step since (a signal sent right
    # after `scontrol resume` never reached the resumed task in a local run, 2026-11-26).
    subprocess.run(["scancel", "--signal=CONT", *held], env=env, check=True)
    while any(max(steps_logged(sweep / n)) <= held[task] for n, task in zip("01", tasks)):
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"the sweep's runs did not go on after SIGCONT: {proc.communicate()[0][-3000:]}")
        time.sleep(0.1)
    print(f"both runs held at steps {held}, continued")
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


def test_sweep_tasks_requeue_themselves_by_their_own_ids(tmp_path, slurm_env, model_cache, cluster):
    """The time-limit warning (submitit's SIGUSR2) reaches both tasks of a sweep's array at once:
    each requeues its own `<array>_<task>` id, not the array (whose id is also task 0's job id, and
    requeueing it raced with the sibling: `scontrol requeue 1 failed: 1_0: Job is pending execution`)."""
    sweep, steps = tmp_path / "sweep", 150
    proc, tasks = start_sweep(sweep, slurm_env, model_cache, steps, cluster[1])
    signalled_at = {n: max(steps_logged(sweep / n)) for n in "01"}
    subprocess.run(["scancel", "--signal=USR2", tasks[0].split("_")[0]], env=slurm_env, check=True)  # the whole array

    summaries, logs = finish_sweep(proc, sweep, steps, tasks)
    for n, task in zip("01", tasks):
        assert f"checkpoint written, requeueing job {task}:" in logs[n], logs[n][-3000:]
        assert signalled_at[n] <= summaries[n]["resumed_from"] < steps
        assert sacct_states(task, slurm_env) == ["REQUEUED", "COMPLETED"]


def test_sweep_task_is_preempted_requeued_and_resumes(tmp_path, slurm_env, model_cache, cluster):
    """A job in `urgent` takes one whole node: SLURM preempts the sweep's task on it; it checkpoints,
    is requeued by SLURM, resumes after the urgent job and finishes; the sweep then ends normally."""
    sweep, steps = tmp_path / "sweep", 150
    proc, tasks = start_sweep(sweep, slurm_env, model_cache, steps, cluster[1])
    urgent = run(["sbatch", "--parsable", "--partition=urgent", f"--cpus-per-task={cluster[1]}", f"--output={tmp_path / 'urgent.out'}",
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
    (["nodes=4", "parallel=ddp"], "error: the job asks for 4 node(s) with 1 task(s) x 1 CPU(s) each, but partition 'debug' has 2 node(s)"),
    ([f"cpus_per_task={os.cpu_count() + 3}"], "0 of them big enough"),
])
def test_impossible_requests_fail_before_anything_is_submitted(tmp_path, slurm_env, cluster, args, message):
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


def test_train_sbatch_two_nodes_in_an_explicit_run_folder(tmp_path, slurm_env, model_cache):
    run_dir = tmp_path / "run"
    log = sbatch("train.sbatch", run_dir, slurm_env, "parallel=ddp", f"model.cache_dir={model_cache}",
                 sbatch_args=["--nodes=2", "--ntasks-per-node=1"])
    assert (run_dir / "summary.json").exists(), log[-4000:]  # outputs decide (see the twin test above)
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["world_size"] == 2 and steps_logged(run_dir) == [0, 1, 2, 3, 3]
    assert summary["nodes"][0] != summary["nodes"][1]


def shm_files() -> set[str]:
    """vLLM's shared-memory queues: a server killed instead of shut down leaves them in /dev/shm."""
    return {p.name for p in Path("/dev/shm").glob("psm_*")}


def test_train_remote_sbatch_starts_a_server_and_a_judge_and_trains_against_them(tmp_path, slurm_env, model_cache):
    """JUDGES=1 JUDGE_MODEL=tiny: on one node the rollout server and the judge share it with the trainer,
    which uses the URL the server wrote (weights pushed to it every step) and is scored by the judge
    every step, through the job's token; both servers shut down (no shared memory left). The layouts
    without a judge, and with several servers and nodes, are test_launch.py's (the sbatch under a
    fake srun): one real job covers the server's start and the judge's beside it."""
    run_dir = tmp_path / "run"
    shm_before = shm_files()
    log = sbatch("train_remote.sbatch", run_dir, slurm_env, "reward=judge", "reward.judge.api=completions",
                 "reward.judge.rating=[0,9]", "reward.judge.template='{prompt}{completion}?'",
                 extra_env={"GRPO_CACHE": model_cache, "JUDGES": "1", "JUDGE_MODEL": "tiny"})
    assert (run_dir / "summary.json").exists(), log[-4000:]
    urls = [p.read_text().strip() for p in (run_dir / "servers").glob("*.url")]
    judges = [p.read_text().strip() for p in (run_dir / "judges").glob("*.url")]
    config = (run_dir / "config.yaml").read_text()
    assert len(urls) == 1 and urls[0].startswith("http://") and urls[0] in config and "backend: remote" in config
    assert len(judges) == 1 and judges[0] in config and judges[0] != urls[0]
    assert "POST /update_weights" in log and steps_logged(run_dir) == [0, 1, 2, 3, 3]
    steps = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"reward/judge"' in line]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["judge/failed"] == 0 for r in steps)
    assert shm_files() - shm_before == set(), "a server was killed, not shut down: its shared memory leaked"


# Run on the trainer's node while the job's server (on the other node) is up: what a process there
# without the token gets from it. /health is open (it proves the port answers); the rest needs the token.
PROBE_WITHOUT_TOKEN = """
import json, os, sys, time, urllib.error, urllib.request
url = sys.argv[1]
def status(path, body=None, token=None):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url + path, data=body and json.dumps(body).encode(), headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code
deadline = time.time() + 300
while True:
    try:
        if status("/health") == 200:
            break
    except OSError:
        pass
    assert time.time() < deadline, "the server never answered /health"
    time.sleep(0.5)
print(json.dumps({"node": os.environ["SLURMD_NODENAME"], "health": status("/health"),
                  "update_weights": status("/update_weights", {"update_info": {}}),
                  "completions": status("/v1/completions", {"prompt": "1+1=", "max_tokens": 1}),
                  "wrong_token": status("/v1/completions", {"prompt": "1+1=", "max_tokens": 1}, token="not-the-token")}))
"""


def test_launch_with_servers_runs_a_companion_server_job(tmp_path, slurm_env, model_cache, cluster):
    """servers=1: the server job takes one whole node, the trainer the other; the trainer finds the
    server's URL (its node's name) in the run folder and its token in a file only the owner reads.
    While it runs, a process on the trainer's node without the token is refused (401) by the server on
    the other node: weight pushes and generation alike. (The dev cluster's nodes share one loopback, so
    this shows the token, not the interface the server binds: docs/security.md.)"""
    run_dir = tmp_path / "run"
    shm_before = shm_files()
    out = run([sys.executable, "-m", "grpo.launch", "nodes=1", "servers=1", f"cpus_per_task={cluster[1]}",
               "rollout=remote", *FAST, f"model.cache_dir={model_cache}", f"run_dir={run_dir}"], slurm_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    server_job, job = out.stdout.split("submitted rollout servers: job ")[1].split(" ")[0], submitted_job(out)
    deadline = time.time() + 120
    while not (urls := [p.read_text().strip() for p in (run_dir / "servers").glob("*.url")]):
        assert time.time() < deadline, "the server wrote no URL"
        time.sleep(1)
    probe = run(["srun", f"--jobid={job}", "--overlap", "--nodes=1", "--ntasks=1", sys.executable, "-c",
                 PROBE_WITHOUT_TOKEN, urls[0]], slurm_env)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    refused = json.loads(probe.stdout.strip().splitlines()[-1])
    wait_gone(job, slurm_env, timeout=480)
    assert (run_dir / "summary.json").exists(), job_logs(run_dir, job)[-3000:]
    config = (run_dir / "config.yaml").read_text()
    assert len(urls) == 1 and urls[0] in config  # found, not configured
    trainer_node = json.load(open(run_dir / "summary.json"))["nodes"][0]
    server_node = urls[0].split("//")[1].split(":")[0]
    assert {server_node, trainer_node} == set(cluster[0][:2]), (server_node, trainer_node)  # one node each
    assert refused == {"node": trainer_node, "health": 200, "update_weights": 401, "completions": 401, "wrong_token": 401}
    token_file = run_dir / "servers" / "token"
    assert f"token_file: {token_file}" in config and not token_file.exists()  # removed with the servers it guarded
    logs = "".join(p.read_text() for p in (run_dir / "slurm").glob("*/*_log.*"))
    # the token itself is nowhere else: launch's tokens are 64 hex digits (grpo.launch.write_token_file)
    assert not re.findall(r"\b[0-9a-f]{64}\b", config + out.stdout + out.stderr + logs)
    assert steps_logged(run_dir) == [0, 1, 2, 3, 3]
    wait_gone(server_job, slurm_env, timeout=60)  # the trainer cancelled its servers at the end
    assert shm_files() - shm_before == set(), "the server was killed, not shut down: its shared memory leaked"


def test_launch_with_judges_runs_a_companion_judge_job(tmp_path, slurm_env, model_cache, cluster):
    """judges=1 judge_model=tiny reward=judge: the judge job takes one whole node, the trainer (rollout=hf)
    the other; the trainer finds the judge's URL in <run_dir>/judges/ and the judges' own token in
    <run_dir>/judges/token, is scored by it every step, and cancels it (and removes the token) at the end."""
    run_dir = tmp_path / "run"
    out = run([sys.executable, "-m", "grpo.launch", "nodes=1", "judges=1", "judge_model=tiny", f"cpus_per_task={cluster[1]}",
               "wait=true", "reward=judge", "reward.judge.api=completions", "reward.judge.rating=[0,9]",
               "reward.judge.template='{prompt}{completion}?'", *FAST, f"model.cache_dir={model_cache}", f"run_dir={run_dir}"],
              {**slurm_env, "GRPO_CACHE": model_cache})
    assert (run_dir / "summary.json").exists(), out.stdout[-3000:] + out.stderr[-3000:]
    judge_job = out.stdout.split("submitted judge servers: job ")[1].split(" ")[0]
    urls = [p.read_text().strip() for p in (run_dir / "judges").glob("*.url")]
    config = (run_dir / "config.yaml").read_text()
    assert len(urls) == 1 and urls[0] in config  # found, not configured
    trainer_node = json.load(open(run_dir / "summary.json"))["nodes"][0]
    judge_node = urls[0].split("//")[1].split(":")[0]
    assert {judge_node, trainer_node} == set(cluster[0][:2]), (judge_node, trainer_node)  # one node each
    token_file = run_dir / "judges" / "token"
    assert f"token_file: {token_file}" in config and not token_file.exists()
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = [r for r in rows if "reward/judge" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["judge/failed"] == 0 and r["judge/requests"] >= 1 for r in steps)
    wait_gone(judge_job, slurm_env, timeout=60)  # the trainer cancelled its judge at the end


def sacct_times(job: str, env) -> list[tuple[str, str]]:
    """(when it was submitted, when it ended) of each start of the job (--duplicates: a requeued job has
    one record per start), oldest first, as sacct prints them (ISO 8601, so they sort)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "--duplicates", "-j", job, "-o", "Submit,End"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, f"sacct does not answer (is slurmdbd up?): {out.stderr}"
    return [tuple(line.split("|")) for line in out.stdout.splitlines() if line.strip()]


def run_jobs(run_dir) -> list[str]:
    """Every job submitted for the run (submitit keeps each one's pickle and logs in <run_dir>/slurm/<job>/)."""
    return sorted(d.name for d in (run_dir / "slurm").iterdir() if d.name.isdigit())


@pytest.mark.parametrize("requeue", ["scontrol requeue", "time-limit warning"])
def test_a_requeued_trainer_starts_its_server_job_again_and_resumes(tmp_path, slurm_env, model_cache, cluster, requeue):
    """servers=1 rollout=remote, the trainer 2 ranks (DDP) on one node, requeued once it trains:
    `scontrol requeue` (SIGTERM, as a preemption: the trainer cancels its server job as it stops) or
    the time-limit warning (SIGUSR2: the trainer cancels its server job, then requeues itself, so the
    old job holds no node while the requeued trainer waits in the queue). The requeued trainer's rank 0
    submits a new server job (cancelling the old one where it still runs), rank 1 takes the same new job from rank 0's word, both train against the new server, resume
    from the checkpoint and finish; no job of the run is left afterwards. Before, the requeued trainer
    failed at once: `the rollout server job N has ended ... Submit the run again`."""
    run_dir, steps = tmp_path / "run", 60  # remote steps on CPU take about 0.5 s: the requeue lands well before the end
    out = run([sys.executable, "-m", "grpo.launch", "nodes=1", "tasks_per_node=2", "parallel=ddp", "servers=1",
               "rollout=remote", *FAST, f"steps={steps}", f"model.cache_dir={model_cache}", f"run_dir={run_dir}"], slurm_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first_server, job = out.stdout.split("submitted rollout servers: job ")[1].split(" ")[0], submitted_job(out)
    wait_for_step(run_dir, 5, job, slurm_env)
    signalled_at = max(steps_logged(run_dir))
    assert signalled_at < steps, "the run finished before it was requeued; give it more steps"
    command = ["scontrol", "requeue", job] if requeue == "scontrol requeue" else ["scancel", "--signal=USR2", job]
    subprocess.run(command, env=slurm_env, check=True)
    requeued_at = time.time()

    wait_gone(job, slurm_env, timeout=480)
    print(f"{requeue} at step {signalled_at}; the job ended {time.time() - requeued_at:.0f} s later")
    logs = job_logs(run_dir, job)
    assert (run_dir / "summary.json").exists(), logs[-4000:]
    second_server = logs.split("started the rollout servers again: job ")[1].split(" ")[0]
    assert f"(job {first_server} served the start before this requeue)" in logs and second_server != first_server
    assert logs.count("started the rollout servers again") == 1  # rank 0 alone submitted it
    word = json.loads((run_dir / "companions.json").read_text())  # rank 0's word to rank 1
    assert word == {"start": f"{job}.1", "jobs": {"rollout server": second_server}}
    assert "POST /update_weights" in job_logs(run_dir, second_server)  # the requeued trainer trained against it
    assert_resumed_and_finished(run_dir, steps, 2, signalled_at)
    assert sacct_states(job, slurm_env) == ["REQUEUED", "COMPLETED"]
    assert run_jobs(run_dir) == sorted([first_server, job, second_server])
    for server in (first_server, second_server):
        wait_gone(server, slurm_env, timeout=90)  # cancelled: by the stopping trainer, its requeue or its end
    assert not (run_dir / "servers" / "token").exists()
    if requeue == "time-limit warning":  # the stopping trainer cancelled its server job before its requeue
        server_ended, requeued = sacct_times(first_server, slurm_env)[-1][1], sacct_times(job, slurm_env)[0][1]
        assert server_ended <= requeued, (server_ended, requeued)  # not later, by the requeued trainer


def test_dedicated_engines_one_per_node_each_serving_its_own_node(tmp_path, slurm_env, model_cache, cluster):
    """nodes=2 tasks_per_node=2 rollout=dedicated: each node's local rank 0 starts one engine on the
    node's CPUs and sends it the prompts of its node's two ranks only; weights go to both engines."""
    run_dir = tmp_path / "run"
    out = run(launch_cmd(run_dir, model_cache, "nodes=2", "tasks_per_node=2", "parallel=ddp", "rollout=dedicated"), slurm_env)
    assert (run_dir / "summary.json").exists(), out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.load(open(run_dir / "summary.json"))
    names = cluster[0][:2]
    assert summary["world_size"] == 4 and summary["nodes"] == [names[0], names[0], names[1], names[1]]
    logs = job_logs(run_dir, submitted_job(out))
    for node, ranks in zip(names, ("0-1", "2-3")):
        assert f"dedicated: node {node} (ranks {ranks}) owns 1 engine(s)" in logs, logs[-4000:]
    engines = {node: [p.read_text() for p in run_dir.glob(f"vllm-engine-{node}-*.log")] for node in names}
    assert all(len(found) == 1 for found in engines.values()), engines.keys()
    # one request per prompt (seeded); each node's engine serves its own two ranks' prompts: the same
    # count on both nodes, and together every prompt of the run (batch 32 / group 4 = 8 per step)
    served = {node: found[0].count("POST /v1/completions") for node, found in engines.items()}
    assert served[names[0]] == served[names[1]] > 0, served
    trained = 3 * 8 // 2  # prompts per node over the 3 steps
    assert served[names[0]] >= trained, served
    assert all(found[0].count("POST /update_weights") >= 3 for found in engines.values())  # every sync reached both


def rank_pid(node: str, rank: int) -> int | None:
    """The pid of the training process of `rank` running on `node` (its SLURM environment)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = dict(kv.split("=", 1) for kv in environ.read_bytes().decode(errors="replace").split("\0") if "=" in kv)
            cmd = (environ.parent / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if (env.get("SLURMD_NODENAME") == node and env.get("SLURM_PROCID") == str(rank) and "submitit" in cmd
                and "python" in cmd):
            return int(environ.parent.name)
    return None


def test_a_killed_rank_on_the_second_node_ends_the_first_within_the_peer_timeout(tmp_path, slurm_env, model_cache, cluster):
    """SIGKILL to rank 1 on node 2: rank 0 on node 1 names rank 1 and its node and stops within
    parallel.peer_timeout_s (20 s here), not the collectives' 600 s."""
    run_dir = tmp_path / "run"
    job = launch_and_wait_for_step(run_dir, slurm_env, 3, "steps=400", "parallel.peer_timeout_s=20", model_cache=model_cache)
    node = cluster[0][1]
    pid = rank_pid(node, 1)
    assert pid, f"no process of rank 1 on {node}"
    killed_at = time.time()
    os.kill(pid, 9)
    wait_gone(job, slurm_env, timeout=180)
    ended_s = time.time() - killed_at
    logs = job_logs(run_dir, job)
    print(f"rank 1 killed; the job ended {ended_s:.0f} s later")
    assert f"rank 1 (node {node} pid {pid})" in logs, logs[-4000:]
    assert ended_s < 20 + 30 + 60, ended_s  # peer timeout + the watchdog's grace + SLURM's teardown
    assert not (run_dir / "summary.json").exists()


def test_a_node_whose_slurmd_stopped_is_an_error_at_submission(tmp_path, slurm_env, cluster):
    """grpo-n2's slurmd stopped: once SLURM marks it not responding (SlurmdTimeout=30 s), a 2-node
    launch fails before submitting, naming the node; `up --nodes 2` brings it back."""
    node = cluster[0][1]
    pidfile = Path(os.environ.get("GRPO_SLURM_DIR", "/tmp/grpo-slurm")) / f"slurmd-{node}.pid"
    os.kill(int(pidfile.read_text()), 15)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], env=slurm_env, capture_output=True, text=True).stdout
            if "*" in state or "down" in state:
                break
            time.sleep(2)
        else:
            pytest.fail(f"SLURM did not mark {node} not responding within 120 s: {state}")
        out = run([sys.executable, "-m", "grpo.launch", "nodes=2", "parallel=ddp", f"run_dir={tmp_path / 'run'}"], slurm_env, timeout=120)
        assert out.returncode == 1 and f"{node} (" in out.stderr and "is not usable" in out.stderr, out.stderr
        assert not (tmp_path / "run").exists()
    finally:
        up = subprocess.run(["slurm/dev-cluster.sh", "up", "--nodes", str(len(cluster[0]))], cwd=ROOT, env=slurm_env,
                            capture_output=True, text=True, timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
