"""The benches' temporary files: one folder per bench command, removed at its end."""

import getpass
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grpo.bench.report import KEPT, scratch


@pytest.fixture
def short_tmp():
    """A temporary directory short enough for vLLM's sockets (pytest's tmp_path is too deep)."""
    folder = tempfile.mkdtemp(prefix="grpo-test-", dir="/tmp")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.starts_process
def test_a_bench_commands_temporary_files_and_its_childrens_go_in_one_folder_removed_at_its_end(short_tmp, monkeypatch):
    """Every bench left its run folders (a checkpoint and an exported model each: gigabytes on a real
    model) in /tmp, and its servers' vLLM sockets and FileStore files, 8 a start. Inside `scratch`
    tempfile and the children's TMPDIR point into one folder, gone at the end with everything in it;
    the compile cache and KEPT (where the MFU bench keeps the folders its report names) stay outside."""
    tmp_path = short_tmp
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)
    with scratch() as folder:
        assert os.path.dirname(folder) == str(tmp_path) and KEPT == [str(tmp_path)]
        run_dir = tempfile.mkdtemp(prefix="bench-hf-")
        open(os.path.join(run_dir, "model.safetensors"), "w").close()
        child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='vllm_dist_'))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        assert os.path.dirname(run_dir) == folder and os.path.dirname(child) == folder
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / f"torchinductor_{getpass.getuser()}")
    assert not os.path.exists(folder) and set(os.listdir(tmp_path)) <= {f"torchinductor_{getpass.getuser()}"}
    assert os.environ["TMPDIR"] == str(tmp_path) and "TORCHINDUCTOR_CACHE_DIR" not in os.environ and KEPT == []
    assert tempfile.gettempdir() == str(tmp_path)


def test_a_scratch_folder_falls_back_to_tmp_where_vllms_sockets_would_not_fit(short_tmp, monkeypatch):
    """An engine's TMPDIR under pytest's deep folder failed its start: ZMQ's "ipc path ... is longer than
    107 characters". Where a uuid-named socket would not fit, the folder is made in /tmp instead."""
    from grpo.scratch import SOCKET_PATH_MAX, scratch_folder

    short = short_tmp
    deep = short_tmp / ("d" * (SOCKET_PATH_MAX - 40 - len(str(short_tmp))))  # fits a socket, not the folder and one
    deep.mkdir()
    for base, parent in ((short, str(short)), (deep, "/tmp")):
        monkeypatch.setattr(tempfile, "tempdir", str(base))
        folder = scratch_folder("grpo-engine-")
        os.rmdir(folder)
        assert os.path.dirname(folder) == parent


def test_environ_kept_puts_back_what_was_there_even_when_the_block_raises(monkeypatch):
    """grpo/scratch.py `environ_kept` (own_tmpdir's TMPDIR and compile cache, an engine's VLLM_RPC_BASE_PATH):
    a key that was set gets its value back, one that was unset is unset again, after a raise too."""
    from grpo.scratch import environ_kept

    monkeypatch.setenv("GRPO_TEST_SET", "before")
    monkeypatch.delenv("GRPO_TEST_UNSET", raising=False)
    with pytest.raises(RuntimeError), environ_kept("GRPO_TEST_SET", "GRPO_TEST_UNSET"):
        os.environ.update(GRPO_TEST_SET="inside", GRPO_TEST_UNSET="inside")
        raise RuntimeError
    assert os.environ["GRPO_TEST_SET"] == "before" and "GRPO_TEST_UNSET" not in os.environ


@pytest.mark.parametrize("rows", [1, 6])
def test_zero3_memory_refuses_rows_that_are_not_whole_groups(rows):
    """`grpo.bench zero3-memory --rows 1` ran a rank's one completion as a group of 4 and reported a
    nan KL and loss; rows that are not whole groups are refused, naming a number that is, before any
    process starts."""
    from grpo.bench.zero3 import bench_zero3_memory
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--rows \d: .* whole groups of 4 .* e\.g\. --rows 4"):
        bench_zero3_memory(rows)
