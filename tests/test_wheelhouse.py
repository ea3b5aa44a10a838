"""`make wheelhouse` / `make setup WHEELHOUSE=...` (grpo/wheelhouse.py): the package lists come from
setup.cfg, torch stays out, pip is given every platform tag a target takes. By value, no network; the
real build and offline install are measured in docs/gpu.md ("Air-gapped install (wheelhouse)")."""

import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from grpo import wheelhouse as wh
from tests.conftest import ROOT

SETUP_CFG = """
[metadata]
name = x

[options]
install_requires =
    torch>=2.13,<2.15
    transformers==5.19.0  # a reason, after the pin
    Hydra_Core==1.3.8
    deepspeed==0.19.8  # parallel=zero2
    datasets==5.2.0

[options.extras_require]
dev =
    pytest>=8
    wandb>=0.22
"""


def test_profiles_read_setup_cfg_and_leave_torch_out():
    assert wh.profile_requirements("trainer", SETUP_CFG) == [
        "transformers==5.19.0", "Hydra_Core==1.3.8", "deepspeed==0.19.8", "datasets==5.2.0", "pytest>=8"]
    assert wh.profile_requirements("full", SETUP_CFG, vllm="vllm==9.9") == [
        "transformers==5.19.0", "Hydra_Core==1.3.8", "deepspeed==0.19.8", "datasets==5.2.0", "pytest>=8", "vllm==9.9"]
    assert wh.profile_requirements("trainer", SETUP_CFG, with_torch=True)[0] == "torch>=2.13,<2.15"
    assert wh.profile_requirements("trainer", SETUP_CFG, skip=("datasets", "hydra-core")) == [
        "transformers==5.19.0", "deepspeed==0.19.8", "pytest>=8"]
    with pytest.raises(ValueError, match="skip: dataset not in setup.cfg"):
        wh.profile_requirements("trainer", SETUP_CFG, skip=("dataset",))  # a typo is not silently ignored
    assert wh.sdist_requirements(SETUP_CFG) == ["deepspeed==0.19.8", "antlr4-python3-runtime==4.9.3"]


def test_the_real_setup_cfg_and_makefile_agree_with_the_lists():
    text = (ROOT / "setup.cfg").read_text()
    install, _ = wh.setup_cfg_requirements(text)
    names = [wh.name_of(r) for r in install]
    assert "torch" in names and "deepspeed" in names and "hydra-core" in names
    trainer = wh.profile_requirements("trainer", text)
    assert [wh.name_of(r) for r in trainer] == [n for n in names if n != "torch"] + ["pytest"]
    assert wh.sdist_requirements(text)[0] in install  # deepspeed built at setup.cfg's own pin
    assert wh.build_requirements((ROOT / "pyproject.toml").read_text()) == ["setuptools>=68", "wheel"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^VLLM_GPU := (\S+)$", makefile, re.M).group(1) == wh.VLLM_GPU


def test_platform_tags_reach_down_to_the_manylinux2014_wheels():
    tags = wh.platform_tags("manylinux_2_28_x86_64")
    assert tags[:2] == ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64"]
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert len(tags) == 24 + 3 and "manylinux_2_29_x86_64" not in tags
    assert wh.platform_tags("linux_x86_64") == ["linux_x86_64"]


def test_torch_outside_setup_cfgs_range_is_named():
    spec = "torch>=2.13,<2.15"
    assert wh.torch_problem("2.13.0+cpu", spec) is None
    assert wh.torch_problem("2.14.1", spec) is None
    assert wh.torch_problem("2.11.0+cu130", spec) == "torch 2.11.0+cu130 is outside torch>=2.13,<2.15 (>=2.13 fails)"
    assert wh.torch_problem("2.15.0", spec).endswith("(<2.15 fails)")


@pytest.mark.parametrize("wheels, code, said", [
    (["torch-2.11.0+cu130-cp312-cp312-manylinux_2_28_x86_64.whl"], 0, "torch: none here; it comes from "),
    (["torch-2.11.0+wheelhouse-py3-none-any.whl"], 1, "has no torch and"),  # the stand-in is no torch
    ([], 1, "has no torch and"),
])
def test_the_targets_check_stops_a_venv_with_no_torch_from_a_folder_with_none(tmp_path, monkeypatch, capsys, wheels, code, said):
    """check_torch on the target, this Python made to have no torch (`import torch` fails): a folder with a
    real torch wheel is fine; one with only the stand-in (built without WITH_TORCH=1), or none, stops the
    install with the ways out."""
    for name in wheels:
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import torch: ImportError
    assert wh.check_torch(tmp_path) == code
    out = capsys.readouterr()
    assert said in (out.out + out.err)
    if code:
        assert "rebuild the wheelhouse with\n  WITH_TORCH=1" in out.err, out.err


def test_the_targets_check_keeps_the_torch_it_finds_and_names_one_outside_the_range(tmp_path, monkeypatch, capsys):
    """A torch already in the venv is kept (the checkout goes on top with --no-deps); outside setup.cfg's
    range it is a warning naming the bound, not a stop."""
    import torch

    assert wh.check_torch(tmp_path) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__} already here" in out and "kept, not replaced" in out and "warning" not in out, out
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert wh.check_torch(tmp_path) == 0
    assert "warning: torch 2.11.0+cu130 is outside torch>=" in capsys.readouterr().out


def test_the_stand_in_torch_is_a_wheel_with_no_dependencies(tmp_path):
    path = wh._stub_torch(tmp_path, "2.11.0")
    assert path.name == "torch-2.11.0+wheelhouse-py3-none-any.whl"
    with zipfile.ZipFile(path) as z:
        metadata = z.read("torch-2.11.0+wheelhouse.dist-info/METADATA").decode()
    assert "Version: 2.11.0+wheelhouse" in metadata and "Requires-Dist" not in metadata


@pytest.mark.starts_process
def test_make_setup_with_a_wheelhouse_installs_with_no_index_and_the_default_is_unchanged(tmp_path):
    def dry_run(*args):
        out = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path}/venv", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / wh.REQUIREMENTS).write_text("hydra-core==1.3.8\n")
    offline = dry_run(f"WHEELHOUSE={tmp_path}/wh")
    pip_lines = [ln for ln in offline.splitlines() if " -m pip install" in ln]
    assert len(pip_lines) == 2 and all("--no-index" in ln for ln in pip_lines), offline
    assert "--system-site-packages" in offline and "--no-deps -e ." in offline and "check-torch" in offline
    default = dry_run()
    assert "--no-index" not in default and '-e ".[dev]"' in default and "--system-site-packages" not in default


@pytest.mark.starts_process
def test_a_venv_made_from_a_venv_sees_that_venvs_packages(tmp_path):
    """The GPU machine's python3 is itself a venv holding torch: `make setup WHEELHOUSE=` made .venv from
    it with --system-site-packages, which saw the base interpreter's packages and no torch. Run by the
    outer Python, `inherit-site` gives the new venv the outer venv's site-packages (here a marker package)."""
    import sys

    outer, inner = tmp_path / "outer", tmp_path / "inner"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", "--without-pip", str(outer)], check=True, timeout=60)
    purelib = subprocess.check_output([str(outer / "bin" / "python"), "-c",
                                       "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    (Path(purelib) / "outer_marker.py").write_text("")
    subprocess.run([str(outer / "bin" / "python"), "-m", "venv", "--system-site-packages", "--without-pip", str(inner)],
                   check=True, timeout=60)
    sees = [str(inner / "bin" / "python"), "-c", "import outer_marker"]
    assert subprocess.run(sees, capture_output=True, timeout=30).returncode != 0  # the gap
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([str(outer / "bin" / "python"), "-m", "grpo.wheelhouse", "inherit-site", str(inner)], check=True,
                   env=env, timeout=60)
    assert subprocess.run(sees, capture_output=True, timeout=30).returncode == 0
    (tmp_path / wh.REQUIREMENTS).write_text("hydra-core==1.3.8\n")
    assert "inherit-site" in subprocess.run(["make", "-n", "setup", f"VENV={inner}", f"WHEELHOUSE={tmp_path}"], cwd=ROOT,
                                            capture_output=True, text=True, timeout=30).stdout
