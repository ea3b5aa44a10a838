"""`python -m grpo.launch nodes=N [launch keys] [grpo.train overrides]`: one N-node training job on
SLURM, submitted through submitit.

Launch keys, defaulting to conf/hydra/launcher/slurm.yaml (the file sweeps use):
  nodes, tasks_per_node, gpus_per_node, cpus_per_task, mem_gb, partition, time (minutes, or SLURM's
  formats: 02:00:00, 1-12:00), account, qos, constraint; for rollout=remote also servers (server
  nodes) and server_gpus; for reward=judge also judges (judge nodes), judge_model and judge_gpus;
  wait=true blocks until the job ends and prints the summary it wrote (an error naming the job's logs
  when it wrote none of its steps: an earlier run's summary in the folder is not taken for it).
Every other argument is a `grpo.train` override.

Before submitting, the train config is composed and validated for nodes x tasks_per_node processes,
each server's and judge's tensor-parallel size is checked against its model's heads, and the cluster
is asked whether the partition exists and the job fits (grpo/slurm.py).

Each of the job's nodes x tasks_per_node tasks runs `grpo.train` in its own process (`TrainJob`),
rank and world size from SLURM, meeting rank 0 at the first node on a port found free there. The run
folder is fixed here, on the submitting machine, so every rank and every requeue agrees on it.
Signals (grpo/preempt.py): scancel or preemption (SIGTERM) checkpoints and exits, and SLURM requeues
a preempted job; submitit's time-limit warning (SIGUSR2) checkpoints and requeues.

Topologies:
  - colocated / hf: every task generates with its own engine (or model); nothing more to start.
  - dedicated: ask for more GPUs per node than tasks (gpus_per_node=8 tasks_per_node=4); each
    node's local rank 0 starts its engines on the GPUs training does not use.
  - remote: servers=S submits a companion job first: S nodes, each running one `grpo.serve`
    (`ServeJob`) per tensor-parallel group of its server_gpus (8 GPUs at
    rollout.remote.tensor_parallel_size=2: 4 servers, 2 GPUs each; one on a node without GPUs), each
    on a port it found free and writing its URL into <run_dir>/servers/, with a fresh random token
    guarding the weight routes (in <run_dir>/servers/token, mode 600, read by both jobs, removed when
    the trainer cancels the servers; never the user's own $GRPO_SERVE_TOKEN). The
    trainer job waits for S URLs whose servers answer /health (a URL file outlives its server:
    `wait_for_urls`), failing at once, saying what to do, if the server job has ended before they
    answered, and cancels the servers on every way out (an error, scancel, preemption).
  - judges (reward=judge): judges=J judge_model=M submits another companion job: J nodes, each running
    one `grpo.serve --model M` (`JudgeJob`; tensor parallel over the node's judge_gpus, or on CPU),
    writing its URL into <run_dir>/judges/. The trainer waits for the J URLs and trains with
    reward.judge.urls set to them and reward.judge.token_file to the judges' own fresh token
    (<run_dir>/judges/token, mode 600), handed explicitly (the judge never falls back to the servers'
    token; grpo/auth.py); the judges are cancelled, and their token removed, with the servers. Any
    configuration can take judges: they only score.
  A trainer that requeues itself on its time-limit warning cancels its server and judge jobs first. A
  requeued trainer (a preemption, its time limit, `scontrol requeue`) starts its server and judge
  jobs again, with the launch's settings and fresh tokens, before it waits for their URLs; so does a
  trainer that finds one ended when it starts (grpo/companions.py: `agree_on_companions`).
The servers a job starts write plain http:// URLs on the cluster's network, so the trainer is given
rollout.remote.allow_plain_http=true (and reward.judge.allow_plain_http=true) for them, in the open in
its config.yaml; servers given by URL get no such key.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from grpo.cli import exit_on_user_error
from grpo.companions import (Companion, agree_on_companions, cancel_jobs, executor_for, executor_settings, judges_dir,
                             servers_dir, slurm_folder, squeue_failure, squeue_says_gone, squeue_state, token_path,
                             wait_for_urls, write_companion_jobs)
from grpo.config import GROUPS, Config, compose_config, known_model_config, validate
from grpo.dist import node_name
from grpo.errors import ConfigError, did_you_mean
from grpo.preempt import sigterm_exits
from grpo.rollout.dedicated import child_visible_devices, config_heads
from grpo.serve import main as serve, resolve_model
from grpo.slurm import SIZE_MINIMUMS, check_request, check_size, check_tensor_parallel, request_from
from grpo.tiny.folders import resolve_model_folder
from grpo.tiny.warm_start import TINY_KINDS
from grpo.train import train

LAUNCH_KEYS = {  # key on the command line -> field of conf/hydra/launcher/slurm.yaml
    "nodes": "nodes", "tasks_per_node": "tasks_per_node", "gpus_per_node": "gpus_per_node",
    "cpus_per_task": "cpus_per_task", "mem_gb": "mem_gb", "partition": "partition", "time": "timeout_min",
    "account": "account", "qos": "qos", "constraint": "constraint",
}
OWN_KEYS = {"servers": 0, "server_gpus": 0, "judges": 0, "judge_gpus": 0, "judge_model": None, "wait": False}


BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def slurm_minutes(value: str) -> int:
    """`time=` in any of SLURM's --time formats, as the whole minutes submitit takes: `90`, `90:30`
    (minutes:seconds), `02:00:00`, `1-12`, `1-12:30`, `1-12:30:00` (days-hours...); seconds round up."""
    days, dash, rest = value.partition("-")
    parts = rest.split(":") if dash else value.split(":")
    if not (all(p.isdigit() for p in parts) and (not dash or days.isdigit()) and len(parts) <= 3):
        raise ConfigError(f"time={value}: give minutes (time=120) or one of SLURM's formats: minutes:seconds, "
                          f"hours:minutes:seconds (02:00:00), days-hours, days-hours:minutes, days-hours:minutes:seconds.")
    numbers = [int(p) for p in parts]
    if dash:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (numbers + [0, 0])[:3]
        hours += 24 * int(days)
    else:  # minutes, minutes:seconds, hours:minutes:seconds
        hours, minutes, seconds = {1: [0, *numbers, 0], 2: [0, *numbers], 3: numbers}[len(numbers)]
    total = -(-((hours * 60 + minutes) * 60 + seconds) // 60)  # whole minutes, rounded up
    if total < 1:
        raise ConfigError(f"time={value} is under a minute; give the job's time limit (time=120 or time=02:00:00).")
    return total


def own_value(key: str, value: str):
    """One of this script's own keys, parsed strictly: a typo (`wait=yes1`, `servers=two`) is an error
    naming the key, never quietly false or a traceback."""
    if key == "judge_model":
        return value
    if key == "wait":
        if value.lower() not in BOOLEANS:
            raise ConfigError(f"wait={value}: give true or false.")
        return BOOLEANS[value.lower()]
    if not value.isdigit():
        raise ConfigError(f"{key}={value}: give a whole number, 0 or more.")
    return int(value)


def launch_number(key: str, value: str) -> float:
    """A size given to this script (nodes=2, mem_gb=7.5) as a number, or an error naming the key."""
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{key}={value}: give a number{' (GB)' if key == 'mem_gb' else ''}.") from None


def parse_args(argv: list[str]) -> tuple[list[str], dict, list[str]]:
    """Split the command line into launcher overrides, this script's own keys and train overrides."""
    launcher, own, train = [], dict(OWN_KEYS), []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in LAUNCH_KEYS:
            value = str(slurm_minutes(value)) if key == "time" else value
            if key in (*SIZE_MINIMUMS, "mem_gb") and value.lower() not in ("null", "none", ""):
                check_size(key, launch_number(key, value))  # nodes=0: refused here, before validate counts 0 processes as 1
            launcher.append(f"hydra.launcher.{LAUNCH_KEYS[key]}={value}")
        elif eq and key in OWN_KEYS:
            own[key] = own_value(key, value)
        elif eq and (meant := launch_key_meant(key)):
            raise ConfigError(f"{key}={value}: {key} is neither a key of grpo.launch nor a setting of grpo.train{meant}.")
        else:
            train.append(arg)
    return launcher, own, train


def launch_key_meant(key: str) -> str:
    """A did-you-mean hint when `key` is a top-level word that is no train setting or group but close
    to one of this script's own keys (`nodse=2`: Hydra would advise `+nodse=2`), else ""."""
    train_keys = {f.name for f in dataclasses.fields(Config)} | set(GROUPS) | {"experiment"}
    if "." in key or "/" in key or key[:1] in "+~" or key in train_keys:
        return ""
    hint = did_you_mean(key, [*LAUNCH_KEYS, *OWN_KEYS])
    return hint if "did you mean" in hint else ""


@dataclass
class TrainJob:
    """What every task of the training job runs (pickled by submitit; a requeue runs it again)."""

    overrides: list[str]
    run_dir: str
    companions: list[Companion] = field(default_factory=list)  # its server and judge jobs, started again on a requeue
    server_wait_s: float = 1800.0

    def __call__(self) -> dict:
        overrides = [*self.overrides, f"run_dir={self.run_dir}"]
        try:
            # a SIGTERM while waiting (up to server_wait_s) exits through the finally; submitit's handler would only log it
            with sigterm_exits(", ".join(f"{c.count} {c.what}(s)" for c in self.companions)):
                if self.companions:
                    agree_on_companions(self.run_dir, self.companions, os.environ, self.server_wait_s)
                for companion in self.companions:
                    urls = wait_for_urls(companion.folder, companion.count, self.server_wait_s, companion.what, self.run_dir,
                                         companion.job_id)
                    overrides.append(f"{companion.urls_key}=[{','.join(urls)}]")
            return train(compose_config(overrides), before_requeue=self.release_servers)
        finally:  # every way out: an error, scancel or preemption (SystemExit), the watchdog (KeyboardInterrupt)
            self.cancel_servers()

    def release_servers(self) -> None:
        """Before the trainer requeues itself on the time-limit warning (grpo/preempt.py `stop`): its
        requeue starts new companion jobs, so the old ones are cancelled now rather than holding their
        nodes until the requeued trainer starts, which may wait long in the queue. A short grace: the
        warning came `signal_delay_s` before the limit, and the step and checkpoint took part of it."""
        self.cancel_servers(grace_s=15)

    def cancel_servers(self, grace_s: float = 60) -> None:
        """Rank 0 cancels the companion jobs (`cancel_jobs`), then removes their token files: nothing is
        left that they guard. A preempted trainer too: its requeue starts new ones (`agree_on_companions`)."""
        if os.environ.get("SLURM_PROCID", "0") != "0":
            return
        cancel_jobs([c.job_id for c in self.companions if c.job_id], grace_s)
        for companion in self.companions:
            with contextlib.suppress(FileNotFoundError):
                os.remove(token_path(companion.folder))


def servers_per_node(server_gpus: int, tensor_parallel_size: int) -> int:
    """One server per tensor-parallel group of a server node's GPUs; one on a node without GPUs."""
    if not server_gpus:
        return 1
    if server_gpus % tensor_parallel_size:
        raise ConfigError(f"server_gpus={server_gpus} is not a multiple of rollout.remote.tensor_parallel_size="
                          f"{tensor_parallel_size}: each server takes that many GPUs.")
    return server_gpus // tensor_parallel_size


def server_visible_devices(local_id: int, tensor_parallel_size: int, parent_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the node's `local_id`-th server: its own consecutive group of GPUs,
    mapped through the job step's own list (SLURM may give 4,5,6,7 or UUIDs)."""
    first = local_id * tensor_parallel_size
    return child_visible_devices([f"cuda:{i}" for i in range(first, first + tensor_parallel_size)], parent_visible)


def serve_task_devices(env, tensor_parallel_size: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for this task of the server job when its node runs several servers (None:
    leave it). Mapped through the step's own list, or, on a cluster that sets none, logical =
    physical: without a list every server of the node would take GPUs 0..tp-1."""
    if int(env.get("SLURM_NTASKS_PER_NODE", "1")) <= 1:
        return None
    return server_visible_devices(int(env.get("SLURM_LOCALID", "0")), tensor_parallel_size, env.get("CUDA_VISIBLE_DEVICES"))


@dataclass
class ServeJob:
    """One rollout server per task of the companion job (one task per tensor-parallel group of a
    node's GPUs): `grpo.serve` on a free port, on its own GPUs, its URL written."""

    overrides: list[str]
    run_dir: str
    extra_args: list[str] = field(default_factory=list)

    def __call__(self) -> None:
        cfg = compose_config([*self.overrides, f"run_dir={self.run_dir}"])
        model = resolve_model_folder(cfg)
        tp = cfg.rollout.remote.tensor_parallel_size
        if (devices := serve_task_devices(os.environ, tp)) is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
        # the server owns its devices: memory fraction and CUDA graphs are grpo.serve's per-device
        # defaults (0.9 on GPU), not the colocated engine's share; the dtype is the trainer's
        # bound to this node's cluster address (its SLURM name, which its URL names), never 0.0.0.0 (every interface)
        serve(["--model", model, "--host", node_name(), "--port", "0", "--url-dir", servers_dir(self.run_dir), "--dtype", cfg.model.dtype,
               "--tensor-parallel-size", str(tp), "--weight-transfer", cfg.rollout.vllm.weight_transfer,
               *(["--routed-experts"] if cfg.rollout.routing_replay or cfg.rollout.routing_observe else []),
               # LoRA: the servers load each sync's adapter (/v1/load_lora_adapter, mounted by --lora-rank only)
               *(["--lora-rank", str(cfg.model.lora.rank)] if cfg.model.lora.rank > 0 else []), *self.extra_args])


@dataclass
class JudgeJob:
    """One judge server per node of the judge job: `grpo.serve --model <judge_model>` on a free port,
    tensor parallel over the node's judge GPUs, its URL written into <run_dir>/judges/."""

    model: str
    run_dir: str
    gpus: int = 0
    extra_args: list[str] = field(default_factory=list)

    def __call__(self) -> None:
        serve(["--model", resolve_model(self.model), "--host", node_name(), "--port", "0", "--url-dir", judges_dir(self.run_dir),
               "--tensor-parallel-size", str(self.gpus or 1), *self.extra_args])


def known_heads(model) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) of a `model` config group, as far as this (login) machine knows them
    without building or fetching anything: the tiny models' from their settings (grpo/tiny builds
    them with num_heads KV heads too), else the config.json `known_model_config` finds. (None, None):
    unknown, and any tensor-parallel size passes."""
    if model.path in TINY_KINDS:
        return model.tiny.num_heads, model.tiny.num_heads
    return config_heads(known_model_config(model))


def check_server_sizes(cfg, own: dict) -> None:
    """The tensor-parallel size of each server and judge this launch starts, against its model's heads,
    with the message slurm/train_remote.sbatch gives (`check_tensor_parallel`): a size vLLM refuses
    would otherwise fail on the server node, after the job waited in the queue."""
    tp = cfg.rollout.remote.tensor_parallel_size
    if own["servers"] and own["server_gpus"] and tp > 1:
        check_tensor_parallel("rollout.remote.tensor_parallel_size", tp, f"{own['server_gpus']} GPU(s) per server node "
                              f"(server_gpus)", own["server_gpus"], *known_heads(cfg.model),
                              "Set rollout.remote.tensor_parallel_size to one of those (server_gpus a multiple of it).")
    if own["judges"] and own["judge_gpus"] > 1:
        judge = compose_config([f"model.path={own['judge_model']}"]).model  # the judge's own settings (a tiny one's heads)
        check_tensor_parallel("judge_gpus", own["judge_gpus"], f"{own['judge_gpus']} GPU(s) per judge node (judge_gpus)",
                              own["judge_gpus"], *known_heads(judge),
                              "Each judge is tensor parallel over all of its node's judge_gpus: set judge_gpus to one of those.")


def wait_for_job(job_id: str, poll_s: float = 5, say_every_s: float = 300) -> None:
    """Until SLURM no longer lists the job (through requeues). Only SLURM's word ends the wait; a squeue
    that keeps failing (the controller down) is said every `say_every_s`, so that a wait SLURM cannot end
    is seen for what it is (it waited in silence)."""
    failing_since = None
    while not squeue_says_gone(out := squeue_state(job_id)):
        why = squeue_failure(out)
        if why is None:
            failing_since = None
        else:
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= say_every_s:
                print(f"squeue has not answered on job {job_id} for {time.monotonic() - failing_since:.0f} s ({why}); still "
                      f"waiting, the job may be running. Ctrl-C ends this wait, not the job (squeue -j {job_id}; "
                      f"sacct -j {job_id}).", flush=True)
                failing_since = time.monotonic()
        time.sleep(poll_s)


def launch(argv: list[str]) -> str:
    """Check and submit; returns the training job's id."""
    launcher_overrides, own, train_overrides = parse_args(argv)
    cfg = compose_config([*train_overrides, "hydra/launcher=slurm", *launcher_overrides], hydra_config=True)
    launcher = cfg.hydra.launcher
    explicit = next((o.split("=", 1)[1] for o in train_overrides if o.startswith("run_dir=")), None)
    run_dir = os.path.abspath(explicit or str(cfg.hydra.run.dir))
    train_overrides = [o for o in train_overrides if not o.startswith("run_dir=")]

    world = int(launcher.nodes) * int(launcher.tasks_per_node)
    if own["judges"]:
        if "judge" not in [f.name for f in cfg.reward.funcs]:
            raise ConfigError(f"judges={own['judges']} starts judge servers for reward `judge`; add reward=judge (or a "
                              f"`judge` entry in reward.funcs).")
        if not own["judge_model"]:
            raise ConfigError("judges=N needs judge_model=M: the judge's folder, hub id or packaged name (smollm2-135m).")
        cfg.reward.judge.urls = ["http://found-when-the-job-starts:0"]
        cfg.reward.judge.allow_plain_http = True  # the job's own judges, as the trainer is told below
    elif own["judge_model"] or own["judge_gpus"]:
        raise ConfigError("judge_model and judge_gpus go with judges=N (the judge nodes to start).")
    if own["servers"]:
        if cfg.rollout.backend != "remote":
            raise ConfigError(f"servers={own['servers']} starts rollout servers for rollout=remote; add rollout=remote.")
        cfg.rollout.remote.urls = ["http://found-when-the-job-starts:0"]
        cfg.rollout.remote.allow_plain_http = True
    elif own["server_gpus"]:
        raise ConfigError("server_gpus goes with servers=N (the server nodes to start) and rollout=remote.")
    validate(cfg, world_size=world, cuda=bool(launcher.gpus_per_node or own["server_gpus"]) or None)  # the job's GPUs, not this machine's
    per_node = servers_per_node(own["server_gpus"], cfg.rollout.remote.tensor_parallel_size)
    check_server_sizes(cfg, own)
    check_request(request_from(launcher))
    if own["servers"]:
        server_launcher = OmegaConf.merge(launcher, {"nodes": own["servers"], "tasks_per_node": per_node,
                                                     "gpus_per_node": own["server_gpus"] or None})
        check_request(request_from(server_launcher))
    if own["judges"]:
        check_request(request_from(OmegaConf.merge(launcher, {"nodes": own["judges"], "tasks_per_node": 1,
                                                              "gpus_per_node": own["judge_gpus"] or None})))

    os.makedirs(run_dir, exist_ok=True)
    companions = []  # each submitted with its URL files of an earlier launch into this folder removed and a fresh token
    if own["judges"]:  # a token of their own: the rollout servers' opens weight pushes, which a judge has no use for
        token_file = token_path(judges_dir(run_dir))
        companions.append(judges := Companion(
            "judge server", "grpo-judge", judges_dir(run_dir), own["judges"],
            JudgeJob(own["judge_model"], run_dir, own["judge_gpus"], ["--token-file", token_file]),
            executor_settings(launcher, nodes=own["judges"], tasks_per_node=1, gpus_per_node=own["judge_gpus"] or None),
            "reward.judge.urls"))
        train_overrides = [*train_overrides, f"reward.judge.token_file={token_file}", "reward.judge.allow_plain_http=true"]
        print(f"submitted judge servers: job {judges.start(run_dir)} ({own['judges']} node(s) of {own['judge_model']})")
    if own["servers"]:
        token_file = token_path(servers_dir(run_dir))
        companions.append(servers := Companion(
            "rollout server", "grpo-serve", servers_dir(run_dir), own["servers"] * per_node,
            ServeJob(train_overrides, run_dir, ["--token-file", token_file]),
            executor_settings(launcher, nodes=own["servers"], tasks_per_node=per_node, gpus_per_node=own["server_gpus"] or None),
            "rollout.remote.urls"))
        train_overrides = [*train_overrides, f"rollout.remote.token_file={token_file}", "rollout.remote.allow_plain_http=true"]
        print(f"submitted rollout servers: job {servers.start(run_dir)} ({own['servers']} node(s) x {per_node} server(s))")
    if companions:  # the trainer's first start takes these jobs (grpo/companions.py: agree_on_companions)
        write_companion_jobs(run_dir, "launch", {c.what: c.job_id for c in companions})
    summary = os.path.join(run_dir, "summary.json")
    before = summary_mtime(summary)  # a reused run folder holds an earlier run's summary: wait=true must not print it
    job = executor_for(slurm_folder(run_dir), executor_settings(launcher), "grpo").submit(
        TrainJob(train_overrides, run_dir, companions))
    print(f"submitted training: job {job.job_id}, {launcher.nodes} node(s) x {launcher.tasks_per_node} task(s)\n"
          f"  run folder {run_dir}\n  logs {run_dir}/slurm/{job.job_id}/\n  squeue -j {job.job_id}; scancel {job.job_id}")
    if own["wait"]:
        wait_for_job(job.job_id)
        print(json.dumps(new_summary(summary, before, cfg.steps, f"{run_dir}/slurm/{job.job_id}/", job.job_id), indent=2))
    return job.job_id


def summary_mtime(path: str) -> int | None:
    """The summary's modification time in ns, None without one."""
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


def new_summary(path: str, before: int | None, steps: int, logs: str, job_id: str) -> dict:
    """The summary the job wrote: newer than `before` (summary_mtime before submitting) and of `steps`
    steps; else a SystemExit naming the job's logs. An older one is an earlier run's in a reused folder,
    and the job then died before its own (or, for a run that had already finished, wrote nothing new)."""
    mtime = summary_mtime(path)
    if mtime is None or (before is not None and mtime <= before):
        raise SystemExit(f"error: job {job_id} ended without writing {path}" + (" (the one there is an earlier run's)"
                         if mtime is not None else "") + f"; see its logs in {logs}")
    with open(path) as f:
        summary = json.load(f)
    if summary.get("steps") != steps:
        raise SystemExit(f"error: job {job_id} ended with a {path} of {summary.get('steps')} steps, not steps={steps}; "
                         f"see its logs in {logs}")
    return summary


def main() -> None:
    keys = ", ".join([*LAUNCH_KEYS, *OWN_KEYS])
    parser = argparse.ArgumentParser(prog="python -m grpo.launch", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s nodes=N [launch keys] [grpo.train overrides]",
                                     description=__doc__)
    parser.add_argument("args", nargs="*", metavar="KEY=VALUE",
                        help=f"launch keys ({keys}); every other argument is a grpo.train override")
    exit_on_user_error(launch, parser.parse_args().args)  # an override Hydra cannot apply too (cli.hydra_message)


if __name__ == "__main__":
    main()
