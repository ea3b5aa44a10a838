"""Every entry point answers `--help` with a usage text and exit 0, and `grpo.train`'s lists options only."""

import subprocess
import sys

import pytest

from grpo import bench
from grpo.cli import exit_on_user_error
from grpo.config import compose_config
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
    "grpo.bench.zero3_head",
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


@pytest.mark.parametrize("override, says", [
    ("algo.lr=abc", "Error merging override algo.lr=abc (Value 'abc' of type 'str' could not be converted to Float"),
    # Hydra's own advice for a typo'd key, `+algo.lrr=1`, is then refused by validate (a key no code reads)
    ("algo.lrr=1", "algo.lrr is not a setting of algo (did you mean algo.lr?)."),
    ("algo.lerning_rate=1e-6", "algo.lerning_rate is not a setting of algo (did you mean algo.lr?)."),
    ("rollout.remote.nodes=2", "rollout.remote.nodes is not a setting of rollout.remote (its settings: "),
    # one URL without brackets: "str is not a ListConfig"
    ("rollout.remote.urls=http://node7:8000", "rollout.remote.urls takes a list: write rollout.remote.urls=[http://node7:8000]"),
    ("rollout=vllm", "Could not find 'rollout/vllm' Available options in 'rollout': colocated dedicated hf remote"),
])
def test_an_override_hydra_cannot_apply_is_one_line(override, says):
    """`python -m grpo.verify algo.lr=abc` (and the bench's overrides) ended in a 20-36 frame traceback whose last line
    was only "Error merging override algo.lr=abc": every command line's `exit_on_user_error` now ends it with Hydra's
    words and their cause, one line, without Hydra's search path."""
    with pytest.raises(SystemExit) as e:
        exit_on_user_error(compose_config, [override])
    assert e.value.code.startswith(f"error: ") and says in e.value.code, e.value.code
    assert "\n" not in e.value.code and "search path" not in e.value.code


@pytest.mark.parametrize("option, text, says", [
    ("experiment=mine", "# @package _global_\nalgo:\n  lerning_rate: 1e-6\n",
     "'experiment/mine' sets algo.lerning_rate, which is not a setting of algo (did you mean algo.lr?); fix that file"),
    ("experiment=mine", "# @package _global_\nrollout:\n  vllm:\n    memory_fracton: 0.5\n",
     "sets rollout.vllm.memory_fracton, which is not a setting of rollout.vllm (did you mean rollout.vllm.memory_fraction?)"),
    ("experiment=mine", "# @package _global_\nstepz: 2\n", "sets stepz, which is not a setting of the config (did you mean steps?)"),
    ("algo=mine", "defaults:\n  - grpo\nlerning_rate: 1e-6\n", "'algo/mine' sets algo.lerning_rate"),
    # in a list's entry Hydra's full_key is the key alone: the root's settings were listed, not the entry's
    ("experiment=mine", "# @package _global_\nreward:\n  funcs:\n    - {name: exact_match, wieght: 1.0}\n",
     "'experiment/mine' sets wieght in an entry of reward.funcs, which has no such setting (did you mean weight?); "
     "fix that file"),
])
def test_a_typod_key_in_a_config_file_names_the_file_and_the_setting_it_meant(tmp_path, option, text, says):
    """A typo inside one's own experiment or option file got Hydra's raw words ("ConfigKeyError raised while
    composing config: Key 'lerning_rate' not in 'AlgoConfig' full_key: ... reference_type=AlgoConfig ..."), with
    no hint of the setting meant, as the command line gets."""
    group = option.split("=")[0]
    (tmp_path / group).mkdir()
    (tmp_path / group / "mine.yaml").write_text(text)
    with pytest.raises(SystemExit) as e:
        exit_on_user_error(compose_config, [option, f"hydra.searchpath=[file://{tmp_path}]"])
    assert e.value.code.startswith("error: ") and says in e.value.code and "\n" not in e.value.code, e.value.code


@pytest.mark.starts_process
@pytest.mark.parametrize("module", ["grpo.train", "grpo.eval"])
def test_a_typod_key_on_a_hydra_apps_command_line_gets_the_setting_it_meant(module):
    """Hydra composes inside @hydra.main and printed its own advice, `+algo.lerning_rate=1e-6`, which
    validate then refuses: the overrides are composed first, and the mistake answered in one line."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-m", module, "algo.lerning_rate=1e-6"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        "error: algo.lerning_rate is not a setting of algo (did you mean algo.lr?)."), out.stderr[-1500:]


def test_a_sweep_without_the_flag_is_left_to_hydra():
    """`hydra.mode=MULTIRUN algo.lr=1e-3,2e-3` is a sweep with no -m: composing it first refused it
    ("Ambiguous value"); Hydra runs it."""
    from grpo.cli import compose_first

    assert exit_on_user_error(compose_first, ["hydra.mode=MULTIRUN", "algo.lr=1e-3,2e-3"]) is None
    assert exit_on_user_error(compose_first, ["algo.lr=1e-3", "steps=3"]) is None
    with pytest.raises(SystemExit, match="did you mean algo.lr"):
        exit_on_user_error(compose_first, ["algo.lerning_rate=1e-3"])


def test_a_typod_launch_key_is_answered_before_hydra_advises_a_plus():
    from grpo.errors import ConfigError
    from grpo.launch import parse_args

    with pytest.raises(ConfigError, match=r"^nodse=2: nodse is neither a key of grpo.launch nor a setting of grpo.train "
                                          r"\(did you mean nodes\?\)\.$"):
        parse_args(["nodse=2"])
    assert parse_args(["nodes=2", "steps=3", "model=tiny", "seed=1"])[2] == ["steps=3", "model=tiny", "seed=1"]


@pytest.mark.parametrize("argv, says", [
    (["rnu"], "unknown command 'rnu': choose from run, async, lora,"),
    (["run", "--zero3-buckets", "16,abc"], "argument --zero3-buckets: 'abc' is not a number: give sizes in MB"),
    (["warm-start", "--seeds", "a"], "argument --seeds: 'a' is not a whole number: give whole numbers"),
    (["run", "--backends", "hf,vlm"], "argument --backends: 'vlm' is not one of colocated, dedicated, hf, remote"),
    (["run", "--parallel", "zero4"], "argument --parallel: 'zero4' is not one of ddp, single, zero2, zero3, zero3_offload"),
    (["sequence-memory", "--sizes", "1,two"], "argument --sizes: 'two' is not a whole number"),
])
def test_a_bad_bench_command_or_list_is_a_usage_error(argv, says, capsys):
    """Refused at parsing, before any benchmark trains: `rnu` was taken for a Hydra override (a traceback), a csv
    list's bad item a ValueError traceback, `--backends vlm` a Hydra error after the backends before it were timed."""
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_bench_lists_parse_by_value():
    args = bench.build_parser().parse_args(["run", "--backends", "", "--zero3-buckets", "16, 64.5", "--parallel", "zero3_offload"])
    assert (args.backends, args.zero3_buckets, args.parallel) == ([], [16.0, 64.5], ["zero3_offload"])
    assert bench.build_parser().parse_args(["run"]).backends == ["hf", "colocated", "dedicated", "remote"]
    assert bench.build_parser().parse_args(["warm-start", "--seeds", "3,1"]).seeds == [3, 1]


def test_a_bench_override_hydra_cannot_apply_fails_before_any_benchmark(capsys):
    """`python -m grpo.bench run algo.lr=abc` (and an override with no command) is composed before the first training."""
    for argv in (["run", "--backends", "hf", "algo.lr=abc"], ["algo.lr=abc"]):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code.startswith("error: Error merging override algo.lr=abc (Value 'abc'"), e.value.code
        assert "bench:" not in capsys.readouterr().out  # no training started


def test_ddp_on_one_process_is_a_user_error_not_a_traceback():
    """`python -m grpo.train parallel=ddp` without torchrun ended in a 26-line traceback around the right words."""
    from grpo.errors import USER_ERRORS
    from grpo.parallel.ddp import DDPStrategy

    with pytest.raises(USER_ERRORS, match=r"parallel=ddp needs several processes: launch with `torchrun"):
        DDPStrategy(None, None, None, 1)
