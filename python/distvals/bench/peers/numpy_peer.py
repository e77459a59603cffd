"""Peer runner: a plain numpy all-reduce of N arrays in one process.

The result lands in every replica's array, as an all-reduce must: the N inputs are
combined with one ufunc per extra replica into the first array, in place, which is then
copied into the other N-1 arrays. Prints JSON lines (see bench_data.emit).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Optional, Sequence

try:
    if TYPE_CHECKING:  # checked as part of the package; runs as a script beside bench_data.py
        from . import bench_data as bd
    else:
        import bench_data as bd
    import numpy as np
except ImportError as e:  # the interpreter lacks numpy: report, do not crash
    sys.stdout.write('{"event": "missing", "reason": "' + str(e).replace('"', "'") + '"}\n')
    sys.exit(0)

__all__ = ["main"]

_UFUNC = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def all_reduce(arrays: Sequence[np.ndarray], op: str) -> None:
    """Reduce ``arrays`` into the first with numpy, in place, then copy it into the
    others: the fewest passes over memory a plain numpy all-reduce needs."""
    f = _UFUNC[op]
    acc = arrays[0]
    for a in arrays[1:]:
        f(acc, a, out=acc)
    if op == "mean":
        np.multiply(acc, acc.dtype.type(1.0 / len(arrays)), out=acc)
    for a in arrays[1:]:
        np.copyto(a, acc)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = bd.runner_parser(__doc__.splitlines()[0]).parse_args(argv)
    op = bd.canonical_op(a.op)
    try:
        bd.resolve_dtype(a.dtype)
        bd.check_op_dtype(op, a.dtype)
    except ValueError as e:
        bd.emit("unsupported", reason=str(e))
        return 0
    bd.emit(
        "start",
        version=np.__version__,
        detail="numpy ufuncs in one thread, in place into the first replica's array, copied to the others",
    )
    if a.probe:
        return 0
    n = a.replicas
    perf = time.perf_counter
    for nbytes, iters in bd.parse_plan(a.plan):
        count = max(1, nbytes // bd.resolve_dtype(a.dtype).itemsize)
        arrays = [bd.make_input(n, r, count, a.dtype, op) for r in range(n)]
        all_reduce(arrays, op)
        wrong = bd.count_wrong(arrays, n, a.dtype, op)
        for _ in range(bd.warmup_for(iters)):
            all_reduce(arrays, op)
        times = []
        for _ in range(iters):
            t0 = perf()
            all_reduce(arrays, op)
            times.append(perf() - t0)
        bd.emit(
            "result",
            bytes=count * arrays[0].itemsize,
            count=count,
            iters=iters,
            time_us=bd.median_us(times),
            wrong=wrong,
            checked=n * count,
        )
        del arrays
    bd.emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
