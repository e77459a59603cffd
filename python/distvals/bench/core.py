"""distvals' own measurements: the ReplicaGroup level and the strategy level.

Every size is verified in the same run, with distinct values per replica, through both
the engine's timing entry point and the public Python call, before it is timed.
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from .memory import BoundMeter, cache_levels
from .peers import bench_data as bd
from .results import Row

if TYPE_CHECKING:
    from ..group import ReplicaGroup
    from ..strategy import MirroredStrategy, Strategy

__all__ = [
    "ALGORITHMS",
    "EXECUTION_MODES",
    "has_strategy",
    "make_strategy",
    "measure_group",
    "measure_strategy",
    "mode_label",
    "strategy_modes",
    "sweep_distvals",
]

ALGORITHMS = ("ring", "tree", "direct", "auto")
# MirroredStrategy(execution=...) values, measured side by side where the strategy has them.
EXECUTION_MODES = ("inline", "threads")
# The memory bound is measured at least this many times per size (its spread is the noise).
MIN_BOUND_SAMPLES = 3
# Trivial strategy.run calls timed at least, at any size.
_TRIVIAL_MIN_ITERS = 200

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


def _inputs_changed(bufs: Sequence[np.ndarray], out: Optional[Sequence[np.ndarray]], dtype: str, op: str) -> int:
    """Out of place (``out`` given): the elements of the inputs that the call changed (an
    engine that reduced into its inputs, then copied them out, counts as wrong)."""
    if out is None:
        return 0
    changed = 0
    for r, b in enumerate(bufs):
        want = bd.fill(np.empty_like(b), len(bufs), r, dtype, op)  # one input's size at a time
        differ = b.view(np.uint8).reshape(b.size, -1) != want.view(np.uint8).reshape(b.size, -1)
        changed += int(np.count_nonzero(differ.any(axis=1)))
    return changed


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


def _fresh_outputs(bufs: Sequence[np.ndarray]) -> List[np.ndarray]:
    """Output arrays beside ``bufs``, every page already touched (used arrays, not fresh)."""
    outs = [np.empty_like(b) for b in bufs]
    for o in outs:
        o.fill(0)
    return outs


def _poison(out: Optional[Sequence[np.ndarray]]) -> None:
    """Out-of-place outputs set to values no result check accepts: NaN, or an integer
    type's largest value (no reference of the bench's inputs reaches it)."""
    for o in out or ():
        o.fill(np.iinfo(o.dtype).max if o.dtype.kind in "iu" else np.nan)


def measure_group(
    group: ReplicaGroup,
    bufs: Sequence[np.ndarray],
    dtype: str,
    op: str,
    algorithm: str,
    iters: int,
    python_loop: bool = True,
    out: Optional[Sequence[np.ndarray]] = None,
) -> Row:
    """One ReplicaGroup.all_reduce row: verified, timed in the engine and from Python.

    ``group`` is a ``distvals.ReplicaGroup``, ``bufs`` one array per replica (from
    ``_buffers``; refilled here). The result of one call on fresh inputs is checked
    through each entry point; the timed loops then run on the same buffers: in place
    (their values drift, which does not change the work done), or from ``bufs`` into
    ``out`` (one array per replica, aliasing none of ``bufs``) when given.
    """
    n = group.num_replicas
    op = bd.canonical_op(op)
    count = bufs[0].size
    engine = group.engine
    dest = bufs if out is None else out
    extra = {} if out is None else {"out": list(out)}
    # Before each check, the outputs hold what no check accepts: a call that wrote
    # nothing into them (the last algorithm's timed loop left right answers there) counts.
    _refill(bufs, dtype, op)
    _poison(out)
    _core.time_all_reduce(engine, bufs, op, algorithm, 1, 0, **extra)
    wrong = bd.count_wrong(dest, n, dtype, op)
    wrong += _inputs_changed(bufs, out, dtype, op)
    _refill(bufs, dtype, op)
    _poison(out)
    group.all_reduce(bufs, op, algorithm, **extra)
    wrong += bd.count_wrong(dest, n, dtype, op)
    wrong += _inputs_changed(bufs, out, dtype, op)
    warmup = bd.warmup_for(iters)
    times = _core.time_all_reduce(engine, bufs, op, algorithm, iters, warmup, **extra)
    time_us = statistics.median(times.tolist()) * 1e6
    py_us = None
    if python_loop:
        f = group.all_reduce
        # Past 1 MiB the call overhead is lost in the transfer time: fewer calls suffice.
        py_iters = iters if count * bufs[0].itemsize <= _PY_FULL_BYTES else max(3, iters // 4)
        if out is None:
            py_us = _python_loop_us(lambda: f(bufs, op, algorithm), py_iters, min(warmup, py_iters))
        else:
            outs = list(out)
            py_us = _python_loop_us(lambda: f(bufs, op, algorithm, out=outs), py_iters, min(warmup, py_iters))
    chosen = _core.choose_algorithm(n, count * bufs[0].itemsize) if algorithm == "auto" else None
    return Row(
        impl="distvals",
        level="group",
        algorithm=algorithm,
        replicas=n,
        bytes=count * bufs[0].itemsize,
        count=count,
        dtype=dtype,
        op=op,
        time_us=time_us,
        iters=iters,
        wrong=wrong,
        checked=2 * n * count,
        timing="engine",
        py_time_us=py_us,
        chosen=chosen,
        out_of_place=out is not None,
    )


def strategy_modes() -> List[Optional[str]]:
    """The execution modes to measure: ``["inline", "threads"]`` when this distvals'
    ``MirroredStrategy`` takes ``execution=``, else ``[None]`` (its only mode)."""
    import distvals

    try:
        params = inspect.signature(distvals.MirroredStrategy).parameters
    except (TypeError, ValueError):
        return [None]
    return list(EXECUTION_MODES) if "execution" in params else [None]


def mode_label(mode: Optional[str]) -> str:
    """Column and row label of an execution mode (``None``: a strategy without modes)."""
    return mode if mode is not None else "default"


def make_strategy(n: int, mode: Optional[str] = None) -> MirroredStrategy:
    """A distvals MirroredStrategy over CPU:0 .. CPU:n-1 (default cross-device ops)."""
    import distvals

    kwargs: Dict[str, Any] = {} if mode is None else {"execution": mode}
    return distvals.MirroredStrategy([f"CPU:{i}" for i in range(n)], **kwargs)


def measure_strategy(
    strategy: Strategy,
    arrays: Sequence[np.ndarray],
    dtype: str,
    op: str,
    iters: int,
    group: Optional[ReplicaGroup] = None,
    mode: Optional[str] = None,
) -> List[Row]:
    """The strategy rows of one size: ``strategy.run(fn)`` with ``fn`` calling
    ``ReplicaContext.all_reduce``, and with a trivial ``fn``.

    Timed per ``strategy.run`` call from Python; the result of the first all-reduce call,
    on distinct inputs per replica, is checked on every replica. ``arrays``: one array per
    replica, refilled here. With ``group`` (a ``ReplicaGroup`` of as many replicas), one
    ``group.all_reduce`` of the same arrays is timed from Python just before and just
    after, and the faster median goes into the all-reduce row's ``group_py_us`` (the
    ratio's baseline); likewise the same call into separate, already-used output arrays
    (``group_out_py_us``: the engine's share of a step that returns new arrays), and the
    memory bound of reading the arrays into those outputs (``out_bound_us``: what a step
    that returns new arrays cannot beat on this machine; see memory.BoundMeter).
    """
    import distvals

    n = strategy.num_replicas_in_sync
    op = bd.canonical_op(op)
    count = arrays[0].size
    _refill(arrays, dtype, op)
    reduce_op = _STRATEGY_OPS[op]
    label = mode_label(mode)

    def fresh() -> Any:
        return strategy.experimental_distribute_values_from_function(lambda ctx: arrays[ctx.replica_id_in_sync_group])

    def step(x: Any) -> Any:
        # Inside strategy.run there is always a replica context.
        return distvals.get_replica_context().all_reduce(reduce_op, x)  # type: ignore[union-attr]

    def trivial(x: Any) -> None:
        return None

    out = strategy.run(step, args=(fresh(),))
    results = [np.asarray(v) for v in strategy.experimental_local_results(out)]
    if len(results) != n:
        raise RuntimeError(f"strategy.run returned {len(results)} per-replica results for {n} replicas")
    wrong = bd.count_wrong(results, n, dtype, op, count=count, copies=n)
    del out, results
    _refill(arrays, dtype, op)
    values = fresh()
    run = strategy.run
    warmup = bd.warmup_for(iters)
    group_us: List[float] = []
    group_out_us: List[float] = []
    py_iters = iters if count * arrays[0].itemsize <= _PY_FULL_BYTES else max(3, iters // 4)
    # The out-of-place baseline writes into outputs used before (as run's pooled results
    # are): run must return new arrays, so this is the same work without the step around it.
    outs = _fresh_outputs(arrays) if group is not None else []
    out_meter = (
        BoundMeter(arrays, n, int(group.engine.threads), cache_levels()[0], py_iters, min(warmup, py_iters), outs=outs)
        if group is not None
        else None
    )

    def time_group() -> None:
        if group is not None:
            f = group.all_reduce
            group_us.append(_python_loop_us(lambda: f(arrays, op, "auto"), py_iters, min(warmup, py_iters)))
            group_out_us.append(
                _python_loop_us(lambda: f(arrays, op, "auto", out=outs), py_iters, min(warmup, py_iters))
            )
        if out_meter is not None:
            out_meter.sample()

    time_group()
    time_us = _python_loop_us(lambda: run(step, args=(values,)), iters, warmup)
    time_group()
    # A trivial step costs microseconds at every size: enough calls for a stable median.
    t_iters = max(iters, _TRIVIAL_MIN_ITERS)
    trivial_us = _python_loop_us(lambda: run(trivial, args=(values,)), t_iters, bd.warmup_for(t_iters))
    # The same bytes as a structure of several arrays (a model's gradients): a dict of
    # six consecutive pieces of each replica's array, views of it.
    structures = [_as_structure(a) for a in arrays]

    def structure_step(x: Any) -> Any:
        ctx = distvals.get_replica_context()
        return ctx.all_reduce(reduce_op, structures[ctx.replica_id_in_sync_group])  # type: ignore[union-attr]

    _refill(arrays, dtype, op)  # the group's in-place calls above changed them
    out = run(structure_step, args=(values,))
    joined = [np.concatenate([d[k].reshape(-1) for k in sorted(d)]) for d in strategy.experimental_local_results(out)]
    structure_wrong = bd.count_wrong(joined, n, dtype, op, count=count, copies=n)
    del out, joined
    structure_us = _python_loop_us(lambda: run(structure_step, args=(values,)), iters, warmup)
    nbytes = count * arrays[0].itemsize
    common: Dict[str, Any] = dict(
        impl="distvals",
        algorithm="auto",
        replicas=n,
        bytes=nbytes,
        count=count,
        dtype=dtype,
        op=op,
        timing="python",
        mode=label,
    )
    # The rows that move data: checked on every replica, compared with the group call.
    outs.clear()  # the baseline's outputs are not needed any more
    moved: Dict[str, Any] = dict(
        iters=iters,
        checked=n * count,
        group_py_us=min(group_us) if group_us else None,
        group_out_py_us=min(group_out_us) if group_out_us else None,
        out_bound_us=out_meter.result()["bound_us"] if out_meter is not None else None,
    )
    return [
        Row(level="strategy", time_us=time_us, wrong=wrong, **moved, **common),
        Row(level="strategy-trivial", time_us=trivial_us, iters=t_iters, wrong=0, checked=0, **common),
        Row(level="strategy-structure", time_us=structure_us, wrong=structure_wrong, **moved, **common),
    ]


def _as_structure(a: np.ndarray) -> Dict[str, np.ndarray]:
    """``a`` as six consecutive pieces (a half, a quarter, ... and the rest), views of it,
    in a dict whose sorted keys give them in order."""
    flat = a.reshape(-1)
    count = flat.size
    sizes = [count // 2, count // 4, count // 8, count // 16, count // 32]
    sizes.append(count - sum(sizes))
    out, lo = {}, 0
    for i, k in enumerate(sizes):
        out[f"w{i}"] = flat[lo : lo + k]
        lo += k
    return out


def sweep_distvals(
    n: int,
    plan: Sequence[Tuple[int, int]],
    dtype: str,
    op: str,
    algorithms: Sequence[str],
    strategy_level: bool,
    tick: Callable[[str], None] = lambda s: None,
    notes: Optional[List[str]] = None,
    out_of_place: bool = False,
    modes: Optional[Sequence[Optional[str]]] = None,
) -> Tuple[List[Row], List[Dict[str, Any]]]:
    """All distvals rows and memory bounds for one replica count over a size plan.

    The memory bound (see memory.py) is measured on each size's own buffers before the
    first row, after each algorithm's rows and after the strategy rows, at least three
    times. ``out_of_place`` adds, per algorithm, a row from the inputs into separate,
    already-used output arrays. ``modes``: the strategy's execution modes to measure
    (default: :func:`strategy_modes`).
    """
    import distvals

    notes = notes if notes is not None else []
    itemsize = bd.resolve_dtype(dtype).itemsize
    caches, _ = cache_levels()
    rows: List[Row] = []
    bounds: List[Dict[str, Any]] = []
    strategies: List[Tuple[Optional[str], Optional[MirroredStrategy]]] = []
    if strategy_level:
        for mode in strategy_modes() if modes is None else modes:
            try:
                strategies.append((mode, make_strategy(n, mode)))
            except Exception as e:  # report it, keep the other rows
                notes.append(f"N={n}: strategy level ({mode_label(mode)}) failed to start: {type(e).__name__}: {e}")
    try:
        with distvals.ReplicaGroup(n) as group:
            threads = int(group.engine.threads)
            for nbytes, iters in plan:
                count = max(1, nbytes // itemsize)
                nb = count * itemsize
                warmup = bd.warmup_for(iters)
                size_rows: List[Row] = []
                # One set of buffers per size: first-touch page faults cost more than filling.
                bufs = _buffers(n, count, dtype, op)
                outs = _fresh_outputs(bufs) if out_of_place and algorithms else None
                meter = BoundMeter(bufs, n, threads, caches, iters, warmup)
                meter.sample()
                for algo in algorithms:
                    tick(f"N={n} {nb} B distvals {algo}")
                    size_rows.append(measure_group(group, bufs, dtype, op, algo, iters))
                    if outs is not None:
                        size_rows.append(measure_group(group, bufs, dtype, op, algo, iters, out=outs))
                    meter.sample()
                for i, (mode, strategy) in enumerate(strategies):
                    if strategy is None:
                        continue
                    tick(f"N={n} {nb} B distvals strategy {mode_label(mode)}")
                    try:
                        size_rows.extend(measure_strategy(strategy, bufs, dtype, op, iters, group, mode))
                    except Exception as e:
                        notes.append(
                            f"N={n}: strategy level ({mode_label(mode)}) failed at {nb} B: {type(e).__name__}: {e}"
                        )
                        _close(strategy)
                        strategies[i] = (mode, None)
                if strategies:
                    meter.sample()
                while len(meter.samples[meter.variants[0]]) < MIN_BOUND_SAMPLES:
                    meter.sample()
                del bufs, outs
                bound = meter.result()
                bounds.append(bound)
                rows.extend(r.finish(bound["bound_us"]) for r in size_rows)
    finally:
        for _, strategy in strategies:
            _close(strategy)
    return rows, bounds


def _close(strategy: Optional[Strategy]) -> None:
    if strategy is not None and hasattr(strategy, "close"):
        strategy.close()
