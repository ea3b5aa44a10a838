"""The `gpu` tier: what only a CUDA GPU can show, skipped without one. `make test-gpu` (`pytest -m gpu`)
on the first machine with a GPU runs, with one command:

  - `python -m grpo.doctor`: every row (versions, device, all-reduce, each backend's 2 steps with the
    sampler-trainer logprob difference after a sync, the weight sync into a `grpo.serve` server);
  - a short run (2 steps on the tiny model) for each rollout backend and parallel strategy that fits
    the machine's GPUs, each checking that the engine serves the trainer's weights after the sync
    (`sampler_diff`), fp32 and bf16, colocated with sleep mode, LoRA in bf16 (the only dtype vLLM's
    CUDA LoRA kernels take). Runs that need two GPUs (dedicated, ddp's two ranks) skip on one.

Also in the tier: test_rollout_vllm.py's real sleep/wake cycle. Written against vLLM 0.33.0 and
DeepSpeed 0.19.8 (docs/gpu.md); not yet run: no GPU has been available to this project."""

import json
import os
import subprocess
import sys

import pytest
import torch

from grpo.doctor import SEEDS, moved_weights, run_parity, two_steps
from tests.conftest import ROOT

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]


def train(tmp_path, backend: str, *overrides, launcher=(sys.executable,), timeout=900) -> dict:
    for seed in SEEDS:  # as the doctor's rows: until step 1 moves the weights, else the sync sent nothing new
        run_dir = tmp_path / f"run-seed{seed}"
        out = subprocess.run([*launcher, "-m", "grpo.train", *two_steps(backend), f"run_dir={run_dir}", f"seed={seed}",
                              *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        # the doctor's parity for the run's model.dtype (grpo.guards.parity): the largest 2e-2 in fp32 on
        # CUDA, the mean 0.1 in bf16
        par = run_parity(str(run_dir))
        diffs = [r[par.metric] for r in rows if par.metric in r]
        if moved_weights(next(r for r in rows if par.metric in r)):
            break
    else:
        pytest.fail(f"step 1 trained nothing under seeds {SEEDS}: no sync carried new weights, so parity was never checked")
    assert len(diffs) == 2 and par.holds(diffs[-1]), (par, diffs)  # after a sync, the engine serves the trainer's weights
    return json.loads((run_dir / "summary.json").read_text())


def test_the_doctor_passes_every_row():
    out = subprocess.run([sys.executable, "-m", "grpo.doctor"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert ", 0 failed" in out.stdout


@pytest.mark.parametrize("backend, parallel, extra", [
    ("hf", "single", []),
    ("colocated", "single", []),
    ("colocated", "single", ["model.dtype=bfloat16"]),
    ("colocated", "single", ["rollout.vllm.sleep=true"]),
    ("colocated", "single", ["model.dtype=bfloat16", "model.lora.rank=8"]),
    ("colocated", "zero2", ["model.dtype=bfloat16"]),
    ("colocated", "zero3", ["model.dtype=bfloat16"]),
    ("hf", "zero3", []),
])
def test_a_short_run_on_one_gpu(tmp_path, backend, parallel, extra):
    summary = train(tmp_path, backend, f"parallel={parallel}", *extra)
    assert summary["steps"] == 2 and summary["peak_memory_gb"] > 0


@pytest.mark.skipif(GPUS < 2, reason="the engine needs a GPU training does not use")
@pytest.mark.parametrize("transfer", ["nccl", "grpo_gloo"])
def test_a_short_dedicated_run_on_a_second_gpu(tmp_path, transfer):
    train(tmp_path, "dedicated", "rollout.dedicated.devices=[cuda:1]", f"rollout.vllm.weight_transfer={transfer}")


@pytest.mark.skipif(GPUS < 2, reason="two NCCL ranks need two GPUs (NCCL refuses two ranks on one device)")
@pytest.mark.parametrize("parallel", ["ddp", "zero3"])
def test_a_short_two_rank_run(tmp_path, parallel):
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    summary = train(tmp_path, "colocated", f"parallel={parallel}", "model.dtype=bfloat16", launcher=torchrun)
    assert summary["world_size"] == 2


def test_a_short_remote_run_against_a_grpo_serve_on_this_machine(tmp_path, monkeypatch):
    """The server placed as the doctor places it (grpo.doctor.server_placement): the last GPU over nccl,
    or the one GPU shared over grpo_gloo."""
    import secrets

    from grpo.doctor import server_placement, start_server, stop_server

    token = secrets.token_hex(16)
    env, transfer = server_placement(GPUS, os.environ.get("CUDA_VISIBLE_DEVICES"))
    server, url = start_server("tiny", token, str(tmp_path / "server.log"), transfer=transfer, env=env)
    monkeypatch.setenv("GRPO_SERVE_TOKEN", token)
    try:
        train(tmp_path, "remote", f"rollout.remote.urls=[{url}]", f"rollout.vllm.weight_transfer={transfer}")
    finally:
        stop_server(server)
