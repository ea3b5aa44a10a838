"""rollout=dedicated: device placement errors, and real engine processes owned by the node's local
main process, with 1 and 2 training processes, that never outlive the trainer."""

import contextlib
import glob
import json
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from grpo.errors import ConfigError, DeviceError
from grpo.rollout.dedicated import (CPU_MEMORY_FRACTION, GPU_MEMORY_FRACTION, DedicatedBackend, check_engine_settings,
                                    engine_argv, pick_devices)
from tests.conftest import FAST, ROOT, compose_cfg, measured
from tests.listener_watch import ListenerWatch
from tests.test_parallel import TORCHRUN


def test_auto_without_gpus_means_cpu_engines(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    assert pick_devices("auto", training_per_node=2) == ["cpu"]


def test_a_device_that_is_not_there_names_the_visible_ones(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    with pytest.raises(DeviceError, match=r"requested device for vllm \(cuda:4\) is not available; visible devices: cuda:0, cuda:1, cuda:2, cuda:3"):
        pick_devices(["cuda:4"], training_per_node=2)
    with pytest.raises(DeviceError, match=r"\(cuda:1\) is used by training process 1 of this node; pick one of cuda:2, cuda:3"):
        pick_devices([1], training_per_node=2)
    assert pick_devices("auto", training_per_node=2) == ["cuda:2", "cuda:3"]
    assert pick_devices([3], training_per_node=2) == ["cuda:3"]
    with pytest.raises(DeviceError, match="all 4 visible GPUs"):
        pick_devices("auto", training_per_node=4)


def test_an_empty_or_repeated_device_list_is_refused_by_name(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    with pytest.raises(DeviceError, match=r"names cuda:2 more than once \(4 and cuda:4 are one device\)"):
        pick_devices(["cuda:2", 2], training_per_node=2)  # was one engine on CUDA_VISIBLE_DEVICES=2,2
    with pytest.raises(DeviceError, match=r"rollout.dedicated.devices=\[\] reserves no device"):
        pick_devices([], training_per_node=2)  # was plan_engines' "max() arg is an empty sequence"
    assert pick_devices(["cuda:2", 3], training_per_node=2) == ["cuda:2", "cuda:3"]


def test_engine_devices_map_through_the_parents_visible_list():
    from grpo.rollout.dedicated import child_visible_devices

    assert child_visible_devices(["cuda:6", "cuda:7"], None) == "6,7"  # no list: logical = physical
    assert child_visible_devices(["cuda:2", "cuda:3"], "4,5,6,7") == "6,7"  # a shared node's share
    assert child_visible_devices(["cuda:1"], "GPU-aaa,GPU-bbb") == "GPU-bbb"  # UUIDs
    with pytest.raises(DeviceError, match="cuda:2 is not among this process's CUDA_VISIBLE_DEVICES=0,1"):
        child_visible_devices(["cuda:2"], "0,1")


def test_no_gpu_machine_rejects_cuda_devices(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    with pytest.raises(DeviceError, match=r"\(cuda:0\) is not available; visible devices: none"):
        pick_devices(["cuda:0"], training_per_node=1)


@pytest.mark.starts_process
def test_parity_and_generations_change_after_sync(tiny_lm, tmp_path):
    import copy

    from omegaconf import OmegaConf

    from grpo.config import RolloutConfig
    from grpo.rollout.dedicated import DedicatedBackend
    from tests.parity import assert_round_trip, assert_turn_one_is_generate, sync_round_trip

    model, tok = copy.deepcopy(tiny_lm[0]), tiny_lm[1]
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    cfg = OmegaConf.structured(RolloutConfig(backend="dedicated", max_new_tokens=32))
    cfg.vllm.memory_fraction, cfg.vllm.max_model_len = 0.1, 128
    backend = DedicatedBackend(cfg, model, tok, str(tmp_path / "model"), run_dir=str(tmp_path))
    folder = backend.folders[0]
    try:
        assert_round_trip(sync_round_trip(backend, model, tok), "dedicated")
        assert_turn_one_is_generate(backend, tok)  # episodes run on the node main's generator thread
        # vLLM's files: in the engine's TMPDIR (the server's own folder there, grpo.serve's own_tmpdir)
        assert any(name.startswith("vllm_dist_") for _, _, names in os.walk(folder) for name in names)
    finally:
        backend.close()
    assert wait_gone(tmp_path) == []
    assert not os.path.exists(folder)  # with vLLM's sockets and FileStore file, which vLLM leaves behind


@pytest.mark.starts_process
def test_two_engines_each_serve_at_the_url_their_own_process_wrote(tiny_lm, tmp_path, monkeypatch):
    """num_engines=2 on CPU: each engine binds a free port itself (grpo.serve --port 0) and names it in a
    folder of its own (its TMPDIR too, removed on close), so pool server i is the port engine process i
    listens on, and its log is named by that port: no engine's URL read as another's."""
    import tempfile

    import psutil
    from omegaconf import OmegaConf

    from grpo.config import RolloutConfig
    from grpo.dist import node_name

    tiny_lm[0].save_pretrained(tmp_path / "model")
    tiny_lm[1].save_pretrained(tmp_path / "model")
    cfg = OmegaConf.structured(RolloutConfig(backend="dedicated", max_new_tokens=8))
    cfg.vllm.memory_fraction, cfg.vllm.max_model_len, cfg.dedicated.num_engines = 0.1, 128, 2
    made, mkdtemp = [], tempfile.mkdtemp  # the real folders, noted
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    backend = DedicatedBackend(cfg, tiny_lm[0], tiny_lm[1], str(tmp_path / "model"), run_dir=str(tmp_path))
    try:
        folders = [f for f in made if os.path.basename(f).startswith("grpo-engine-")]
        assert len(folders) == 2 and folders == backend.folders, (folders, backend.folders)
        urls = [s.url for s in backend.pool.servers]
        assert urls == [f"http://127.0.0.1:{p}" for p in backend.ports] and len(set(urls)) == 2
        for url, proc in zip(urls, backend.procs):
            listening = [f"http://{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(proc.pid).net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN]
            assert url in listening, (url, listening)
        assert sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "vllm-engine-*.log"))) == sorted(
            f"vllm-engine-{node_name()}-{p}.log" for p in backend.ports)
    finally:
        backend.close()
    assert wait_gone(tmp_path) == [] and not any(os.path.exists(f) for f in folders), folders


@pytest.mark.starts_process
def test_an_engine_whose_core_died_fails_the_weight_push_in_seconds_naming_its_log(tiny_lm, tmp_path):
    """vLLM keeps its API process when its EngineCore dies (killed for memory, crashed), and a request in
    flight then is never answered: the push waited out request_timeout_s (600 s) and said the server was
    "unreachable (timed out)". Here the core is stopped, the push sent (its /start_weight_update queued to
    the core), the core killed: the push fails within seconds naming EngineDeadError and the engine's log,
    and the engine is gone at once on close (it ignores SIGTERM while it holds the request)."""
    import copy

    import psutil
    from omegaconf import OmegaConf

    from grpo.config import RolloutConfig
    from grpo.endpoints import ServerGone
    from grpo.weights import group_by_size

    model, tok = copy.deepcopy(tiny_lm[0]), tiny_lm[1]
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    cfg = OmegaConf.structured(RolloutConfig(backend="dedicated", max_new_tokens=32))
    cfg.vllm.memory_fraction, cfg.vllm.max_model_len = 0.1, 128
    assert cfg.dedicated.request_timeout_s == 600
    backend = DedicatedBackend(cfg, model, tok, str(tmp_path / "model"), run_dir=str(tmp_path))
    try:
        core = next(p for p in psutil.Process(backend.procs[0].pid).children() if p.name() == "VLLM::EngineCore")
        core.suspend()  # the push's first request reaches the core's queue and waits
        server = backend.pool.servers[0]
        send = server.send

        def send_then_kill(path, *args, **kwargs):
            # The kill counts from the request's send, and gives the API 5 s to queue it to the core on a
            # loaded machine: a core killed before that is known dead, and the request is refused at once
            # (500), not held.
            if path == "/start_weight_update":
                threading.Timer(5.0, core.kill).start()
            return send(path, *args, **kwargs)

        server.send = send_then_kill
        start = time.monotonic()
        with pytest.raises(ServerGone) as e:
            backend.update_weights(group_by_size(model.named_parameters(), 1 << 20), version=1)
        assert time.monotonic() - start < 30
        log = glob.glob(str(tmp_path / "vllm-engine-*.log"))[0]
        assert str(e.value).startswith(f"{backend.pool.servers[0].url}/start_weight_update will never be answered: its "
                                       f"vLLM engine died (EngineDeadError); the end of {log}:\n")
        assert backend.procs[0].poll() is None  # its API process lives on, holding the request
    finally:
        start = time.monotonic()
        backend.close()
    assert time.monotonic() - start < 15
    assert wait_gone(tmp_path) == []


def engine_pids(run_dir) -> list[int]:
    # vllm-engine-<node>-<port>.log
    ports = [os.path.basename(p)[: -len(".log")].rsplit("-", 1)[1] for p in glob.glob(os.path.join(run_dir, "vllm-engine-*.log"))]
    pids = []
    for proc in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            cmd = open(proc, "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(f"--port {port}" in cmd for port in ports):
            pids.append(int(proc.split("/")[2]))
    return pids


def wait_gone(run_dir, seconds=90) -> list[int]:
    deadline = time.time() + seconds
    while (left := engine_pids(run_dir)) and time.time() < deadline:
        time.sleep(1)
    return left


def run_ok(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def check_run(run_dir, steps):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    assert [r["weight_version"] for r in trained] == list(range(steps))
    assert all(d < 1e-3 for d in measured(trained))  # synced every step 
    assert len(glob.glob(os.path.join(run_dir, "vllm-engine-*.log"))) == 1  # one engine for the node
    assert wait_gone(run_dir) == [], "engine processes outlived the run"


@pytest.mark.slow  # the episode driver on a server pool: test_remote's guess run; dedicated's own runs: the ddp e2e run
def test_guess_episodes_through_dedicated(make_cfg):
    """3 steps of experiment=guess_tiny: the node main builds the environments and drives the episodes
    against its engine; several turns, the trainer scoring the engine's tokens across turns."""
    from grpo.train import train

    cfg = make_cfg("experiment=guess_tiny", "rollout=dedicated", "rollout.vllm.memory_fraction=0.1", "steps=3",
                   "eval_every=0", "checkpoint_every=0")
    with ListenerWatch(os.getpid()) as watch:  # the trainer (this process) and its engine
        train(cfg)
    watch.assert_accounted("vLLM engine API (dedicated engine 0)", "vLLM engine internals", "weight-transfer group")
    from tests.parity import assert_guess_run_scores_the_samplers_tokens

    assert_guess_run_scores_the_samplers_tokens(cfg.run_dir)
    assert wait_gone(cfg.run_dir) == []


@pytest.mark.starts_process
# make test: rollout=dedicated, parallel=ddp (e2e_smoke)
# slow: zero3 (ZeRO-3's gathered push to a server: test_remote's zero3 run, e2e_smoke)
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.e2e_smoke), pytest.param("zero3", marks=pytest.mark.slow)])
def test_two_process_run_with_one_engine_per_node(tmp_path, cache_dir, hub_like_policy, parallel):
    """The engine's folder carries a hub model's generation_config.json (conftest): sampling stays pinned."""
    out = run_ok([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, f"parallel={parallel}",
                  "rollout=dedicated", "parallel.sync_bucket_mb=1", f"hydra.run.dir={tmp_path}",
                  f"model.cache_dir={cache_dir}", f"model.path={hub_like_policy}"])
    check_run(tmp_path, steps=3)
    from tests.test_library_logs import assert_readable

    assert_readable(out.stdout + out.stderr, f"a 2-process {parallel} dedicated run's console")
    engine_log = glob.glob(os.path.join(tmp_path, "vllm-engine-*.log"))[0]
    assert_readable(open(engine_log).read(), "its engine's log")


@pytest.mark.starts_process
def test_engines_die_when_the_trainer_is_killed(tmp_path, cache_dir):
    from grpo.scratch import inductor_cache_dir

    cmd = [sys.executable, "-m", "grpo.train", *FAST, "steps=500", "rollout=dedicated",
           f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    tmp = Path(tempfile.mkdtemp(prefix="grpo-test-", dir="/tmp"))  # the trainer's TMPDIR (short: vLLM's sockets fit)
    env = {**os.environ, "TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()}  # the warm compile cache
    trainer = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    log = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while not (log.exists() and log.read_text().count("\n") >= 2) and time.time() < deadline:
        assert trainer.poll() is None
        time.sleep(0.5)
    assert engine_pids(tmp_path), "the engine should be running mid-training"
    engine_folders = lambda: [p.name for p in tmp.iterdir() if p.name.startswith(("grpo-engine-", "vllm_dist_"))]  # noqa: E731
    assert engine_folders(), "the engine's folder (its URL file and TMPDIR) should be in the trainer's TMPDIR"
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert wait_gone(tmp_path) == [], "engines were orphaned by a killed trainer"
    deadline = time.time() + 30  # the reaper removes its engine's folder once the group is gone
    while engine_folders() and time.time() < deadline:
        time.sleep(0.5)
    assert engine_folders() == []  # with vLLM's sockets and FileStore file in it
    shutil.rmtree(tmp)


def test_cpu_cores_reserve_the_last_cpus_for_the_engines():
    from grpo.rollout.dedicated import split_cpus

    assert split_cpus([0, 1], 1) == ([0], [1])
    assert split_cpus([2, 3, 6, 7], 2) == ([2, 3], [6, 7])  # the affinity mask's own ids (SLURM, taskset)
    for bad in (0, 2, 5):
        with pytest.raises(DeviceError, match="cpu_cores"):
            split_cpus([0, 1], bad)


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for a parent that is gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.starts_process
def test_the_reaper_runs_without_torch():
    """Started beside every engine: by its file (reaper_argv), no package import pulls torch in (it
    took 235 MB and 3 s as `python -m grpo.rollout.reaper`)."""
    from grpo.rollout.reaper import reaper_argv

    argv = reaper_argv(1, 1, 1)
    out = subprocess.run([argv[0], "-X", "importtime", *argv[1:-3], "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "trainer that started the engine" in out.stdout
    assert not re.search(r"\|\s+(torch|grpo)\b", out.stderr), [line for line in out.stderr.splitlines() if "torch" in line][:3]


@pytest.mark.starts_process
def test_the_reaper_ends_an_engine_that_ignores_sigterm_once_its_trainer_is_killed():
    """vLLM's server can hang in its shutdown with requests in flight when its trainer is SIGKILLed;
    the reaper started beside it (as launch_engine does) kills the group after its grace period."""
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)"
    trainer = (
        "import os, subprocess, sys, time\n"
        f"engine = subprocess.Popen([sys.executable, '-c', {stubborn!r}], start_new_session=True, stdout=subprocess.PIPE)\n"
        "engine.stdout.readline()\n"
        "from grpo.rollout.reaper import reaper_argv\n"
        "subprocess.Popen(reaper_argv(engine.pid, 1, os.getpid()), start_new_session=True)\n"
        "print(engine.pid, flush=True)\n"
        "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", trainer], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    engine = int(parent.stdout.readline())
    time.sleep(2)  # the reaper has set up its death signal
    assert running(engine)
    parent.kill()
    parent.wait()
    deadline = time.time() + 20
    while running(engine) and time.time() < deadline:
        time.sleep(0.2)
    assert not running(engine), "the engine outlived its killed trainer"


@pytest.mark.starts_process
def test_the_reaper_sends_sigterm_to_every_process_of_the_engines_group(tmp_path):
    """vLLM's server and its EngineCore share the engine's process group; each must get the SIGTERM
    (its chance to clean up, e.g. its /dev/shm queues) before the SIGKILL, not the group's leader alone."""
    from grpo.rollout.reaper import end_group

    child = ("import pathlib, signal, sys, time\n"
             f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(tmp_path / 'child')!r}).write_text('term'), sys.exit(0)))\n"
             "print(flush=True)\n"
             "time.sleep(120)\n")
    leader = ("import subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE)\n"
              "child.stdout.readline()\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(120)\n")
    engine = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True, stdout=subprocess.PIPE, text=True)
    child_pid = int(engine.stdout.readline())
    end_group(engine.pid, 10)
    engine.wait(30)
    assert (tmp_path / "child").read_text() == "term"
    assert not running(child_pid)


@pytest.mark.starts_process
def test_a_reaper_whose_trainer_died_before_it_armed_its_signal_ends_the_engine_at_once():
    """PR_SET_PDEATHSIG set after the trainer died never fires: the reaper sees a parent other than the
    trainer it was given and ends the group then, rather than waiting beside an orphaned engine."""
    from grpo.rollout.reaper import reaper_argv

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)"
    engine = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE)
    engine.stdout.readline()
    gone_trainer = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_trainer.wait()  # a pid that is not the reaper's parent: its trainer, already dead
    try:
        subprocess.run(reaper_argv(engine.pid, 0.5, gone_trainer.pid), cwd=ROOT, timeout=60, check=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)
    engine.wait(30)
    assert engine.returncode == -signal.SIGKILL


def test_each_nodes_ranks_must_be_consecutive():
    """The node groups are blocks of consecutive ranks: block placement passes, SLURM's cyclic
    placement (ranks alternating between nodes) and two blocks on one node name are errors."""
    from grpo.errors import DeviceError
    from grpo.rollout.dedicated import check_node_layout

    check_node_layout(["n1", "n1", "n2", "n2"], 2)
    check_node_layout(["vm", "vm"], 2)
    with pytest.raises(DeviceError, match="rank 0: n1, rank 1: n2, rank 2: n1, rank 3: n2"):
        check_node_layout(["n1", "n2", "n1", "n2"], 2)
    with pytest.raises(DeviceError):
        check_node_layout(["n1", "n1", "n1", "n1"], 2)


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:1"], ["cpu"]])
def test_an_engines_command_says_eager_or_graphs_whatever_the_device(devices):
    """rollout.vllm.enforce_eager=true (the default) was left unsaid, and grpo.serve's default on a GPU is
    CUDA graphs: a user who asked for eager got graphs. Both ways are passed now."""
    from types import SimpleNamespace

    for eager, flag in ((True, "--enforce-eager"), (False, "--no-enforce-eager")):
        cfg = SimpleNamespace(max_model_len=256, kv_cache_gb="auto", images_per_prompt=1, memory_fraction=0.3,
                              enforce_eager=eager)
        argv = engine_argv("/m", devices, "/engine0", cfg, "float32", "nccl")
        assert [a for a in argv if a.endswith("enforce-eager")] == [flag], argv
    # no port picked for it: it binds a free one itself and names it in its own folder (server_watch.wait_for_url)
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--url-dir") + 1] == "/engine0"
    gpus = engine_argv("/m", ["cuda:0", "cuda:1"], "/engine0", cfg, "bfloat16")
    assert gpus[gpus.index("--tensor-parallel-size") + 1] == "2" and gpus[gpus.index("--dtype") + 1] == "bfloat16"


def test_engine_settings_of_cpu_engines_are_refused_on_gpus_not_ignored():
    """A GPU engine owns its devices and takes 0.9 of each; rollout.vllm.memory_fraction and
    rollout.dedicated.cpu_cores size and pin CPU engines only. Set on GPUs they were passed over without
    a word (--memory-fraction 0.9 whatever the config said); rollout=dedicated's own values pass."""
    preset = compose_cfg("rollout=dedicated").rollout
    assert preset.vllm.memory_fraction == CPU_MEMORY_FRACTION == 0.1 and preset.dedicated.cpu_cores == 0
    check_engine_settings(preset, ["cuda:1"])
    argv = engine_argv("/m", ["cuda:1"], "/engine0", preset.vllm, "bfloat16")
    assert argv[argv.index("--memory-fraction") + 1] == str(GPU_MEMORY_FRACTION) == "0.9"
    argv = engine_argv("/m", ["cpu"], "/engine0", preset.vllm, "float32")
    assert argv[argv.index("--memory-fraction") + 1] == "0.1"

    mine = compose_cfg("rollout=dedicated", "rollout.vllm.memory_fraction=0.5", "rollout.dedicated.cpu_cores=1").rollout
    check_engine_settings(mine, ["cpu"])  # read there
    with pytest.raises(ConfigError) as e:
        check_engine_settings(mine, ["cuda:1", "cuda:2"])
    assert str(e.value) == (
        "rollout.vllm.memory_fraction=0.5 and rollout.dedicated.cpu_cores=1 with rollout=dedicated on ['cuda:1', "
        "'cuda:2']: engines on GPUs own their devices and take 0.9 of each, and no CPU cores are reserved for them; "
        "these settings size and pin CPU engines only. Remove them (rollout.vllm.kv_cache_gb=N gives a GPU engine's "
        "KV cache an explicit size in GiB).")
    with pytest.raises(ConfigError, match=r"^rollout.dedicated.cpu_cores=2 with rollout=dedicated on \['cuda:0'\]"):
        check_engine_settings(compose_cfg("rollout=dedicated", "rollout.dedicated.cpu_cores=2").rollout, ["cuda:0"])
    # validate's hook, told whether the run has GPUs (grpo.launch: the job's, on a login node)
    DedicatedBackend.check_hardware(mine, cuda=False)
    DedicatedBackend.check_hardware(preset, cuda=True)
    with pytest.raises(ConfigError, match=r"^rollout.vllm.memory_fraction=0.5 and rollout.dedicated.cpu_cores=1 with "
                                          r"rollout=dedicated on \['cuda'\]"):
        DedicatedBackend.check_hardware(mine, cuda=True)
