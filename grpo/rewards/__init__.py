"""Reward functions: `fn(completions: list[str], samples: list[Sample], **info) -> list[float | None]`.

A finite number is a score. None means the function does not apply to that completion (it abstains:
the other functions still count). A completion a function failed on is `FAILED` (NaN) in the
scores `score` returns: excluded from the statistics (advantage 0, its tokens out of the loss),
whatever the other functions gave it, because their partial sum is not the reward the run asked for. `info` holds `completion_ids` (token
ids per completion) and `max_new_tokens`; a function takes what it needs and ignores the rest.
With an environment (env=...), `completions` are each episode's final turn and `completion_ids` its
ids, and `info` adds `transcripts` (every turn and observation as text), `turns`, `finish_reasons`
(stop, length, turns, error) and `env_rewards`; the `env` function returns the environment's reward.
`reward.funcs` names functions from `REWARDS` or by dotted path (`mypkg.rewards.my_reward`), each
with a weight. A reward that holds a model (`MODEL_REWARDS`: `rm`, a reward model) is a module with
`check(cfg)` (validate: its settings, nothing loaded) and `build(cfg, device)` (the function, its model
loaded once when the run is built); it is called like any other.

A rule function that raises or runs past `reward.timeout_s` on a batch is retried one completion at
a time (each with the same timeout; after 3 timeouts the batch's remaining completions are skipped);
each completion it still fails on is FAILED, with a warning naming the function, the completion and
the error. A value that is not a finite number (NaN, inf, a string) is a failure too. `score` counts,
per rule function, the completions it was tried on and failed on (`<name>/completions_tried`,
`<name>/completions_failed` in its stats, logged each step). The run goes on, unless the function failed
on every completion it was tried on, over every rank, in two batches in a row (a wrong signature, a
field the task's samples lack, NaN throughout): every advantage would be 0 and the run would train
nothing, so it stops (RewardStop; grpo/rewards/failure_streak.py says why not on one batch).
A hung call's thread cannot be killed in Python; it is abandoned (a daemon thread) and the run moves past it.

A model reward (`MODEL_REWARDS`) is called once per batch in the caller's thread, with no
`reward.timeout_s` and no retry: it bounds its own time (a reward model's token budget, its servers'
or a judge's request timeouts). An abandoned call would keep its forwards running on the trainer's
device beside the one-at-a-time retries and the next update (and, under sequence parallelism, enter
the split's attention from another thread), and a retry would score every completion again. If it
raises, the batch's completions are FAILED, with a warning. A model reward never abstains: its None
(a judge's failed or garbage answer, a text past a reward model's context or budget: each warned and
counted by the function) is FAILED, and so is a score that is not finite (warned here).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import time
import warnings
from collections.abc import Mapping, Set as AbstractSet
from typing import Callable

from omegaconf import OmegaConf

from grpo.dotted import import_dotted, signature_of
from grpo.errors import ConfigError, HungCallsError, RewardStop
from grpo.reward_config import JudgeConfig, RewardModelConfig
from grpo.rewards.countdown import countdown
from grpo.timeouts import call_with_timeout, check_hung
from grpo.rewards.env import env_reward
from grpo.rewards.failure_streak import FAILED_KEY, TRIED_KEY
from grpo.rewards.exact_match import exact_match
from grpo.rewards.format import answer_format, overlong_penalty
from grpo.rewards.math_answer import math_verify

RewardFn = Callable[..., list]

REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "format": answer_format,
    "countdown": countdown,
    "overlong": overlong_penalty,
    "math_verify": math_verify,
    "env": env_reward,
}
# name -> module (imported on use) with check(cfg) and build(cfg, device) -> RewardFn
MODEL_REWARDS: dict[str, str] = {
    "rm": "grpo.rewards.rm",
    "judge": "grpo.rewards.judge",
}
MODEL_SETTINGS = {"rm": RewardModelConfig, "judge": JudgeConfig}  # reward.<name>.*: read only by that reward


def resolve_reward(name: str) -> RewardFn:
    if name in REWARDS:
        return REWARDS[name]
    if "." not in name:
        raise ConfigError(f"reward {name!r} is not one of {sorted(REWARDS) + sorted(MODEL_REWARDS)} nor a dotted path "
                          f"'module.function'.")
    fn = import_dotted(name, f"reward {name!r}")
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable.")
    check_argument_order(name, fn)
    return fn


def check_argument_order(name: str, fn) -> None:
    """A reward is called as fn(completions, samples, **info); one written TRL's way, (prompts,
    completions, **kwargs), would silently score the samples as completions."""
    signature = signature_of(fn)
    if signature is None:
        return
    params = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if params[:1] in (["prompts"], ["prompt"]) or "completions" in params[1:2]:
        raise ConfigError(f"reward {name!r} takes ({', '.join(params)}, ...), but a reward is called as fn(completions, "
                          f"samples, **info): the completions' texts first, then their samples (each with .prompt and "
                          f".answer), so it would read the samples as completions. Reorder its parameters to "
                          f"(completions, samples, **kwargs); docs/rewards.md.")


def reward_names(cfg) -> list[str]:
    """reward.funcs' names in order; an entry without one (`reward.funcs=[{weight: 1}]`) is refused
    here, before anything reads `name` (OmegaConf's MissingMandatoryValue), and so is a name listed
    twice (its reward would count twice, silently)."""
    names = []
    for i, f in enumerate(cfg.reward.funcs):
        if OmegaConf.is_missing(f, "name"):
            raise ConfigError(f"reward.funcs[{i}] has no name: give each entry one, e.g. reward.funcs=[{{name: "
                              f"exact_match, weight: 1.0}}] (one of {sorted(REWARDS) + sorted(MODEL_REWARDS)} or a "
                              f"dotted path 'module.function').")
        if f.name in names:
            raise ConfigError(f"reward.funcs lists {f.name!r} twice, so its reward would count twice: list it once "
                              f"with weight: 2 (or the sum of the weights you meant).")
        names.append(f.name)
    return names


def check_rewards(cfg) -> None:
    """validate's part (`cfg`: the run config): at least one function, each named once, every name
    resolves, a timeout that can pass, and a reward that holds a model checks its own settings
    without loading anything."""
    if not cfg.reward.funcs:
        raise ConfigError("reward.funcs is empty: list at least one reward function (e.g. reward=exact_match).")
    reward_names(cfg)
    timeout_s = cfg.reward.timeout_s
    if not 0 < timeout_s < math.inf:  # 0: every call "times out" at once; inf: threading cannot wait that long
        raise ConfigError(f"reward.timeout_s={timeout_s}: give a number of seconds > 0 (a rule reward that runs past "
                          f"it is retried one completion at a time; 0 or less would drop every slow call), e.g. "
                          f"reward.timeout_s=30.")
    weights = {f.name: f.weight for f in cfg.reward.funcs}
    if not all(math.isfinite(w) for w in weights.values()):  # inf * 0 is NaN; NaN passes both checks below
        raise ConfigError(f"reward.funcs weights {weights}: each weight must be a finite number (inf or nan would make "
                          f"the rewards inf or NaN, every completion's advantage NaN or 0).")
    if any(w == 0 for w in weights.values()) or max(weights.values()) <= 0:
        raise ConfigError(f"reward.funcs weights {weights}: a weight of 0 changes nothing (drop that function), and "
                          f"at least one must be > 0; with none the run learns to lower every reward (a function that "
                          f"measures a cost can return it negated).")
    for f in cfg.reward.funcs:
        if f.name in MODEL_REWARDS:
            importlib.import_module(MODEL_REWARDS[f.name]).check(cfg)
        else:
            resolve_reward(f.name)  # raises a ConfigError naming the function
    unread = unread_model_settings(cfg)
    if unread:
        names = sorted({key.split(".")[1] for key in unread})
        raise ConfigError(f"{'; '.join(unread)}: reward.funcs has no {' nor '.join(names)}, so nothing reads "
                          f"{'these settings' if len(unread) > 1 else 'the setting'}. Add the reward (reward="
                          f"{names[0]}, or an entry `{names[0]}` in reward.funcs), or remove the setting.")


def changed(given, default, prefix: str) -> list[str]:
    """`prefix.key=value` for every leaf of the dict `given` that differs from `default`'s."""
    out = []
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(default.get(key), dict):
            out += changed(value, default[key], f"{prefix}.{key}")
        elif value != default.get(key):
            out.append(f"{prefix}.{key}={value!r}")
    return out


def unread_model_settings(cfg) -> list[str]:
    """reward.rm.* and reward.judge.* given (other than the schema's defaults) while reward.funcs holds
    no `rm` (`judge`): no function reads them (reward.rm.path=tiny_rm beside reward=exact_match)."""
    used = {f.name for f in cfg.reward.funcs}
    out = []
    for name, schema in MODEL_SETTINGS.items():
        if name not in used and name in cfg.reward:
            given = OmegaConf.to_container(cfg.reward[name], resolve=True)
            out += changed(given, dataclasses.asdict(schema()), f"reward.{name}")
    return out


def build_rewards(cfg, device="cpu") -> list[tuple[str, RewardFn, float]]:
    """(name, function, weight) per `reward.funcs` entry of the run config `cfg`; a reward that holds a
    model is built here, once, its model on `device` (the trainer's)."""
    def build(name: str) -> RewardFn:
        if name in MODEL_REWARDS:
            return importlib.import_module(MODEL_REWARDS[name]).build(cfg, device)
        return resolve_reward(name)

    return [(f.name, build(f.name), float(f.weight)) for f in cfg.reward.funcs]


MAX_HANGS = 3  # per function and batch, in the one-at-a-time retry
FAILED = math.nan  # a completion the function could not score: excluded, whatever the others gave it


def as_number(value) -> float | None:
    """A reward function's value as a float where it is a real number: a Python int, float or bool (as
    before: `c == s.answer` is 1 or 0), a numpy scalar (np.float32 from np.mean, np.int64) or a 0-d
    tensor; None for anything else (a string, a tensor of several values), which is not a score."""
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or array: not numbers.Real
        item = value.item()
        return float(item) if isinstance(item, (int, float)) else None
    return None


def is_score(value) -> bool:
    """A reward is a finite real number, or None (the function abstains)."""
    return value is None or ((number := as_number(value)) is not None and math.isfinite(number))


def as_scores(values: list) -> list[float | None]:
    """A function's values, each checked by `batch_problem`, as Python floats (None kept)."""
    return [None if v is None else as_number(v) for v in values]


def is_scored(value) -> bool:
    """Whether a value of `score`'s rewards_FB counts: a number, not None (abstained) nor FAILED."""
    return value is not None and not math.isnan(value)


def batch_problem(values: list, n: int, finite: bool = True) -> str | None:
    """What is wrong with a function's answer for n completions (None: one score each). `finite=False`:
    NaN and inf pass (a model reward's, handled per completion)."""
    if len(values) != n:
        return f"returned {len(values)} values for {n} completion{'s' * (n != 1)}"
    number = is_score if finite else (lambda v: v is None or as_number(v) is not None)
    bad = next((v for v in values if not number(v)), "ok")
    return None if bad == "ok" else f"returned {bad!r}, not a finite number or None"


def as_values(returned) -> list:
    """A reward function's answer as a list, one value per completion in their order: a list, tuple, 1-D
    array or tensor, or any other ordered iterable (a generator). A dict, set or str is refused: its keys,
    its hash order or its characters would be read as the scores."""
    if isinstance(returned, (Mapping, AbstractSet, str, bytes)):
        raise TypeError(f"returned a {type(returned).__name__}, not a list of scores in the completions' order")
    return list(returned)


def run_model_reward(name: str, fn, completions: list[str], samples: list, info: dict) -> list:
    """A model reward's scores: once, in this thread (see the module's docstring)."""
    try:
        values = as_values(fn(completions, samples, **info))
        error = batch_problem(values, len(completions), finite=False)
    except RewardStop:
        raise
    except Exception as e:  # noqa: BLE001 - the batch is excluded and the run goes on, as for a rule reward
        error = f"{type(e).__name__}: {e}"
    if error is not None:
        warnings.warn(f"reward {name!r} failed on the batch ({error}); its {len(completions)} completions are excluded",
                      stacklevel=3)
        return [FAILED] * len(completions)
    values = as_scores(values)
    infinite = [i for i, v in enumerate(values) if v is not None and not math.isfinite(v)]
    if infinite:
        warnings.warn(f"reward {name!r} gave {len(infinite)} of {len(values)} completions a score that is not finite "
                      f"({values[infinite[0]]!r} for completion {infinite[0]}); they are excluded. A reward model in "
                      f"bf16 or fp16 can overflow: try reward.rm.dtype=float32.", stacklevel=3)
    return [v if v is not None and math.isfinite(v) else FAILED for v in values]


def run_rule_reward(name: str, fn, completions: list[str], samples: list, info: dict,
                    timeout_s: float, counted: list[bool]) -> tuple[list, int, int]:
    """A rule reward's scores (FAILED where it failed), and how many of the `counted` completions it
    failed on and was tried on (`failure_streak`): the whole batch at once, else one completion at a time."""
    setting = "reward.timeout_s"
    values, error = call_with_timeout(lambda: as_values(fn(completions, samples, **info)), timeout_s, setting, (RewardStop,))
    if error is None and (error := batch_problem(values, len(completions))) is None:
        return as_scores(values), 0, sum(counted)
    warnings.warn(f"reward {name!r} failed on the batch ({error}); scoring its completions one at a time", stacklevel=3)
    out, hangs, failed, tried = [], 0, 0, 0
    for i, (c, s) in enumerate(zip(completions, samples)):
        one = {k: [v[i]] if isinstance(v, list) and len(v) == len(completions) else v for k, v in info.items()}
        if hangs < MAX_HANGS:
            value, err = call_with_timeout(lambda c=c, s=s, one=one: as_values(fn([c], [s], **one)), timeout_s, setting,
                                           (RewardStop,))
            hangs += err is not None and err.startswith("no answer")
            if err is None:
                err = batch_problem(value, 1)
            tried += counted[i]
            failed += counted[i] and err is not None
        else:  # bounded: a function that keeps hanging does not stall the step for B x timeout
            value, err = None, f"skipped after {MAX_HANGS} timeouts in this batch"
        if err is not None:
            warnings.warn(f"reward {name!r} failed on completion {i} {c[:60]!r} ({err}); it is excluded", stacklevel=3)
        out.append(FAILED if err is not None else as_scores(value)[0])
    return out, failed, tried


def score(reward_fns, completions: list[str], samples: list, timeout_s: float = 30.0,
          counted: list[bool] | None = None, **info) -> tuple[list[list[float | None]], dict[str, float]]:
    """Run every reward function -> (rewards_FB, stats): rewards_FB a score, None (abstained) or FAILED
    per function and completion (`combine_rewards` sums them); each function's seconds
    (`time/reward_<name>_s`), a rule function's completions failed and tried (`failure_streak`) among
    the `counted` ones (default all; an episode that ended in "error" is not) and the counts a function
    keeps in its `stats` attribute (a judge's requests, failures, garbage answers, retries) as
    `<name>/<count>`; all of them add up over draws."""
    rewards_FB, stats = [], {}
    try:  # the environment's calls abandoned while generating (timeouts.call_with_timeout): stopped here, with every rank
        check_hung()
    except HungCallsError as e:
        raise RewardStop(str(e)) from e
    counted = [True] * len(completions) if counted is None else counted
    for name, fn, _ in reward_fns:
        t0 = time.perf_counter()
        if name in MODEL_REWARDS:
            rewards_FB.append(run_model_reward(name, fn, completions, samples, info))
        else:
            try:
                values, stats[f"{name}/{FAILED_KEY}"], stats[f"{name}/{TRIED_KEY}"] = run_rule_reward(
                    name, fn, completions, samples, info, timeout_s, counted)
            except HungCallsError as e:  # as a RewardStop: every rank stops together (failure_streak.stop_together)
                raise RewardStop(f"reward {name!r}: {e}") from e
            rewards_FB.append(values)
        stats[f"time/reward_{name}_s"] = time.perf_counter() - t0
        stats.update({f"{name}/{k}": float(v) for k, v in (getattr(fn, "stats", None) or {}).items()})
    if "env" not in [name for name, _, _ in reward_fns] and any(r is not None for r in info.get("env_rewards") or ()):
        warnings.warn("the environment gives its episodes rewards (Step.reward), but reward.funcs has no `env`, so "
                      "nothing trains on them: if they should, add it (reward=env, or an entry {name: env, weight: 1.0} "
                      "beside the others); an environment whose final answer the task's own reward already scores "
                      "(env=retry) can leave it out.", stacklevel=2)  # the same text each batch: Python shows it once
    return rewards_FB, stats
