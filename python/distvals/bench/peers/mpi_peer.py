"""Peer runner: mpi4py ``Allreduce`` (in place) over Open MPI, one process per rank.

Started as ``mpirun -n N python mpi_peer.py ...``. A call's time is the slowest rank's
time for that call; the median over calls is reported. Rank 0 prints JSON lines (see
bench_data.emit). With ``--probe`` it runs without mpirun and only reports the version.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional, Sequence

try:
    if TYPE_CHECKING:  # checked as part of the package; runs as a script beside bench_data.py
        from . import bench_data as bd
    else:
        import bench_data as bd
    import numpy as np
except ImportError as e:
    sys.stdout.write('{"event": "missing", "reason": "' + str(e).replace('"', "'") + '"}\n')
    sys.exit(0)

__all__ = ["main"]

_MPI_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = bd.runner_parser(__doc__.splitlines()[0]).parse_args(argv)
    op = bd.canonical_op(a.op)
    try:
        import mpi4py
    except ImportError as e:
        bd.emit("missing", reason=f"cannot import mpi4py: {e}")
        return 0
    if op == "mean":
        bd.emit("unsupported", reason="MPI has no mean reduction")
        return 0
    if a.dtype not in _MPI_DTYPES:
        bd.emit("unsupported", reason=f"MPI has no {a.dtype} type")
        return 0
    if a.probe:
        bd.emit("start", version=mpi4py.__version__, detail="probe")
        return 0
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if n != a.replicas:
        if rank == 0:
            bd.emit("error", reason=f"started with {n} ranks, expected {a.replicas}")
        return 1
    red = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[op]
    if rank == 0:
        lib = MPI.Get_library_version().replace("\0", "").split(",")[0].strip()
        bd.emit(
            "start", version=mpi4py.__version__, detail=f"comm.Allreduce(MPI.IN_PLACE, ...) on {n} processes, {lib}"
        )
    dt = bd.resolve_dtype(a.dtype)
    wtime = MPI.Wtime
    for nbytes, iters in bd.parse_plan(a.plan):
        count = max(1, nbytes // dt.itemsize)
        buf = bd.make_input(n, rank, count, a.dtype, op)
        comm.Allreduce(MPI.IN_PLACE, buf, op=red)
        wrong = comm.allreduce(bd.count_wrong([buf], n, a.dtype, op), op=MPI.SUM)
        bd.fill(buf, n, rank, a.dtype, op)
        for _ in range(bd.warmup_for(iters)):
            comm.Allreduce(MPI.IN_PLACE, buf, op=red)
        times = np.empty(iters, dtype=np.float64)
        comm.Barrier()
        for i in range(iters):
            t0 = wtime()
            comm.Allreduce(MPI.IN_PLACE, buf, op=red)
            times[i] = wtime() - t0
        slowest = np.empty_like(times)
        comm.Reduce(times, slowest, op=MPI.MAX, root=0)
        if rank == 0:
            bd.emit(
                "result",
                bytes=count * dt.itemsize,
                count=count,
                iters=iters,
                time_us=bd.median_us(slowest),
                wrong=int(wrong),
                checked=n * count,
            )
        del buf
    if rank == 0:
        bd.emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
