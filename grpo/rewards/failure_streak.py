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
"""

from __future__ import annotations

from typing import Callable

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

    def observe(self, stats: dict[str, float], stopped: RewardStop | None = None) -> None:
        """`stopped`: the RewardStop this rank's scoring raised (its stats are then empty)."""
        ranks_stopped, *counts = self.reduce([float(stopped is not None)] + [
            float(stats.get(f"{name}/{key}", 0.0)) for name in self.names for key in (FAILED_KEY, TRIED_KEY)])
        stop_together(stopped, ranks_stopped, self.gather)
        self.observed += 1
        for i, name in enumerate(self.names):
            failed, tried = counts[2 * i], counts[2 * i + 1]
            self.streak[name] = self.streak[name] + 1 if tried > 0 and failed == tried else 0
            if self.streak[name] >= self.stop_after:
                self.stop(name, f"{failed:.0f} of {tried:.0f} in the last")

    def finish(self) -> None:
        """At the run's end (every rank: the streaks are the same everywhere): a run too short for
        `stop_after` batches (steps=1, a resume one step before the end) in which a reward failed
        throughout every batch it scored stops too, rather than end as if it had trained."""
        for name in self.names:
            if self.observed and self.streak[name] == self.observed:
                self.stop(name, f"every batch this run scored, {self.observed}")

    def stop(self, name: str, which: str) -> None:
        raise RewardStop(f"reward {name!r} failed on every completion it was tried on in {self.streak[name]} batch(es) in "
                         f"a row, on every rank ({which}; the warnings above name each error): every advantage would be 0 "
                         "and the run would train nothing. " + ADVICE + " (A single batch may also be one dataset row "
                         "whose reference the reward cannot read.)")
