"""distvals' own measurements: the ReplicaGroup level and the strategy level.

Every size is verified in the same run, with distinct values per replica, through both
the engine's timing entry point and the public Python call, before it is timed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from .memory import copy_round_us, memory_bound_us
from .peers import bench_data as bd
from .results import Row

__all__ = ["ALGORITHMS", "has_strategy", "measure_group", "measure_strategy", "sweep_distvals"]

ALGORITHMS = ("ring", "tree", "direct", "auto")

# ReplicaContext.all_reduce takes tf.distribute-style op names.
# Sizes up to this get as many Python-timed calls as engine-timed ones.
_PY_FULL_BYTES = 1 << 20

_STRATEGY_OPS = {"sum": "SUM", "mean": "MEAN", "min": "MIN", "max": "MAX", "prod": "PRODUCT"}


def has_strategy() -> bool:
    """Whether this distvals has MirroredStrategy (the strategy-level rows need it)."""
    import distvals

    return hasattr(distvals, "MirroredStrategy") and hasattr(distvals, "get_replica_context")


def _buffers(n: int, count: int, dtype: str, op: str) -> List[np.ndarray]:
    dt = bd.resolve_dtype(dtype)
    return [bd.fill(np.empty(count, dtype=dt), n, r, dtype, op) for r in range(n)]


def _refill(bufs: Sequence[np.ndarray], dtype: str, op: str) -> None:
    for r, b in enumerate(bufs):
        bd.fill(b, len(bufs), r, dtype, op)


def _python_loop_us(call: Callable[[], Any], iters: int, warmup: int) -> float:
    """Median microseconds of ``call()`` timed one call at a time from Python."""
    for _ in range(warmup):
        call()
    perf = time.perf_counter
    times = [0.0] * iters
    for i in range(iters):
        t0 = perf()
        call()
        times[i] = perf() - t0
    return statistics.median(times) * 1e6


def measure_group(group, bufs: Sequence[np.ndarray], dtype: str, op: str, algorithm: str, iters: int,
                  python_loop: bool = True) -> Row:
    """One ReplicaGroup.all_reduce row: verified, timed in the engine and from Python.

    ``group`` is a ``distvals.ReplicaGroup``, ``bufs`` one array per replica (from
    ``_buffers``; refilled here). The result of one call on fresh inputs is checked
    through each entry point; the timed loops then run in place on the same buffers
    (their values drift, which does not change the work done).
    """
    n = group.num_replicas
    op = bd.canonical_op(op)
    count = bufs[0].size
    _refill(bufs, dtype, op)
    engine = group.engine
    _core.time_all_reduce(engine, bufs, op, algorithm, 1, 0)
    wrong = bd.count_wrong(bufs, n, dtype, op)
    _refill(bufs, dtype, op)
    group.all_reduce(bufs, op, algorithm)
    wrong += bd.count_wrong(bufs, n, dtype, op)
    warmup = bd.warmup_for(iters)
    times = _core.time_all_reduce(engine, bufs, op, algorithm, iters, warmup)
    time_us = statistics.median(times.tolist()) * 1e6
    py_us = None
    if python_loop:
        f = group.all_reduce
        # Past 1 MiB the call overhead is lost in the transfer time: fewer calls suffice.
        py_iters = iters if count * bufs[0].itemsize <= _PY_FULL_BYTES else max(3, iters // 4)
        py_us = _python_loop_us(lambda: f(bufs, op, algorithm), py_iters, min(warmup, py_iters))
    chosen = _core.choose_algorithm(n, count * bufs[0].itemsize) if algorithm == "auto" else None
    return Row(impl="distvals", level="group", algorithm=algorithm, replicas=n, bytes=count * bufs[0].itemsize,
               count=count, dtype=dtype, op=op, time_us=time_us, iters=iters, wrong=wrong, checked=2 * n * count,
               timing="engine", py_time_us=py_us, chosen=chosen)


def make_strategy(n: int):
    """A distvals MirroredStrategy over CPU:0 .. CPU:n-1 (default cross-device ops)."""
    import distvals

    return distvals.MirroredStrategy([f"CPU:{i}" for i in range(n)])


def measure_strategy(strategy, arrays: Sequence[np.ndarray], dtype: str, op: str, iters: int) -> Row:
    """One ``strategy.run(fn)`` row where ``fn`` calls ``ReplicaContext.all_reduce``.

    Timed per ``strategy.run`` call from Python; the result of the first call, on
    distinct inputs per replica, is checked on every replica. ``arrays``: one array per
    replica, refilled here.
    """
    import distvals

    n = strategy.num_replicas_in_sync
    op = bd.canonical_op(op)
    count = arrays[0].size
    _refill(arrays, dtype, op)
    reduce_op = _STRATEGY_OPS[op]

    def fresh():
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: arrays[ctx.replica_id_in_sync_group])

    def step(x):
        return distvals.get_replica_context().all_reduce(reduce_op, x)

    out = strategy.run(step, args=(fresh(),))
    results = [np.asarray(v) for v in strategy.experimental_local_results(out)]
    if len(results) != n:
        raise RuntimeError(f"strategy.run returned {len(results)} per-replica results for {n} replicas")
    wrong = bd.count_wrong(results, n, dtype, op)
    del out, results
    _refill(arrays, dtype, op)
    values = fresh()
    run = strategy.run
    time_us = _python_loop_us(lambda: run(step, args=(values,)), iters, bd.warmup_for(iters))
    nbytes = count * arrays[0].itemsize
    return Row(impl="distvals", level="strategy", algorithm="auto", replicas=n, bytes=nbytes, count=count,
               dtype=dtype, op=op, time_us=time_us, iters=iters, wrong=wrong, checked=n * count, timing="python")


def sweep_distvals(n: int, plan: Sequence[Tuple[int, int]], dtype: str, op: str, algorithms: Sequence[str],
                   strategy_level: bool, tick: Callable[[str], None] = lambda s: None,
                   notes: Optional[List[str]] = None) -> Tuple[List[Row], List[dict]]:
    """All distvals rows and memory bounds for one replica count over a size plan.

    The copy bound is measured before and after each size's rows (see memory.py).
    """
    import distvals

    notes = notes if notes is not None else []
    itemsize = bd.resolve_dtype(dtype).itemsize
    rows: List[Row] = []
    bounds: List[dict] = []
    strategy = None
    if strategy_level:
        try:
            strategy = make_strategy(n)
        except Exception as e:  # report it, keep the group rows
            notes.append(f"N={n}: strategy level failed to start: {type(e).__name__}: {e}")
    with distvals.ReplicaGroup(n) as group:
        for nbytes, iters in plan:
            count = max(1, nbytes // itemsize)
            nb = count * itemsize
            warmup = bd.warmup_for(iters)
            samples = [copy_round_us(n, nb, iters, warmup)]
            size_rows = []
            # One set of buffers per size: first-touch page faults cost more than filling.
            bufs = _buffers(n, count, dtype, op)
            for algo in algorithms:
                tick(f"N={n} {nb} B distvals {algo}")
                size_rows.append(measure_group(group, bufs, dtype, op, algo, iters))
            if strategy is not None:
                tick(f"N={n} {nb} B distvals strategy")
                try:
                    size_rows.append(measure_strategy(strategy, bufs, dtype, op, iters))
                except Exception as e:
                    notes.append(f"N={n}: strategy level failed at {nb} B: {type(e).__name__}: {e}")
                    strategy = None
            del bufs
            samples.append(copy_round_us(n, nb, iters, warmup))
            bound = memory_bound_us(samples)
            bounds.append({"replicas": n, "bytes": nb, "bound_us": bound, "copy_samples_us": samples,
                           "copy_gbps": 2.0 * n * nb / (bound * 1e-6) / 1e9})
            rows.extend(r.finish(bound) for r in size_rows)
    if strategy is not None and hasattr(strategy, "close"):
        strategy.close()
    return rows, bounds
