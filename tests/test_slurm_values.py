"""grpo.slurm, grpo.launch and grpo.companions by value: the gaps a mutation test of their plain functions
found (each test's docstring names the mistake it guards)."""

import os

import pytest

from grpo.slurm import ClusterError, Node, Request, check_request, gpu_count, slurm_nodes
from tests.fake_slurm import fake_slurm


def test_only_gpu_gres_counts_as_gpus():
    """Other generic resources on a node (MPS shares, GPU shards, license-like gres) are not GPUs: counting
    any gres item made a node of `gpu:2,mps:200` 202 GPUs."""
    assert gpu_count("gpu:2,mps:200") == 2
    assert gpu_count("shard:a100:8,gpu:a100:4(S:0)") == 4
    assert gpu_count("mps:100") == 0


def test_a_node_whose_slurmd_does_not_answer_is_not_usable_in_any_state():
    """'*' after any state (idle*, mixed*) marks a node whose slurmd does not answer, not only down*."""
    assert not Node("n1", "debug", 2, 1000, 0, True, "idle*").usable
    assert not Node("n2", "debug", 2, 1000, 0, True, "mixed*").usable
    assert Node("n3", "debug", 2, 1000, 0, True, "idle").usable


def test_sinfo_lines_become_nodes(tmp_path, monkeypatch):
    """`sinfo -N -o %N|%P|%c|%m|%G|%T` as Nodes: the default partition's '*' stripped from its name and kept
    as `default`, memory in MB (a `+` of a range dropped; none given: 0), GPUs from the gres."""
    lines = ["n1|debug*|8|16000|(null)|idle", "n2|gpu|64|512000+|gpu:a100:4(S:0-1)|mixed", "n3|gpu|4|N/A|gpu:2|down*"]
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"sinfo": f"print({chr(10).join(lines)!r})",
                                                             "sbatch": "sys.exit('sbatch: not expected here')"}))
    assert slurm_nodes() == [Node("n1", "debug", 8, 16000, 0, True, "idle"),
                             Node("n2", "gpu", 64, 512000, 4, False, "mixed"),
                             Node("n3", "gpu", 4, 0, 2, False, "down*")]
    assert check_request(Request(), slurm_nodes()) == "debug"


def test_mem_gb_is_gibibytes_of_the_nodes_megabytes():
    """sinfo's %m is MiB; mem_gb=16 is 16384 of them: a node of 16000 MB cannot hold it (x1000 took it)."""
    nodes = [Node("n1", "debug", 8, 16000, 0, True)]
    with pytest.raises(ClusterError, match="No node has 16 GB of memory"):
        check_request(Request(mem_gb=16), nodes)
    assert check_request(Request(mem_gb=15.625), nodes) == "debug"  # 16000 MiB exactly


def test_a_gpu_job_needs_four_cpus_per_task_and_four_are_enough():
    """The bound itself: 3 CPUs per GPU task are refused, 4 accepted (MIN_GPU_TASK_CPUS)."""
    nodes = [Node("g1", "gpu", 64, 512_000, 8, True)]
    with pytest.raises(ClusterError, match="cpus_per_task=3 with gpus_per_node=8"):
        check_request(Request(tasks_per_node=8, cpus_per_task=3, gpus_per_node=8), nodes)
    assert check_request(Request(tasks_per_node=8, cpus_per_task=4, gpus_per_node=8), nodes) == "gpu"


def test_a_launcher_without_gpus_asks_for_none():
    """conf/hydra/launcher/slurm.yaml's gpus_per_node: null is 0 GPUs (a CPU job fits a CPU node), and
    cpus_per_task: null is 1."""
    from omegaconf import OmegaConf

    from grpo.slurm import request_from

    launcher = OmegaConf.create({"nodes": 2, "tasks_per_node": 3, "cpus_per_task": None, "gpus_per_node": None,
                                 "mem_gb": None, "partition": "cpu"})
    assert request_from(launcher) == Request(nodes=2, tasks_per_node=3, cpus_per_task=1, gpus_per_node=0, partition="cpu")


def test_a_judge_without_gpus_is_served_with_a_tensor_parallel_size_of_one(monkeypatch):
    """judge_gpus=0 (a CPU judge): grpo.serve gets --tensor-parallel-size 1, never 0; with 2: 2."""
    import grpo.launch
    from grpo.launch import JudgeJob

    argvs = []
    monkeypatch.setattr(grpo.launch, "serve", argvs.append)
    monkeypatch.setattr(grpo.launch, "node_name", lambda: "n7")
    monkeypatch.setattr(grpo.launch, "resolve_model", lambda m: f"/models/{m}")
    JudgeJob("judge-m", "/runs/r")()
    JudgeJob("judge-m", "/runs/r", 2, ["--token-file", "/runs/r/judges/token"])()
    assert argvs == [
        ["--model", "/models/judge-m", "--host", "n7", "--port", "0", "--url-dir", "/runs/r/judges", "--tensor-parallel-size", "1"],
        ["--model", "/models/judge-m", "--host", "n7", "--port", "0", "--url-dir", "/runs/r/judges", "--tensor-parallel-size", "2",
         "--token-file", "/runs/r/judges/token"]]


class Submitted:
    """A stand-in for submitit's executor (no SLURM here): records each job it is given, ids from 100."""

    def __init__(self):
        self.jobs = []

    def __call__(self, folder, settings, name):  # executor_for(...)
        self.jobs.append([folder, settings, name])
        return self

    def submit(self, fn):
        self.jobs[-1].append(fn)
        return type("Job", (), {"job_id": str(99 + len(self.jobs))})()


def test_a_relative_run_dir_is_fixed_as_an_absolute_folder_at_submission(tmp_path, monkeypatch):
    """The run folder is fixed on the submitting machine: run_dir=runs/a from /home/u/x is /home/u/x/runs/a for
    every rank and every requeue (each task's working directory is SLURM's, not the launch's)."""
    import grpo.launch

    executor = Submitted()
    monkeypatch.setattr(grpo.launch, "executor_for", executor)
    monkeypatch.setattr(grpo.launch, "check_request", lambda request: None)
    monkeypatch.chdir(tmp_path)
    grpo.launch.launch(["nodes=1", "run_dir=runs/a"])
    [(folder, settings, name, trainer)] = executor.jobs
    assert (trainer.run_dir, folder, name) == (str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "a" / "slurm" / "%j"), "grpo")
    assert "run_dir=runs/a" not in trainer.overrides


@pytest.mark.parametrize("rank, cancels", [("0", True), ("1", False), ("2", False), ("15", False)])
def test_only_rank_0_cancels_the_companion_jobs_and_removes_their_tokens(tmp_path, monkeypatch, rank, cancels):
    """Every other rank leaves the companions alone (rank 2 too, not only rank 1)."""
    from grpo.companions import Companion, servers_dir, token_path, write_token_file
    from grpo.launch import ServeJob, TrainJob
    from tests.fake_slurm import recording

    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"scancel": recording(calls), "squeue": "pass"}))
    monkeypatch.setenv("SLURM_PROCID", rank)
    run = str(tmp_path / "run")
    token = write_token_file(servers_dir(run))
    servers = Companion("rollout server", "grpo-serve", servers_dir(run), 1, ServeJob([], run), {}, "rollout.remote.urls", "11")
    TrainJob([], run, [servers]).cancel_servers(grace_s=0)
    assert (calls.read_text().splitlines() if calls.exists() else []) == (
        ["scancel --signal=INT 11", "scancel 11"] if cancels else [])
    assert os.path.exists(token) != cancels and token == token_path(servers_dir(run))


def test_each_job_keeps_its_logs_in_its_own_folder():
    """submitit's folder takes SLURM's %j: <run_dir>/slurm/<job id>/, the folder launch's messages name; without
    it the trainer's, servers' and judges' logs and pickles of every requeue shared one folder."""
    from grpo.companions import judges_dir, servers_dir, slurm_folder, token_path

    assert slurm_folder("/runs/r") == "/runs/r/slurm/%j"
    assert (servers_dir("/runs/r"), judges_dir("/runs/r"), token_path("/runs/r/servers")) == (
        "/runs/r/servers", "/runs/r/judges", "/runs/r/servers/token")


@pytest.mark.starts_process
def test_a_server_killed_by_a_signal_fails_its_node_with_128_plus_the_signal(tmp_path):
    """serve-node's exit code when a server dies of SIGKILL (the OOM killer): 137, as a shell reports it,
    not 119 (128 + -9); the node's other server is stopped."""
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    server = tmp_path / "server.py"
    server.write_text("import os, signal, sys, time\n"
                      "if os.environ['CUDA_VISIBLE_DEVICES'] == '1':\n"
                      "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n"
                      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                      "time.sleep(60)\n")
    code = (f"import sys; from grpo.slurm import serve_node; "
            f"sys.exit(serve_node(['0', '1'], [], command=[sys.executable, {str(server)!r}], grace_s=10))")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    node = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert node.returncode == 128 + signal.SIGKILL, node.stderr
    assert f"CUDA_VISIBLE_DEVICES=1 exited with {-signal.SIGKILL}" in node.stderr


@pytest.mark.parametrize("body, listed, gone", [
    ("import time; time.sleep(10)", True, False),  # squeue does not answer: nothing is known to have ended
    ('print("RUNNING")', True, False),
    ("pass", False, True),  # answers, no longer lists it
    # the controller busy: wait=true returned at once and reported a running job as ended without its summary
    ("sys.exit('squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation')", True, False),
    ("sys.exit('slurm_load_jobs error: Invalid job id specified')", False, True),  # past MinJobAge: ended
])
def test_a_squeue_that_does_not_answer_leaves_the_job_listed(tmp_path, monkeypatch, body, listed, gone):
    """job_listed (cancel_jobs waits while it holds; wait=true polls it) takes a squeue past SLURM_CALL_S, or
    one that fails, as still listed; job_gone takes either as not ended. Only SLURM's own word ends a job:
    no longer listed, or an id it no longer knows."""
    import grpo.companions
    from grpo.companions import job_gone, job_listed

    # the bound cut short only the squeue that never answers: one that answers is a Python start, which a loaded machine can hold past 1 s
    monkeypatch.setattr(grpo.companions, "SLURM_CALL_S", 1 if "sleep" in body else 60)
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"squeue": body}))
    assert (job_listed("11"), job_gone("11")) == (listed, gone)


def test_wait_true_says_a_squeue_that_keeps_failing_and_ends_only_on_slurms_word(tmp_path, monkeypatch, capsys):
    """wait=true (grpo.launch.wait_for_job) through a squeue that fails twice (the controller down), answers
    RUNNING, fails once more, then no longer lists the job: each failure past `say_every_s` is said (here
    0 s: every one) with squeue's own line, the RUNNING answer ends the failing stretch, and only the
    empty answer ends the wait. Before, a squeue failing for good made the wait silent forever."""
    import grpo.companions
    from grpo.launch import wait_for_job

    calls = tmp_path / "calls"
    answers = ["fail", "fail", "running", "fail", "gone"]
    monkeypatch.setattr(grpo.companions, "SLURM_CALL_S", 5)
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {"squeue": (
        f"n = len(open({str(calls)!r}).read()) if os.path.exists({str(calls)!r}) else 0\n"
        f"open({str(calls)!r}, 'a').write('x')\n"
        f"answer = {answers!r}[n]\n"
        "if answer == 'fail': sys.exit('squeue: error: slurm_load_jobs error: Unable to contact slurm controller')\n"
        "if answer == 'running': print('RUNNING')")}))
    wait_for_job("42", poll_s=0, say_every_s=0)
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("squeue has not answered")]
    assert len(calls.read_text()) == 5 and len(said) == 3, said
    assert said[0].startswith("squeue has not answered on job 42 for 0 s (squeue: error: slurm_load_jobs error: Unable "
                              "to contact slurm controller); still waiting, the job may be running. Ctrl-C ends this "
                              "wait, not the job (squeue -j 42; sacct -j 42)."), said[0]
    capsys.readouterr()
    calls.unlink()
    wait_for_job("42", poll_s=0, say_every_s=3600)  # within the default's stretch: nothing said
    assert "squeue has not answered" not in capsys.readouterr().out


def test_the_trainer_takes_as_many_urls_as_servers_it_waits_for(tmp_path):
    """Three servers answering in the folder, the trainer waiting for two: the first two URLs in sorted order,
    not all three (rollout.remote.urls of exactly the job's servers)."""
    import contextlib

    from grpo.companions import wait_for_urls
    from tests.test_launch import healthy_server

    with contextlib.ExitStack() as stack:
        urls = sorted(stack.enter_context(healthy_server()) for _ in range(3))
        folder = tmp_path / "servers"
        folder.mkdir()
        for i, url in enumerate(urls):
            (folder / f"n{i}.url").write_text(url + "\n")
        assert wait_for_urls(str(folder), 2, 30, "rollout server", str(tmp_path)) == urls[:2]


def test_the_sbatch_script_asks_for_the_launchs_gpus_signal_and_requeue(tmp_path, monkeypatch):
    """What executor_for hands sbatch (submitit's script, read by a stand-in sbatch): each setting of the
    launcher as its #SBATCH line; gpus_per_node and the time-limit warning (--signal=USR2@120: the
    checkpoint-and-requeue) among them. Unset ones (account, qos, constraint) ask nothing."""
    from grpo.companions import executor_for

    script = tmp_path / "script.sh"
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", {
        "srun": "pass",
        "sbatch": f'open({str(script)!r}, "w").write(open(sys.argv[-1]).read()); print("Submitted batch job 5")'}))
    settings = {"nodes": 2, "tasks_per_node": 4, "timeout_min": 90, "gpus_per_node": 8, "cpus_per_task": 8, "mem_gb": 64,
                "partition": "gpu", "account": None, "qos": None, "constraint": None, "signal_delay_s": 120,
                "additional_parameters": {"requeue": True}, "setup": []}
    job = executor_for(str(tmp_path / "slurm" / "%j"), settings, "grpo").submit(print, "never run here")
    assert job.job_id == "5"
    lines = {line.split()[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH")}
    assert {"--nodes=2", "--ntasks-per-node=4", "--time=90", "--gpus-per-node=8", "--cpus-per-task=8", "--mem=64GB",
            "--partition=gpu", "--signal=USR2@120", "--requeue", "--job-name=grpo"} <= lines
    assert not [line for line in lines if line.startswith(("--account", "--qos", "--constraint"))]
