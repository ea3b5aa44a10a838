"""What a run folder keeps across a kill and resume, or a `resume=false` restart: `metrics.jsonl` and
the wandb history hold every step once, and a fresh start never rewrites an earlier run's records.

wandb runs offline here (`mode=offline`: no network); its history is read back from the `.wandb`
files it writes, record by record, as `wandb sync` would upload them."""

import glob
import json
import math
import os
import struct
import time

import pytest
from omegaconf import OmegaConf

from grpo.checkpoint import set_aside_checkpoints
from grpo.config import LoggerConfig
from grpo.log import RunLogger


def wandb_records(path: str) -> list:
    """The protobuf records of one offline `.wandb` file (wandb's LevelDB-style log: a 7-byte file
    header ':W&B' + magic + version, then 32 KiB blocks of records, each a 7-byte header (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, out, buf = open(path, "rb").read(), 7, 32768, [], b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def wandb_history(run_dir) -> dict[int, float]:
    """The run's history as the wandb server keeps it: attempts in order, each rewind (`resume_from`,
    the run record's branch point) dropping the rows after its step, a later row replacing nothing
    (wandb ignores a step not above the run's last)."""
    rows: dict[int, float] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run" and record.run.branch_point.run:
                rows = {s: v for s, v in rows.items() if s <= record.run.branch_point.value}
            elif kind == "history":
                item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "x" in item and item["_step"] > max(rows, default=-1):
                    rows[item["_step"]] = item["x"]
    return rows


def settled_history(run_dir, expected: dict, timeout_s: float = 60.0) -> dict[int, float]:
    """`wandb_history` once it equals `expected`, or as it is after `timeout_s`: wandb's service writes
    a finished run's records after `wandb.finish()` returns (seen in CI under load: the resumed attempt's
    file read mid-write held none of its rows, and held them all a minute later)."""
    deadline = time.monotonic() + timeout_s
    while (rows := wandb_history(run_dir)) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return rows


def logger(run_dir, resume_step=None) -> RunLogger:
    cfg = OmegaConf.structured(LoggerConfig(backend="wandb", mode="offline", project="grpo-test", log_every=1000))
    return RunLogger(cfg, str(run_dir), 8, {}, resume_step=resume_step)


def wandb_values(run_dir, key: str) -> list[str]:
    """The value_json of `key` in every history record of the folder's runs."""
    return [i.value_json for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))
            for r in wandb_records(path) if r.WhichOneof("record_type") == "history"
            for i in r.history.item if (i.key or "/".join(i.nested_key)) == key]


def wandb_projects(run_dir) -> set[str]:
    return {r.run.project for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
            for r in wandb_records(path) if r.WhichOneof("record_type") == "run"}


def jsonl(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["x"]) for r in map(json.loads, open(run_dir / "metrics.jsonl"))]


@pytest.mark.starts_process
def test_a_resumed_run_logs_every_step_once_to_metrics_and_wandb(tmp_path):
    """Killed after logging step 6 with its checkpoint at 4, resumed: steps 5 and 6 are redone. Both
    metrics.jsonl and the wandb run hold 1..8 once each, the redone steps with the resumed values
    (resume="allow" on one id kept the killed attempt's 5 and 6 in wandb and dropped the new ones)."""
    first = logger(tmp_path)
    for step in range(1, 7):
        first.log(step, {"x": float(step), **({"g": math.inf, "d": math.nan} if step == 1 else {})})
    first.close()  # as the kill leaves it: the rows up to 6 are written
    time.sleep(1.1)  # wandb names an attempt's offline folder by the second it starts (and its id): a resume in the same second would replace it
    resumed = logger(tmp_path, resume_step=4)
    for step in range(5, 9):
        resumed.log(step, {"x": 10.0 * step})
    resumed.close()
    expected = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 50.0, 6: 60.0, 7: 70.0, 8: 80.0}
    assert jsonl(tmp_path) == sorted(expected.items())
    assert settled_history(tmp_path, expected) == expected
    assert wandb_projects(tmp_path) == {"grpo-test"}  # logger.project reached wandb.init, in both attempts
    # wandb takes NaN and inf (a skipped step's grad_norm shows as a spike, not a gap); metrics.jsonl has None
    assert (wandb_values(tmp_path, "g"), wandb_values(tmp_path, "d")) == (["Infinity"], ["NaN"])


@pytest.mark.starts_process
def test_resume_false_keeps_the_earlier_runs_records_aside(tmp_path):
    """A `resume=false` restart in a used folder: the earlier run's checkpoints, metrics, summary, config
    and wandb id move aside together, untouched; the new run's metrics and wandb run start empty."""
    first = logger(tmp_path)
    for step in range(1, 4):
        first.log(step, {"x": float(step)})
    first.close()
    (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    old_id = (tmp_path / "wandb_id").read_text()

    aside = set_aside_checkpoints(str(tmp_path))
    fresh = logger(tmp_path)  # what the run does next: resume_step None
    fresh.log(1, {"x": 100.0})
    fresh.close()

    assert sorted(os.listdir(aside)) == ["checkpoints", "config.yaml", "metrics.jsonl", "summary.json", "wandb_id"]
    assert open(os.path.join(aside, "config.yaml")).read() == "seed: 1\n"  # the earlier run's, not overwritten
    assert [json.loads(line)["step"] for line in open(os.path.join(aside, "metrics.jsonl"))] == [1, 2, 3]
    assert jsonl(tmp_path) == [(1, 100.0)] and not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "wandb_id").read_text() != old_id  # a new wandb run, not the old one's steps 1..3
    (tmp_path / "empty").mkdir()
    assert set_aside_checkpoints(str(tmp_path / "empty")) is None  # nothing to keep: nothing moves


def test_grpo_eval_leaves_a_training_folders_metrics_alone(tmp_path):
    """`grpo.eval run_dir=<a training run>` would append a step-0 row after the run's last step."""
    from grpo.eval import is_training_folder

    assert not is_training_folder(str(tmp_path))  # an eval-only folder: its metrics.jsonl gets the row
    (tmp_path / "summary.json").write_text("{}")
    assert is_training_folder(str(tmp_path))


def test_wandb_without_a_key_is_a_config_error_with_the_advice(tmp_path, monkeypatch):
    """logger=wandb online with no credentials: wandb's UsageError traceback ("No API key configured")
    before; now one ConfigError saying what to set. No network: wandb refuses before it connects."""
    from grpo.errors import ConfigError

    for key in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))
    cfg = OmegaConf.merge(OmegaConf.structured(LoggerConfig), {"backend": "wandb", "mode": "online"})
    with pytest.raises(ConfigError, match="logger=wandb needs WANDB_API_KEY or"):
        RunLogger(cfg, str(tmp_path), 1, {})


def test_run_files_are_strict_json_and_read_back_as_nan(tmp_path):
    """A metric with no value and a skipped step's overflowed grad_norm were written NaN and Infinity,
    which JSON.parse refuses and jq reads as 1.8e308: now null, in metrics.jsonl and summary.json alike;
    read_metrics gives NaN back to Python readers (grpo.verify, the doctor, the benches)."""
    import math

    from grpo.log import read_metrics, write_json

    def strict(text: str):  # a JSON parser as strict as JSON.parse
        def refuse(constant):
            raise ValueError(f"not JSON: {constant}")
        return json.loads(text, parse_constant=refuse)

    cfg = OmegaConf.structured(LoggerConfig(backend="console", log_every=1000))
    log = RunLogger(cfg, str(tmp_path), 2, {})
    log.log(1, {"loss": 0.5, "grad_norm": math.inf, "sampler_diff": math.nan, "episode/rates": [1.0, -math.inf]})
    log.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert strict(line) == {"step": 1, "loss": 0.5, "grad_norm": None, "sampler_diff": None, "episode/rates": [1.0, None]}
    [row] = read_metrics(tmp_path / "metrics.jsonl")
    assert row["loss"] == 0.5 and math.isnan(row["grad_norm"]) and math.isnan(row["sampler_diff"])

    write_json(str(tmp_path / "summary.json"), {"eval_gain": math.nan, "nested": {"peak": math.inf}, "steps": 2})
    assert strict((tmp_path / "summary.json").read_text()) == {"eval_gain": None, "nested": {"peak": None}, "steps": 2}


def test_a_resume_at_the_last_step_keeps_one_final_evaluation_row(tmp_path):
    """Killed between the final evaluation's row and summary.json: the resumed run (nothing left to
    train) logs the evaluation again, and metrics.jsonl held it twice. Continued to more steps, an
    earlier run's final row at its last step stays (it was that run's evaluation). As the run opens
    its log: RunLogger, resumed at step 4 of 4, then of 8."""
    def rows(*steps):
        return "".join(json.dumps({"step": s, "x": i}) + "\n" for i, s in enumerate(steps))

    cfg = OmegaConf.structured(LoggerConfig(log_every=1000))
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(0, 1, 2, 3, 4, 4))  # step 4's training row, then its final evaluation
    RunLogger(cfg, str(tmp_path), 4, {}, resume_step=4).close()
    assert [json.loads(x)["x"] for x in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    path.write_text(rows(0, 1, 2, 3, 4, 4, 5))
    RunLogger(cfg, str(tmp_path), 8, {}, resume_step=4).close()  # steps=8 now: the run goes on from 4
    assert [json.loads(x)["x"] for x in path.read_text().splitlines()] == [0, 1, 2, 3, 4, 5]


def test_a_logged_row_is_on_disk_at_once_and_a_torn_one_is_dropped_on_resume(tmp_path):
    """A row is in the file as soon as it is logged (a kill loses none, and `tail -f` and grpo.plot see it
    mid-run); a kill mid-write leaves a torn last line, which the resume drops (appended to, it made the
    next row unreadable: read_metrics, and so verify, doctor and plot, failed on the file)."""
    from grpo.log import read_metrics

    cfg = OmegaConf.structured(LoggerConfig(log_every=1000))
    path = tmp_path / "metrics.jsonl"
    run = RunLogger(cfg, str(tmp_path), 10, {})
    for step in (1, 2, 3):
        run.log(step, {"loss": 0.1 * step})
        assert json.loads(path.read_text().splitlines()[-1]) == {"step": step, "loss": 0.1 * step}  # not closed yet
    run.close()
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # killed while writing step 4's row; its checkpoint is step 3's
    resumed = RunLogger(cfg, str(tmp_path), 10, {}, resume_step=3)
    resumed.log(4, {"loss": 0.4})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(str(path))] == [(1, 0.1), (2, 0.2), (3, 0.1 * 3), (4, 0.4)]


def test_a_deleted_metrics_file_stops_the_run_instead_of_logging_into_it(tmp_path):
    """`rm -rf` of the run folder mid-run: the logger kept writing to the unlinked file and the run
    ended with exit 0, its metrics and config gone. Now the next row raises, naming the file."""
    from grpo.errors import RunFolderError

    cfg = OmegaConf.structured(LoggerConfig(backend="console", log_every=1000))
    log = RunLogger(cfg, str(tmp_path), 4, {})
    log.log(1, {"loss": 0.5})
    os.remove(tmp_path / "metrics.jsonl")
    with pytest.raises(RunFolderError, match="metrics.jsonl was deleted or replaced while this run wrote to it"):
        log.log(2, {"loss": 0.4})
    log.close()


def test_one_live_run_per_folder(tmp_path):
    """A second run in a folder a live run holds is refused, naming the holder; the lock goes with the
    process (or the run's exit), so a later run, a resume, takes it."""
    from grpo.errors import RunFolderError
    from grpo.run_lock import hold_run_folder

    with hold_run_folder(str(tmp_path), is_main=True):
        assert (tmp_path / ".lock").read_text().startswith(f"{os.getpid()} on ")
        with pytest.raises(RunFolderError, match=f"is in use by another run \\(process {os.getpid()} on "):
            with hold_run_folder(str(tmp_path), is_main=True):
                pass
    with hold_run_folder(str(tmp_path), is_main=True):  # released: taken again
        pass
    with pytest.raises(RunFolderError, match="/proc/1: this process cannot write there"):  # not a traceback on rank 0
        with hold_run_folder("/proc/1", is_main=True):
            pass


def test_leftovers_of_killed_writes_are_removed_and_an_unwritable_checkpoints_folder_is_named(tmp_path):
    """A kill during an export left model.tmp-<pid> (a real model's partial copy: gigabytes) and during
    a checkpoint's publish a .latest-<pid> pointer; no later run removed another pid's. A checkpoints
    folder no process can write failed at the first save, after training up to it."""
    from grpo.checkpoint import _prune, check_writable, remove_leftovers
    from grpo.config import ConfigError
    from grpo.train import resumed_span

    (tmp_path / "model.tmp-12345").mkdir()
    (tmp_path / "model.tmp-12345" / "model.safetensors").write_text("partial")
    (tmp_path / "model").mkdir()
    remove_leftovers(str(tmp_path / "model"))
    assert sorted(os.listdir(tmp_path)) == ["model"]
    root = tmp_path / "checkpoints"
    for d in ("step_00000002", "step_00000004", ".tmp-step_00000006"):
        (root / d).mkdir(parents=True)
    (root / ".latest-777").write_text("step_00000004")
    _prune(str(root), keep=2, newest="step_00000004")
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004"]

    check_writable(str(tmp_path))
    (tmp_path / "ro").mkdir()
    os.symlink("/proc/1", tmp_path / "ro" / "checkpoints")  # a folder no one, root included, can add a file to
    with pytest.raises(ConfigError, match="cannot write checkpoints there"):
        check_writable(str(tmp_path / "ro"))
    assert resumed_span(0, 8) == "" and resumed_span(4, 8) == " for steps 5-8 (resumed)"
    assert resumed_span(8, 8) == " (resumed: the final evaluation only)"


class RecordingSink:
    """A logger.backend of one's own (a dotted path): what a TensorBoard or MLflow writer would be given."""

    made: list = []

    def __init__(self, run_dir, run_config, resume_step, prefix="x/"):
        self.rows, self.finished, self.prefix = [], False, prefix
        self.made.append((run_dir, run_config, resume_step, self))

    def log(self, metrics, step):
        self.rows.append((step, {self.prefix + k: v for k, v in metrics.items()}))

    def finish(self):
        self.finished = True


def recording_sink(run_dir, run_config, resume_step, prefix="x/"):
    """A sink made by a function (docs/logging.md: a class or a function)."""
    return RecordingSink(run_dir, run_config, resume_step, prefix)


class NeedsDir:
    """A writer whose own argument has no default: logger.kwargs must give it."""

    def __init__(self, run_dir, run_config, resume_step, log_dir):
        pass

    def log(self, metrics, step):
        pass

    def finish(self):
        pass


class NoFinish:
    def __init__(self, run_dir, run_config, resume_step):
        pass

    def log(self, metrics, step):
        pass


def test_a_sink_of_ones_own_gets_every_row_as_metrics_jsonl_has_it(tmp_path):
    """logger.backend named only console or wandb: another writer meant editing grpo/log.py. A dotted path
    is built with (run_dir, run_config, resume_step, **logger.kwargs), gets each row (NaN as None, as
    metrics.jsonl writes it) and is finished on close; a misfit is refused at validate, naming it."""
    import math

    from grpo.config import validate
    from grpo.errors import ConfigError
    from tests.conftest import compose_cfg

    RecordingSink.made.clear()
    cfg = OmegaConf.merge(OmegaConf.structured(LoggerConfig), {"backend": "tests.test_run_records.RecordingSink",
                                                               "kwargs": {"prefix": "run/"}, "log_every": 1000})
    run = RunLogger(cfg, str(tmp_path), 2, {"seed": 3}, resume_step=None)
    run.log(1, {"loss": 0.5, "sampler_diff": math.nan})
    run.log(2, {"loss": 0.25})
    run.close()
    (run_dir, run_config, resume_step, sink), = RecordingSink.made
    assert (run_dir, run_config, resume_step) == (str(tmp_path), {"seed": 3}, None) and sink.finished
    assert sink.rows == [(1, {"run/loss": 0.5, "run/sampler_diff": None}), (2, {"run/loss": 0.25})]
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [
        {"step": 1, "loss": 0.5, "sampler_diff": None}, {"step": 2, "loss": 0.25}]
    assert not RunLogger(cfg, str(tmp_path / "r1"), 2, {}, enabled=False).sink  # ranks but the first: no sink

    validate(compose_cfg("logger.backend=tests.test_run_records.RecordingSink"))
    validate(compose_cfg("logger.backend=tests.test_run_records.NeedsDir", "+logger.kwargs.log_dir=tb"))
    validate(compose_cfg("logger.backend=tests.test_run_records.recording_sink"))
    RecordingSink.made.clear()
    (tmp_path / "f").mkdir()
    by_function = RunLogger(OmegaConf.merge(cfg, {"backend": "tests.test_run_records.recording_sink"}), str(tmp_path / "f"),
                            1, {}, resume_step=None)
    by_function.log(1, {"loss": 0.5})
    by_function.close()
    assert RecordingSink.made[0][3].rows == [(1, {"run/loss": 0.5})] and RecordingSink.made[0][3].finished
    for overrides, says in [
        (["logger.backend=tests.test_run_records.NeedsDir"], "missing a required argument: 'log_dir'"),
        (["logger.backend=.tests.test_run_records.RecordingSink"], "could not be imported"),
        (["logger.backend=tensorboard"], "logger.backend='tensorboard' is not console, wandb, nor a dotted path"),
        (["logger.backend=tests.test_run_records.Nope"], "logger.backend='tests.test_run_records.Nope' could not be imported"),
        (["logger.backend=tests.test_run_records.NoFinish"], "whose result has log(metrics, step) and finish(); it has no finish()"),
        (["logger.backend=tests.test_run_records.RecordingSink", "+logger.kwargs.prefx=a"],
         "cannot be called as (run_dir, run_config, resume_step, **logger.kwargs) with logger.kwargs={'prefx': 'a'}"),
        (["+logger.kwargs.prefix=a"], "logger.kwargs={'prefix': 'a'}: only a logger.backend of one's own (a dotted "
                                      "path) takes them; logger.backend=console reads logger.log_every/sample_every/num_samples."),
        (["logger=wandb", "+logger.kwargs.prefix=a"], "logger.backend=wandb reads logger.project/entity/mode."),
    ]:
        with pytest.raises(ConfigError) as e:
            validate(compose_cfg(*overrides))
        assert says in str(e.value), str(e.value)


def test_the_summarys_revision_says_when_the_tree_differs_from_its_commit(tmp_path):
    """summary.json's git_revision names the code that ran: a run from an edited tree is not its commit's
    (the results docs quote this field as a run's provenance). An untracked file changes no code that ran."""
    import subprocess

    from grpo.provenance import git_revision

    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path,  # noqa: E731
                                    check=True, capture_output=True, text=True).stdout.strip()
    assert git_revision(str(tmp_path)) == "unknown"  # not a checkout
    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-qm", "one")
    commit = git("rev-parse", "HEAD")
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert git_revision(str(tmp_path)) == commit
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_revision(str(tmp_path)) == f"{commit}-dirty"
    assert not (tmp_path / ".git" / "index.lock").exists()


def test_the_console_prints_every_log_every_steps_and_the_last_one(tmp_path, capsys):
    """log_every=2 over 5 steps prints steps 2, 4 and 5 (the last, whatever log_every), a metric without a
    value (NaN) left out of the line; a tuple's NaN is written null as a list's is."""
    import math

    cfg = OmegaConf.structured(LoggerConfig(backend="console", log_every=2))
    log = RunLogger(cfg, str(tmp_path), 5, {})
    for step in range(1, 6):
        log.log(step, {"loss": 0.5, "kl": math.nan, "pair": (1.0, math.nan)})
    log.close()
    assert capsys.readouterr().out.splitlines() == [f"step    {s}/5 | loss +0.5000" for s in (2, 4, 5)]  # NaN: not shown
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["pair"] == [1.0, None]


def test_a_fresh_start_gets_a_new_wandb_run_and_a_resume_rewinds_the_recorded_one(tmp_path):
    """A folder's wandb_id is an earlier run's: a fresh start (resume_step None) records a new id, never
    logging into that run; a resume at step 4 rewinds the id recorded."""
    from grpo.log import wandb_resume

    (tmp_path / "wandb_id").write_text("0123456789abcdef\n")
    fresh = wandb_resume(str(tmp_path), None)
    assert set(fresh) == {"id"} and fresh["id"] != "0123456789abcdef" and len(fresh["id"]) == 16
    assert (tmp_path / "wandb_id").read_text() == fresh["id"] + "\n"
    assert wandb_resume(str(tmp_path), 4) == {"resume_from": f"{fresh['id']}?_step=4"}


def test_a_fresh_start_empties_the_folders_metrics(tmp_path):
    """resume_step None (a fresh start in a folder of an earlier run) keeps none of its rows."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n')
    cfg = OmegaConf.structured(LoggerConfig(backend="console", log_every=1000))
    log = RunLogger(cfg, str(tmp_path), 2, {}, resume_step=None)
    log.log(1, {"loss": 0.25})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.25}\n'


@pytest.mark.starts_process
def test_a_resume_at_the_last_step_sends_the_final_evaluation_to_wandb(tmp_path):
    """Killed in the final evaluation (step 4's checkpoint written), resumed: the run only evaluates, and
    logs it at step 4. wandb, rewound to step 4, dropped that row (its step not above 4): the wandb run
    had no final eval/accuracy while metrics.jsonl had it."""
    cfg = OmegaConf.structured(LoggerConfig(backend="wandb", mode="offline", project="grpo-test", log_every=1000))
    first = RunLogger(cfg, str(tmp_path), 4, {})
    for step in range(1, 5):
        first.log(step, {"x": float(step)})
    first.close()  # killed during the final evaluation
    time.sleep(1.1)  # a resume in the same second would replace the first attempt's offline folder
    resumed = RunLogger(cfg, str(tmp_path), 4, {}, resume_step=4)
    resumed.log(4, {"eval/accuracy": 0.5})
    resumed.close()
    assert jsonl_steps(tmp_path) == [1, 2, 3, 4, 4]
    expected = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    assert settled_history(tmp_path, expected) == expected  # step 4's training row kept
    deadline = time.monotonic() + 60
    while not wandb_values(tmp_path, "eval/accuracy") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert wandb_values(tmp_path, "eval/accuracy") == ["0.5"]


def jsonl_steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
