"""`python -m grpo.bench shared-cores`: the default run's step time alone and beside one busy
process, one thread per core against `threads=auto` (grpo/cpus.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from grpo.bench.runs import bench_parallel
from grpo.cpus import usable_cpus


def bench_shared_cores(steps: int, extra: list[str]) -> list[dict]:
    """Step time of the default run (one process) alone and beside one busy single-threaded process,
    with a thread per core (torch's default, what runs did before `threads=auto`) and with
    `threads=auto`. The ratio to the same setting alone is the slowdown a shared login node or CI
    runner causes."""
    cores = usable_cpus()  # the affinity mask, SLURM_CPUS_PER_TASK, a cgroup quota: threads=N takes no more
    rows, alone = [], {}
    for busy in (False, True):
        for setting in (str(cores), "auto"):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                time.sleep(1.0 if busy else 0)
                r = bench_parallel("single", steps, [f"threads={setting}", *extra])
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            label = "auto" if setting == "auto" else f"{setting} (one per core)"
            if not busy:
                alone[setting] = r["step_s"]
            rows.append({"threads": label, "beside": "one busy process" if busy else "nothing", "step_s": r["step_s"],
                         "threads_used": r["threads"], "vs_alone": r["step_s"] / alone[setting]})
    return rows


def report_shared_cores(steps: int, overrides: list[str]) -> tuple[dict, list]:
    rows = bench_shared_cores(steps, overrides)
    return {"shared_cores": rows}, [("step time of the default run alone and beside one busy process (rollout=hf, parallel=single)",
                                     rows, ["threads", "beside", "threads_used", "step_s", "vs_alone"])]
