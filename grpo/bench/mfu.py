"""`python -m grpo.bench mfu`: each phase's seconds, FLOPs, tokens/s and model FLOPs utilisation (MFU)
for short trainings side by side (the default run and SmolLM2 on arithmetic, or any run folders given
with `--run-dir`), from the step metrics every run logs (grpo/mfu.py), and what bounds the step: its
counted FLOPs over the measured peak (the arithmetic bound) against its seconds.

Means over the steps after the first (it carries warm-ups); MFU of a phase = its FLOPs over its
seconds over the best of the peaks the run measured at its start and its end and its fastest phase (grpo/peak.py: on
shared 2-core machines it varies by about +-25% between processes and over minutes, so compare runs
as ratios, measured in one command). The runs it trains keep their metrics and summary in the folder
it prints; their checkpoints (1.6 GB for SmolLM2 with AdamW's state) are deleted once read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile

from grpo.bench.report import KEPT
from grpo.bench.runs import QUIET, compose, metrics_rows

WORKLOADS = {
    "default": [],  # the tiny model on the default task
    # SmolLM2-135M (fp32) on one-digit arithmetic; the held-out evaluation cut to 8 questions
    "smollm2": ["experiment=smollm2_arithmetic_cpu", "eval_every=0", "task.eval_size=8", "logger.sample_every=0"],
}
PHASES = ("generate", "score", "sleep", "update", "sync")  # sleep: a colocated engine freeing its memory (GPU)


def phase_rows(run_dir: str) -> tuple[list[dict], dict]:
    """(one row per phase, the step's row) for a finished run folder."""
    rows = metrics_rows(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}: no timed step in metrics.jsonl (the first step is not timed: run 2 or more)")
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    # the best of the run's measurements (its start, its end, its fastest phase): the machine's cores, less
    # what another tenant took at either moment; the steps' own mfu/ are against the start's, raised by a faster phase
    # rank 0's device; the ranks' flops/* are summed (grpo.metrics.reduce_metrics), so against every rank's device
    peak = max(summary["peak_tflops_measured"], summary.get("peak_tflops_at_end") or 0.0,
               summary.get("peak_tflops_achieved") or 0.0) * 1e12 * summary.get("world_size", 1)
    # over the steps that measured it: a step whose groups were all flat trained nothing, its update/real_token_frac is NaN
    mean = lambda k: statistics.mean([v for r in rows if math.isfinite(v := r.get(k, 0.0))] or [math.nan])  # noqa: E731
    out = []
    for phase in PHASES:
        seconds, flops = mean(f"time/{phase}_s"), mean(f"flops/{phase}")
        # generation's work over the engines' seconds on the batch (with algo.max_staleness the trainer's
        # wait for it is not its generation)
        busy = mean("time/batch_generate_s") if phase == "generate" and "time/batch_generate_s" in rows[0] else seconds
        row = {"phase": phase, "seconds": seconds, "share": seconds / mean("step_s"), "gflop": flops / 1e9,
               "tflops": flops / busy / 1e12 if busy and flops else None,
               "mfu": flops / busy / peak if busy and flops else None}
        if phase == "generate":
            row["tokens_per_s"] = mean("gen_tokens_per_s")
            if not any("mfu/generate" in r for r in rows):
                row["mfu"] = None  # the engines ran elsewhere (dedicated, remote): not this device's
        if phase == "update":
            row["tokens_per_s"] = mean("update_tokens_per_s")
            row["real_token_frac"] = mean("update/real_token_frac")
        out.append(row)
    counted = mean("flops/update") + (mean("flops/generate") if any("mfu/generate" in r for r in rows) else 0.0)
    step = {"step_s": mean("step_s"), "bound_s": counted / peak, "peak_tflops": peak / 1e12, "ranks": summary.get("world_size", 1),
            "mfu_step": counted / mean("step_s") / peak, "steps_timed": len(rows), "layout": rows[-1].get("layout")}
    step["step_over_bound"] = step["step_s"] / step["bound_s"] if step["bound_s"] else None
    return out, step


def report_mfu(workloads: list[str], steps: int, run_dirs: list[str], overrides: list[str]) -> tuple[dict, list]:
    from grpo.train import train  # lazy: heavy

    folders = [(os.path.basename(os.path.normpath(d)), d) for d in run_dirs]
    for name in workloads:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
        run_dir = tempfile.mkdtemp(prefix=f"bench-mfu-{name}-", dir=(KEPT or [None])[0])  # named in the report: kept
        print(f"bench: mfu of {name}, {steps} steps ({run_dir})", flush=True)
        train(compose([*WORKLOADS[name], f"steps={steps}", *QUIET, f"run_dir={run_dir}", "export_model=false", *overrides]))
        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)  # the last step's, never read here
        folders.append((name, run_dir))
    report, sections = {"runs": []}, []
    for name, run_dir in folders:
        phases, step = phase_rows(run_dir)
        report["runs"].append({"name": name, "run_dir": run_dir, "phases": phases, **step})
        summed = f" (summed over {step['ranks']} ranks)" if step["ranks"] > 1 else ""
        sections.append((f"{name}: {step['steps_timed']} steps timed, layout {step['layout']}, peak {step['peak_tflops']:.3g} "
                         f"TFLOP/s measured{summed}; step {step['step_s']:.3f} s against its arithmetic bound {step['bound_s']:.3f} s "
                         f"({step['step_over_bound']:.1f}x), step MFU {step['mfu_step']:.1%}", phases,
                         ["phase", "seconds", "share", "gflop", "tflops", "mfu", "tokens_per_s", "real_token_frac"]))
    return report, sections
