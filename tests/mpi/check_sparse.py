"""Worker script: IndexedSlices through MultiWorkerMirroredStrategy's collectives, checked
against a float64 numpy reference on every worker and every local replica (run under
mpirun by tests/test_multi_worker.py).

    mpirun -n 3 python -m mpi4py tests/mpi/check_sparse.py --replicas 1,2,3

SUM gathers every replica's rows of every worker, in global replica order; MEAN divides
the values by the global replica count; replicas may pass different numbers of rows.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import expect, expect_close, expect_raises, finish, layout, make_strategy, parse_args

import distvals as dv

WIDTH = 2
DENSE_ROWS = 8


def slices_for(g: int, dtype="float32", dense_rows: int = DENSE_ROWS) -> dv.IndexedSlices:
    """Global replica g's rows: g % 3 of them (none for some), its own values and indices."""
    rows = g % 3
    values = (np.arange(rows * WIDTH, dtype=np.float64).reshape(rows, WIDTH) + 10 * g + 1) * (-1) ** g
    indices = (np.arange(rows) * (g + 1) + g) % DENSE_ROWS
    return dv.IndexedSlices(values.astype(dtype), indices, (dense_rows, WIDTH))


def check(got, total: int, op: str, rank: int, what: str, dtype="float32") -> None:
    parts = [slices_for(g, dtype) for g in range(total)]
    values = np.concatenate([np.asarray(p.values, np.float64) for p in parts])
    indices = np.concatenate([p.indices for p in parts])
    if op == "MEAN":
        values = values / total
    expect(isinstance(got, dv.IndexedSlices), rank, f"{what}: a {type(got).__name__}")
    expect(np.asarray(got.values).dtype == np.dtype(dtype), rank, f"{what}: dtype {np.asarray(got.values).dtype}")
    expect_close(got.indices, indices, rank, f"{what} indices")
    expect_close(got.values, values, rank, f"{what} values", 1e-6)
    expect(tuple(got.dense_shape) == (DENSE_ROWS, WIDTH), rank, f"{what}: dense_shape {got.dense_shape}")


def main() -> int:
    a = parse_args()
    rank, size, counts, total, offset = layout(a.replicas)
    s = make_strategy(a.replicas, a.timeout, a.execution)
    checks = 0

    def gid() -> int:
        return dv.get_replica_context().replica_id_in_sync_group

    for op in ("SUM", "MEAN"):
        # ---- inside run: alone, and in a structure with dense leaves ----------------------------
        def step(op=op):
            g = gid()
            ctx = dv.get_replica_context()
            alone = ctx.all_reduce(op, slices_for(g))
            mixed = ctx.all_reduce(op, {"d": np.full(3, g + 1.0), "e": (slices_for(g, "float64"),)})
            return alone, mixed

        alone, mixed = s.run(step)
        d = np.arange(1, total + 1, dtype=np.float64)
        for r, (one, both) in enumerate(zip(s.experimental_local_results(alone), s.experimental_local_results(mixed))):
            what = f"{op} replica {offset + r}"
            check(one, total, op, rank, what)
            check(both["e"][0], total, op, rank, f"{what} in a structure", "float64")
            expect_close(both["d"], np.full(3, d.sum() if op == "SUM" else d.mean()), rank, f"{what} dense leaf")
        checks += 3

        # ---- cross-replica: strategy.reduce and extended.reduce_to -----------------------------
        per = s.run(lambda: slices_for(gid()))
        check(s.reduce(op, per, axis=None), total, op, rank, f"strategy.reduce {op}")
        mirrored = s.extended.reduce_to(op, per, s.extended.worker_devices)
        for r, copy in enumerate(s.experimental_local_results(mirrored)):
            check(copy, total, op, rank, f"reduce_to {op} copy {r}")
        out = s.extended.batch_reduce_to(op, [(per, s.extended.worker_devices)])
        for r, copy in enumerate(s.experimental_local_results(out[0])):
            check(copy, total, op, rank, f"batch_reduce_to {op} copy {r}")
        checks += 3

    # ---- workers that disagree: every worker gets a MismatchError, and the strategy goes on ----
    if size > 1:
        last = rank == size - 1
        bad = s.run(lambda: slices_for(gid(), "float64" if last else "float32"))
        e = expect_raises(
            ValueError, lambda: s.reduce("SUM", bad, axis=None), rank, "values dtype", f"worker {size - 1}"
        )
        expect(isinstance(e, dv.MismatchError), rank, f"mismatch error type {type(e).__name__}")
        bad = s.run(lambda: slices_for(gid(), dense_rows=DENSE_ROWS + 1 if last else DENSE_ROWS))
        first_other = sum(counts[:-1])
        expect_raises(
            dv.MismatchError,
            lambda: s.reduce("MEAN", bad, axis=None),
            rank,
            "dense_shape",
            f"replica {first_other} of dense_shape ({DENSE_ROWS + 1}, {WIDTH})",
        )
        checks += 2
        again = s.run(lambda: slices_for(gid()))
        check(s.reduce("SUM", again, axis=None), total, "SUM", rank, "a reduce after a mismatch")
        checks += 1

    return finish(rank, checks, s)


if __name__ == "__main__":
    sys.exit(main())
