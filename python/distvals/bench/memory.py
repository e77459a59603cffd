"""The memory bound: the shortest time in which N·S bytes can be read and N·S written.

An in-place all-reduce of S bytes over N replicas in one process reads at least N·S
bytes and writes at least N·S bytes. The bound is measured on the very buffers the
all-reduce runs on (so the same working set: a size that fits a cache is bounded by that
cache, not by DRAM) with ``_core.time_memory_bound``: the threads read every byte of
every buffer and store it back in place, thread p on slice p of each buffer as the
direct algorithm cuts them, handed out and timed the way ``_core.time_all_reduce`` times
a collective (the calling thread takes part 0 and hands the others to persistent
threads; no barrier the collective does not pay).

Several ways to do that are measured and the fastest wins (see :func:`bound_variants`):
plain or streaming (non-temporal) stores, on the group's threads or on the calling
thread alone (the engine runs small collectives on the calling thread). The bound is
measured several times per size, interleaved with the rows it bounds; the fastest
median is the bound and the spread of the medians is the run's noise at that size.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from .. import _core

if TYPE_CHECKING:
    import numpy as np

__all__ = ["BoundMeter", "Cache", "bound_variants", "cache_levels", "level_of", "parse_cpu_list"]

# Up to this many bytes in all buffers together the calling thread alone is also tried:
# the engine runs small collectives there (below 96 KiB today) and one thread wins while
# handing work to another costs more than the work.
ONE_THREAD_MAX_BYTES = 4 << 20
# Where nothing tells the cache sizes: a common x86-64 or arm64 server core.
_ASSUMED = ((1, 32 << 10, 1), (2, 1 << 20, 1), (3, 32 << 20, 0))


@dataclass(frozen=True)
class Cache:
    """One level of data (or unified) cache as CPU 0 sees it."""

    level: int
    size: int  # bytes
    shared_cpus: int  # CPUs that share one instance of it (1: private to a core)

    @property
    def name(self) -> str:
        return f"L{self.level}"

    def describe(self) -> str:
        from .table import format_size

        share = "per core" if self.shared_cpus <= 1 else f"shared by {self.shared_cpus} CPUs"
        return f"{self.name} {format_size(self.size)} {share}"


def parse_cpu_list(text: str) -> int:
    """Number of CPUs in a sysfs CPU list such as ``"0-3,8,10-11"``."""
    n = 0
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            n += int(b) - int(a) + 1
        else:
            n += 1
    return n


def _parse_size(text: str) -> int:
    t = text.strip().upper()
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            return int(t[:-1]) * mult
    return int(t)


def _from_sysfs(root: str) -> List[Cache]:
    out: Dict[int, Cache] = {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    for name in names:
        if not name.startswith("index"):
            continue
        d = os.path.join(root, name)
        try:

            def read(leaf: str) -> str:
                with open(os.path.join(d, leaf)) as f:
                    return f.read().strip()

            if read("type") == "Instruction":
                continue
            level, size = int(read("level")), _parse_size(read("size"))
            try:
                shared = parse_cpu_list(read("shared_cpu_list"))
            except (OSError, ValueError):
                shared = 1
        except (OSError, ValueError):
            continue
        if size > 0:
            out[level] = Cache(level, size, max(1, shared))
    return [out[k] for k in sorted(out)]


def _from_sysconf() -> List[Cache]:
    names = ((1, "SC_LEVEL1_DCACHE_SIZE"), (2, "SC_LEVEL2_CACHE_SIZE"), (3, "SC_LEVEL3_CACHE_SIZE"))
    cpus = os.cpu_count() or 1
    out = []
    for level, name in names:
        try:
            size = int(os.sysconf(name))
        except (AttributeError, ValueError, OSError):
            continue
        if size > 0:
            out.append(Cache(level, size, cpus if level == 3 else 1))
    return out


def cache_levels(sysfs_root: str = "/sys/devices/system/cpu/cpu0/cache") -> Tuple[List[Cache], str]:
    """CPU 0's data and unified caches, lowest level first, and where the sizes came from.

    Linux's sysfs first (it knows which CPUs share each cache); else ``sysconf`` (which on
    some AMD processors reports the whole package's L3); else assumed sizes, said so.
    """
    caches = _from_sysfs(sysfs_root)
    if caches:
        return caches, "sysfs"
    caches = _from_sysconf()
    if caches:
        return caches, "sysconf"
    cpus = os.cpu_count() or 1
    return [Cache(lv, size, shared or cpus) for lv, size, shared in _ASSUMED], "assumed"


def level_of(replicas: int, nbytes: int, threads: int, caches: Sequence[Cache]) -> str:
    """Where an in-place all-reduce's working set (N·S bytes) lives when ``threads`` share it.

    A cache shared by k CPUs holds the data of up to k threads; ``threads`` threads on
    distinct cores use ceil(threads / k) instances of it. The first level whose instances
    together hold the working set names it; "DRAM" when none does.
    """
    total = replicas * nbytes
    t = max(1, threads)
    for c in caches:
        instances = -(-t // max(1, c.shared_cpus))
        if total <= c.size * instances:
            return c.name
    return "DRAM"


def bound_variants(
    replicas: int, nbytes: int, threads: int, caches: Sequence[Cache], streaming: Optional[bool] = None
) -> List[Tuple[int, bool]]:
    """The (threads, streaming stores) ways to measure the bound at one size.

    Always the group's threads with plain stores; the calling thread alone while the
    buffers are small (:data:`ONE_THREAD_MAX_BYTES`); streaming stores once the working
    set leaves the private caches (in the last cache level or DRAM), where they may win.
    """
    if streaming is None:
        streaming = bool(getattr(_core, "memory_bound_has_streaming", False))
    t = max(1, threads)
    out = [(t, False)]
    if t > 1 and replicas * nbytes <= ONE_THREAD_MAX_BYTES:
        out.append((1, False))
    private = [c for c in caches if c.shared_cpus <= 1]
    level = level_of(replicas, nbytes, t, caches)
    if streaming and (not private or level not in {c.name for c in private}):
        out.append((t, True))
    return out


def variant_name(v: Tuple[int, bool]) -> str:
    """``(2, False)`` -> ``"2 thr"``, ``(2, True)`` -> ``"2 thr nt"`` (non-temporal)."""
    return f"{v[0]} thr" + (" nt" if v[1] else "")


class BoundMeter:
    """Measures the bound of one size several times, between the rows it bounds.

    ``bufs``: the all-reduce's own arrays (one per replica; their contents are kept).
    ``outs`` (one array per buffer, overlapping none): the bound of a collective whose
    results go to memory of their own (``strategy.run`` returns new arrays): the same
    bytes read and written, over twice the working set, which may leave a cache the
    in-place bound fits. Call :meth:`sample` before, between and after the rows;
    :meth:`result` gives the bound (fastest median of any variant in any sample), the way
    that won, and the noise: the spread (max / min - 1) of the winning variant's medians
    over the samples.
    """

    def __init__(
        self,
        bufs: Sequence[np.ndarray],
        replicas: int,
        threads: int,
        caches: Sequence[Cache],
        iters: int,
        warmup: int,
        variants: Optional[Sequence[Tuple[int, bool]]] = None,
        outs: Optional[Sequence[np.ndarray]] = None,
    ) -> None:
        self.bufs = list(bufs)
        self.outs = list(outs) if outs is not None else None
        self.replicas = replicas
        # Arrays the working set spans: the buffers, and the outputs when there are any.
        self.arrays = replicas * (2 if self.outs is not None else 1)
        self.nbytes = int(self.bufs[0].nbytes)
        self.threads = threads
        self.caches = list(caches)
        self.iters = max(1, int(iters))
        self.warmup = max(0, int(warmup))
        self.variants = (
            list(variants) if variants is not None else bound_variants(self.arrays, self.nbytes, threads, caches)
        )
        self.samples: Dict[Tuple[int, bool], List[float]] = {v: [] for v in self.variants}

    def sample(self) -> None:
        """One median per variant (microseconds per round)."""
        for v in self.variants:
            times = _core.time_memory_bound(self.bufs, v[0], v[1], self.iters, self.warmup, out=self.outs)
            self.samples[v].append(statistics.median(times.tolist()) * 1e6)

    def result(self) -> Dict[str, Any]:
        if not any(self.samples.values()):
            raise ValueError("no memory-bound sample was taken")
        best = min((min(s), v) for v, s in self.samples.items() if s)
        bound, win = best
        meds = self.samples[win]
        noise = 100.0 * (max(meds) / min(meds) - 1.0) if len(meds) > 1 else None
        moved = 2.0 * self.replicas * self.nbytes
        return {
            "replicas": self.replicas,
            "bytes": self.nbytes,
            "bound_us": bound,
            "gbps": moved / (bound * 1e-6) / 1e9 if bound > 0 else None,
            "level": level_of(self.arrays, self.nbytes, win[0], self.caches),
            "out_of_place": self.outs is not None,
            "threads": win[0],
            "streaming": win[1],
            "noise_pct": noise,
            "samples": len(meds),
            "variants": {variant_name(v): s for v, s in self.samples.items()},
        }
