"""The GPU bundle (grpo/gpu_bundle.py, issue 49): vLLM's wheel trimmed, the payload cut into carry-sized
parts with their manifest, and the last call's script putting them back together, all on stand-ins
(no network, no GPU)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from grpo import gpu_bundle
from grpo.gpu_bundle import (CALL_BYTES, INSURANCE, LEAN, MiB, PART_BYTES, bundle_calls, download_command,
                             install_command, pack, split, trim_wheel)

ROOT = Path(__file__).resolve().parents[1]

MEMBERS = {  # a stand-in for vLLM 0.26.0's wheel: (member, dropped without --keep-moe, dropped with it)
    "vllm/__init__.py": (False, False),
    "vllm/_C_stable_libtorch.abi3.so": (False, False),
    "vllm/_vllm_fa3_C.abi3.so": (False, False),
    "vllm/_vllm_fa2_C.abi3.so": (True, True),
    "vllm/_moe_C_stable_libtorch.abi3.so": (True, False),
    "vllm/vllm-rs": (True, True),
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": (True, True),
    "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": (False, False),
    "vllm-0.26.0.dist-info/METADATA": (False, False),
}


def stand_in_wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name in MEMBERS:
            z.writestr(name, name.encode() * 10)
        z.writestr("vllm-0.26.0.dist-info/RECORD", "".join(f"{n},sha256=x,{len(n) * 10}\n" for n in MEMBERS)
                   + "vllm-0.26.0.dist-info/RECORD,,\n")


@pytest.mark.parametrize("keep_moe", [False, True])
def test_the_trimmed_wheel_drops_what_hopper_never_loads_and_its_record_agrees(tmp_path, keep_moe):
    src, dst = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", tmp_path / "trimmed.whl"
    stand_in_wheel(src)
    gone = trim_wheel(src, dst, keep_moe=keep_moe)
    expected_gone = {n for n, (plain, moe) in MEMBERS.items() if (moe if keep_moe else plain)}
    assert set(gone) == expected_gone
    with zipfile.ZipFile(dst) as z:
        names = set(z.namelist())
        record = {line.split(",")[0] for line in z.read("vllm-0.26.0.dist-info/RECORD").decode().splitlines() if line}
        assert z.read("vllm/_vllm_fa3_C.abi3.so") == b"vllm/_vllm_fa3_C.abi3.so" * 10
    assert names == (set(MEMBERS) - expected_gone) | {"vllm-0.26.0.dist-info/RECORD"}
    assert record == names  # pip checks installed files against RECORD: no line for a member that is gone


def test_the_payload_is_cut_into_carry_sized_calls_with_checksums(tmp_path):
    payload = tmp_path / "payload.tar.xz"
    payload.write_bytes(os.urandom(5 * MiB + 3))
    manifest = split(payload, tmp_path / "bundle", part_bytes=2 * MiB, carry_bytes=3 * MiB)
    calls = manifest["calls"]
    assert [c["folder"] for c in calls] == ["call1", "call2", "call3"]
    assert [p["bytes"] for c in calls for p in c["parts"]] == [2 * MiB, 2 * MiB, MiB + 3]
    data = b"".join((tmp_path / "bundle" / c["folder"] / p["name"]).read_bytes() for c in calls for p in c["parts"])
    assert data == payload.read_bytes()
    assert manifest["bytes"] == 5 * MiB + 3 and manifest["sha256"] == hashlib.sha256(data).hexdigest()
    for c in calls:
        folder = tmp_path / "bundle" / c["folder"]
        assert sum(f.stat().st_size for f in folder.iterdir()) <= 3 * MiB
        for p in c["parts"]:
            assert hashlib.sha256((folder / p["name"]).read_bytes()).hexdigest() == p["sha256"]
    sums = (tmp_path / "bundle" / "call3" / "SHA256SUMS").read_text().split("\n")
    assert [line.split()[1] for line in sums if line] == ["part.00", "part.01", "part.02"]
    assert json.loads((tmp_path / "bundle" / "call3" / "manifest.json").read_text()) == manifest
    with pytest.raises(ValueError, match="no room"):
        split(payload, tmp_path / "other", part_bytes=3 * MiB, carry_bytes=3 * MiB)


def test_the_pins_and_pips_options_name_the_lent_machine():
    assert len(LEAN) == 78 and len(INSURANCE) == 11
    assert all("==" in pin for pin in [*LEAN, *INSURANCE]) and len({p.split("==")[0].lower() for p in LEAN + INSURANCE}) == 89
    cmd = download_command(Path("w"), [gpu_bundle.VLLM, *LEAN])
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--no-deps" in cmd and "vllm==0.26.0" in cmd
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert platforms[0] == "manylinux_2_35_x86_64" and "manylinux_2_28_x86_64" in platforms  # vLLM 0.26.0's own tag
    assert "manylinux_2_31_x86_64" in platforms and "manylinux2014_x86_64" in platforms  # llguidance's, most wheels'
    assert "manylinux1_x86_64" in platforms
    assert "--only-binary=:all:" in cmd  # --no-deps lets pip take an sdist for another platform otherwise
    install = install_command(Path("site"), [Path("a.whl")])
    assert {"--no-index", "--no-deps", "--target"} <= set(install) and install[-1] == "a.whl"


def dist_info(site: Path, name: str, *requires: str) -> None:
    folder = site / f"{name}-1.0.dist-info"
    folder.mkdir(parents=True)
    headers = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{headers}\n"
                                     "Requires-Dist: in-the-description\n")


def test_missing_names_each_requirement_nothing_in_the_bundle_or_on_the_machine_meets(tmp_path):
    """The first GPU call (2026-11-28) stopped on `No module named 'tvm_ffi'`: xgrammar's requirement
    apache-tvm-ffi was neither bundled nor on the image, and `pip install --no-deps` said nothing."""
    site = tmp_path / "site"
    dist_info(site, "xgrammar", "apache-tvm-ffi>=0.1.10", "pydantic", "torch>=1.10.0",
              'triton; platform_system == "Linux" and platform_machine == "x86_64"')
    dist_info(site, "pydantic")
    dist_info(site, "vllm", "flashinfer-python==0.6.11", "Typing_Extensions>=4.9", 'xformers; extra == "xf"',
              'tomli; python_version < "3.11"', 'pywin32; sys_platform == "win32"', 'numba==0.65.0; python_version == "3.12"')
    image = frozenset({"torch", "triton", "typing-extensions", "numba"})
    assert gpu_bundle.missing(site, image, {"flashinfer-python": "off"}) == ["xgrammar-1.0 needs apache-tvm-ffi>=0.1.10"]
    assert gpu_bundle.missing(site, image, {}) == ["vllm-1.0 needs flashinfer-python==0.6.11",
                                                   "xgrammar-1.0 needs apache-tvm-ffi>=0.1.10"]
    dist_info(site, "apache_tvm_ffi", "typing-extensions>=4.13")
    assert gpu_bundle.missing(site, image, {"flashinfer-python": "off"}) == []
    assert gpu_bundle.missing(site, frozenset(), {"flashinfer-python": "off"}) == [  # the image's part, by name
        "apache_tvm_ffi-1.0 needs typing-extensions>=4.13", "vllm-1.0 needs Typing_Extensions>=4.9",
        'vllm-1.0 needs numba==0.65.0; python_version == "3.12"', "xgrammar-1.0 needs torch>=1.10.0",
        'xgrammar-1.0 needs triton; platform_system == "Linux" and platform_machine == "x86_64"']


def test_the_calls_stage_then_unpack_and_run():
    manifest = {"calls": [{"folder": "call1", "parts": []}, {"folder": "call2", "parts": []}]}
    first, last = bundle_calls(manifest, "dist/gpu_bundle")
    assert first["carry"] == ["dist/gpu_bundle/call1"] and "cp dist/gpu_bundle/call1/part.* /tmp/gpu_stage/" in first["command"]
    assert last["carry"] == ["dist/gpu_bundle/call2"]
    assert last["command"].startswith("bash scripts/gpu_bundle_go.sh dist/gpu_bundle/call2 bash scripts/gpu_vllm_run.sh")


@pytest.mark.parametrize("tool", [False, pytest.param(True, marks=pytest.mark.starts_process)])
def test_the_packed_folders_unpack_under_their_names(tmp_path, monkeypatch, tool):
    """Python's lzma path (no `xz` tool) and the `xz` tool's, unpacked as the last call does (tarfile,
    the data filter): each folder under its given name, not its own (cache -> grpo_cache)."""
    if tool and not gpu_bundle.shutil.which("xz"):
        pytest.skip("no xz tool here")
    if not tool:
        monkeypatch.setattr(gpu_bundle.shutil, "which", lambda name: None)
    (tmp_path / "site" / "pkg").mkdir(parents=True)
    (tmp_path / "site" / "pkg" / "__init__.py").write_text("VALUE = 7\n")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "model.json").write_text("{}")
    pack({"site": tmp_path / "site", "grpo_cache": tmp_path / "cache"}, tmp_path / "payload.tar.xz")
    with tarfile.open(tmp_path / "payload.tar.xz", "r:xz") as t:
        t.extractall(tmp_path / "out", filter="data")
    assert (tmp_path / "out" / "site" / "pkg" / "__init__.py").read_text() == "VALUE = 7\n"
    assert (tmp_path / "out" / "grpo_cache" / "model.json").exists()


@pytest.mark.starts_process
def test_the_last_call_checks_unpacks_and_runs_with_the_bundle_on_the_path(tmp_path):
    """scripts/gpu_bundle_go.sh on a stand-in bundle of two calls: call 1's part staged first, then the
    last call checks both, unpacks and imports from the bundle; a corrupt part stops it (exit 3)."""
    (tmp_path / "site" / "bundled").mkdir(parents=True)
    (tmp_path / "site" / "bundled" / "__init__.py").write_text("VALUE = 'from the bundle'\n")
    (tmp_path / "site" / "filler.bin").write_bytes(os.urandom(300_000))  # incompressible: two parts
    pack({"site": tmp_path / "site"}, tmp_path / "payload.tar.xz")
    split(tmp_path / "payload.tar.xz", tmp_path / "bundle", part_bytes=200_000, carry_bytes=2 * MiB)
    stage, site, out = tmp_path / "stage", tmp_path / "unpacked", tmp_path / "out"
    env = {**os.environ, "GPU_STAGE": str(stage), "GPU_SITE": str(site), "OUT": str(out)}
    stage.mkdir()
    for part in (tmp_path / "bundle" / "call1").glob("part.*"):  # what call 1's command does
        (stage / part.name).write_bytes(part.read_bytes())
    go = [str(ROOT / "scripts" / "gpu_bundle_go.sh"), str(tmp_path / "bundle" / "call2"),
          sys.executable, "-c", "import bundled; print(bundled.VALUE)"]
    done = subprocess.run(["bash", *go], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "from the bundle" in done.stdout and "rc=0" in done.stdout
    assert (out / "manifest.json").exists() and (out / "go.log").exists()
    (stage / "part.00").write_bytes(b"corrupt")
    again = subprocess.run(["bash", *go], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 3 and "STAGE LOST" in again.stdout


def test_a_bundle_without_the_trainers_wheels_is_refused_with_the_command_that_builds_them(tmp_path):
    """scripts/gpu_vllm_run.sh installs hydra, omegaconf, deepspeed and peft from the bundle's
    trainer_wheels/ (the image lacks them): a bundle built with `--add dist/wheels`, as the docs once
    said, failed every grpo step on the lent GPU."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with pytest.raises(SystemExit, match=r"no --add folder is named trainer_wheels.*pip wheel --no-deps -w "
                                         r"dist/trainer_wheels hydra-core==\S+ omegaconf==\S+ .*peft==\S+`"):
        gpu_bundle.check_trainer_wheels([wheels])
    trainer = tmp_path / "trainer_wheels"
    trainer.mkdir()
    for name in ("hydra_core-1.3.8", "omegaconf-2.3.1", "antlr4_python3_runtime-4.9.3", "deepspeed-0.19.8", "hjson-3.1.0"):
        (trainer / f"{name}-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(SystemExit, match="has no wheel of peft"):
        gpu_bundle.check_trainer_wheels([trainer, wheels])
    (trainer / "peft-0.21.2-py3-none-any.whl").write_bytes(b"")
    gpu_bundle.check_trainer_wheels([trainer, wheels])


def test_a_call_folder_over_the_carry_is_refused_the_last_one_too(tmp_path):
    """The carry check counts every file in each call folder, the last one's checksums and manifest
    included: a stale 1.6 MiB file left in call2 puts it at 2.1 MiB, over a 2 MiB carry (by 0.1 MiB,
    so a check loosened by a MiB passes it), and so does a stale file in call1."""
    payload = tmp_path / "payload.tar.xz"
    payload.write_bytes(os.urandom(MiB + MiB // 2))  # two parts: 1 MiB and 0.5 MiB
    for stale_in in ("call2", "call1"):
        out = tmp_path / stale_in
        (out / stale_in).mkdir(parents=True)
        (out / stale_in / "left_over.bin").write_bytes(b"x" * (MiB + 6 * MiB // 10))
        with pytest.raises(ValueError, match=f"{stale_in} holds .* bytes, over the {2 * MiB} one call carries"):
            split(payload, out, part_bytes=MiB, carry_bytes=2 * MiB)
    assert len(split(payload, tmp_path / "clean", part_bytes=MiB, carry_bytes=2 * MiB)["calls"]) == 2


def test_the_carry_is_what_a_call_leaves_after_the_checkout():
    """A call takes 64 MiB with the checkout's files, which had grown to 3.1 MiB (the carry was sized for
    2 MB: a 62 MiB folder beside it was 65.1 MiB). By value: the folder gets 64 MiB less the checkout
    and 1 MiB spare, a part 1 MiB less than that (at most 60 MiB); a checkout leaving under 8 MiB is refused."""
    assert gpu_bundle.carry_budget(3 * MiB) == (59 * MiB, 60 * MiB)
    assert gpu_bundle.carry_budget(MiB // 2) == (PART_BYTES, 62 * MiB + MiB // 2) and PART_BYTES == 60 * MiB
    with pytest.raises(SystemExit, match="the checkout holds 57.0 MiB of files a call copies"):
        gpu_bundle.carry_budget(57 * MiB)
    assert CALL_BYTES == 64 * MiB


def test_the_checkout_a_call_copies_is_its_tracked_and_unignored_files(tmp_path):
    """What the device copies beside a carried folder: tracked files and untracked ones git does not
    ignore (a scratch repository: 6 + 1000 + 300 bytes counted, the ignored 5000 not, a deleted tracked
    file not); no repository: refused with what to do."""
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path / "repo", check=True, capture_output=True)

    (tmp_path / "repo").mkdir()
    git("init", "-q")
    (tmp_path / "repo" / ".gitignore").write_text("dist/\n")
    (tmp_path / "repo" / "a.py").write_bytes(b"x" * 1000)
    (tmp_path / "repo" / "gone.py").write_bytes(b"x" * 77)
    git("add", ".gitignore", "a.py", "gone.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    (tmp_path / "repo" / "gone.py").unlink()
    (tmp_path / "repo" / "new.txt").write_bytes(b"y" * 300)
    (tmp_path / "repo" / "dist").mkdir()
    (tmp_path / "repo" / "dist" / "part.00").write_bytes(b"z" * 5000)
    assert gpu_bundle.checkout_bytes(tmp_path / "repo") == 1306
    (tmp_path / "plain").mkdir()
    with pytest.raises(SystemExit, match="build it from a git clone of the project"):
        gpu_bundle.checkout_bytes(tmp_path / "plain")


def test_the_calls_are_refused_once_the_checkout_outgrew_the_bundle(tmp_path, capsys):
    """`calls` checks each folder with the checkout as it is now: a bundle built for a 3 MiB checkout
    (a 60 MiB folder) fails on the device if the checkout is 5 MiB by the time of the calls."""
    payload = tmp_path / "payload.tar.xz"
    payload.write_bytes(b"p" * (3 * MiB))
    manifest = split(payload, tmp_path / "bundle", part_bytes=2 * MiB, carry_bytes=3 * MiB)  # folders of 2 and 1 MiB (+ sums)
    gpu_bundle.check_fits(tmp_path / "bundle", manifest, CALL_BYTES - 2 * MiB)  # call1 exactly at the limit
    with pytest.raises(SystemExit, match=r"call1 \(2.00 MiB\) with the checkout's 62.00 MiB is over the 64 MiB a call takes: rebuild"):
        gpu_bundle.check_fits(tmp_path / "bundle", manifest, CALL_BYTES - 2 * MiB + 1)
