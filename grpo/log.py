"""Metrics to the console (a progress line every `log_every` steps), `metrics.jsonl`, and one more sink
chosen by `logger.backend`: `wandb`, or a dotted path to one's own (`mypkg.loggers.TensorBoard`), a class
or function called as `sink(run_dir, run_config, resume_step, **logger.kwargs)` whose result has
`log(metrics: dict, step: int)` and `finish()` (docs/logging.md)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import sys

from grpo.dotted import bind_or_refuse, import_dotted
from grpo.errors import ConfigError, RunFolderError

WANDB_ONLY = ("project", "entity")  # logger settings only wandb reads


# ---- run files (metrics.jsonl, summary.json, eval.json): strict JSON ----
# Python's json writes NaN and Infinity, which JSON has not: JSON.parse refuses such a row and jq reads
# Infinity as 1.8e308. A value a float cannot give (a rate over 0 tool calls, sampler_diff of a step that
# trained nothing, a skipped step's overflowed grad_norm: guard/skipped_steps counts it) is written null.

def strict(value):
    """`value` with every non-finite float (NaN, +-inf) as None, through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """Strict JSON of `value` (`strict`); a non-finite value left in some other type fails here, loudly."""
    return json.dumps(strict(value), allow_nan=False, **kwargs)


def write_json(path: str, data: dict) -> None:
    """`data` as strict JSON at `path`, whole or not at all (a kill leaves the old file)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(dumps(data, indent=2))
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl's rows, each null value back as NaN (a metric with no value, as the run computed
    it), so a reader's arithmetic and comparisons see a float."""
    with open(path, encoding="utf-8") as f:
        return [{k: math.nan if v is None else v for k, v in json.loads(line).items()} for line in f if line.strip()]


def format_line(step: int, total: int, m: dict) -> str:
    parts = [f"step {step:>4}/{total}"]
    for key, label, fmt in (
        ("reward/mean", "reward", "{:.3f}"),
        ("reward/zero_std_frac", "zero_std", "{:.2f}"),
        ("loss", "loss", "{:+.4f}"),
        ("clip_frac", "clip", "{:.3f}"),
        ("kl", "kl", "{:.4f}"),
        ("entropy", "ent", "{:.3f}"),
        ("completion_len", "len", "{:.1f}"),
        ("lr", "lr", "{:.1e}"),
        ("tokens_per_s", "tok/s", "{:,.0f}"),
        ("step_s", "s/step", "{:.3f}"),
        ("mfu/update", "mfu upd", "{:.1%}"),
        ("eval/accuracy", "eval_acc", "{:.3f}"),
    ):
        if key in m and m[key] is not None and not (isinstance(m[key], float) and math.isnan(m[key])):
            parts.append(f"{label} {fmt.format(m[key])}")
    return " | ".join(parts)


WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what wandb.init's settings take
SINK_METHODS = ("log", "finish")


def resolve_sink(backend: str):
    """None for `console` (metrics.jsonl and the console only), else the sink's factory: `wandb`'s or a dotted path's."""
    if backend == "console":
        return None
    if backend == "wandb":
        return WandbSink
    if "." not in backend:
        raise ConfigError(f"logger.backend={backend!r} is not console, wandb, nor a dotted path 'module.Class' to a "
                          f"sink of one's own (docs/logging.md).")
    factory = import_dotted(backend, f"logger.backend={backend!r}")
    missing = [m for m in SINK_METHODS if isinstance(factory, type) and not callable(getattr(factory, m, None))]
    if not callable(factory) or missing:
        raise ConfigError(f"logger.backend={backend!r} must be a class or function whose result has log(metrics, step) "
                          f"and finish(){f'; it has no {missing[0]}()' if missing else ''}.")
    return factory


def check(cfg, defaults) -> None:
    """logger.project and logger.entity name a wandb run: with the console logger nothing reads them, so a
    setting there is refused rather than left to look as if it took effect; logger.kwargs go to a sink of
    one's own only. `defaults`: LoggerConfig()."""
    factory = resolve_sink(cfg.backend)
    if cfg.get("kwargs") and factory in (None, WandbSink):
        reads = "logger.project/entity/mode" if factory is WandbSink else "logger.log_every/sample_every/num_samples"
        raise ConfigError(f"logger.kwargs={dict(cfg.kwargs)}: only a logger.backend of one's own (a dotted path) takes "
                          f"them; logger.backend={cfg.backend} reads {reads}.")
    if factory is not None:  # the call RunLogger makes, bound now: a misfit failed after the model loaded
        kwargs = sink_kwargs(cfg)
        bind_or_refuse(factory, ("run_dir", {}, None), kwargs, refusal=lambda signature, e: (
            f"logger.backend={cfg.backend!r}{signature} cannot be called as (run_dir, run_config, resume_step, "
            f"**logger.kwargs) with logger.kwargs={kwargs}: {e}."))
    if cfg.backend == "wandb":
        mode = cfg.get("mode") or os.environ.get("WANDB_MODE")
        if mode is not None and mode not in WANDB_MODES:
            where = "$WANDB_MODE" if os.environ.get("WANDB_MODE") == mode else "logger.mode"
            raise ConfigError(f"{where}={mode!r}: use one of {', '.join(WANDB_MODES)} (wandb's own check ends in a "
                              "traceback after the model is built).")
        return
    given = [f"logger.{k}={cfg[k]!r}" for k in WANDB_ONLY if cfg[k] != getattr(defaults, k)]
    if given:
        raise ConfigError(f"{', '.join(given)}: only logger=wandb reads this; add logger=wandb or drop the setting "
                          f"(logger.backend={cfg.backend} writes the console and metrics.jsonl).")


def sink_kwargs(cfg) -> dict:
    """What the sink is called with after (run_dir, run_config, resume_step): logger.project, entity and mode
    for wandb, logger.kwargs for one's own."""
    if cfg.backend == "wandb":
        return {k: cfg.get(k) for k in (*WANDB_ONLY, "mode")}
    return dict(cfg.get("kwargs") or {})


class WandbSink:
    """logger=wandb: the run's rows to Weights & Biases (logger.project, entity, mode), resumed with the run.
    Called as every sink is; it takes NaN as it is (a sink of one's own gets None, as metrics.jsonl has it)."""

    takes_nan = True

    def __init__(self, run_dir: str, run_config: dict, resume_step: int | None, project: str | None = None,
                 entity: str | None = None, mode: str | None = None):
        import wandb  # wandb: optional, only with logger.backend=wandb

        try:
            self.run = wandb.init(project=project, entity=entity, mode=mode, dir=run_dir, config=run_config,
                                  name=os.path.basename(os.path.normpath(run_dir)), **wandb_resume(run_dir, resume_step))
        except wandb.errors.UsageError as e:  # no API key found (wandb's own search), an unknown mode
            raise ConfigError(f"logger=wandb: wandb.init refused the run ({e}). logger=wandb needs WANDB_API_KEY or "
                              f"`wandb login`; or logger.mode=offline (logged here, `wandb sync` later), or "
                              f"logger=console.") from e

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


class RunLogger:
    def __init__(self, cfg, run_dir: str, total_steps: int, run_config: dict, enabled: bool = True, resume_step: int | None = None):
        self.cfg, self.total, self.enabled = cfg, total_steps, enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.sink = None
        if not enabled:
            return
        final = resume_step == total_steps  # resumed at the last step: only the final evaluation is left
        truncate_after(self.path, resume_step, final)  # steps past the checkpoint are redone on resume
        self.file = open(self.path, "a", encoding="utf-8")
        factory = resolve_sink(cfg.backend)
        # wandb drops a row whose step is not above the one it rewinds to: rewound to the last step, the
        # final evaluation (logged at that step) never reached it. It rewinds one step further and is sent
        # that step's kept rows again, which the evaluation's row then joins.
        replay = final and factory is WandbSink
        try:
            if factory is not None:
                self.sink = factory(run_dir, run_config, resume_step - 1 if replay else resume_step, **sink_kwargs(cfg))
            for row in read_metrics(self.path) if replay else ():
                if row.pop("step") == resume_step:
                    self.sink.log(row, resume_step)
        except BaseException:
            self.file.close()
            raise

    def log(self, step: int, metrics: dict, console: bool | None = None) -> None:
        if not self.enabled:
            return
        if os.fstat(self.file.fileno()).st_nlink == 0:  # rows written now would reach no file anyone can read
            raise RunFolderError(f"{self.path} was deleted or replaced while this run wrote to it (its run folder removed, "
                                 "or another run started in it): stopping rather than logging to a file no one can read. "
                                 "The checkpoints that remain resume the run.")
        self.file.write(dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.sink is not None:
            self.sink.log(metrics if getattr(self.sink, "takes_nan", False) else strict(metrics), step)
        if console or (console is None and (step % self.cfg.log_every == 0 or step == self.total)):
            print(format_line(step, self.total, metrics), flush=True)

    def samples(self, step: int, rows: list[tuple[str, str, float]]) -> None:
        if not self.enabled:
            return
        for prompt, completion, reward in rows:
            print(f"  sample @ {step}: {prompt!r} -> {completion!r}  reward {reward:g}", flush=True)

    def info(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Idempotent: the run's exit path closes it again after an early close."""
        if not self.enabled or self.file.closed:
            return
        self.file.close()
        if self.sink is not None:
            self.sink.finish()


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line).get("step")
    except json.JSONDecodeError:  # a line torn by a kill
        return None


def truncate_after(path: str, step: int | None, final: bool = False) -> None:
    """Keep rows up to `step` (the checkpoint resumed from); None keeps nothing (a fresh start). `final`
    (`step` is the run's last): of `step` its first row only, the training row. The resumed run only
    evaluates, and a final evaluation's row logged before a kill (its summary not yet written) would
    be there twice."""
    if not os.path.exists(path):
        return
    kept, seen = [], False
    with open(path, encoding="utf-8") as f:
        for line in f if step is not None else ():
            if (s := _step_of(line)) is None or s > step or (s == step and seen and final):
                continue
            seen = seen or s == step
            kept.append(line)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def wandb_resume(run_dir: str, resume_step: int | None) -> dict:
    """wandb.init's run id and resume arguments. wandb drops a row whose step is not above the run's
    last one, so resuming the same run with resume="allow" would keep the killed attempt's values of
    the redone steps while metrics.jsonl keeps the resumed ones. Instead:
      - a resumed run rewinds the folder's wandb run to the checkpoint (`resume_from=<id>?_step=<n>`):
        wandb drops the killed attempt's rows after it and the redone steps are logged once;
      - a fresh start gets a new id, recorded in `<run_dir>/wandb_id` (set aside with the metrics by
        resume=false), so it never logs into an earlier run of the same folder."""
    path = os.path.join(run_dir, "wandb_id")
    if resume_step is not None and os.path.exists(path):
        with open(path) as f:
            return {"resume_from": f"{f.read().strip()}?_step={resume_step}"}
    if resume_step is not None:  # a folder from before wandb_id: its id was the folder's hash
        return {"resume_from": f"{hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]}?_step={resume_step}"}
    run_id = secrets.token_hex(8)
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return {"id": run_id}
