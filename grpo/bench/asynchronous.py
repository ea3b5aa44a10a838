"""`python -m grpo.bench async`: step time with asynchronous rollouts (algo.max_staleness 0, 1, 2;
rollout=dedicated, then remote) and their learning side by side (k = 0 against k = 1)."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time

from grpo.bench.runs import QUIET, backend_overrides, compose, metrics_rows, pinned, served, tiny_model_path
from grpo.rollout.dedicated import split_cpus
from grpo.train import train


def bench_async(steps: int, learn_steps: int, engine_cores: int, extra: list[str]) -> tuple[list[dict], list[dict]]:
    """algo.max_staleness k = 0, 1, 2 with rollout=dedicated, then with rollout=remote (a local
    `grpo.serve`): the same model, task and batch, one after another in this process (each starts its
    own engine), timed over the steps after the first. With `engine_cores` > 0 the engine gets the last
    that many CPUs and the trainer the rest (`rollout.dedicated.cpu_cores`; for remote the server and
    this process are pinned the same way), as reserved GPUs would be. Then the default task learned
    with k = 0 and k = 1 through rollout=dedicated for the same steps (0: no learning run)."""
    # k = 0 is the synchronous loop exactly; k >= 1 its stale batches clipped around the sampler
    # (algo.trust_region=auto); the overrides may change both
    common = [*QUIET, "export_model=false", *extra]
    dedicated = ["rollout=dedicated", f"rollout.dedicated.cpu_cores={engine_cores}"]
    training_cpus, engine_cpus = split_cpus(sorted(os.sched_getaffinity(0)), engine_cores) if engine_cores else (None, None)
    timing, learning = [], []
    for backend in ("dedicated", "remote"):
        with served(tiny_model_path(), cpus=engine_cpus) if backend == "remote" else contextlib.nullcontext() as url:
            for k in (0, 1, 2):
                run_dir = tempfile.mkdtemp(prefix=f"bench-async-{backend}{k}-")
                overrides = dedicated if backend == "dedicated" else backend_overrides("remote", url)
                print(f"bench: rollout={backend} algo.max_staleness={k}, {steps} steps", flush=True)
                t0 = time.perf_counter()
                with pinned(training_cpus if backend == "remote" else None):
                    train(compose([*common, *overrides, f"algo.max_staleness={k}", f"steps={steps}", f"run_dir={run_dir}"]))
                rows = metrics_rows(run_dir)
                mean = lambda key: statistics.mean(r[key] for r in rows)  # noqa: E731
                timing.append({"backend": backend, "max_staleness": k, "steps_timed": len(rows), "step_s": mean("step_s"),
                               "wait_for_data_s": mean("time/wait_for_data_s"), "score_s": mean("time/score_s"),
                               "update_s": mean("time/update_s"), "sync_s": mean("time/sync_s"),
                               "engine_wait_s": mean("time/engine_wait_s"), "staleness": mean("async/staleness_mean"),
                               "sampler_kl": mean("sampler_kl"), "wall_s": time.perf_counter() - t0})
    for row in timing:
        row["speedup"] = next(r["step_s"] for r in timing if r["backend"] == row["backend"]) / row["step_s"]
    for k in (0, 1) if learn_steps else ():
        run_dir = tempfile.mkdtemp(prefix=f"bench-async-learn{k}-")
        print(f"bench: learning with algo.max_staleness={k}, {learn_steps} steps", flush=True)
        summary = train(compose([*common, *dedicated, f"algo.max_staleness={k}", f"steps={learn_steps}", f"run_dir={run_dir}"]))
        learning.append({"max_staleness": k, "steps": learn_steps, "eval_before": summary["eval_before"],
                         "eval_after": summary["eval_after"], "eval_gain": summary["eval_gain"], "wall_s": summary["wall_s"]})
    return timing, learning


def report_async(steps: int, learn_steps: int, engine_cores: int, overrides: list[str]) -> tuple[dict, list]:
    timing, learning = bench_async(steps, learn_steps, engine_cores, overrides)
    sections = [(f"asynchronous rollouts, engine on {engine_cores or 'all shared'} CPU(s) (means over the steps after the first)",
                 timing, ["backend", "max_staleness", "step_s", "speedup", "wait_for_data_s", "score_s", "update_s", "sync_s",
                          "engine_wait_s", "staleness", "sampler_kl", "wall_s"])]
    if learning:
        sections.append(("learning the default task, the same steps", learning,
                         ["max_staleness", "steps", "eval_before", "eval_after", "eval_gain", "wall_s"]))
    return {"async": timing, "async_learning": learning}, sections
