"""Peer runner: torch.distributed all_reduce with the gloo backend on N processes.

The runner spawns N worker processes (one per rank, rendezvous through a file); each
times ``dist.all_reduce`` on its own CPU tensor. A call's time is the slowest rank's
time for that call; the median over calls is reported. Rank 0 prints JSON lines (see
bench_data.emit).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

try:
    if TYPE_CHECKING:  # checked as part of the package; runs as a script beside bench_data.py
        from . import bench_data as bd
    else:
        import bench_data as bd
except ImportError as e:
    sys.stdout.write('{"event": "missing", "reason": "' + str(e).replace('"', "'") + '"}\n')
    sys.exit(0)

__all__ = ["main"]

_TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")


def _worker(
    rank: int, n: int, init_file: str, dtype: str, op: str, plan: List[Tuple[int, int]], timeout: float
) -> None:
    import torch
    import torch.distributed as dist

    # One intra-op thread per rank: N ranks share the machine's cores.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=timeout)
    )
    red = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[
        op
    ]
    tdt = getattr(torch, dtype)
    perf = time.perf_counter
    try:
        for nbytes, iters in plan:
            itemsize = torch.empty((), dtype=tdt).element_size()
            count = max(1, nbytes // itemsize)

            def fresh() -> torch.Tensor:
                if dtype == "bfloat16":  # numpy has no bfloat16: build it from int64
                    return torch.from_numpy(bd.input_values(n, rank, count, dtype, op)).to(tdt)
                return torch.from_numpy(bd.make_input(n, rank, count, dtype, op))

            t = fresh()
            dist.all_reduce(t, op=red)
            bad = bd.count_wrong([t.float().numpy() if dtype == "bfloat16" else t.numpy()], n, dtype, op)
            wrong = torch.tensor([bad], dtype=torch.int64)
            dist.all_reduce(wrong, op=dist.ReduceOp.SUM)
            t = fresh()
            for _ in range(bd.warmup_for(iters)):
                dist.all_reduce(t, op=red)
            times = torch.empty(iters, dtype=torch.float64)
            dist.barrier()
            for i in range(iters):
                t0 = perf()
                dist.all_reduce(t, op=red)
                times[i] = perf() - t0
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            if rank == 0:
                bd.emit(
                    "result",
                    bytes=count * itemsize,
                    count=count,
                    iters=iters,
                    time_us=bd.median_us(times.tolist()),
                    wrong=int(wrong.item()),
                    checked=n * count,
                )
            del t
    finally:
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = bd.runner_parser(__doc__.splitlines()[0]).parse_args(argv)
    op = bd.canonical_op(a.op)
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        bd.emit("missing", reason=f"cannot import torch.distributed: {e}")
        return 0
    if not dist.is_available() or not dist.is_gloo_available():
        bd.emit("missing", reason="this torch build has no gloo backend")
        return 0
    if op == "mean":
        bd.emit("unsupported", reason="gloo has no AVG reduction")
        return 0
    if a.dtype not in _TORCH_DTYPES:
        bd.emit("unsupported", reason=f"dtype {a.dtype}")
        return 0
    bd.emit(
        "start",
        version=torch.__version__,
        detail=f"torch.distributed.all_reduce, gloo, {a.replicas} processes, 1 intra-op thread each",
    )
    if a.probe:
        return 0
    plan = bd.parse_plan(a.plan)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="distvals-bench-gloo-") as d:
        init_file = os.path.join(d, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, a.replicas, init_file, a.dtype, op, plan, a.timeout))
            for r in range(a.replicas)
        ]
        for p in procs:
            p.start()
        # Each rank's collective waits are bounded by the process group's timeout; this
        # join bounds the whole sweep too, so a dead rank cannot hold the runner.
        deadline = time.monotonic() + a.timeout * (len(plan) + 1)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        if failed:
            bd.emit(
                "error",
                reason=f"rank(s) {failed} failed or timed out (exit codes {[procs[r].exitcode for r in failed]})",
            )
            return 1
    bd.emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
