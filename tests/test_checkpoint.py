"""Checkpoints are atomic, and a run killed mid-way resumes to the same results."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from grpo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from grpo.config import AlgoConfig
from grpo.log import read_metrics
from grpo.parallel.single import SingleStrategy
from tests.conftest import FAST, ROOT


def strategy_for(model):
    return SingleStrategy(None, model, OmegaConf.structured(AlgoConfig()), total_steps=10)


def test_kill_during_save_leaves_last_good_checkpoint(tmp_path, tiny_lm, monkeypatch):
    import copy

    model = copy.deepcopy(tiny_lm[0])
    strategy = strategy_for(model)
    save_checkpoint(str(tmp_path), 1, strategy, {"sampler": {"epoch": 0, "pos": 5}})
    good = {k: v.clone() for k, v in model.state_dict().items()}

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def dies_half_way(folder):  # writes part of the checkpoint, then the process "dies"
        with open(os.path.join(folder, "trainer.pt"), "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(strategy, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 2, strategy, {"sampler": {"epoch": 0, "pos": 9}})
    monkeypatch.undo()

    path = latest_checkpoint(str(tmp_path))
    assert path.endswith("step_00000001")
    fresh = strategy_for(copy.deepcopy(tiny_lm[0]))
    state = load_checkpoint(path, fresh)
    assert state["step"] == 1 and state["sampler"] == {"epoch": 0, "pos": 5}
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, good[k])

    # the next good save replaces the pointer and cleans the half-written leftovers
    save_checkpoint(str(tmp_path), 3, strategy, {"sampler": {}}, keep=1)
    left = sorted(os.listdir(tmp_path / "checkpoints"))
    assert left == ["latest", "step_00000003"]


def killed_while_replacing_step_2(run_dir, strategy, monkeypatch) -> None:
    """Steps 1 and 2 saved, then step 2 saved again and killed once the old step 2 is moved aside."""
    for step in (1, 2):
        save_checkpoint(str(run_dir), step, strategy, {}, keep=5)
    real_rename = os.rename

    def dies_after_moving_aside(src, dst):
        real_rename(src, dst)
        if os.path.basename(dst).startswith(".old-"):
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(os, "rename", dies_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(run_dir), 2, strategy, {}, keep=5)
    monkeypatch.undo()


def test_kill_while_replacing_the_same_step_falls_back_to_a_complete_one(tmp_path, tiny_lm, monkeypatch):
    killed_while_replacing_step_2(tmp_path, strategy_for(tiny_lm[0]), monkeypatch)
    # `latest` names step 2, which is not in place: the newest complete checkpoint is used instead
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002"
    assert latest_checkpoint(str(tmp_path)).endswith("step_00000001")


def test_keep_prunes_old_checkpoints(tmp_path, tiny_lm):
    strategy = strategy_for(tiny_lm[0])
    for step in (1, 2, 3, 4):
        save_checkpoint(str(tmp_path), step, strategy, {}, keep=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_00000003", "step_00000004"]


def run_train(run_dir, cache_dir, *overrides):
    cmd = [sys.executable, "-m", "grpo.train", *FAST, f"hydra.run.dir={run_dir}", f"model.cache_dir={cache_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(run_dir):
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))  # null (a metric with no value): NaN
    keep = ("reward/mean", "reward/std", "loss", "grad_norm", "entropy", "eval/accuracy", "weight_version")
    return [(r["step"], {k: r[k] for k in keep if k in r}) for r in rows]


@pytest.mark.starts_process
def test_killed_run_resumes_to_the_same_results(tmp_path, cache_dir):
    args = ["steps=30", "checkpoint_every=4", "keep_checkpoints=100"]
    # build the tiny model first so both runs start from the same cached folder
    ref = run_train(tmp_path / "uninterrupted", cache_dir, *args)
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out

    victim = run_train(tmp_path / "killed", cache_dir, *args)
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    log = tmp_path / "killed" / "metrics.jsonl"

    def logged_past_checkpoint() -> bool:  # rows the resume must discard and redo
        if not latest.exists() or not log.exists():
            return False
        saved = int(latest.read_text().strip().split("_")[1])
        return any(json.loads(line)["step"] >= saved + 2 for line in log.read_text().splitlines() if line.endswith("}"))

    deadline = time.time() + 300
    while not logged_past_checkpoint() and time.time() < deadline:
        time.sleep(0.005)
    alive_at_kill = victim.poll() is None
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    assert alive_at_kill, "the run finished before it could be killed; make it longer"
    killed_at = int(latest.read_text().strip().split("_")[1])
    assert killed_at < 30

    resumed = run_train(tmp_path / "killed", cache_dir, *args)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "resumed from" in out and "differs from its earlier run's" not in out  # the same config: no warning

    a, b = metrics(tmp_path / "uninterrupted"), metrics(tmp_path / "killed")
    assert [s for s, _ in b] == [s for s, _ in a]  # no step lost, none logged twice
    for (step, ra), (_, rb) in zip(a, b):
        for k in ra:
            assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6, nan_ok=True), (step, k)
    wa = torch.load(tmp_path / "uninterrupted" / "checkpoints" / "step_00000030" / "trainer.pt", weights_only=True)["model"]
    wb = torch.load(tmp_path / "killed" / "checkpoints" / "step_00000030" / "trainer.pt", weights_only=True)["model"]
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)
    summary = json.load(open(tmp_path / "killed" / "summary.json"))
    assert summary["resumed_from"] == killed_at and summary["steps"] == 30


def test_a_resume_with_another_config_keeps_the_earlier_one_and_names_what_changed(tmp_path):
    """config.yaml was overwritten on every start: a resumed run with another algo.lr or LoRA alpha (which
    no checkpoint holds) trained on without a word, and the earlier config was gone. Keys a resume may
    change (steps, logging, checkpoint cadence, the servers' URLs) are not counted."""
    from omegaconf import OmegaConf

    from grpo.checkpoint import config_changes, record_config

    first = {"algo": {"lr": 1e-3, "beta": 0.0}, "model": {"lora": {"alpha": 16}}, "steps": 100, "logger": {"log_every": 10}}
    assert record_config(str(tmp_path), first, resuming=True) == []  # nothing earlier
    same = {**first, "steps": 300, "logger": {"log_every": 1}}
    assert record_config(str(tmp_path), same, resuming=True) == [] and len(os.listdir(tmp_path)) == 1
    other = {**same, "algo": {"lr": 5e-4, "beta": 0.0}, "model": {"lora": {"alpha": 32}}, "seed": 1}
    assert record_config(str(tmp_path), other, resuming=True) == ["algo.lr", "model.lora.alpha", "seed"]
    kept = [f for f in os.listdir(tmp_path) if f.startswith("config-")]
    assert len(kept) == 1 and OmegaConf.to_container(OmegaConf.load(tmp_path / kept[0]))["algo"]["lr"] == 1e-3
    assert OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml"))["algo"]["lr"] == 5e-4
    # a finished run started again with another lr trains nothing: config.yaml stays the one it was trained with
    # (it was rewritten, and the folder claimed lr 1e-3 for a model trained at 5e-4)
    files = sorted(os.listdir(tmp_path))
    assert record_config(str(tmp_path), first, resuming=True, finished=True) == ["algo.lr", "model.lora.alpha", "seed"]
    assert sorted(os.listdir(tmp_path)) == files
    assert OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml"))["algo"]["lr"] == 5e-4
    assert record_config(str(tmp_path), first, resuming=False) == []  # resume=false: nothing compared
    assert config_changes({"a": [1, 2]}, {"a": [1, 3]}) == ["a"] and config_changes({"a": {"b": 1}}, {"a": 2}) == ["a"]
    # a requeued grpo.launch trainer's new servers and judges (grpo/companions.py); another key of theirs still counts
    served = {"rollout": {"remote": {"urls": ["http://n1:4000"], "tensor_parallel_size": 1}}, "reward": {"judge": {"urls": ["http://n2:1"]}}}
    moved = {"rollout": {"remote": {"urls": ["http://n3:5000"], "tensor_parallel_size": 1}}, "reward": {"judge": {"urls": ["http://n4:2"]}}}
    assert config_changes(served, moved) == []
    moved["rollout"]["remote"]["tensor_parallel_size"] = 2
    assert config_changes(served, moved) == ["rollout.remote.tensor_parallel_size"]
    # a run folder of a grpo before 31a69dd wrote the judge's default choices out; now they are {} (read as yes/no)
    judged = lambda choices: {"reward": {"judge": {"choices": choices}}}  # noqa: E731
    assert config_changes(judged({"yes": 1.0, "no": 0.0}), judged({})) == []
    assert config_changes(judged({"yes": 1.0, "no": 0.5}), judged({})) == ["reward.judge.choices.no", "reward.judge.choices.yes"]
    assert config_changes(judged({}), judged({"correct": 1.0, "wrong": 0.0})) == ["reward.judge.choices.correct", "reward.judge.choices.wrong"]
    # a folder written before task.correct existed (1db02ee): absent is exact; another value is a change
    assert config_changes({"task": {"name": "jsonl"}}, {"task": {"name": "jsonl", "correct": "exact"}}) == []
    assert config_changes({"task": {"name": "jsonl"}}, {"task": {"name": "jsonl", "correct": "math_verify"}}) == ["task.correct"]


def test_a_resumed_schedule_is_the_resumed_runs_own(tiny_lm):
    """torch's load_state_dict puts back the saved param groups' lr and weight decay and LambdaLR's
    base_lrs: a resume asked for a lower lr trained on at the old one, and a finished 4-step run
    continued to 8 took the old schedule's last lr (0) for step 5, then jumped to 4.3e-4.
    `resume_schedule` gives the run its own lr, weight decay and schedule at the checkpoint's step:
    from there on, the lrs of a straight run of the new config."""
    from grpo.parallel.base import build_optimizer, resume_schedule

    model, _ = tiny_lm
    algo = lambda lr, wd: OmegaConf.structured(AlgoConfig(lr=lr, weight_decay=wd, warmup_steps=1))  # noqa: E731
    old_opt, old_sched = build_optimizer(model, algo(1e-3, 0.0), total_steps=4)
    for _ in range(4):
        old_opt.step()
        old_sched.step()
    assert old_sched.get_last_lr() == [0.0]  # the 4-step run's end
    opt, sched = build_optimizer(model, algo(5e-4, 0.1), total_steps=8)
    opt.load_state_dict(old_opt.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    assert opt.param_groups[0]["lr"] == 0.0 and opt.param_groups[0]["weight_decay"] == 0.0  # what load leaves
    resume_schedule(sched, algo(5e-4, 0.1))
    straight_opt, straight = build_optimizer(model, algo(5e-4, 0.1), total_steps=8)
    lrs, expected = [], []
    for _ in range(4):  # steps 5-8
        lrs.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr() == [lrs[-1]]
        opt.step()
        sched.step()
    for step in range(8):
        expected.append(straight_opt.param_groups[0]["lr"])
        straight_opt.step()
        straight.step()
    assert lrs == pytest.approx(expected[4:]) and lrs[0] == pytest.approx(5e-4 * 4 / 7)
    assert opt.param_groups[0]["weight_decay"] == 0.1


def test_guard_counts_go_on_across_a_resume():
    """guard/skipped_steps is a running total, and 3 non-finite steps in a row stop the run: both
    restarted from 0 on every resume (a requeue between the 2nd and 3rd such step never stopped)."""
    from grpo.guards import NonFiniteSteps, Parity, RunGuards

    before = RunGuards(None, 0, Parity("max", 0.05), 0, 1)
    for step in (1, 2):
        with pytest.warns(UserWarning, match="non-finite"):
            before.after_update(step, {"loss": float("nan"), "grad_norm": 1.0}, 0)
    saved = before.state_dict()
    after = RunGuards(None, 0, Parity("max", 0.05), 0, 1)
    after.load_state_dict(saved)
    assert after.after_update(3, {"loss": 1.0, "grad_norm": 1.0}, 0) == {"guard/skipped_steps": 2}
    after.load_state_dict(saved)
    with pytest.raises(NonFiniteSteps, match="3 steps in a row"):
        after.after_update(3, {"loss": float("nan"), "grad_norm": 1.0}, 0)
    RunGuards(None, 0, Parity("max", 0.05), 0, 1).load_state_dict({})  # a checkpoint from before the counts


@pytest.mark.starts_process
def test_a_run_folder_that_cannot_be_made_is_named_before_anything_is_built(make_cfg, tmp_path):
    """run_dir naming a file (or a read-only place): os.makedirs' FileExistsError traceback before."""
    from grpo.errors import ConfigError
    from grpo.train import train

    (tmp_path / "taken").write_text("a file")
    for where in (tmp_path / "taken", tmp_path / "taken" / "run"):
        with pytest.raises(ConfigError, match=rf"^run_dir={where}: cannot make that folder \(.+\); give a folder this user can write"):
            train(make_cfg(f"run_dir={where}"))


def test_a_fresh_start_sets_an_earlier_runs_export_aside(tmp_path):
    """resume=false moved the earlier run's checkpoints and metrics but left its model/: a new run that
    stopped before its own export then stood on the earlier run's weights as its result. The configs its
    resumes kept (config-<time>.yaml) stayed beside the new run's config.yaml, read as the new run's."""
    from grpo.checkpoint import set_aside_checkpoints

    for name in ("checkpoints", "model", "adapter"):
        (tmp_path / name).mkdir()
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "config-20261203-182846.yaml").write_text("algo: {}\n")  # the config a resume of that run replaced
    aside = set_aside_checkpoints(str(tmp_path))
    assert sorted(os.listdir(aside)) == ["adapter", "checkpoints", "config-20261203-182846.yaml", "model", "summary.json"]
    assert not (tmp_path / "model").exists() and not (tmp_path / "config-20261203-182846.yaml").exists()


@pytest.mark.starts_process
def test_a_resume_trains_at_its_new_lr_and_a_finished_run_exports_its_own_step(make_cfg, tmp_path):
    """A run of 2 steps at lr 1e-3, resumed to 4 at 5e-4, trains steps 3-4 at 5e-4 (it stayed at 1e-3).
    The export records its step: a finished run whose model/ is an earlier step's (stopped before its
    export, after a shorter run's) exports again. A checkpoint past `steps` in a run that never finished
    is refused: it would finish as a shorter run holding more training."""
    from grpo.errors import ConfigError
    from grpo.export import exported_step
    from grpo.train import train

    run, fixed = tmp_path / "run", ("algo.warmup_steps=0", "algo.lr_schedule=constant")
    train(make_cfg("steps=2", "algo.lr=1e-3", *fixed))
    assert exported_step(str(run / "model")) == 2
    train(make_cfg("steps=4", "algo.lr=5e-4", *fixed))
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [(r["step"], r["lr"]) for r in rows if "lr" in r] == [(1, 1e-3), (2, 1e-3), (3, 5e-4), (4, 5e-4)]
    assert exported_step(str(run / "model")) == 4
    (run / "model" / "grpo_export.json").write_text('{"step": 2}')  # as if the export of step 4 never came
    train(make_cfg("steps=4", "algo.lr=5e-4", *fixed))
    assert exported_step(str(run / "model")) == 4
    state = torch.load(run / "checkpoints" / "step_00000004" / "state_rank0.pt", weights_only=False)
    assert state["guards"] == {"skipped": 0, "in_a_row": 0, "sampler_count": 0}  # the guards' counts go along
    # the finished 4-step run continued to 5 and stopped after its checkpoint, before its own summary
    four = (run / "summary.json").read_text()
    train(make_cfg("steps=5", "algo.lr=5e-4", *fixed))
    (run / "summary.json").write_text(four)
    config = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"is at step 5, past steps=4.*Raise steps to at least 5"):
        train(make_cfg("steps=4", "algo.lr=1e-4", *fixed))  # the 4-step summary is not step 5's
    assert (run / "config.yaml").read_text() == config and exported_step(str(run / "model")) == 5


def test_a_checkpoint_is_resumed_only_by_the_strategy_processes_and_adapter_that_can_read_it(tmp_path, tiny_lm):
    """single and ddp share trainer.pt at any number of processes; ZeRO's shards need the same stage on as
    many processes. A ZeRO-2 checkpoint resumed with parallel=single failed after the model was built
    (trainer.pt: FileNotFoundError), with config.yaml already rewritten to say single."""
    import copy

    from grpo.checkpoint import check_layout
    from grpo.errors import ConfigError

    path = save_checkpoint(str(tmp_path / "a"), 1, strategy_for(copy.deepcopy(tiny_lm[0])), {},
                           layout={"strategy": "single", "world_size": 1})
    for strategy, world in (("single", 1), ("ddp", 4)):
        check_layout(path, strategy, world)
    with pytest.raises(ConfigError, match=r"written by parallel=single on 1 process\(es\); this run is parallel=zero2 on 2 "
                                          r"process\(es\), which cannot read it. Resume with parallel=single or parallel=ddp"):
        check_layout(path, "zero2", 2)
    zero = tmp_path / "z"
    (zero / "deepspeed").mkdir(parents=True)
    (zero / "grpo_layout.json").write_text(json.dumps({"strategy": "zero2", "world_size": 2}))
    check_layout(str(zero), "zero2", 2)
    for strategy, world in (("zero2", 1), ("zero3", 2), ("single", 1), ("ddp", 2)):
        with pytest.raises(ConfigError, match=r"Resume with parallel=zero2 on 2 process\(es\)"):
            check_layout(str(zero), strategy, world)
    # the adapter it holds: another rank or other modules are other parameters (DeepSpeed said "parameter-alignment
    # layout does not match"; single "checkpoint does not match the LoRA adapter"), after the model was built
    adapter = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}
    (zero / "grpo_layout.json").write_text(json.dumps({"strategy": "zero2", "world_size": 2, "adapter": adapter}))
    check_layout(str(zero), "zero2", 2, {"rank": 8, "target_modules": ["q_proj", "v_proj"]})
    for other, said in (({"rank": 16, "target_modules": ["q_proj", "v_proj"]}, r"a LoRA adapter of model.lora.rank=16 on model.lora.target_modules=\[q_proj,v_proj\]"),
                        ({"rank": 8, "target_modules": ["q_proj"]}, r"a LoRA adapter of model.lora.rank=8 on model.lora.target_modules=\[q_proj\]"),
                        (None, r"full fine-tuning \(model.lora.rank=0\)")):
        with pytest.raises(ConfigError, match=rf"holds a LoRA adapter of model.lora.rank=8 on model.lora.target_modules=\[q_proj,"
                                              rf"v_proj\]; this run asks for {said}, whose parameters are others"):
            check_layout(str(zero), "zero2", 2, other)
    (zero / "grpo_layout.json").write_text(json.dumps({"strategy": "zero2", "world_size": 2, "adapter": None}))
    with pytest.raises(ConfigError, match=r"holds full fine-tuning \(model.lora.rank=0\); this run asks for a LoRA adapter"):
        check_layout(str(zero), "zero2", 2, adapter)
    (zero / "grpo_layout.json").write_text(json.dumps({"strategy": "zero2", "world_size": 2}))  # before the adapter was recorded
    check_layout(str(zero), "zero2", 2, adapter)
    (zero / "grpo_layout.json").unlink()  # written before the layout was recorded: the files tell the kind only
    check_layout(str(zero), "zero3", 1)
    with pytest.raises(ConfigError, match="Resume with parallel=zero2 or zero3"):
        check_layout(str(zero), "ddp", 2)


@pytest.mark.starts_process
def test_a_run_in_a_folder_another_live_run_holds_is_refused_before_it_touches_it(tmp_path, cache_dir):
    """Two runs on one folder: the second truncated the first's metrics.jsonl and removed its checkpoint
    in progress (same temporary name); the first crashed in its next save. The second is now refused
    at setup with one line naming the holder, and leaves the folder as it was."""
    from grpo.run_lock import hold_run_folder

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    with hold_run_folder(str(run_dir), is_main=True):  # this test process: the live run
        second = run_train(run_dir, cache_dir)
        out, _ = second.communicate(timeout=300)
    assert second.returncode == 1, out
    assert f"error: {run_dir} is in use by another run (process {os.getpid()} on " in out
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'
    assert not (run_dir / "config.yaml").exists()


@pytest.mark.starts_process
@pytest.mark.parametrize("mode", ["slow_rank1", "leftover"])
def test_two_ranks_publish_a_checkpoint_only_once_both_wrote(tmp_path, mode):
    """Two ranks (torchrun, gloo), tests/checkpoint_race.py: rank 1 writes its state late. Rank 0 must
    publish (COMPLETE, `latest`) only after it did: published early, the checkpoint lacks state_rank1.pt
    and rank 1's write fails into the renamed folder. `leftover`: a killed save left the temporary folder
    (with a stale rank 1 state), which rank 0 is slow to remove: rank 1 waits for the new one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if mode == "leftover":
        from grpo.checkpoint import checkpoint_name

        (run_dir / "checkpoints" / f".tmp-{checkpoint_name(1)}").mkdir(parents=True)
        (run_dir / "checkpoints" / f".tmp-{checkpoint_name(1)}" / "state_rank1.pt").write_bytes(b"killed")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "tests/checkpoint_race.py", str(run_dir), mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    latest = latest_checkpoint(str(run_dir))
    assert latest is not None, out.stdout[-3000:] + out.stderr[-3000:]
    held = sorted(f for f in os.listdir(latest) if f.startswith("state_rank"))
    assert held == ["state_rank0.pt", "state_rank1.pt"], f"the published checkpoint holds {held}"
    assert [torch.load(os.path.join(latest, f), weights_only=False)["data"] for f in held] == [0, 1]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    returned = [json.loads((run_dir / f"returned_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert returned == [latest, latest]


@pytest.mark.starts_process
def test_a_checkpoint_of_another_model_is_refused_by_name_and_leaves_config_yaml(make_cfg, tmp_path):
    """A resume whose model differs from the checkpoint's (here one layer fewer) ended in torch's
    "Error(s) in loading state_dict" traceback after the model was built, and config.yaml had already been
    rewritten to the refused run's settings: the next, correct resume then warned of a change it never made."""
    from grpo.errors import ConfigError
    from grpo.train import train

    run = tmp_path / "run"
    train(make_cfg("steps=1", "export_model=false"))
    config = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"another model than this run's: \d+ tensors not in this model \(the first: "
                                          r"model\.layers\.1\..*resume=false"):
        train(make_cfg("steps=2", "export_model=false", "model.tiny.num_layers=1"))
    assert (run / "config.yaml").read_text() == config
    assert not [f for f in os.listdir(run) if f.startswith("config-")]


@pytest.mark.starts_process
def test_a_resumed_runs_summary_gen_tokens_per_s_covers_every_step(make_cfg, tmp_path):
    """summary.json's gen_tokens_per_s is every step's sampled tokens over the engines' seconds
    (docs/logging.md), also for a run stopped after step 2 and resumed to 3: it was step 3's alone."""
    from grpo.train import train

    run = tmp_path / "run"
    train(make_cfg("steps=2", "checkpoint_every=1"))
    summary = train(make_cfg("steps=3", "checkpoint_every=1"))
    assert summary["resumed_from"] == 2
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    seconds = [r["time/batch_generate_s"] for r in steps]
    tokens = [r["gen_tokens_per_s"] * s for r, s in zip(steps, seconds)]  # one process: its own tokens
    assert summary["gen_tokens_per_s"] == pytest.approx(sum(tokens) / sum(seconds), rel=1e-9)
