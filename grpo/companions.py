"""The companion server jobs of a `grpo.launch` training job (servers=S: its rollout servers;
judges=J: its judges), from submission to cancellation: each is submitted through submitit with a
fresh token (`Companion.start`), found through the URL files its servers write (`wait_for_urls`),
cancelled by the trainer's rank 0 on every way out (`cancel_jobs`), and submitted again by a trainer
that SLURM requeued or whose companion job has ended (`agree_on_companions`).

Why again: a trainer stopped by SIGTERM cannot tell a preemption (SLURM requeues it) from a `scancel`
(final), so on either it cancels its companion jobs as it exits; one that requeues itself on its
time-limit warning cancels them before its requeue (`TrainJob.release_servers`). The requeued trainer runs the same pickled
`grpo.launch.TrainJob`, which carries each `Companion` (what its tasks run, the executor's settings),
and its rank 0 submits the jobs again as the launch did. The other ranks learn the new jobs from
rank 0's word in <run_dir>/companions.json, marked with this start of the trainer (`<job id>.<restarts>`)
and written only once the old URL files are gone and the fresh tokens are written: no rank takes an
old URL or an old token.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from grpo.endpoints import Server
from grpo.errors import ServerError, TokenError
from grpo.preempt import own_job_id, restarts
from grpo.progress import WaitProgress

SLURM_CALL_S = 30  # squeue, scancel: a busy slurmctld answers late, never this late (TimeoutExpired then)
COMPANION_JOBS = "companions.json"  # in the run folder: rank 0's word on which jobs serve this start of the trainer
EXECUTOR_KEYS = ("nodes", "tasks_per_node", "timeout_min", "gpus_per_node", "cpus_per_task", "mem_gb", "partition",
                 "account", "qos", "constraint", "signal_delay_s", "additional_parameters", "setup")


def servers_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "servers")


def judges_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "judges")


def slurm_folder(run_dir: str) -> str:
    """Where submitit keeps each job's pickle and logs: <run_dir>/slurm/<job id>/."""
    return os.path.join(run_dir, "slurm", "%j")


def token_path(folder: str) -> str:
    return os.path.join(folder, "token")


def private_folder(folder: str) -> str:
    """`folder` (made if missing, mode 700), once no other user can put a file into it: the trainer sends
    its token and its weights to every URL it finds there, so a URL file another user planted (a folder
    made or left writable by them: a run_dir another user created first, a umask of 002) would hand both
    to their server. The folder and the run folder above it (which could swap the folder for another)
    must be this user's and writable by no one else."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for path in (folder, os.path.dirname(os.path.abspath(folder))):
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise TokenError(f"{path} is {'a symlink' if stat.S_ISLNK(st.st_mode) else f'mode {stat.S_IMODE(st.st_mode):o}'}, "
                             f"owned by uid {st.st_uid}: another user could put a URL file into {folder} and receive the "
                             f"servers' token and the trainer's weights. Give a run_dir of your own that only you can "
                             f"write to (chmod go-w {path}).")
    return folder


def write_token_file(folder: str) -> str:
    """A fresh random token in <folder>/token (the servers' or the judges' folder of the run), readable by
    its owner only (chmod 600): the run folder is on a file system every node sees, and the token never
    enters a command line, a config or the job's environment. Fresh per submission, never the user's own
    $GRPO_SERVE_TOKEN (which may guard their other servers); removed by `TrainJob.cancel_servers`."""
    private_folder(folder)
    path = token_path(folder)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.replace(path + ".tmp", path)
    return path


KEPT_JOB_VARS = ("SLURM_CONF", "SLURM_CLUSTERS")  # the user's own, for sbatch (SLURM sets neither in a job): the launch's too


def inherited_job_vars(env) -> list[str]:
    """The variables of the SLURM job this process runs in that `sbatch` would carry into a job it
    submits (it exports the whole environment), where SLURM reads them as that job's own settings: an
    inherited SLURM_CPU_BIND pins the new job's tasks to this job's CPUs, silently; SLURM_CPUS_PER_TASK
    or SLURM_MEM_PER_CPU beside the new job's own request stop its srun ("set by two different
    environment variables", "mutually exclusive"), and so does SRUN_CPUS_PER_TASK (Slurm 22.05's sbatch
    sets it in the job). SLURM_*, SRUN_*, PMI_* and PMIX_*, but `KEPT_JOB_VARS`."""
    return sorted(k for k in env if k.startswith(("SLURM_", "SRUN_", "PMI_", "PMIX_")) and k not in KEPT_JOB_VARS)


@contextlib.contextmanager
def outside_this_job():
    """os.environ without `inherited_job_vars` for the block (a submission from inside a job: a requeued
    trainer's rank 0, before training starts, on its main thread), so the job it submits is the one the
    launch submitted from a login node; then as before."""
    saved = {k: os.environ.pop(k) for k in inherited_job_vars(os.environ)}
    try:
        yield
    finally:
        os.environ.update(saved)


def executor_settings(launcher, **changes) -> dict:
    """conf/hydra/launcher/slurm.yaml's values that `executor_for` takes, with `changes`, as plain values
    (a `Companion` carries them: pickled with the trainer)."""
    settings = {k: launcher[k] for k in EXECUTOR_KEYS} | changes
    return {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in settings.items()}


def executor_for(folder: str, settings: dict, name: str):
    """A submitit SLURM executor with `settings` (`executor_settings`)."""
    import submitit  # submitit: heavy, only when a job is submitted

    p = settings
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    generic = {"name": name, "nodes": p["nodes"], "tasks_per_node": p["tasks_per_node"], "timeout_min": p["timeout_min"],
               "gpus_per_node": p["gpus_per_node"], "cpus_per_task": p["cpus_per_task"], "mem_gb": p["mem_gb"]}
    slurm = {"slurm_partition": p["partition"], "slurm_account": p["account"], "slurm_qos": p["qos"],
             "slurm_constraint": p["constraint"], "slurm_signal_delay_s": p["signal_delay_s"],
             "slurm_additional_parameters": p["additional_parameters"] or None, "slurm_setup": p["setup"]}
    executor.update_parameters(**{k: v for k, v in {**generic, **slurm}.items() if v is not None})
    return executor


@dataclass
class Companion:
    """A companion server job of the training job: its rollout servers or its judges. It carries all
    that its submission takes, so a requeued trainer submits it again exactly as the launch did."""

    what: str  # "rollout server" or "judge server", as messages name it
    name: str  # the SLURM job name: grpo-serve, grpo-judge
    folder: str  # servers_dir or judges_dir: its servers' URL files and its token
    count: int  # the servers the trainer waits for
    task: Callable[[], None]  # what each task of the job runs (grpo.launch.ServeJob, JudgeJob); --token-file token_path(folder)
    executor: dict  # executor_settings: the launch's, with this job's nodes, tasks and GPUs
    urls_key: str  # the train override its URLs go into: rollout.remote.urls, reward.judge.urls
    job_id: str | None = None  # the job submitted last

    def start(self, run_dir: str) -> str:
        """Submit the job afresh: the URL files of earlier servers removed (a URL file outlives its
        server), a fresh token written, then sbatch through submitit. Returns the new job's id."""
        for old in glob.glob(os.path.join(self.folder, "*.url")):
            os.remove(old)
        write_token_file(self.folder)
        with outside_this_job():  # a requeued trainer submits from inside its own job
            self.job_id = executor_for(slurm_folder(run_dir), self.executor, self.name).submit(self.task).job_id
        return self.job_id


def answers(url: str) -> bool:
    """Whether a server listens at `url` and answers /health (an open route): a URL file outlives its server."""
    try:
        Server(url, None, 5).request("/health")
    except ServerError:
        return False
    return True


def squeue_state(job_id: str) -> subprocess.CompletedProcess | None:
    """`squeue` on the job (`sacct` may be off); None when it did not answer within SLURM_CALL_S."""
    try:
        return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=SLURM_CALL_S)
    except subprocess.TimeoutExpired:
        return None


def job_listed(job_id: str) -> bool:
    """Whether SLURM may still hold the job: not `job_gone`. A squeue that fails (the controller busy:
    "Socket timed out") or does not answer says nothing has ended: listed. (It read a failing squeue as
    gone, and `wait=true` returned at once, reporting a running job as ended without its summary.)"""
    return not job_gone(job_id)


def job_gone(job_id: str) -> bool:
    """Whether SLURM says the job has ended: squeue lists it no more, or no longer knows its id (after the
    cluster's MinJobAge). A squeue that fails otherwise, or does not answer, says nothing: False."""
    return squeue_says_gone(squeue_state(job_id))


UNKNOWN_JOB = "Invalid job id"  # squeue's word for an id past the cluster's MinJobAge: the job has ended


def squeue_says_gone(out: subprocess.CompletedProcess | None) -> bool:
    """`job_gone` on one squeue_state answer."""
    return out is not None and ((out.returncode == 0 and not out.stdout.strip()) or UNKNOWN_JOB in out.stderr)


def squeue_failure(out: subprocess.CompletedProcess | None) -> str | None:
    """Why a squeue_state answer says nothing of the job (no answer, or an error other than an unknown id);
    None where SLURM answered."""
    if out is None:
        return f"no answer within {SLURM_CALL_S} s"
    if out.returncode != 0 and UNKNOWN_JOB not in out.stderr:
        return (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
    return None


def wait_for_urls(folder: str, count: int, timeout_s: float, what: str, run_dir: str, job: str | None = None) -> list[str]:
    """The URLs of `count` servers of a companion job (`what`: rollout or judge servers) that wrote them
    into `folder` and answer /health. A URL file whose server is gone (a server that died) is passed
    over, never handed to the trainer. `job`: the companion job's id; once SLURM has ended it, the wait
    is an error at once, saying what to do: the job this start of the trainer submitted or found
    running ended before its servers answered (it failed to start, or reached its time limit)."""
    private_folder(folder)  # every URL in it gets the token: none planted by another user
    deadline = time.time() + timeout_s
    progress = WaitProgress(f"{count} {what}(s) to write their URL into {folder} and answer /health", timeout_s,
                            note=f"server job log under {run_dir}/slurm/")
    while True:
        urls = [u for u in sorted(Path(p).read_text().strip() for p in glob.glob(os.path.join(folder, "*.url"))) if answers(u)]
        if len(urls) >= count:
            return urls[:count]
        if job and job_gone(job):
            raise ServerError(f"the {what} job {job} has ended (squeue no longer lists it) with {len(urls)} of {count} "
                              f"{what}(s) answering: its servers failed to start or reached their time limit; see its log "
                              f"in {run_dir}/slurm/{job}/. Submit the run again with run_dir={run_dir} (python -m "
                              f"grpo.launch ...): it starts new servers and resumes from its last checkpoint.")
        progress()
        if time.time() > deadline:
            raise RuntimeError(f"only {len(urls)} of {count} {what}s wrote their URL into {folder} and answered /health "
                               f"within {timeout_s:.0f} s; is the server job running (squeue)? Its log is under {run_dir}/slurm/.")
        time.sleep(2)


def cancel_jobs(jobs: list[str], grace_s: float = 60) -> None:
    """SIGINT first, as Ctrl-C would (vLLM then shuts its engine down and frees its shared memory); a
    plain scancel only for a job still there after `grace_s`. Rollout servers and judges alike."""
    if not jobs:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):  # the plain scancel below, after the grace, still goes
        subprocess.run(["scancel", "--signal=INT", *jobs], check=False, timeout=SLURM_CALL_S)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(job_listed(j) for j in jobs):
        time.sleep(1)
    try:
        subprocess.run(["scancel", *jobs], check=False, timeout=SLURM_CALL_S)
    except subprocess.TimeoutExpired:  # on every way out of the trainer: say so, never mask why it ended
        print(f"scancel did not answer within {SLURM_CALL_S} s: cancel job(s) {' '.join(jobs)} by hand (scancel).", flush=True)


def trainer_start(env) -> tuple[str, bool]:
    """(this start of the training job, the same on every rank: `<job id>.<restarts>`; whether SLURM
    requeued it). SLURM sets SLURM_RESTART_COUNT from the first requeue on (preemption, `scontrol requeue`)."""
    n = restarts(env)
    return f"{own_job_id(env) or 'local'}.{n}", n > 0


def companions_to_start(jobs: dict[str, str | None], requeued: bool, ended: set[str]) -> list[str]:
    """Which companion jobs (`jobs`: what -> the job submitted last) rank 0 submits again: every one when
    SLURM requeued the trainer (its stop cancelled them; one still listed, a cancel that did not finish,
    is cancelled again), else those that have ended (`ended`) or were never submitted."""
    return [what for what, job in jobs.items() if requeued or job is None or job in ended]


def write_companion_jobs(run_dir: str, start: str, jobs: dict[str, str | None], error: str | None = None) -> None:
    """Rank 0's word to the other ranks (and to the trainer's next start), written atomically, so no rank
    reads half of it: for the trainer's `start`, the companion jobs are `jobs`, or they failed (`error`)."""
    path = os.path.join(run_dir, COMPANION_JOBS)
    with open(path + ".tmp", "w") as f:
        json.dump({"start": start, "jobs": jobs, **({"error": error} if error else {})}, f)
    os.replace(path + ".tmp", path)


def read_companion_jobs(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, COMPANION_JOBS)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def jobs_of_start(word: dict | None, start: str) -> dict[str, str] | None:
    """The companion jobs of the trainer's `start` in rank 0's `word`; None while there is no word yet or
    it is of an earlier start (the launch's, the start before a requeue: its URLs and tokens are old)."""
    if not word or word["start"] != start:
        return None
    if "error" in word:
        raise ServerError(f"rank 0 could not start the companion jobs: {word['error']}")
    return word["jobs"]


def agree_on_companions(run_dir: str, companions: list[Companion], env, timeout_s: float) -> None:
    """Every rank of this start of the trainer on the same companion jobs (sets each `job_id`), started
    again where needed (`companions_to_start`). Only rank 0 submits: it cancels an old job still listed,
    removes the old URL files, writes fresh tokens, submits, and only then writes its word; every other
    rank waits for the word of this very start."""
    start, requeued = trainer_start(env)
    if env.get("SLURM_PROCID", "0") != "0":
        deadline = time.time() + timeout_s
        while (jobs := jobs_of_start(read_companion_jobs(run_dir), start)) is None:
            if time.time() > deadline:
                raise RuntimeError(f"rank 0 wrote no companion jobs for this start of the training job ({start}) into "
                                   f"{run_dir}/{COMPANION_JOBS} within {timeout_s:.0f} s; see rank 0's log under "
                                   f"{run_dir}/slurm/.")
            time.sleep(1)
    else:
        last = (read_companion_jobs(run_dir) or {}).get("jobs", {})  # the launch's word, or the previous start's
        jobs = {c.what: last.get(c.what, c.job_id) for c in companions}
        try:
            ended = set() if requeued else {j for j in jobs.values() if j and job_gone(j)}
            again = companions_to_start(jobs, requeued, ended)
            cancel_jobs([jobs[what] for what in again if jobs[what] and job_listed(jobs[what])])
            for companion in (c for c in companions if c.what in again):
                companion.start(run_dir)
                print(f"started the {companion.what}s again: job {companion.job_id} (job {jobs[companion.what]} "
                      f"{'served the start before this requeue' if requeued else 'has ended'})", flush=True)
                jobs[companion.what] = companion.job_id
        except BaseException as e:  # the other ranks would wait for a word that never comes
            write_companion_jobs(run_dir, start, jobs, error=f"{type(e).__name__}: {e}")
            raise
        write_companion_jobs(run_dir, start, jobs)
    for companion in companions:
        companion.job_id = jobs[companion.what]
