"""When a rule reward is broken, not unlucky: it failed on every completion it was tried on, over the
whole step (every rank's share), in `STOP_AFTER` batches in a row. Then every advantage would be 0 batch
after batch, and the run would train nothing and exit 0, so it stops (RewardStop) on every rank at once.

Why not one batch: a rank's share can be a single prompt (batch_size = G x ranks), and one malformed
row of the dataset (a reference answer the reward cannot parse) then fails all of its completions; the
next batch draws other rows. A resume draws the failed batch again (the sampler is saved as of the
batches trained), so stopping on it would stop the resumed run too. Why every rank: ranks see different
rows, and a rank that stopped alone would leave the others waiting in their next collective.

Completions a reward was never tried on (skipped after `MAX_HANGS` timeouts in the batch) count neither
way: a few hanging completions say nothing about the rest; nor do episodes that ended in "error" (their
environment failed; `withhold_errored` gives them no reward anyway), so a reward that cannot read an
empty or cut-off final turn is not blamed for the environment. A model reward (a reward model, a judge)
decides its own stop (its servers' answers, reward.judge.min_scored), and so may a rule reward (by
raising RewardStop): that stop is made on every rank too (`stop_together`), in the same all-reduce, since a
rank that raised alone would leave the others waiting in their next collective until the peer watchdog.

The same holds for the whole reward, whatever the cause: when no completion of the step, on any rank,
got a reward in `STOP_AFTER` batches in a row (every episode's environment failed, or every function
abstained: None everywhere, e.g. a format regex that never matches), every advantage is 0 and the run
would train nothing and exit 0 (`nothing_rewarded`), so it stops too, naming which of the two it was.
Where every function is a model reward, only the first: a judge or reward model that scored nothing
decides its own stop (reward.judge.min_scored=0 asks to go on).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from grpo.dist import all_gather, all_reduce_sum
from grpo.errors import RewardStop

STOP_AFTER = 2  # batches in a row
FAILED_KEY, TRIED_KEY = "completions_failed", "completions_tried"  # each rule reward's counts in score()'s stats: <name>/<count>

ADVICE = ("a reward takes (completions, samples, **kwargs) and returns one finite number or None per completion; "
          "check that it reads fields the task's samples have (task=...), return 0 or None for a completion it "
          "cannot read instead of raising, raise reward.timeout_s if it is slow, or drop it from reward.funcs.")


def stop_together(stopped: RewardStop | None, ranks_stopped: float,
                  gather: Callable[[object], list] = all_gather) -> None:
    """Every rank calls this with its own stop (None: none) and the number of ranks that stopped (an
    all-reduced count): when any did, every rank raises, the others with the first stopped rank's reason
    (a collective only then, so it costs nothing while no reward stops)."""
    if not ranks_stopped:
        return
    reasons = gather(None if stopped is None else str(stopped))
    if stopped is not None:
        raise stopped
    rank, reason = next((r, m) for r, m in enumerate(reasons) if m is not None)
    raise RewardStop(f"rank {rank} stopped the run: {reason}")


class FailureStreak:
    """Counts, per rule reward, the batches in a row it failed throughout (`observe`, once per scored
    batch on every rank, with `grpo.rewards.score`'s stats), and stops every rank when a reward stopped
    on one."""

    def __init__(self, names: list[str], reduce: Callable[[list[float]], list[float]] = all_reduce_sum,
                 stop_after: int = STOP_AFTER, gather: Callable[[object], list] = all_gather):
        self.names, self.reduce, self.stop_after, self.gather = names, reduce, stop_after, gather
        self.streak = {name: 0 for name in names}
        self.observed = 0  # batches scored by this process
        self.unrewarded, self.errored_throughout = 0, True  # batches in a row where no completion got a reward

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the runs of failed and unrewarded batches go on across a resume, as in the
        unbroken run (a resume from the batch after the first failed one stopped a batch later, or never).
        `observed` stays this process's (`finish`)."""
        return {"streak": dict(self.streak), "unrewarded": self.unrewarded, "errored_throughout": self.errored_throughout}

    def load_state_dict(self, state: dict) -> None:
        self.streak.update({k: v for k, v in state.get("streak", {}).items() if k in self.streak})
        self.unrewarded = state.get("unrewarded", 0)
        self.errored_throughout = state.get("errored_throughout", True)

    def observe(self, stats: dict[str, float], stopped: RewardStop | None = None,
                rewards: Sequence[float] | None = None, finish_reasons: Sequence[str] = ()) -> None:
        """`stopped`: the RewardStop this rank's scoring raised (its stats are then empty); `rewards`:
        this rank's combined reward per completion (NaN: none), `finish_reasons` its episodes' endings."""
        rewards = [] if rewards is None else [float(r) for r in rewards]
        mine = [sum(math.isfinite(r) for r in rewards), sum(f == "error" for f in finish_reasons), len(rewards)]
        ranks_stopped, *counts, rewarded, errored, total = self.reduce([float(stopped is not None)] + [
            float(stats.get(f"{name}/{key}", 0.0)) for name in self.names for key in (FAILED_KEY, TRIED_KEY)] + mine)
        stop_together(stopped, ranks_stopped, self.gather)
        self.observed += 1
        for i, name in enumerate(self.names):
            failed, tried = counts[2 * i], counts[2 * i + 1]
            self.streak[name] = self.streak[name] + 1 if tried > 0 and failed == tried else 0
            if self.streak[name] >= self.stop_after:
                self.stop(name, f"{failed:.0f} of {tried:.0f} in the last")
        nothing = total > 0 and rewarded == 0
        self.errored_throughout = nothing and errored == total and (self.errored_throughout or not self.unrewarded)
        self.unrewarded = self.unrewarded + 1 if nothing else 0
        if self.unrewarded >= self.stop_after and (self.names or self.errored_throughout):
            self.nothing_rewarded(f"{errored:.0f} of {total:.0f} episodes ended in error in the last")

    def finish(self) -> None:
        """At the run's end (every rank: the streaks are the same everywhere): a run too short for
        `stop_after` batches (steps=1, a resume one step before the end) in which a reward failed
        throughout every batch it scored stops too, rather than end as if it had trained."""
        for name in self.names:
            if self.observed and self.streak[name] == self.observed:
                self.stop(name, f"every batch this run scored, {self.observed}")
        if self.observed and self.unrewarded == self.observed and (self.names or self.errored_throughout):
            self.nothing_rewarded(f"every batch this run scored, {self.observed}")

    def stop(self, name: str, which: str) -> None:
        raise RewardStop(f"reward {name!r} failed on every completion it was tried on in {self.streak[name]} batch(es) in "
                         f"a row, on every rank ({which}; the warnings above name each error): every advantage would be 0 "
                         "and the run would train nothing. " + ADVICE + " (A single batch may also be one dataset row "
                         "whose reference the reward cannot read.)")

    def nothing_rewarded(self, which: str) -> None:
        n = f"{self.unrewarded} batch(es) in a row, on every rank ({which})"
        if self.errored_throughout:
            raise RewardStop(f"every episode ended in 'error' in {n}: its environment failed (the warnings above name "
                             "each error), so no completion got a reward and the run would train nothing. Check env.name's "
                             "environment: reset(sample, seed) returns the opening text or None, and step(action) a "
                             "Step(observation: str | None, reward: finite number | None, done: bool, info: dict); "
                             "docs/environments.md.")
        raise RewardStop(f"no completion got a reward in {n}: every reward function abstained on each (returned None), "
                         "or one failed on it (the warnings above say why), or its episode ended in error, so every "
                         "advantage would be 0 and the run would train nothing. A "
                         "reward returns None only where it does not apply: check what it matches (a format or answer "
                         "pattern the completions never contain) against a few completions, or reward.funcs.")
