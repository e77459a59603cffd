"""Peer runner: TensorFlow MirroredStrategy on N logical CPU devices.

``strategy.run`` of a ``tf.function`` whose replica function calls
``ReplicaContext.all_reduce``: the way a TensorFlow user writes a synchronous
all-reduce across local replicas. The cross-device ops are TensorFlow's default for CPU
devices. Prints JSON lines (see bench_data.emit).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:
    if TYPE_CHECKING:  # checked as part of the package; runs as a script beside bench_data.py
        import numpy as np

        from . import bench_data as bd
    else:
        import bench_data as bd
except ImportError as e:
    sys.stdout.write('{"event": "missing", "reason": "' + str(e).replace('"', "'") + '"}\n')
    sys.exit(0)

__all__ = ["main"]


def _distribute(tf: Any, strategy: Any, arrays: Sequence[np.ndarray]) -> Any:
    """A PerReplica value whose replica r holds ``arrays[r]`` on its own logical device."""
    devices = strategy.extended.worker_devices

    def value(ctx: Any) -> Any:
        r = ctx.replica_id_in_sync_group
        with tf.device(devices[r]):  # (without it every replica's constant lands on CPU:0)
            return tf.constant(arrays[r])

    return strategy.experimental_distribute_values_from_function(value)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = bd.runner_parser(__doc__.splitlines()[0]).parse_args(argv)
    op = bd.canonical_op(a.op)
    try:
        import tensorflow as tf
    except ImportError as e:
        bd.emit("missing", reason=f"cannot import tensorflow: {e}")
        return 0
    if op not in ("sum", "mean"):
        bd.emit("unsupported", reason=f"ReplicaContext.all_reduce supports SUM and MEAN only, not {op}")
        return 0
    try:
        dt = bd.resolve_dtype(a.dtype)
        bd.check_op_dtype(op, a.dtype)
    except ValueError as e:
        bd.emit("unsupported", reason=str(e))
        return 0
    n = a.replicas
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    devices = [f"/cpu:{i}" for i in range(n)]
    strategy = tf.distribute.MirroredStrategy(devices)
    cross = (
        type(strategy.extended._cross_device_ops).__name__
        if getattr(strategy.extended, "_cross_device_ops", None) is not None
        else "default"
    )
    bd.emit(
        "start",
        version=tf.__version__,
        detail=f"tf.function(strategy.run) + ReplicaContext.all_reduce on {n} logical CPUs, cross-device ops {cross}",
    )
    if a.probe:
        return 0
    reduce_op = tf.distribute.ReduceOp.SUM if op == "sum" else tf.distribute.ReduceOp.MEAN

    def replica_fn(x: Any) -> Any:
        return tf.distribute.get_replica_context().all_reduce(reduce_op, x)

    @tf.function  # type: ignore[untyped-decorator]
    def step(v: Any) -> Any:
        return strategy.run(replica_fn, args=(v,))

    perf = time.perf_counter
    arrays: Optional[List[np.ndarray]]
    for nbytes, iters in bd.parse_plan(a.plan):
        count = max(1, nbytes // dt.itemsize)
        arrays = [bd.make_input(n, r, count, a.dtype, op) for r in range(n)]
        values = _distribute(tf, strategy, arrays)
        out = step(values)
        results = [t.numpy() for t in strategy.experimental_local_results(out)]
        wrong = bd.count_wrong(results, n, a.dtype, op, count=count, copies=n)
        del out, results
        for _ in range(bd.warmup_for(iters)):
            step(values)
        times = []
        for _ in range(iters):
            t0 = perf()
            # Eager execution on CPU is synchronous: the call returns once every replica's
            # result has been computed.
            step(values)
            times.append(perf() - t0)
        bd.emit(
            "result",
            bytes=count * dt.itemsize,
            count=count,
            iters=iters,
            time_us=bd.median_us(times),
            wrong=wrong,
            checked=n * count,
        )
        values = arrays = None  # free this size's buffers before the next
    bd.emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
