"""`python -m grpo.doctor`: the table, a failing check's fix and the exit code. The full doctor (every
backend on real engines) runs in CI (`.ci/run`), not in this tier."""

import pytest

from grpo import doctor


def test_versions_device_and_peak_pass_here(capsys):
    assert doctor.main(["--only", "versions,device,peak"]) == 0
    out = capsys.readouterr().out
    assert "versions" in out and "torch" in out and "PASS" in out and "FAIL" not in out
    assert "3 passed, 0 failed" in out
    import torch

    # what ran where: the CPU model, torch's kernel set and the threads (float rounding differs by CPU)
    assert f"torch kernels {torch.backends.cpu.get_cpu_capability()}" in out and "threads" in out
    assert "TFLOP/s dense matmul" in out and "fp32" in out and "bf16" in out


@pytest.mark.starts_process
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


def test_the_parity_bound_follows_the_dtype_and_the_device_by_value():
    """One bound for the doctor, grpo.verify's sampler/sync rows and the `gpu` tier: fp32 1e-3 on the
    CPU; on CUDA 2e-2 (a margin over fp32 Triton attention; 0.1 under a TF32 the user chose: test_precision.py);
    bf16 0.1.
    A missed sync (4.4 on the doctor's tiny model) is outside every one."""
    import pytest

    from grpo.guards import SAMPLER_DIFF_BOUND, parity_bound

    assert parity_bound("float32", "cpu") == 1e-3 and parity_bound("float32", "cuda") == 2e-2
    assert parity_bound("bfloat16", "cpu") == parity_bound("bfloat16", "cuda") == 0.1
    assert parity_bound("float16", "cuda") == 2e-2
    assert all(parity_bound(d, dev) < min(SAMPLER_DIFF_BOUND[d], 4.4) for d in SAMPLER_DIFF_BOUND for dev in ("cpu", "cuda"))
    with pytest.raises(ValueError, match="no parity bound"):
        parity_bound("int8", "cuda")


def test_a_backend_row_passes_within_its_devices_bound(tmp_path, monkeypatch):
    """The doctor's row takes the run's model.dtype and this machine's device: an fp32 run whose
    engine is 5e-3 off fails on the CPU and passes on CUDA (its fp32 bound's margin), as the `gpu` tier's
    runs do (tests/test_gpu.py reads the same `run_parity_bound`)."""
    import json
    import os
    import subprocess

    import torch

    def fake_run(cmd, timeout_s, env=None):  # a finished 2-step run, its engine 5e-3 off after the sync
        run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("run_dir="))
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 1, "sampler_diff": 1e-6}) + "\n" + json.dumps({"step": 2, "sampler_diff": 5e-3}) + "\n")
        json.dump({"peak_memory_gb": 0.1}, open(os.path.join(run_dir, "summary.json"), "w"))
        open(os.path.join(run_dir, "config.yaml"), "w").write("model:\n  dtype: float32\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(doctor, "run_child", fake_run)
    on_cpu = doctor.check_backend("hf", str(tmp_path / "cpu"), [])
    assert not on_cpu.ok and "bound 0.001" in on_cpu.detail and "(> 0.001)" in on_cpu.fix
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    on_cuda = doctor.check_backend("hf", str(tmp_path / "cuda"), [])
    assert on_cuda.ok and "bound 0.02" in on_cuda.detail


@pytest.mark.parametrize("ok", [True, False])
def test_a_failed_checks_folder_is_kept_for_the_log_its_fix_names(ok, monkeypatch, capsys):
    """The first GPU run's remote row said "see /tmp/grpo-doctor-.../server.log", and the doctor had
    deleted that folder on exit. A failed check keeps it (and says where); a clean run leaves nothing."""
    import os

    seen = {}

    def run_checks(only, work, judge=None):
        seen["work"] = work
        with open(os.path.join(work, "server.log"), "w") as f:
            f.write("the engine's error\n")
        return [doctor.Result("remote", ok, "server did not start", "see " + os.path.join(work, "server.log"))]

    monkeypatch.setattr(doctor, "run_checks", run_checks)
    assert doctor.main(["--only", "remote"]) == (0 if ok else 1)
    out = capsys.readouterr().out
    assert os.path.exists(os.path.join(seen["work"], "server.log")) is (not ok)
    assert (f"run folders in {seen['work']}" in out) is (not ok), out
    if not ok:
        import shutil

        shutil.rmtree(seen["work"])
