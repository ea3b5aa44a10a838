"""Plots from metrics.jsonl: the series they draw, `python -m grpo.plot`, and the notebook executed
on a run the test makes (so it cannot rot unnoticed)."""

import json
import math

import pytest

from grpo.plot import PANELS, load_metrics, main, run_label, series, write_plots
from tests.conftest import ROOT

ROWS = [
    {"step": 0, "eval/accuracy": 0.25},
    {"step": 1, "reward/mean": 0.5, "kl": 0.0, "completion_len": 4.0, "clip_frac": 0.0, "tokens_per_s": 100.0},
    {"step": 2, "reward/mean": math.nan, "kl": 0.01, "completion_len": 3.5, "clip_frac": 0.1, "tokens_per_s": 120.0},
    {"step": 2, "eval/accuracy": 0.5},  # the final evaluation shares the last step
]


def write_run(folder, rows=ROWS):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def test_series_keeps_the_rows_that_hold_a_number():
    assert series(ROWS, "eval/accuracy") == ([0, 2], [0.25, 0.5])
    assert series(ROWS, "reward/mean") == ([1], [0.5])  # NaN (no completion scored) is left out
    assert series(ROWS, "entropy") == ([], [])


def test_run_label():
    assert run_label("/x/outputs/2026-11-22/17-03-13") == "2026-11-22/17-03-13"  # Hydra's date/time folders
    assert run_label("/x/outputs/smollm2/") == "smollm2"


def test_runs_with_the_same_folder_name_are_all_plotted(tmp_path):
    """lr1e-6/seed0 and lr3e-6/seed0 were both labelled seed0, and one of them vanished from every panel."""
    from grpo.plot import load_runs

    a, b = write_run(tmp_path / "lr1e-6" / "seed0"), write_run(tmp_path / "lr3e-6" / "seed0", ROWS[:2])
    c = write_run(tmp_path / "other")
    runs = load_runs([a, b, c])
    assert list(runs) == ["lr1e-6/seed0", "lr3e-6/seed0", "other"] and len(runs["lr3e-6/seed0"]) == 2


def test_an_empty_metrics_file_and_an_out_that_is_a_file_are_errors(tmp_path):
    """An empty metrics.jsonl (a run stopped before its first evaluation) gave 7 empty plots and exit 0;
    --out naming a file, a FileExistsError traceback."""
    run = write_run(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match=r"metrics.jsonl has no rows: the run logged nothing yet"):
        main([str(tmp_path / "empty")])
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit, match=r"^error: --out .*a_file: a file of that name exists; give a folder"):
        main([run, "--out", str(tmp_path / "a_file")])


def test_plot_command_writes_one_png_per_metric_and_an_overview(tmp_path):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", ROWS[:2])
    main([a, b, "--out", str(tmp_path / "plots")])
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert len(PANELS) == 6 and len(names) == 7
    assert names == sorted([k.replace("/", "_") + ".png" for k, _ in PANELS] + ["overview.png"])
    assert all((tmp_path / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)


def test_plot_command_names_a_folder_without_metrics(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl does not exist"):
        main([str(tmp_path)])


@pytest.mark.starts_process
def test_notebook_runs_on_a_fresh_run(make_cfg, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    from grpo.train import train

    train(make_cfg("steps=2", "eval_every=1"))
    run = tmp_path / "run"
    monkeypatch.setenv("GRPO_RUNS", str(run))
    nb = nbformat.read(ROOT / "notebooks" / "runs.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1 + len(PANELS)  # the overview, then one per metric
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "run: step 0 " in printed and "-> step 2 " in printed  # before, after (the step-1 eval in between)
    assert len(write_plots([str(run)], str(tmp_path / "png"))) == 7  # and the command's PNGs from the same run


def test_a_half_written_last_line_is_left_out_with_a_warning(tmp_path):
    """A run killed while writing a row leaves half a line: it was a JSONDecodeError traceback."""
    run = write_run(tmp_path / "run")
    with open(f"{run}/metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')
    with pytest.warns(UserWarning, match=rf"{run}/metrics.jsonl:5: the last line is not a whole JSON row"):
        assert json.dumps(load_metrics(run)) == json.dumps(ROWS)  # (NaN != NaN: compared as text)


def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path):
    run = write_run(tmp_path / "run")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("".join([lines[0], "not json\n", *lines[1:]]))
    with pytest.raises(SystemExit, match=rf"error: {run}/metrics.jsonl:2: not a JSON row \(Expecting value\)"):
        main([run, "--out", str(tmp_path / "plots")])
