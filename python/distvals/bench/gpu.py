"""The GPU all-reduce benchmark: ``python -m distvals.bench.gpu``.

N logical replicas of one GPU (``distvals.config.set_logical_gpus``), each with its
own buffer and stream, all-reduce S bytes in place. Per size it prints the median
time (CUDA events around back-to-back calls), algbw = S/t, busbw = algbw·2(N-1)/N,
the percentage of the device-memory bound (2·N·S bytes at the device-to-device copy
bandwidth measured in the same run) and the wrong elements of a checked call (every
replica starts from distinct values; the result is compared with a float64
reference). Where cupy is installed, a peer column: cupy summing the same N buffers
into one output (``cupy.add``), on the same memory. The ``run(us)`` column is the layer
users call every step: ``MirroredStrategy.run`` of a function doing
``ctx.all_reduce`` of the same buffers (a new result per call, synchronous, as a
training step sees it; host wall time, median), its result checked like the engine's;
after each replica count's table, one row does the same for a list of 50 arrays of
4 KiB (a model's gradients; ``--leaves``, ``--leaf-size``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

import numpy as np

from .. import _core, config
from ..cuda import DeviceArray, device_count, unavailable_reason
from ..cuda_group import CudaReplicaGroup
from ..strategy import MirroredStrategy
from .peers import bench_data as bd

__all__ = ["main", "run"]

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num) :]
    if unit not in _UNITS or not num:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4K, 256M, 1G)")
    return int(float(num) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _cupy_sum_us(bufs: Sequence[DeviceArray], count: int, iters: int) -> Optional[float]:
    try:
        import cupy as cp
    except ImportError:
        return None
    with cp.cuda.Device(bufs[0].device):
        xs = [cp.asarray(_prefix(b, count)) for b in bufs]
        out = cp.empty_like(xs[0])

        def once() -> None:
            cp.add(xs[0], xs[1] if len(xs) > 1 else xs[0], out=out)
            for x in xs[2:]:
                cp.add(out, x, out=out)

        once()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(iters):
            start.record()
            once()
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
        return float(np.median(times))


def _timed_run(strategy: Any, per: Any, op: str, iters: int, read: Callable[[Any], Any]) -> Tuple[float, Any]:
    """Median wall time of ``strategy.run`` of one ``ctx.all_reduce(op, x)`` of the
    distributed value ``per``, and ``read`` of the local results of the first call
    (read before the timed calls, so that those results' device memory is free again)."""
    from ..context import get_replica_context

    def step(x: Any) -> Any:
        ctx = get_replica_context()
        assert ctx is not None  # run calls step in a replica context
        return ctx.all_reduce(op, x)

    first = read(strategy.experimental_local_results(strategy.run(step, args=(per,))))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        strategy.run(step, args=(per,))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e6, first


def _strategy_run_us(strategy: Any, views: Sequence[DeviceArray], op: str, iters: int) -> Tuple[float, List[Any]]:
    """Median wall time of ``strategy.run`` of one ``ctx.all_reduce(op, x)`` over
    ``views`` (one per replica), and the results of the first call."""
    per = strategy.experimental_distribute_values_from_function(lambda ctx: views[ctx.replica_id_in_sync_group])
    return _timed_run(strategy, per, op, iters, lambda first: [r.numpy() for r in first])


def _structure_run_us(
    strategy: Any, n: int, leaves: int, count: int, dtype: str, op: str, gpu: int, iters: int = 30
) -> Tuple[float, int]:
    """Median wall time of ``strategy.run`` of one ``ctx.all_reduce(op, grads)`` of a
    list of ``leaves`` DeviceArrays of ``count`` elements per replica (a model's
    gradients), and the wrong elements of its first result: the leaves, concatenated,
    checked like the engine's result (every leaf holds its own part of the inputs)."""
    dt = np.dtype(dtype)
    grads = []
    for r in range(n):
        host = bd.make_input(n, r, leaves * count, dtype, op)
        row = []
        for i in range(leaves):
            a = DeviceArray((count,), dt, gpu)
            a.copy_from(np.ascontiguousarray(host[i * count : (i + 1) * count]))
            row.append(a)
        grads.append(row)
    per = strategy.experimental_distribute_values_from_function(lambda ctx: grads[ctx.replica_id_in_sync_group])
    us, results = _timed_run(
        strategy, per, op, iters, lambda first: [np.concatenate([leaf.numpy() for leaf in res]) for res in first]
    )
    return us, bd.count_wrong(results, n, dtype, op, count=leaves * count, copies=n)


def _prefix(buf: DeviceArray, count: int) -> DeviceArray:
    return DeviceArray._view(buf.ptr, (count,), buf.dtype, buf.device, buf)


def run(
    replicas: Sequence[int],
    sizes: Sequence[int],
    dtype: str = "float32",
    op: str = "sum",
    algorithm: str = "auto",
    gpu: int = 0,
    budget_seconds: float = 150.0,
    out: TextIO = sys.stdout,
    strategy_run: bool = True,
    leaves: int = 50,
    leaf_bytes: int = 4096,
) -> List[Dict[str, Any]]:
    """Measure and print the table; returns one dict per row. ``strategy_run`` adds the
    ``run(us)`` column and, with ``leaves`` > 0, one row per replica count (its
    ``leaves`` key set) for ``strategy.run`` of an all-reduce of a list of ``leaves``
    arrays of ``leaf_bytes`` each (a model's gradients)."""
    t0 = time.monotonic()
    dt = np.dtype(dtype)
    esize = dt.itemsize
    name = _core.cuda.device_name(gpu)
    copy_bytes = 256 << 20
    copy_s = float(np.median(_core.cuda.time_copy(gpu, copy_bytes, 10, 2)))
    copy_bw = 2 * copy_bytes / copy_s
    print(f"# distvals GPU all-reduce on {name} (CUDA device {gpu}), {dtype} {op}, algorithm {algorithm}", file=out)
    print(
        f"# device-to-device copy bandwidth: {copy_bw / 1e9:.1f} GB/s ({format_size(copy_bytes)} copies); "
        f"bound = 2*N*S at that bandwidth",
        file=out,
    )
    rows: List[Dict[str, Any]] = []
    max_count = max(sizes) // esize
    before = config.get_logical_gpus()
    try:
        for n in replicas:
            config.set_logical_gpus(n)
            names = [f"GPU:{gpu * n + k}" for k in range(n)]
            group = CudaReplicaGroup(names)
            strategy = MirroredStrategy(names) if strategy_run else None
            bufs = [DeviceArray((max_count,), dt, gpu) for _ in range(n)]
            # The CPU bench's inputs and check: distinct, mixed values per replica, so
            # that reading one replica twice, or a neighbouring element, is counted.
            hosts = [bd.make_input(n, r, max_count, dtype, op) for r in range(n)]
            print(f"#\n# {n} logical replicas on CUDA device {gpu}", file=out)
            print(
                f"#{'size':>10} {'count':>11} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
                f"{'%bound':>7} {'wrong':>6} {'cupy(us)':>9} {'run(us)':>9}",
                file=out,
            )
            for size in sizes:
                if time.monotonic() - t0 > budget_seconds:
                    print(f"# stopped: the time budget of {budget_seconds:g} s is spent", file=out)
                    return rows
                count = max(1, size // esize)
                size = count * esize  # whole elements: the bytes the call moves
                est = 2 * n * size / copy_bw + 20e-6
                wrong = 0
                views = [_prefix(b, count) for b in bufs]
                for r, v in enumerate(views):
                    v.copy_from(hosts[r][:count])
                run_us = None
                if strategy is not None:
                    # Out of place, so the inputs stay for the engine's own check below.
                    run_us, results = _strategy_run_us(strategy, views, op, min(30, max(5, int(0.1 / est))))
                    wrong += bd.count_wrong(results, n, dtype, op, count=count, copies=n)
                # One checked call, then the timed ones (which keep reducing in place).
                group.all_reduce(views, op=op, algorithm=algorithm)
                wrong += bd.count_wrong([v.numpy() for v in views], n, dtype, op, count=count, copies=n)
                iters = int(min(200, max(5, 0.25 / est)))
                raw = [(v.ptr, count, v.device) for v in views]
                t = float(np.median(_core.cuda.time_all_reduce(group.engine, raw, dt.name, op, algorithm, iters, 3)))
                algbw = size / t
                busbw = algbw * 2 * (n - 1) / n
                bound = 100.0 * (2 * n * size / copy_bw) / t
                cupy_us = _cupy_sum_us(views, count, min(iters, 50)) if n > 1 else None
                row = dict(
                    replicas=n,
                    bytes=size,
                    count=count,
                    time_us=t * 1e6,
                    algbw_gbs=algbw / 1e9,
                    busbw_gbs=busbw / 1e9,
                    bound_pct=bound,
                    wrong=wrong,
                    cupy_us=cupy_us,
                    run_us=run_us,
                )
                rows.append(row)
                cupy_txt = "-" if cupy_us is None else f"{cupy_us:.1f}"
                run_txt = "-" if run_us is None else f"{run_us:.1f}"
                print(
                    f" {format_size(size):>10} {count:>11} {t * 1e6:>10.1f} {algbw / 1e9:>12.2f} "
                    f"{busbw / 1e9:>12.2f} {bound:>7.1f} {wrong:>6} {cupy_txt:>9} {run_txt:>9}",
                    file=out,
                    flush=True,
                )
            if strategy is not None and leaves > 0:
                leaf_count = max(1, leaf_bytes // esize)
                tree_us, tree_wrong = _structure_run_us(strategy, n, leaves, leaf_count, dtype, op, gpu)
                print(
                    f"# strategy.run of one all_reduce of {leaves} arrays of {format_size(leaf_count * esize)}: "
                    f"{tree_us:.1f} us, wrong {tree_wrong}",
                    file=out,
                    flush=True,
                )
                rows.append(
                    dict(
                        replicas=n,
                        bytes=leaves * leaf_count * esize,
                        count=leaf_count,
                        leaves=leaves,
                        run_us=tree_us,
                        wrong=tree_wrong,
                    )
                )
            group.close()
            if strategy is not None:
                strategy.close()
            del bufs
    finally:
        config.set_logical_gpus(before)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distvals.bench.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="2,4,8", help="logical replica counts, comma-separated (default 2,4,8)")
    p.add_argument("--min", dest="min_bytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("--max", dest="max_bytes", type=parse_size, default=parse_size("1G"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--op", default="sum")
    p.add_argument("--algorithm", default="auto", choices=["auto", "ring", "tree", "direct"])
    p.add_argument("--gpu", type=int, default=0, help="the CUDA device to run on")
    p.add_argument("--budget-seconds", type=float, default=150.0, help="stop measuring after this long")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--no-run", action="store_true", help="skip the strategy.run column and row")
    p.add_argument("--leaves", type=int, default=50, help="arrays of the strategy.run row's structure (0: no row)")
    p.add_argument("--leaf-size", type=parse_size, default=parse_size("4K"), help="bytes of each of those arrays")
    a = p.parse_args(argv)
    if device_count() == 0:
        print(f"no CUDA device: {unavailable_reason()}", file=sys.stderr)
        return 2
    sizes, s = [], a.min_bytes
    while s <= a.max_bytes:
        sizes.append(s)
        s *= 2
    replicas = [int(x) for x in a.replicas.split(",") if x.strip()]
    rows = run(
        replicas,
        sizes,
        a.dtype,
        a.op,
        a.algorithm,
        a.gpu,
        a.budget_seconds,
        strategy_run=not a.no_run,
        leaves=a.leaves,
        leaf_bytes=a.leaf_size,
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = sum(r["wrong"] or 0 for r in rows)
    if bad:
        print(f"# {bad} wrong elements", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
