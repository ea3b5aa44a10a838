"""A step's metrics over ranks: each rank logs its own share, `reduce_metrics` makes the whole batch's.

Each rank holds the same number of prompts, so a per-prompt or per-completion mean is the mean of the
ranks' means. What is not needs its parts: a mean over the completions a reward scored (they differ
by rank), a standard deviation, a rate over tool calls, a count. A rank logs those as a `Ratio`
(numerator and denominator, each summed over ranks, then divided), a `Spread` (count, sum and sum of
squares: the whole batch's sample standard deviation) or a `Count` (summed). Averaged instead, a
rank with no scored completion made `reward/<function>` NaN for the run, `reward/std` left out the
spread between ranks (0.18 against 0.51), and a judge's 3 failures read 1.5.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from grpo.dist import DistInfo, all_gather, all_reduce_max, all_reduce_sum


def std_from_moments(count: float, total: float, squares: float) -> float:
    """Sample std (n - 1) from summed moments; 0 for fewer than two values (rewards: grpo/algorithm.py's
    batch scale, and a logged `Spread`)."""
    if count < 2:
        return 0.0
    var = (squares - total * total / count) / (count - 1)
    return max(var, 0.0) ** 0.5


@dataclass(frozen=True)
class Ratio:
    """num / den over every rank's parts; NaN where no rank had a denominator."""

    num: float
    den: float

    def parts(self) -> list[float]:
        return [float(self.num), float(self.den)]

    @staticmethod
    def value(num: float, den: float) -> float:
        return num / den if den else math.nan


@dataclass(frozen=True)
class Spread:
    """The sample standard deviation (as torch.std) of n values with sum s and sum of squares ss; 0
    for fewer than two values."""

    n: float
    s: float
    ss: float

    def parts(self) -> list[float]:
        return [float(self.n), float(self.s), float(self.ss)]

    value = staticmethod(std_from_moments)

    @classmethod
    def of(cls, values) -> "Spread":
        """From a 1-D tensor, in float64 (a sum of squares of many rewards)."""
        v = values.double()
        return cls(float(v.numel()), float(v.sum()), float((v * v).sum()))


@dataclass(frozen=True)
class Count:
    """A count or a total (requests, errors, seconds summed over trajectories): summed over ranks."""

    n: float

    def parts(self) -> list[float]:
        return [float(self.n)]

    @staticmethod
    def value(n: float) -> float:
        return n


PARTS = (Ratio, Spread, Count)


def resolve(metrics: dict) -> dict:
    """One rank's metrics as plain numbers (a single process's run)."""
    return {k: type(v).value(*v.parts()) if isinstance(v, PARTS) else v for k, v in metrics.items()}


# plain numbers summed over ranks (a Count says so itself): throughputs, `loss` (each rank's is its share of the one global loss:
# grpo/algorithm.py's `LossNorm` counts are the whole batch's), the engines' busy seconds (summed over
# the ranks' own requests: several remote ranks sharing servers count their overlap once each)
SUMMED = {"loss", "tokens_per_s", "gen_tokens_per_s", "trained_completions", "time/engine_busy_s"}


def reduce_metrics(metrics: dict, info: DistInfo) -> dict[str, float | str]:
    """The whole batch's metrics from every rank's: a `Ratio`, `Spread` or `Count` from its parts summed
    over ranks; a plain number is the ranks' mean (every rank holds the same number of prompts), summed
    where SUMMED says, the largest for a `*_max`; names (the update's `layout`, the
    same on every rank) as they are. The ranks must log the same keys (`same_keys`)."""
    if info.world_size == 1:
        return resolve(metrics)
    keys = sorted(k for k, v in metrics.items() if not isinstance(v, str))
    same_keys(keys)
    parts = [v.parts() if isinstance(v, PARTS) else [float(v)] for v in (metrics[k] for k in keys)]
    sums = iter(all_reduce_sum([x for p in parts for x in p]))
    summed = {k: [next(sums) for _ in p] for k, p in zip(keys, parts)}
    largest = [k for k in keys if k.endswith("_max")]
    maxima = dict(zip(largest, all_reduce_max([float(metrics[k]) for k in largest])))
    out = {k: v for k, v in metrics.items() if isinstance(v, str)}
    for k in keys:
        v = metrics[k]
        if isinstance(v, PARTS):
            out[k] = type(v).value(*summed[k])
        elif k in maxima:
            out[k] = maxima[k]
        else:
            out[k] = summed[k][0] if k in SUMMED else summed[k][0] / info.world_size
    return out


def same_keys(keys: list[str]) -> None:
    """Every rank's metric names are the same, or an error naming the difference: a key only some ranks
    log would make the all-reduce of their values pair other metrics (or, of other lengths, abort it)."""
    crc = zlib.crc32("\n".join(keys).encode())
    high, low = all_reduce_max([crc, -crc])
    if high != -low:
        every = all_gather(keys)
        differ = sorted(set().union(*map(set, every)) - set.intersection(*map(set, every)))
        raise RuntimeError(f"the ranks log different metrics this step: {differ} only on some ranks (a metric a "
                           f"rank leaves out when it has no rows, for example); every rank must log every key.")
