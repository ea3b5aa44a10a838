"""What the benches' short trainings share: the composed config, the tiny model's folder, a local
`grpo.serve` for the remote backend, CPU pinning, one timed training per backend or strategy, and
the timed rows of its metrics.jsonl."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from grpo import listeners
from grpo.config import compose_config
from grpo.cpus import set_num_threads
from grpo.log import read_metrics
from grpo.progress import WaitProgress
from grpo.rollout.dedicated import engine_exit, pinned_engine_env
from grpo.rollout.server_watch import wait_for_url
from grpo.tiny.folders import resolve_model_folder
from grpo.train import train

QUIET = ["checkpoint_every=0", "logger.log_every=1000", "logger.sample_every=0"]  # the bench prints its own tables


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compose(overrides: list[str]):
    return compose_config(overrides)


def tiny_model_path() -> str:
    return resolve_model_folder(compose(["run_dir=unused"]))


def backend_overrides(backend: str, url: str | None) -> list[str]:
    return [f"rollout={backend}"] + ([f"rollout.remote.urls=[{url}]"] if url else [])


def metrics_rows(run_dir: str) -> list[dict]:
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    return [r for r in rows if "step_s" in r][1:]  # the first step carries warm-ups


@contextlib.contextmanager
def served(model_path: str, timeout_s: float = 300, cpus: list[int] | None = None):
    """A local `grpo.serve` on `model_path` for the remote backend, on a port it finds free and listens
    on before it names it (its URL read from a folder of its own: server_watch.wait_for_url); yields its
    URL. With `cpus`, the server is pinned to them (its vLLM threads bound there), as
    `rollout.dedicated.cpu_cores` pins engines."""
    folder = tempfile.mkdtemp(prefix="grpo-bench-serve-")  # its URL file and its log
    log_path = os.path.join(folder, "serve.log")
    env = {**os.environ, **pinned_engine_env(cpus)}
    with open(log_path, "w") as log:
        # pinned by grpo.serve itself (--cpus), as dedicated's engines are: no preexec_fn, which is unsafe in
        # this threaded process (a child can deadlock between fork and exec)
        proc = subprocess.Popen([sys.executable, "-m", "grpo.serve", "--model", model_path, "--port", "0", "--url-dir", folder,
                                 "--max-model-len", "256", "--memory-fraction", "0.1",
                                 *(["--cpus", ",".join(map(str, cpus))] if cpus else [])],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.time() + timeout_s
        url = wait_for_url(folder, timeout_s, lambda: engine_exit(proc, log_path), f"grpo.serve on {model_path}")
        listeners.expect_served(proc.pid, url, "the bench's grpo.serve")
        progress = WaitProgress(f"grpo.serve at {url} to answer /health", timeout_s)
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if (gone := engine_exit(proc, log_path)) or time.time() > deadline:
                    raise RuntimeError(f"grpo.serve on {model_path} did not start: "
                                       f"{gone or f'no answer to /health within {timeout_s:.0f} s'}") from None
                progress()
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # its group, whose leader may have exited already
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def pinned(cpus: list[int] | None):
    """This process on `cpus` (one torch thread each) for the block, then as before; None: unchanged."""
    if not cpus:
        yield
        return
    before, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    set_num_threads(len(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        set_num_threads(threads)


def bench_backend(backend: str, steps: int, extra: list[str], url: str | None = None) -> dict:
    """A short training of the default run through `backend`, in this process: its mean step times."""
    run_dir = tempfile.mkdtemp(prefix=f"bench-{backend}-")
    cfg = compose([*backend_overrides(backend, url), f"steps={steps}", *QUIET, f"run_dir={run_dir}", *extra])
    print(f"bench: rollout={backend}, {steps} steps", flush=True)
    train(cfg)
    rows = metrics_rows(run_dir)
    mean = lambda k: statistics.mean(r[k] for r in rows)  # noqa: E731
    return {
        "backend": backend,
        "steps_timed": len(rows),
        "gen_tokens_per_s": mean("gen_tokens_per_s"),
        "step_s": mean("step_s"),
        "generate_s": mean("time/generate_s"),
        "score_s": mean("time/score_s"),
        "update_s": mean("time/update_s"),
        "sync_s": mean("time/sync_s"),
        "model_path": cfg.model.path if cfg.model.path != "tiny" else None,
    }


def bench_parallel(strategy: str, steps: int, extra: list[str], procs: int = 2) -> dict:
    """A short `rollout=hf` training under `strategy`: one process for single, else `procs` ranks."""
    run_dir = tempfile.mkdtemp(prefix=f"bench-{strategy}-")
    n = 1 if strategy == "single" else procs
    launch = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                              "--nproc_per_node", str(n)]
    cmd = [*launch, "-m", "grpo.train", f"parallel={strategy}", "rollout=hf", f"steps={steps}", *QUIET,
           "export_model=false", f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    print(f"bench: parallel={strategy} on {n} process(es), {steps} steps", flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"parallel={strategy} failed:\n{out.stderr[-3000:]}")
    rows = metrics_rows(run_dir)
    mean = lambda k: statistics.mean(r[k] for r in rows)  # noqa: E731
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    return {"strategy": strategy, "procs": n, "steps_timed": len(rows), "step_s": mean("step_s"),
            "threads": summary.get("threads_per_process"),
            "generate_s": mean("time/generate_s"), "update_s": mean("time/update_s"), "sync_s": mean("time/sync_s")}
