"""End-to-end runs of `python -m grpo.train` on the embedded default."""

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from grpo.bench.mfu import phase_rows
from grpo.log import read_metrics
from grpo.train import train
from tests.conftest import FAST, ROOT, assert_rewards_vary, measured
from tests.listener_watch import ListenerWatch


@pytest.mark.starts_process
@pytest.mark.e2e_smoke  # make test's run of rollout=hf, parallel=single
def test_short_run_writes_its_run_folder(make_cfg, tmp_path, hub_like_policy):
    """rollout=hf on a folder whose generation_config.json sets a repetition penalty, min-p, top-k...:
    generate samples with the run's own settings only, so the sampler's logprobs are the trainer's."""
    with ListenerWatch(os.getpid()) as watch:  # rollout=hf listens on nothing
        summary = train(make_cfg(f"model.path={hub_like_policy}"))
    watch.assert_accounted()
    run = tmp_path / "run"
    assert {"config.yaml", "metrics.jsonl", "summary.json"} <= set(os.listdir(run))
    on_disk = json.load(open(run / "summary.json"))
    assert on_disk == summary
    assert on_disk["steps"] == 3 and on_disk["wall_s"] > 0
    import torch

    machine = on_disk["machine"]  # what ran where: rounding, and so a small model's training, differs by CPU
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["torch_threads"] == on_disk["threads_per_process"] and machine["cpu_model"]
    evals = [r["eval/accuracy"] for r in read_metrics(run / "metrics.jsonl") if "eval/accuracy" in r]
    assert evals == [on_disk["eval_before"], on_disk["eval_after"]]
    rows = read_metrics(run / "metrics.jsonl")  # null (a step that trained nothing: no token fraction) as NaN
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("reward/mean", "reward/std", "reward/zero_std_frac", "clip_frac", "kl", "entropy",
                "completion_len", "tokens_per_s", "step_s", "weight_version"):
        assert key in steps[0], key
    # the groups whose rewards were all equal are dropped, the rest trained: 32 completions in 8 groups of 4
    assert [r["trained_completions"] for r in steps] == [round(32 * (1 - r["reward/zero_std_frac"])) for r in steps]
    # the hf sampler is the trainer's module, but generate would take the folder's repetition penalty,
    # min-p, top-k...: with them the sampler's logprobs were 1.77 from the trainer's, without 1e-6
    assert all(d < 1e-3 for d in measured(steps)), [r["sampler_diff"] for r in steps]
    # the rate each step's update took (read after it, the scheduler's next: [1, 1/2, 0] x lr): a warm-up
    # of 1 of the 3 optimizer steps, then linear decay, [1/2, 1, 1/2] x lr
    lr = OmegaConf.load(run / "config.yaml").algo.lr
    assert [r["lr"] for r in steps] == pytest.approx([lr / 2, lr, lr / 2])
    # the engines' seconds over the batch, inside the trainer's for it (k = 0: generated right there)
    assert all(0 < r["time/batch_generate_s"] <= r["time/generate_s"] for r in steps), steps
    # the phases are disjoint parts of the step (the guards' checks and the metrics are the rest)
    phases = ("time/generate_s", "time/score_s", "time/sleep_s", "time/update_s", "time/sync_s")
    assert all(min(r[k] for k in phases) >= 0 and sum(r[k] for k in phases) <= r["step_s"] for r in steps), steps
    assert os.path.isdir(run / "checkpoints" / "step_00000003")
    # each phase's FLOPs and MFU against the peak measured at the start (grpo/mfu.py); hf generates on
    # the trainer's device, so generation has an MFU too; a trained step's padding is counted apart
    assert on_disk["peak_tflops_measured"] > 0 and on_disk["peak_tflops_at_end"] > 0
    assert on_disk["peak_tflops_nominal"] is None  # a CPU
    for r in steps:
        assert r["flops/generate"] > 0 and 0 < r["mfu/generate"] < 5 and 0 < r["mfu/step"] < 5, r  # a unit slip: 1e3
        assert (r["flops/update"] > 0) == (r["trained_completions"] > 0) and 0 <= r["mfu/update"] < 5, r
        assert r["trained_completions"] == 0 or 0 < r["update/real_token_frac"] <= 1, r
    phases, step = phase_rows(str(run))  # `grpo.bench mfu --run-dir`'s table of this folder
    assert [p["phase"] for p in phases] == ["generate", "score", "sleep", "update", "sync"] and step["steps_timed"] == 2
    update = next(p for p in phases if p["phase"] == "update")
    assert update["gflop"] == pytest.approx(sum(r["flops/update"] for r in steps[1:]) / 2 / 1e9)
    assert update["mfu"] == pytest.approx(update["gflop"] * 1e9 / update["seconds"] / (step["peak_tflops"] * 1e12))
    assert step["bound_s"] > 0 and step["step_over_bound"] > 1


@pytest.mark.starts_process
def test_every_algo_variant_runs(make_cfg, learning_policy):
    for overrides in (
        ["algo=dr_grpo"],
        ["algo=dapo"],
        ["algo.beta=0.04", "algo.zero_std_groups=keep", "algo.num_iterations=2", "algo.num_minibatches=2",
         "algo.is_level=sequence", "algo.is_mode=mask"],
    ):
        cfg = make_cfg(*overrides, "steps=2", "resume=false")
        train(cfg)
        rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
        trained = [r for r in rows if "loss" in r]
        assert [r["step"] for r in trained] == [1, 2], overrides  # a fresh start: no rows of the run before
        assert_rewards_vary(trained)  # some group had something to learn from
        for r in trained:  # a step that trained moved the weights; one whose groups were all dropped did not
            assert (r["grad_norm"] > 0) == (r["trained_completions"] > 0), (overrides, r)


@pytest.mark.starts_process
@pytest.mark.parametrize("variant", ["gspo", "rloo", "reinforce_pp", "cispo"])
def test_variant_presets_train(make_cfg, learning_policy, variant):
    """Each variant's preset trains 2 steps; reused batches (2 passes x 2 minibatches) make the
    ratios move, so GSPO's tight sequence clip (4e-4) and CISPO's weight clip have something to do."""
    cfg = make_cfg(f"algo={variant}", "steps=2", "algo.num_iterations=2", "algo.num_minibatches=2")
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert_rewards_vary(trained)
    assert all(r["grad_norm"] > 0 for r in trained if r["trained_completions"]), trained
    if variant in ("gspo", "cispo"):
        assert max(measured(trained, "clip_frac")) > 0, trained


@pytest.mark.starts_process
def test_wandb_logger_offline(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(make_cfg("logger=wandb", "steps=2"))
    runs = os.listdir(tmp_path / "run" / "wandb")
    assert any(r.startswith("offline-run-") for r in runs), runs


@pytest.mark.starts_process
def test_cli_prints_the_figures(tmp_path, cache_dir):
    cmd = [sys.executable, "-m", "grpo.train", *FAST, "steps=2", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "eval accuracy" in out.stdout and "in 2 steps" in out.stdout


@pytest.mark.starts_process
def test_cli_bad_config_exits_with_a_clear_message(tmp_path):
    cmd = [sys.executable, "-m", "grpo.train", "algo.batch_size=30", f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "algo.batch_size=30 is not a multiple of algo.group_size=16" in out.stderr


@pytest.mark.slow
def test_default_run_meets_the_learning_bar(tmp_path, cache_dir, learning_policy):
    """The README's default run: held-out greedy accuracy up by >= 0.20 within 5 minutes."""
    cmd = [sys.executable, "-m", "grpo.train", f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.load(open(tmp_path / "summary.json"))
    print(summary)
    assert summary["eval_after"] - summary["eval_before"] >= 0.20
    assert summary["wall_s"] < 300


@pytest.mark.starts_process
def test_bf16_reference_runs_as_the_policy_so_the_first_kl_is_zero(make_cfg, learning_policy):
    """model.dtype=bfloat16, parallel=single: the policy runs fp32 masters under bf16 autocast, and so
    must the reference (Strategy.prepare_reference). One step, before which the two are the same
    weights: KL exactly 0 (with the reference in pure bf16 it was 8.9e-5)."""
    cfg = make_cfg("model.dtype=bfloat16", "algo.beta=0.04", "algo.zero_std_groups=keep", "steps=1")
    train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl")) if '"loss"' in line]
    assert rows[0]["trained_completions"] > 0  # precondition: some tokens entered the KL
    assert rows[0]["kl"] < 1e-6, rows[0]["kl"]


@pytest.mark.starts_process
def test_evaluation_is_no_steps_engine_time_and_a_stop_at_a_checkpoint_step_saves_once(make_cfg, monkeypatch):
    """rollout=hf given a server's busy counter (seconds inside generate): the evaluations before step 1
    and after steps 2 and 4 are in no step's `time/engine_busy_s` (they were in the next step's: busy
    0.09 s in a step of 0.04 s). A stop signal during step 4, a checkpoint_every step, writes that
    checkpoint once (twice before: the grace period before SIGKILL spent on a copy)."""
    import time

    import grpo.train as train_module
    from grpo.rollout.hf import HFBackend

    busy, generate = [0.0], HFBackend.generate

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return generate(self, *args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - t0

    monkeypatch.setattr(HFBackend, "generate", timed)
    monkeypatch.setattr(HFBackend, "engine_busy_s", lambda self: busy[0])
    saves, save = [], train_module.save_checkpoint
    monkeypatch.setattr(train_module, "save_checkpoint", lambda run_dir, step, *a, **k: (saves.append(step), save(run_dir, step, *a, **k))[1])
    cfg = make_cfg("steps=6", "eval_every=2", "checkpoint_every=2")
    stop_at = os.path.join(cfg.run_dir, "checkpoints", "step_00000004")
    monkeypatch.setattr(train_module.StopSignal, "requested", lambda self: os.path.exists(stop_at))  # during step 4
    with pytest.raises(SystemExit):
        train_module.train(cfg)
    assert saves == [2, 4]
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl")) if '"step_s"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 < r["time/engine_busy_s"] <= r["step_s"] for r in rows), rows


def test_a_sweep_with_one_run_dir_for_every_job_is_refused():
    """`-m ... run_dir=X`: every job in one folder; the first trained and each later one resumed it,
    printed "already finished" and exited 0 with the first job's summary. Per-job values pass."""
    from grpo.errors import ConfigError
    from grpo.config import check_sweep_folder

    with pytest.raises(ConfigError, match=r"run_dir=/runs/lr is one folder for every job .*hydra.sweep.dir=/runs/lr"):
        check_sweep_folder(OmegaConf.create({"run_dir": "/runs/lr"}), multirun=True)
    for one in ("${hydra:runtime.cwd}/runs/one", "${hydra:sweep.dir}"):  # Hydra's, yet the same for every job
        with pytest.raises(ConfigError, match="is one folder for every job"):
            check_sweep_folder(OmegaConf.create({"run_dir": one}), multirun=True)
    for per_job in ("${hydra:runtime.output_dir}", "/runs/lr/${hydra:job.num}", "/runs/lr${algo.lr}",
                    "/runs/${hydra:job.override_dirname}"):
        check_sweep_folder(OmegaConf.create({"run_dir": per_job}), multirun=True)
    check_sweep_folder(OmegaConf.create({"run_dir": "/runs/lr"}), multirun=False)


@pytest.mark.starts_process
def test_the_command_line_refuses_a_sweep_into_one_folder(tmp_path):
    out = subprocess.run([sys.executable, "-m", "grpo.train", "-m", f"run_dir={tmp_path / 'one'}", "algo.lr=1e-3,2e-3",
                          f"hydra.sweep.dir={tmp_path / 'sweep'}", *FAST], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "is one folder for every job of this sweep" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "one").exists()  # refused before anything was written


def test_a_finished_run_drops_the_rows_of_a_continuation_killed_before_its_first_checkpoint(tmp_path):
    """A finished 4-step run continued with steps=8, killed at step 6 before any checkpoint past 4, then
    run again with steps=4: 'already finished', its summary returned, but metrics.jsonl kept steps 5 and
    6, which the folder's model never trained (grpo.plot drew them as the run's)."""
    from types import SimpleNamespace

    from grpo.train import finished

    rows = [{"step": s, "x": s} for s in (0, 1, 2, 3, 4)] + [{"step": 4, "eval/accuracy": 0.5}, {"step": 5}, {"step": 6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4}))
    r = SimpleNamespace(info=SimpleNamespace(is_main=True), run_dir=str(tmp_path), start=4,
                        cfg=SimpleNamespace(export_model=False))
    assert finished(r) == {"steps": 4}
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == rows[:6]
