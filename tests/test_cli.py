"""Every entry point answers `--help` with a usage text and exit 0, and `grpo.train`'s lists options only."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

ENTRY_POINTS = [  # update when adding a module with `if __name__ == "__main__"`: the count catches a missed one
    "grpo.bench",
    "grpo.bench_memory",
    "grpo.bench_warm_start",
    "grpo.bench_zero3",
    "grpo.doctor",
    "grpo.eval",
    "grpo.launch",
    "grpo.plot",
    "grpo.rollout.reaper",
    "grpo.serve",
    "grpo.train",
]


def test_entry_points_are_all_counted():
    found = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "grpo").rglob("*.py")
                   if 'if __name__ == "__main__"' in p.read_text())
    assert found == ENTRY_POINTS and len(found) == 11


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_shows_a_usage_and_exits_0(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: "), out.stdout[:500]
    if module == "grpo.train":  # the groups' options, not the schemas behind them (`algo=base_algo` composed bare)
        assert "algo: cispo, dapo, dr_grpo, grpo, gspo, reinforce_pp, rloo" in out.stdout
        assert "base_" not in out.stdout and "docs/troubleshooting.md" in out.stdout
