"""`python -m grpo.bench run` (the default): rollout throughput and the step-time breakdown per backend
(for `remote` a local `grpo.serve` started first), weight-sync cost per bucket size, step time per
parallel strategy (`single` as one process, the others as 2 torchrun processes), and ZeRO-3's gather
cost against bucket size (grpo/bench/sync.py)."""

from __future__ import annotations

import contextlib

import torch

from grpo.bench.runs import bench_backend, bench_parallel, peak_rss_mb, served, tiny_model_path
from grpo.bench.sync import bench_sync, bench_zero3_sync


def report_run(backends: list[str], steps: int, sync_repeats: int, strategies: list[str], zero3_buckets: list[float],
               overrides: list[str]) -> tuple[dict, list]:
    """(the JSON report, the sections to print) of the default bench."""
    step_rows, sync = [], []
    for b in backends:
        with served(tiny_model_path()) if b == "remote" else contextlib.nullcontext() as url:
            step_rows.append(bench_backend(b, steps, overrides, url))
            if b != "hf":  # hf shares the trainer's module: nothing is sent
                sync += bench_sync(b, [0, 0.25, 64], sync_repeats, url)
    parallel = [bench_parallel(s, steps, overrides) for s in strategies]
    zero3 = bench_zero3_sync(zero3_buckets) if zero3_buckets else []
    report = {"steps": step_rows, "sync": sync, "parallel": parallel, "zero3_sync": zero3, "peak_rss_mb": peak_rss_mb(),
              "threads": torch.get_num_threads()}
    sections = []
    if step_rows:
        sections.append(("rollout and step time (tiny model, 512 completions per step)", step_rows,
                         ["backend", "gen_tokens_per_s", "step_s", "generate_s", "score_s", "update_s", "sync_s"]))
    if sync:
        sections.append(("weight sync (median of repeats)", sync, ["backend", "bucket_mb", "tensors", "model_mb", "sync_s", "mb_per_s"]))
    if parallel:
        sections.append(("step time per strategy (rollout=hf; single is 1 process, the others 2)", parallel,
                         ["strategy", "procs", "step_s", "generate_s", "update_s", "sync_s"]))
    if zero3:
        sections.append((f"ZeRO-3 gather of a {zero3[0]['model_mb']:.0f} MB model on 2 ranks, per bucket size (rank 0; "
                         f"largest tensor {zero3[0]['largest_tensor_mb']:.0f} MB)", zero3,
                         ["bucket_mb", "gather_s", "mb_per_s", "peak_above_rest_mb"]))
    sections.append(f"\npeak RSS {report['peak_rss_mb']:.0f} MB")
    return report, sections
