"""Asynchronous rollouts (algo.max_staleness): real engine processes generate the next batches while
the trainer updates; the versions the engines report having served prove the bound, and a run
killed with batches in flight resumes with none lost and none trained twice."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import FAST, ROOT, assert_rewards_vary, compose_cfg
from tests.test_dedicated import run_ok, wait_gone
from tests.test_parallel import TORCHRUN

ASYNC = ["rollout=dedicated"]  # algo.trust_region=auto: clipped around the sampler


def trained_rows(run_dir) -> list[dict]:
    return [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "loss" in r]


def assert_stale_batches_disagree(rows: list[dict]) -> None:
    """Every stale batch was sampled by older weights, so the trainer disagrees with the sampler,
    where that can show: the batch trained some token (a batch of flat groups trains none and reports
    0), and an optimizer step came between the version that sampled it and the one that trains it (a
    step whose groups were all flat leaves the weights as they were, so its successor is not stale
    in fact). At least one batch must qualify."""
    by_step = {r["step"]: r for r in rows}
    moved = lambda r: any(by_step[t]["trained_completions"] > 0 for t in range(int(r["weight_version"]) + 1, r["step"]))  # noqa: E731
    shown = [r for r in rows if r["async/staleness_max"] > 0 and r["trained_completions"] > 0 and moved(r)]
    assert shown, f"precondition: no stale batch both trained and followed an update: {rows}"
    assert all(r["sampler_diff"] > 1e-3 and r["sampler_kl"] > 0 for r in shown), shown


@pytest.mark.starts_process
@pytest.mark.parametrize("parallel, k, versions, behind, loss", [
    ("ddp", 2, [0, 0, 0, 1, 2], [0, 1, 2, 2, 2], "algo.is_level=token"),  # decoupled PPO, weighted by is_*
    # ZeRO-3: each push gathers the shards (collectives every rank joins) while the owner's batch is in flight
    ("zero3", 1, [0, 0, 1, 2], [0, 1, 1, 1], "algo.trust_region=auto"),  # clipped around the sampler
])
def test_two_processes_train_on_batches_at_most_k_versions_old(tmp_path, cache_dir, learning_policy, parallel, k, versions, behind, loss):
    steps = len(versions)
    run_ok([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, f"steps={steps}", f"parallel={parallel}",
            *ASYNC, loss, f"algo.max_staleness={k}", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    rows = trained_rows(tmp_path)
    assert_rewards_vary(rows[:-1])  # the weights move only if an earlier batch carried a signal
    # batch s is handed over at step max(1, s - k), when the engines hold version max(0, s - 1 - k), and
    # trained at step s by the trainer at version s - 1. weight_version is what the engine reported
    # (/weight_info) before and after serving it, averaged over both ranks: a rank that saw another
    # version would leave a fraction here.
    assert [r["weight_version"] for r in rows] == versions
    assert [r["async/staleness_max"] for r in rows] == behind
    assert all(r["async/staleness_max"] <= k for r in rows)
    # the stale batches really came from older weights: the trainer disagrees with the sampler
    # (a first batch of flat groups trains no token: nothing measured, NaN)
    assert rows[0]["trained_completions"] == 0 or (rows[0]["sampler_diff"] < 1e-3 and rows[0]["sampler_kl"] < 1e-6)
    assert_stale_batches_disagree(rows)
    assert all(r["time/wait_for_data_s"] >= 0 and r["time/engine_wait_s"] >= 0 for r in rows)
    assert wait_gone(tmp_path) == [], "engine processes outlived the run"


@pytest.mark.starts_process
def test_in_process_backend_trains_on_batches_k_versions_old_without_the_overlap(make_cfg, learning_policy):
    """rollout=hf with k = 1: each batch is generated when it is handed over (before that step's
    update), so it is as stale as from engines elsewhere, only not overlapped: the same off-policy
    learning, in one process, for studying staleness cheaply."""
    from grpo.train import train

    cfg = make_cfg("steps=4", "algo.max_staleness=1")
    with pytest.warns(UserWarning, match="generation takes turns with the update"):
        train(cfg)
    rows = trained_rows(cfg.run_dir)
    assert_rewards_vary(rows[:-1])
    assert [r["weight_version"] for r in rows] == [0, 0, 1, 2]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    # fresh: the trainer holds the sampling weights; stale: they moved since (a lazy generate at
    # .result() would sample with the trainer's own weights and leave ~0 here)
    assert rows[0]["trained_completions"] == 0 or (rows[0]["sampler_diff"] < 1e-4 and rows[0]["sampler_kl"] < 1e-8)
    assert_stale_batches_disagree(rows)
    # the last step generates nothing (its batch came at step 3): the trainer's seconds in generation are
    # next to none, the batch's own are its generation's, and the rate divides by those (it divided by
    # the trainer's: 3.3 million tokens/s at the last step, and step 1 timed two batches for one)
    last = rows[-1]
    assert last["time/generate_s"] < last["time/batch_generate_s"], last
    assert all(r["gen_tokens_per_s"] == pytest.approx(r["completion_len"] * 32 / r["time/batch_generate_s"], rel=1e-6)
               for r in rows), rows
    # the step's rates need its seconds to generate one batch: step 1 generated two, step 4 none (it read
    # 8,994 tokens/s against about 700, and mfu/step 0.21 against 0.02)
    for key in ("tokens_per_s", "mfu/step"):
        assert [r[key] is None for r in rows] == [True, False, False, True], (key, rows)  # NaN: null in the file


def expected_prompts(steps: int, per_step: int) -> list[str]:
    """The first prompt of every step's batch, as an uninterrupted run draws them."""
    from grpo.tasks import TrainSampler, build_task

    cfg = compose_cfg(*FAST)
    sampler = TrainSampler(build_task(cfg.task).train, seed=cfg.seed)
    return [sampler.next(per_step)[0].prompt for _ in range(steps)]


def logged_prompts(output: str) -> dict[int, str]:
    return {int(m[1]): eval(m[2]) for m in re.finditer(r"sample @ (\d+): ('(?:[^'\\]|\\.)*')", output)}


@pytest.mark.starts_process
def test_killed_async_run_resumes_with_no_batch_lost_or_trained_twice(tmp_path, cache_dir):
    steps, run_dir = 14, tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo.train", *FAST, f"steps={steps}", *ASYNC, "algo.max_staleness=1",
           "checkpoint_every=3", "logger.sample_every=1", "logger.num_samples=1", f"hydra.run.dir={run_dir}",
           f"model.cache_dir={cache_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    victim = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    latest, log = run_dir / "checkpoints" / "latest", run_dir / "metrics.jsonl"

    def logged_past_checkpoint() -> bool:  # the next batch is in flight, and rows the resume must redo exist
        if not latest.exists() or not log.exists():
            return False
        saved = int(latest.read_text().strip().split("_")[1])
        return any(json.loads(line)["step"] >= saved + 2 for line in log.read_text().splitlines() if line.endswith("}"))

    deadline = time.time() + 400
    while not logged_past_checkpoint() and time.time() < deadline:
        time.sleep(0.005)
    alive_at_kill = victim.poll() is None
    victim.send_signal(signal.SIGKILL)
    first_output, _ = victim.communicate()
    assert alive_at_kill, "the run finished before it could be killed; make it longer"
    killed_at = int(latest.read_text().strip().split("_")[1])
    assert killed_at < steps - 1
    assert wait_gone(run_dir) == []

    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    rows = [json.loads(line) for line in open(log)]
    trained = [r["step"] for r in rows if "loss" in r]
    assert trained == list(range(1, steps + 1))  # no step lost, none logged twice
    # every step trained the prompts an uninterrupted run draws: the batch in flight at the kill was
    # drawn again, not skipped, and no batch trained twice
    before, after = logged_prompts(first_output), logged_prompts(resumed.stdout)
    prompts = [before[s] if s <= killed_at else after[s] for s in range(1, steps + 1)]
    assert prompts == expected_prompts(steps, per_step=8)
    # after the resume the engines start from the checkpoint's weights: the first batch is fresh
    stale = {r["step"]: r["async/staleness_max"] for r in rows if "loss" in r}
    assert stale[killed_at + 1] == 0 and all(stale[s] == 1 for s in range(killed_at + 2, steps + 1))
    assert json.load(open(run_dir / "summary.json"))["resumed_from"] == killed_at
