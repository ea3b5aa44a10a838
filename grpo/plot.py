"""Plots of one or several runs from their `metrics.jsonl`: reward, held-out accuracy, KL, completion
length, clip fraction and throughput against the step, one line per run.

`python -m grpo.plot RUN_DIR... [--out DIR]` writes one PNG per metric and `overview.png` (all of
them in a grid) for people without Jupyter; notebooks/runs.ipynb draws the same figures with the same
functions. Figures are built with `matplotlib.figure.Figure`, not pyplot, so nothing depends on a
display or on global state; the command uses the Agg backend.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings

from grpo.errors import DatasetError

# (metric key in metrics.jsonl, title); the keys are the ones grpo.train and grpo.update log
PANELS = [
    ("reward/mean", "reward (mean)"),
    ("eval/accuracy", "held-out accuracy (greedy)"),
    ("kl", "KL to reference (k3; 0 when algo.beta=0)"),
    ("completion_len", "completion length (tokens)"),
    ("clip_frac", "clipped token fraction"),
    ("tokens_per_s", "tokens/s (whole step)"),
]


def load_metrics(run_dir: str) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl (one per step, plus evaluation rows). A last line that is not
    JSON is the half-written row of a run that was killed (or is still writing): left out, with a
    warning naming it. One anywhere else is a DatasetError naming the file and the line."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: is {run_dir!r} a run folder of grpo.train?")
    with open(path, encoding="utf-8") as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    rows = []
    for number, line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == lines[-1][0]:
                warnings.warn(f"{path}:{number}: the last line is not a whole JSON row (a run killed while writing "
                              f"it?); plotting the {len(rows)} row(s) before it.", stacklevel=2)
                break
            raise DatasetError(f"{path}:{number}: not a JSON row ({e.msg}); metrics.jsonl holds one JSON object per "
                               f"line: remove or repair that line.") from None
    if not rows:  # what a run that stopped before its first evaluation leaves: empty plots, exit 0, before
        raise DatasetError(f"{path} has no rows: the run logged nothing yet (it stopped, or is still starting).")
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold `key` with a number (NaN and None are left out)."""
    steps, values = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
            steps.append(row["step"])
            values.append(float(v))
    return steps, values


def run_label(run_dir: str) -> str:
    """A short name: the folder, and its parent for Hydra's `date/time` folders."""
    parts = os.path.normpath(os.path.abspath(run_dir)).split(os.sep)
    return "/".join(parts[-2:]) if parts[-1][:2].isdigit() else parts[-1]


def run_labels(run_dirs: list[str]) -> list[str]:
    """`run_label` of each, with parent folders added where two are the same (lr1e-6/seed0 and
    lr3e-6/seed0, not seed0 twice: one run would vanish from every panel)."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    depth = [run_label(d).count("/") + 1 for d in run_dirs]
    while True:
        labels = ["/".join(p[-k:]) for p, k in zip(parts, depth)]
        same = {label for label in labels if labels.count(label) > 1}
        longer = [i for i, label in enumerate(labels) if label in same and depth[i] < len(parts[i])]
        if not longer:  # unique, or one folder given twice
            return labels
        for i in longer:
            depth[i] += 1


def load_runs(run_dirs: list[str]) -> dict[str, list[dict]]:
    return {label: load_metrics(d) for label, d in zip(run_labels(run_dirs), run_dirs)}


def draw(ax, runs: dict[str, list[dict]], key: str, title: str) -> None:
    for label, rows in runs.items():
        steps, values = series(rows, key)
        if steps:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if not ax.lines:
        ax.text(0.5, 0.5, f"no {key!r} logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_metric(runs: dict[str, list[dict]], key: str, title: str | None = None):
    from matplotlib.figure import Figure  # matplotlib: optional (the plot extra)

    fig = Figure(figsize=(5, 3.2), layout="constrained")
    ax = fig.add_subplot()
    draw(ax, runs, key, title or key)
    if len(runs) > 1 and ax.lines:
        ax.legend(fontsize=7)
    return fig


def plot_overview(runs: dict[str, list[dict]]):
    """All PANELS in one 2 x 3 figure."""
    from matplotlib.figure import Figure  # matplotlib: optional (the plot extra)

    fig = Figure(figsize=(13, 7), layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    for ax, (key, title) in zip(axes, PANELS):
        draw(ax, runs, key, title)
    handles, labels = axes[0].get_legend_handles_labels()
    if len(runs) > 1 and handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)), fontsize=8)
    return fig


def file_name(key: str) -> str:
    return key.replace("/", "_") + ".png"


def write_plots(run_dirs: list[str], out_dir: str) -> list[str]:
    """One PNG per panel and overview.png in out_dir; returns the paths written."""
    runs = load_runs(run_dirs)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for key, title in PANELS:
        path = os.path.join(out_dir, file_name(key))
        plot_metric(runs, key, title).savefig(path, dpi=100)
        written.append(path)
    path = os.path.join(out_dir, "overview.png")
    plot_overview(runs).savefig(path, dpi=100)
    return written + [path]


def main(argv: list[str] | None = None) -> None:
    import matplotlib  # matplotlib: optional (the plot extra)

    matplotlib.use("Agg")
    parser = argparse.ArgumentParser(prog="python -m grpo.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="where the PNGs go (default: RUN_DIR/plots of the first run)")
    args = parser.parse_args(argv)
    try:
        paths = write_plots(args.run_dirs, args.out or os.path.join(args.run_dirs[0], "plots"))
    except FileExistsError as e:
        raise SystemExit(f"error: --out {e.filename}: a file of that name exists; give a folder for the PNGs.") from e
    except (FileNotFoundError, DatasetError) as e:
        raise SystemExit(f"error: {e}") from e
    print(f"wrote {len(paths)} plots to {os.path.dirname(paths[0])}")


if __name__ == "__main__":
    main()
