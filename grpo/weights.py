"""Weights on their way from a strategy to a rollout engine: a leaf both sides import.

One bucket is a list of (parameter name, full tensor) pairs of bounded total size; a strategy
yields them lazily (under ZeRO-3 each is gathered when asked for), a backend consumes them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

import torch

WeightBuckets = Iterable[list[tuple[str, torch.Tensor]]]
T = TypeVar("T")


def is_vision_parameter(name: str) -> bool:
    """Whether a parameter name belongs to a vision-language model's vision tower (Qwen2-VL: `visual`)."""
    return ".visual." in f".{name}"


def engine_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, parameter) pairs a weight sync sends: all but a frozen vision tower's
    (model.freeze_vision), which the engines keep as they loaded it."""
    return ((n, p) for n, p in named if sent(n, p))


def sent(name: str, p: torch.Tensor) -> bool:
    return p.requires_grad or not is_vision_parameter(name)


def unsent_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names `engine_parameters` leaves out: weights the engines must keep as they loaded them."""
    return [n for n, p in named if not sent(n, p)]


def full_nbytes(t: torch.Tensor) -> int:
    """Bytes of the full tensor: a ZeRO-3 parameter's local placeholder is empty, `ds_numel` is not."""
    return getattr(t, "ds_numel", t.numel()) * t.element_size()


def group_by_size(items: Iterable[tuple[str, T]], bucket_bytes: int,
                  nbytes: Callable[[T], int] = full_nbytes) -> Iterator[list[tuple[str, T]]]:
    """Consecutive (name, tensor) pairs in groups of at most `bucket_bytes` (a larger one goes alone)."""
    bucket, size = [], 0
    for name, t in items:
        n = nbytes(t)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket
