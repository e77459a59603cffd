"""The memory bound: the time to move 2·N·S bytes at this machine's copy bandwidth.

An all-reduce of S bytes over N replicas in one process reads at least N·S bytes and
writes at least N·S bytes. ``_core.time_copy(N, S)`` times rounds in which N threads
each copy S bytes (2·N·S bytes moved), so the median round *is* the bound's time.
"""

from __future__ import annotations

import statistics
from typing import List

from .. import _core

__all__ = ["copy_round_us", "memory_bound_us"]


def copy_round_us(replicas: int, nbytes: int, iters: int, warmup: int) -> float:
    """Median microseconds of one round of N threads each copying ``nbytes`` bytes."""
    times = _core.time_copy(int(replicas), int(max(1, nbytes)), int(iters), int(warmup))
    return statistics.median(times.tolist()) * 1e6


def memory_bound_us(samples: List[float]) -> float:
    """The bound from several medians taken at different moments of the same run.

    The machine may be shared: a round slowed by another process measures that process,
    not the memory. The fastest median is the closest to what the memory can do, which
    makes the percentage of the bound a conservative figure.
    """
    if not samples:
        raise ValueError("no copy measurement")
    return min(samples)
