"""`python -m grpo.verify`: every check passes on a healthy run, and a planted defect fails the check
that covers it, named (the 2-process runs: docs/verify.md)."""

import pytest

from tests.conftest import FAST

pytestmark = pytest.mark.filterwarnings("ignore")


def lines(capsys) -> dict[str, str]:
    out = capsys.readouterr().out
    return {ln.split()[1]: ln.split()[0] for ln in out.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP")}, out


def test_verify_passes_on_the_default_run(cache_dir, capsys):
    from grpo.verify import verify

    assert verify([*FAST, f"model.cache_dir={cache_dir}"]) == 0
    status, out = lines(capsys)
    assert {k for k, v in status.items() if v == "PASS"} >= {
        "sampler", "ratio", "reference", "layout/packed", "layout/shared", "micro-batches", "sync", "resume"}, out
    assert "the model ran shared" in out


def test_verify_names_a_planted_layout_defect(cache_dir, capsys, monkeypatch):
    """Shared rows whose first completion token is read one position late (a hidden_at off by one:
    the probes, which compare hidden states, cannot see it; the logprobs can)."""
    import grpo.logprobs
    from grpo.verify import verify

    real = grpo.logprobs.pack_shared

    def late(*a, **k):
        rows = real(*a, **k)
        row, col = rows.hidden_at
        rows.hidden_at = (row, (col + 1).clamp(max=rows.input_ids_RW.shape[1] - 1))
        return rows

    monkeypatch.setattr(grpo.logprobs, "pack_shared", late)
    assert verify([*FAST, f"model.cache_dir={cache_dir}"]) == 1
    status, out = lines(capsys)
    assert status["layout/shared"] == "FAIL" and status["layout/packed"] == "PASS", out
    assert "FAIL: " in out and "layout/shared" in out.splitlines()[-1]


def test_the_resume_check_skips_under_several_processes_after_the_group_is_gone():
    """grpo.verify runs its resume check after the process group is closed, when dist.world_size() says
    1 again: it must go by the launch's world size, or each torchrun rank would start a grpo.train that
    inherits the rank variables and waits in another's rendezvous (a hang seen under parallel=ddp)."""
    from grpo.verify import resume_check

    check = resume_check(["steps=1"], world_size=2)
    assert check.status == "SKIP" and "one process" in check.detail, check


def test_the_resume_checks_runs_get_no_rendezvous_of_this_process():
    """A one-process ZeRO or DDP verify holds a store on its MASTER_PORT; its resume runs must start
    their own (given it, they failed with EADDRINUSE on the first GPU run and on CPU)."""
    from grpo.verify import child_env

    env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1",
                     "LOCAL_RANK": "0", "PATH": "/bin", "GRPO_CACHE": "/c"})
    assert env == {"PATH": "/bin", "GRPO_CACHE": "/c"}
