"""``mpirun -n 2 python -m distvals.bench --mpi``: the hierarchical all-reduce of
``MultiWorkerMirroredStrategy`` next to plain mpi4py ``Allreduce``, in one run.

Each of the W processes started by mpirun is a worker with R local replicas (``--replicas``,
default 2). For every size S (bytes per replica) the table shows the median time of:

- ``hier``: one hierarchical all-reduce of the worker's R buffers (engine reduce, MPI
  Iallreduce between workers, engine broadcast; pipelined in chunks), the call the
  strategy makes in cross-replica context;
- ``hier run``: the same inside ``strategy.run`` (every replica thread calls
  ``ReplicaContext.all_reduce`` on its own buffer);
- ``mpi W``: plain ``comm.Allreduce(MPI.IN_PLACE, ...)`` of S bytes over the W workers;
- ``mpi WxR``: plain ``Allreduce`` of S bytes over W*R processes, one per replica: the
  workers plus W*(R-1) processes spawned for the purpose (``MPI.Comm.Spawn``), i.e.
  the same number of participants as the strategy has replicas;
- ``local``: the hierarchical all-reduce's own local steps alone (engine reduce of the R
  buffers into the buffer MPI would send, engine broadcast from it), so that ``mpi W +
  local`` is what the three steps cost one after the other, with no overlap;
- ``chunked``: ``hier`` with the pipeline on (4 MiB chunks: the local steps of one chunk
  overlap MPI's work on another), for sizes it splits; below ``hier`` it would gain.
  (When ``DISTVALS_MPI_CHUNK_BYTES`` turns the pipeline on, ``hier`` is chunked and this
  column shows one chunk.)

A call's time is the slowest process's time for that call. Every method starts from
distinct values per replica (process) and is checked against a float64 reference in
the same run (the ``wrong`` columns). ``ratio`` = time(mpi WxR) / time(hier): above 1 the
hierarchical all-reduce is faster.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from .peers import bench_data as bd
from .table import format_size

__all__ = ["main", "parse_args"]

_CHILD = "--child"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from .cli import parse_size

    def sizes_list(text: str) -> List[int]:
        return [parse_size(t) for t in text.split(",") if t.strip()]

    p = argparse.ArgumentParser(
        prog="mpirun -n W python -m distvals.bench --mpi",
        description="Hierarchical all-reduce (MultiWorkerMirroredStrategy) against plain mpi4py Allreduce, in one run.",
    )
    p.add_argument("--replicas", "-r", type=int, default=2, help="local replicas per worker (default 2)")
    p.add_argument(
        "--sizes", type=sizes_list, default=None, help="bytes per replica, e.g. 1M,4M,16M (default 1K,1M,16M,64M)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "int32", "int64"])
    p.add_argument("--iters", type=int, default=20, help="timed calls per size at most (default 20)")
    p.add_argument("--min-iters", type=int, default=5, help="timed calls per size at least (default 5)")
    p.add_argument("--no-spawn", action="store_true", help="skip the W*R-process Allreduce (no MPI_Comm_spawn)")
    p.add_argument("--no-run", action="store_true", help="skip the strategy.run level")
    p.add_argument("--timeout", type=float, default=300.0, help="longest wait of any collective, seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument(_CHILD, action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sizes = a.sizes or [1 << 10, 1 << 20, 16 << 20, 64 << 20]
    if a.replicas < 1 or a.iters < 1 or a.min_iters < 1:
        p.error("--replicas, --iters and --min-iters must be at least 1")
    return a


def _plan(a: argparse.Namespace) -> List[List[int]]:
    """[count, iterations] per size."""
    itemsize = np.dtype(a.dtype).itemsize
    return [[max(1, s // itemsize), bd.iterations(s, a.iters, a.min_iters, budget_bytes=1 << 30)] for s in a.sizes]


class _Clock:
    """Per-call times of one method on one process; the slowest process counts."""

    def __init__(self, comm: Any, mpi: Any, timeout: float) -> None:
        self.comm, self.mpi, self.timeout = comm, mpi, timeout

    def wait(self, req: Any, what: str) -> None:
        from ..mpi_runtime import poll

        if not poll(req, time.monotonic() + self.timeout):
            sys.stderr.write(f"distvals.bench --mpi: {what} waited {self.timeout:g} s; aborting\n")
            sys.stderr.flush()
            self.mpi.COMM_WORLD.Abort(1)

    def barrier(self) -> None:
        self.wait(self.comm.Ibarrier(), "barrier")

    def slowest_median_us(self, times: np.ndarray) -> float:
        out = np.empty_like(times)
        self.wait(self.comm.Iallreduce(times, out, op=self.mpi.MAX), "timing reduction")
        return bd.median_us(out)

    def total(self, value: int) -> int:
        buf = np.array([value], dtype=np.int64)
        self.wait(self.comm.Iallreduce(self.mpi.IN_PLACE, buf, op=self.mpi.SUM), "check reduction")
        return int(buf[0])


def _time_calls(clock: _Clock, iters: int, refill: Callable[[], None], call: Callable[[], None]) -> float:
    """Median over ``iters`` calls of the slowest process's time, refilling the inputs
    (untimed) before each call."""
    for _ in range(bd.warmup_for(iters)):
        refill()
        call()
    times = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        refill()
        clock.barrier()
        t0 = time.perf_counter()
        call()
        times[i] = time.perf_counter() - t0
    return clock.slowest_median_us(times)


def _plain_allreduce(
    comm: Any, mpi: Any, plan: Sequence[Sequence[int]], dtype: str, timeout: float
) -> List[Dict[str, Any]]:
    """Plain blocking ``Allreduce`` over ``comm`` for every size: one process = one replica."""
    clock = _Clock(comm, mpi, timeout)
    n, rank = comm.Get_size(), comm.Get_rank()
    out = []
    for count, iters in plan:
        buf = bd.make_input(n, rank, count, dtype, "sum")

        def refill(buf: np.ndarray = buf) -> None:
            bd.fill(buf, n, rank, dtype, "sum")

        def call(buf: np.ndarray = buf) -> None:
            comm.Allreduce(mpi.IN_PLACE, buf, op=mpi.SUM)

        refill()
        call()
        wrong = clock.total(bd.count_wrong([buf], n, dtype, "sum"))
        us = _time_calls(clock, iters, refill, call)
        out.append({"time_us": us, "wrong": wrong})
        del buf
    return out


def _child() -> int:
    """A spawned process of the W*R-process Allreduce."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    comm = parent.Merge(high=True)
    setup = comm.bcast(None, root=0)
    _plain_allreduce(comm, MPI, setup["plan"], setup["dtype"], setup["timeout"])
    comm.Free()
    parent.Disconnect()
    return 0


def firsts(rows: List[List[np.ndarray]]) -> List[np.ndarray]:
    """Each replica's one result of a single-array call of the collectives."""
    return [row[0] for row in rows]


def _hierarchical(
    strategy: Any, plan: Sequence[Sequence[int]], dtype: str, clock: _Clock, with_run: bool
) -> List[Dict[str, Any]]:
    import distvals as dv

    ext = strategy.extended
    coll = ext._coll
    n_local, offset, total = ext._n, ext._offset, strategy.num_replicas_in_sync
    out = []
    for count, iters in plan:
        bufs = [bd.make_input(total, offset + r, count, dtype, "sum") for r in range(n_local)]
        got: List[Any] = [None]

        def refill(bufs: List[np.ndarray] = bufs) -> None:
            for r, b in enumerate(bufs):
                bd.fill(b, total, offset + r, dtype, "sum")

        leaves = [[b] for b in bufs]

        def call(leaves: List[List[np.ndarray]] = leaves) -> None:
            # The strategy's collectives, single-call, without strategy.run around them
            # (their arguments made once, as the plain MPI call's buffer is).
            got[0] = coll.all_reduce(dv.ReduceOp.SUM, leaves)

        refill()
        call()
        row = {
            "time_us": 0.0,
            "wrong": clock.total(bd.count_wrong(firsts(got[0]), total, dtype, "sum", count=count, copies=n_local)),
        }
        row["time_us"] = _time_calls(clock, iters, refill, call)
        from ..mpi_collectives import PIPELINE_CHUNK_BYTES

        other = PIPELINE_CHUNK_BYTES if coll.chunk_bytes <= 0 else 0
        chunk_bytes = coll.chunk_bytes
        coll.chunk_bytes = other
        split = len(coll._chunks(count, np.dtype(dtype).itemsize)) > 1
        coll.chunk_bytes = chunk_bytes
        if split or len(coll._chunks(count, np.dtype(dtype).itemsize)) > 1:
            # The same call with the pipeline switched the other way.
            coll.chunk_bytes = other
            try:
                refill()
                call()
                row["wrong"] += clock.total(
                    bd.count_wrong(firsts(got[0]), total, dtype, "sum", count=count, copies=n_local)
                )
                row["chunked_us"] = _time_calls(clock, iters, refill, call)
            finally:
                coll.chunk_bytes = chunk_bytes
        if n_local > 1:
            # The local steps alone, exactly as the call makes them: small buffers reduced
            # into the call's flat buffer (the one MPI would send) and copied out to new
            # results; large ones all-reduced into the replicas' new results, then
            # broadcast from the first (where MPI would have worked in between).
            from ..host_collectives import new_array

            work = np.dtype(dtype)
            kind = coll._arrays_kind(dv.ReduceOp.SUM, bufs[0])

            def local_steps(bufs: List[np.ndarray] = bufs, kind: Any = kind, work: np.dtype = work) -> None:
                if kind.flat is not None:
                    data = coll._small_local_reduce(kind, bufs)
                    got[0] = coll._small_spread(data, dv.ReduceOp.SUM, n_local, None)
                    return
                outs = [new_array((count,), work) for _ in range(n_local)]
                coll._reduce_chunk(dv.ReduceOp.SUM, [b.reshape(-1) for b in bufs], outs, 0, count)
                coll._broadcast_chunk(outs, 0, count)
                got[0] = outs

            row["local_us"] = _time_calls(clock, iters, refill, local_steps)
        if with_run:
            results: List[Any] = [None]

            def step(bufs: List[np.ndarray] = bufs) -> Any:
                ctx = dv.get_replica_context()  # always set inside strategy.run
                return ctx.all_reduce("SUM", bufs[ctx.replica_id_in_sync_group - offset])  # type: ignore[union-attr]

            def run_call() -> None:
                results[0] = strategy.run(step)

            refill()
            run_call()
            got = [np.asarray(x) for x in strategy.experimental_local_results(results[0])]
            row["run_wrong"] = clock.total(bd.count_wrong(got, total, dtype, "sum", count=count, copies=n_local))
            row["run_time_us"] = _time_calls(clock, iters, refill, run_call)
        out.append(row)
        del bufs
    return out


def _fmt_us(us: Optional[float]) -> str:
    if us is None:
        return "-"
    return f"{us:,.1f}" if us < 100 else f"{us:,.0f}"


def _chunked_label() -> str:
    """What the chunked column holds: the call with the pipeline switched the other way
    from this run's setting (DISTVALS_MPI_CHUNK_BYTES)."""
    from ..mpi_collectives import PIPELINE_CHUNK_BYTES
    from ..multi_worker import _chunk_bytes

    set_to = _chunk_bytes()
    if set_to <= 0:
        return f"pipelined in {format_size(PIPELINE_CHUNK_BYTES)} chunks"
    return f"the unpipelined call (this run pipelines in {format_size(set_to)} chunks)"


def _table(a: argparse.Namespace, rows: List[Dict[str, Any]], W: int, lib: str, notes: List[str]) -> str:
    R = a.replicas
    lines = [
        f"# distvals MPI bench: {W} worker(s) x {R} replica(s) = {W * R} replicas in sync, {a.dtype} sum",
        f"# peers: plain mpi4py Allreduce(IN_PLACE) over {W} and over {W * R} processes ({lib})",
        "# time: median over calls of the slowest process, microseconds",
        "#   hier: the hierarchical all-reduce (single call); run: the same in strategy.run; chunked: hier",
        f"#   {_chunked_label()}; local: its local reduce + broadcast alone; W+local: mpi W + local",
        "#   run/W = run / mpi W; hier/sum = hier / (mpi W + local), at most 1 when nothing is wasted;",
        "#   WxR/hier = mpi WxR / hier (above 1: the hierarchy beats one process per replica)",
        (
            f"# {'bytes':>10} {'hier':>9} {'run':>9} {'chunked':>9} {'mpi W':>9} {'local':>9} {'W+local':>9} "
            f"{'mpi WxR':>9} {'run/W':>6} {'hier/sum':>8} {'WxR/hier':>8} {'wrong':>5}"
        ),
    ]
    for r in rows:
        wxr = r.get("mpi_wxr_us")
        local = r.get("local_us") or 0.0
        both = r["mpi_w_us"] + local
        run_w = f"{r['run_us'] / r['mpi_w_us']:.2f}" if r.get("run_us") else "-"
        wxr_hier = f"{wxr / r['hier_us']:.2f}" if wxr else "-"
        lines.append(
            f"  {r['bytes']:>10} {_fmt_us(r['hier_us']):>9} {_fmt_us(r.get('run_us')):>9} "
            f"{_fmt_us(r.get('chunked_us')):>9} {_fmt_us(r['mpi_w_us']):>9} {_fmt_us(r.get('local_us')):>9} "
            f"{_fmt_us(both):>9} {_fmt_us(wxr):>9} {run_w:>6} {r['hier_us'] / both:>8.2f} {wxr_hier:>8} "
            f"{r['wrong']:>5}"
        )
    lines += [f"# note: {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    import distvals as dv

    from ..mpi_runtime import load_mpi

    mpi = load_mpi("python -m distvals.bench --mpi")
    if a.child:
        return _child()
    world = mpi.COMM_WORLD
    W, rank = world.Get_size(), world.Get_rank()
    options = dv.CommunicationOptions(timeout_seconds=a.timeout)
    strategy = dv.MultiWorkerMirroredStrategy([f"CPU:{i}" for i in range(a.replicas)], options)
    clock = _Clock(world, mpi, a.timeout)
    plan = _plan(a)
    itemsize = np.dtype(a.dtype).itemsize
    notes: List[str] = []
    hier = _hierarchical(strategy, plan, a.dtype, clock, not a.no_run)
    plain_w = _plain_allreduce(world, mpi, plan, a.dtype, a.timeout)
    plain_wxr: List[Optional[Dict[str, Any]]] = [None] * len(plan)
    extra = W * (a.replicas - 1)
    if a.no_spawn:
        notes.append("the WxR-process Allreduce was skipped (--no-spawn)")
    elif extra == 0:
        plain_wxr = list(plain_w)
    else:
        info = mpi.Info.Create()
        # More processes than slots on a small machine: allowed, they mostly wait.
        info.Set("map_by", ":OVERSUBSCRIBE")
        try:
            inter = world.Spawn(
                sys.executable, args=["-m", "distvals.bench.mpi", _CHILD], maxprocs=extra, info=info, root=0
            )
        except mpi.Exception as e:
            notes.append(f"the WxR-process Allreduce could not spawn {extra} processes: {e}")
            inter = None
        if inter is not None:
            merged = inter.Merge(high=False)
            merged.bcast({"plan": plan, "dtype": a.dtype, "timeout": a.timeout}, root=0)
            plain_wxr = list(_plain_allreduce(merged, mpi, plan, a.dtype, a.timeout))
            merged.Free()
            inter.Disconnect()
    rows = []
    for (count, iters), h, pw, pwr in zip(plan, hier, plain_w, plain_wxr):
        wrong = h["wrong"] + h.get("run_wrong", 0) + pw["wrong"] + (pwr["wrong"] if pwr else 0)
        rows.append(
            {
                "bytes": count * itemsize,
                "count": count,
                "iters": iters,
                "hier_us": h["time_us"],
                "run_us": h.get("run_time_us"),
                "chunked_us": h.get("chunked_us"),
                "local_us": h.get("local_us"),
                "mpi_w_us": pw["time_us"],
                "mpi_wxr_us": pwr["time_us"] if pwr else None,
                "wrong": wrong,
            }
        )
    if rank == 0:
        lib = mpi.Get_library_version().replace("\0", "").split(",")[0].strip()
        sys.stdout.write(_table(a, rows, W, lib, notes))
        sys.stdout.flush()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    {
                        "workers": W,
                        "replicas_per_worker": a.replicas,
                        "dtype": a.dtype,
                        "mpi": lib,
                        "chunked": _chunked_label(),
                        "rows": rows,
                        "notes": notes,
                    },
                    f,
                    indent=1,
                )
                f.write("\n")
    strategy.close()
    wrong = sum(r["wrong"] for r in rows)
    if wrong and rank == 0:
        print(f"# ERROR: {wrong} wrong result elements", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
