"""`python -m grpo.doctor`: the table, a failing check's fix and the exit code. The full doctor (every
backend on real engines) runs in CI (`.ci/run`), not in this tier."""

from grpo import doctor


def test_versions_and_device_pass_here(capsys):
    assert doctor.main(["--only", "versions,device"]) == 0
    out = capsys.readouterr().out
    assert "versions" in out and "torch" in out and "PASS" in out and "FAIL" not in out
    assert "2 passed, 0 failed" in out
    import torch

    # what ran where: the CPU model, torch's kernel set and the threads (float rounding differs by CPU)
    assert f"torch kernels {torch.backends.cpu.get_cpu_capability()}" in out and "threads" in out


def test_a_failing_run_is_a_fail_row_with_its_fix(tmp_path):
    """A training run that exits non-zero (here: a config key that does not exist) fails its row."""
    result = doctor.check_backend("hf", str(tmp_path), ["no_such_key=1"])
    assert not result.ok and "no_such_key" in result.detail and "python -m grpo.train rollout=hf" in result.fix
    text = doctor.table([result, doctor.Result("device", True, "CPU only")])
    assert "hf      FAIL" in text and "fix" in text and "device  PASS" in text


def test_unknown_check_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        doctor.main(["--only", "gpu-magic"])
    assert "unknown check(s) gpu-magic" in capsys.readouterr().err


def test_the_doctors_server_never_shares_a_gpu_with_the_trainer_over_nccl():
    """NCCL refuses two ranks of one communicator on one device ('Duplicate GPU detected'): with one
    GPU the trainer and server share it over grpo_gloo; with several the server takes the last one
    (through the parent's CUDA_VISIBLE_DEVICES) and vLLM's nccl carries the weights."""
    from grpo.doctor import server_placement

    assert server_placement(0, None) == ({}, "grpo_gloo")
    assert server_placement(1, None) == ({}, "grpo_gloo")
    assert server_placement(8, None) == ({"CUDA_VISIBLE_DEVICES": "7"}, "nccl")
    assert server_placement(2, "4,6") == ({"CUDA_VISIBLE_DEVICES": "6"}, "nccl")
