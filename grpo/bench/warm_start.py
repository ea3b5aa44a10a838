"""`python -m grpo.bench warm-start`: steps until the tiny model's warm start reaches its target,
per seed, under numerically different settings of this machine (torch's AVX2 kernels against its
default, one thread against the default). Each setting runs in a fresh process of this module
(`python -m grpo.bench.warm_start OUT SEEDS`), since ATEN_CPU_CAPABILITY is read once at start."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from grpo.config import compose_config
from grpo.cpus import machine_info
from grpo.errors import WarmStartError
from grpo.tasks import build_task
from grpo.tiny.warm_start import build_warm_tiny

SETTINGS = {"default": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2"}, "1-thread": {"OMP_NUM_THREADS": "1"}}


def default_settings() -> str:
    """Two numerically different settings of this machine."""
    return "default,avx2" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "default,1-thread"


def worker(seeds: list[int], out: str) -> None:
    """The tiny model built and warm-started for each seed, from scratch (no cache), in this process's numerics."""
    cfg = compose_config(["run_dir=unused"])
    task, rows = build_task(cfg.task), []
    for seed in seeds:
        tiny = cfg.model.tiny.copy()
        tiny.seed = seed
        try:
            info = build_warm_tiny(tiny, task, cfg.rollout.max_new_tokens, log=lambda *_: None)[2]
        except WarmStartError as e:  # a miss is a row, not the end of the bench
            info = {"warm_start_steps": tiny.warm_start_max_steps, "error": str(e)}
        rows.append({"seed": seed, **info, **machine_info()})
    with open(out, "w") as f:
        json.dump(rows, f)


def bench_warm_start(seeds: list[int], settings: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in settings:
            print(f"bench: warm starts of seeds {seeds}, setting {name}", flush=True)
            out = os.path.join(tmp, f"{name}.json")
            subprocess.run([sys.executable, "-m", "grpo.bench.warm_start", out, ",".join(map(str, seeds))],
                           check=True, env={**os.environ, **SETTINGS[name]})
            rows += [{"setting": name, **r} for r in json.load(open(out))]
    return rows


def report_warm_start(seeds: list[int], settings: str | None) -> tuple[dict, list]:
    """(the JSON report, the sections to print): the table and each setting's min / median / max steps."""
    names = (settings or default_settings()).split(",")
    rows = bench_warm_start(seeds, names)
    sections = [("the tiny model's warm start: supervised steps until greedy train accuracy reaches the target", rows,
                 ["setting", "cpu_capability", "torch_threads", "seed", "warm_start_steps", "warm_start_train_accuracy",
                  "warm_start_s"])]
    for name in names:
        got = sorted(r["warm_start_steps"] for r in rows if r["setting"] == name)
        sections.append(f"{name}: steps min {got[0]}, median {statistics.median(got):g}, max {got[-1]}; "
                        f"misses {sum('error' in r for r in rows if r['setting'] == name)}")
    return {"warm_start": rows}, sections


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m grpo.bench.warm_start",
                                     description="One setting's warm starts, in this process's numerics; "
                                                 "`python -m grpo.bench warm-start` runs one per setting.")
    parser.add_argument("out", help="the JSON file the rows are written to")
    parser.add_argument("seeds", help="comma-separated model seeds, e.g. 0,1,2")
    args = parser.parse_args()
    worker([int(x) for x in args.seeds.split(",")], args.out)
