"""Worker script: every route a buffer can take across the workers gives the reference
result, the same bits on every worker.

- ``HierarchicalCollectives._mpi_all_reduce`` on sizes that take each route of
  ``distvals.mpi_exchanges`` (polled
  Iallreduce below 64 KiB; two workers swapping whole buffers up to 512 KiB; the ring of
  halves above, and the ring of any worker count when each piece is 1 MiB; blocking
  Allreduce between), in place and from a separate input, for every op and the dtypes
  MPI reduces (float16 crossing as float32).
- The same from ``strategy.run`` with chunks small enough that the pipeline runs
  (several chunks, the last one below 64 KiB) and large enough that one chunk takes
  the ring.
- Several local arrays per worker (a different number on each) reduced inside the
  swapped buffers and the ring, into new results and in place, every result of every
  worker against the reference; a worker whose agreement flag is False stops them all.
- Signed zeros under MIN and MAX: every worker's result has the same bits.
"""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import expect, expect_close, finish, make_strategy, parse_args, reference, tolerance, value_for
from mpi4py import MPI

import distvals as dv
from distvals import mpi_exchanges as mx
from distvals.reduce_op import ReduceOp

OPS = {"sum": ReduceOp.SUM, "min": ReduceOp.MIN, "max": ReduceOp.MAX, "product": ReduceOp.PRODUCT}


def same_everywhere(x: np.ndarray, rank: int, what: str) -> None:
    """Every worker holds the same bytes in ``x``."""
    crc = np.array([zlib.crc32(np.ascontiguousarray(x).tobytes())], dtype=np.int64)
    table = np.empty(MPI.COMM_WORLD.Get_size(), dtype=np.int64)
    MPI.COMM_WORLD.Allgather(crc, table)
    expect(bool(np.all(table == table[0])), rank, f"{what}: results differ between workers ({table.tolist()})")


def main() -> int:
    a = parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    checks = 0
    s = make_strategy("1", a.timeout)
    coll = s.extended._coll

    # ---- the routes of one flat buffer, called directly ------------------------------------------
    counts = [1_000, 40_000, 1_600_001]  # float32: 4 KB, 160 KB, 6.4 MB (2.1 MB pieces of 3)
    seen = set()
    for count in counts:
        for dtype in ("float32", "float64", "int32", "int64", "float16", "complex64"):
            ops = ["sum", "product"] if dtype == "complex64" else list(OPS)
            if count > 100_000 and dtype in ("int32", "float64"):
                ops = ops[:1]  # the ring's reductions are the same code for every op
            for op in ops:
                dt = np.dtype(dtype)
                # Worker w's values; the reference reduces them in float64.
                mine = value_for(rank, (count,), dtype, op, salt=count)
                want = reference([value_for(w, (count,), dtype, op, salt=count) for w in range(size)], op)
                wire = np.dtype(np.float32) if dt == np.float16 else dt
                seen.add(coll._exchanges.route(count * wire.itemsize, wire))
                for in_place in (True, False):
                    buf = mine.copy() if in_place else np.full(count, 99, dtype=dt)
                    src = None if in_place else mine.copy()
                    coll._mpi_all_reduce(buf, OPS[op], "check", None, send=src)
                    what = f"{op} {dtype} x{count} {'in place' if in_place else 'from an input'}"
                    expect_close(buf, want, rank, what, tolerance(dtype))
                    if src is not None:
                        expect(np.array_equal(src, mine), rank, f"{what}: the input was changed")
                    same_everywhere(buf, rank, what)
                    checks += 1
    want_routes = {"nonblocking", "pair", "ring"} if size == 2 else {"nonblocking", "blocking", "ring"}
    expect(want_routes <= seen, rank, f"routes taken: {sorted(seen)}, expected at least {sorted(want_routes)}")

    # ---- several local replicas reduced inside the exchanges ---------------------------------------
    # Worker w has 1 + (w + k) % 3 local arrays (so the workers' counts differ); every
    # result of every worker must be the reduction of every array of every worker.
    def n_local(w: int, k: int) -> int:
        return 1 + (w + k) % 3

    for k, count in enumerate([40_000, 1_600_001]):
        for dtype, ops in (("float32", list(OPS)), ("int64", ["sum", "max"]), ("complex64", ["sum"])):
            dt = np.dtype(dtype)
            route = coll._exchanges.route(count * dt.itemsize, dt)
            if route not in ("pair", "ring"):
                continue
            for op in ops:
                ids = [(w, r) for w in range(size) for r in range(n_local(w, k))]
                arrays = {i: value_for(10 * i[0] + i[1], (count,), dtype, op, salt=count) for i in ids}
                want = reference(list(arrays.values()), op)
                mine = [arrays[(rank, r)].copy() for r in range(n_local(rank, k))]
                for in_place in (True, False):
                    local = [m.copy() for m in mine]
                    outs = local if in_place else [np.full(count, 99, dtype=dt) for _ in local]
                    ok = coll._carried_all_reduce(outs[0], OPS[op], None, True, "check", None, local, outs)
                    what = f"{len(local)} local arrays, {op} {dtype} x{count} by {route}, in place: {in_place}"
                    expect(ok, rank, f"{what}: the flags said some worker disagreed")
                    for r, o in enumerate(outs):
                        expect_close(o, want, rank, f"{what}, result {r}", tolerance(dtype))
                        expect(o.tobytes() == outs[0].tobytes(), rank, f"{what}: result {r} differs from 0")
                    if not in_place:
                        expect(
                            all(np.array_equal(x, m) for x, m in zip(local, mine)), rank, f"{what}: an input changed"
                        )
                    same_everywhere(outs[0], rank, what)
                    checks += 1
            # A worker whose flag says "not my call": every worker learns it, none finishes.
            local = [m.copy() for m in [value_for(rank, (count,), dtype)] * n_local(rank, k)]
            ok = coll._carried_all_reduce(local[0], OPS["sum"], None, rank != size - 1, "check", None, local, local)
            expect(not ok, rank, f"{dtype} x{count} by {route}: the last worker's flag was False, yet ok")
            checks += 1

    # Signed zeros: worker w passes -0.0 where w is odd, +0.0 where even.
    for op in ("min", "max"):
        for count in (100, 100_000, 2_000_000):
            zeros = np.full(count, -0.0 if rank % 2 else 0.0, dtype=np.float32)
            coll._mpi_all_reduce(zeros, OPS[op], "check", None)
            expect(bool(np.all(zeros == 0)), rank, f"{op} of signed zeros x{count}")
            same_everywhere(zeros, rank, f"{op} of signed zeros x{count}")
            checks += 1
    s.close()

    # ---- strategy.run through the pipeline (small chunks) and through one large chunk --------------
    for chunk in (1 << 20, 64 << 20):
        os.environ["DISTVALS_MPI_CHUNK_BYTES"] = str(chunk)
        s = make_strategy(a.replicas, a.timeout, a.execution)
        total = s.num_replicas_in_sync
        # Where every worker reduces its replicas inside the exchanges, two workers swap
        # halves from 128 KiB on; elsewhere whole buffers up to 512 KiB. Every worker
        # must hold the same size, or their MPI calls would not match.
        hier = s.extended._coll
        fused = world.allreduce(int(hier.reduces_inside_exchanges), op=MPI.MIN)
        want_max = mx.PAIR_MAX_BYTES_LOCAL if fused else mx.PAIR_MAX_BYTES
        held = world.allgather(hier._exchanges.pair_max_bytes)
        expect(held == [want_max] * size, rank, f"swap sizes held: {held}, expected {want_max} on every worker")
        checks += 1
        for dtype, op, count in [
            ("float32", "sum", 70_001),  # 280 KB: the ring where every worker reduces inside it
            ("float32", "sum", 2_600_005),
            ("int64", "max", 300_003),
            ("float64", "mean", 1_100_000),
        ]:

            def big(dtype=dtype, op=op, count=count):
                g = dv.get_replica_context().replica_id_in_sync_group
                return dv.get_replica_context().all_reduce(op, value_for(g, (count,), dtype, op, salt=count))

            out = s.run(big)
            want = reference([value_for(g, (count,), dtype, op, salt=count) for g in range(total)], op)
            local = [np.asarray(x) for x in s.experimental_local_results(out)]
            what = f"run: {op} {dtype} x{count} in chunks of {chunk} bytes"
            for r, got in enumerate(local):
                expect_close(got, want, rank, f"{what}, local replica {r}", tolerance(dtype))
                expect(got.tobytes() == local[0].tobytes(), rank, f"{what}: local replica {r} differs from 0")
            same_everywhere(local[0], rank, what)  # one call per worker, whatever its replica count
            checks += 1
        s.close()

    return finish(rank, checks)


if __name__ == "__main__":
    sys.exit(main())
