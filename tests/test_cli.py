"""Every entry point answers `--help` with a usage text and exit 0, and `grpo.train`'s lists options only."""

import subprocess
import sys

import pytest

from grpo import bench
from tests.conftest import ROOT

ENTRY_POINTS = [  # every module with `if __name__ == "__main__"`: one added and not listed here fails below
    "grpo.bench",
    "grpo.bench.lora",
    "grpo.bench.memory",
    "grpo.bench.packing",
    "grpo.bench.sequence",
    "grpo.bench.sync",
    "grpo.bench.warm_start",
    "grpo.bench.zero3",
    "grpo.doctor",
    "grpo.eval",
    "grpo.gpu_bundle",
    "grpo.launch",
    "grpo.library_logs",
    "grpo.plot",
    "grpo.rollout.reaper",
    "grpo.serve",
    "grpo.slurm",
    "grpo.train",
    "grpo.verify",
    "grpo.wheelhouse",
]


def test_entry_points_are_all_counted():
    found = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__main__")
                   for p in (ROOT / "grpo").rglob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    assert found == ENTRY_POINTS


@pytest.mark.starts_process
@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_shows_a_usage_and_exits_0(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: "), out.stdout[:500]
    if module == "grpo.train":  # the groups' options, not the schemas behind them (`algo=base_algo` composed bare)
        assert "algo: cispo, dapo, dr_grpo, grpo, gspo, reinforce_pp, rloo" in out.stdout
        assert "base_" not in out.stdout and "docs/troubleshooting.md" in out.stdout


def test_every_bench_command_has_its_own_help(capsys):
    """`python -m grpo.bench COMMAND --help`, in this process (the dispatcher imports no benchmark):
    each command's usage names it, and the top-level help lists them all."""
    assert set(bench.build_parser()._subparsers._group_actions[0].choices) == set(bench.COMMANDS)
    for argv in ([], *([name] for name in bench.COMMANDS)):
        with pytest.raises(SystemExit) as e:
            bench.main([*argv, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: python -m grpo.bench {argv[0] if argv else ''}".rstrip()), out[:300]
        if argv:  # the command's own options, its report in a file of its own
            assert "--out OUT" in out, out
            assert bench.build_parser().parse_args(argv).out == f"bench_results/{'bench' if argv[0] == 'run' else argv[0]}.json"
        if not argv:
            assert all(f"    {name}" in out for name in bench.COMMANDS), out


def test_the_old_bench_flags_name_their_command(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--warm-start", "--seeds", "0"])
    assert e.value.code == 2
    assert "python -m grpo.bench warm-start" in capsys.readouterr().err


def test_a_bench_too_short_to_time_is_refused_before_it_trains(capsys):
    """A run's first step is not timed (an episode run's last neither): `--steps 1` trained to the end and
    then failed on an empty mean (statistics.StatisticsError); now the usage error says why."""
    for argv, low in ((["run", "--steps", "1"], 2), (["episodes", "--steps", "2"], 3), (["mfu", "--steps", "1"], 2)):
        with pytest.raises(SystemExit) as e:
            bench.build_parser().parse_args(argv)
        assert e.value.code == 2
        assert f"argument --steps: {argv[-1]} is below {low}: the first" in capsys.readouterr().err
    assert bench.build_parser().parse_args(["episodes", "--steps", "3"]).steps == 3
