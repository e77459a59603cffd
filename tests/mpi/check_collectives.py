"""Worker script: MultiWorkerMirroredStrategy collectives checked against numpy on every
worker and every local replica (run under mpirun by tests/test_multi_worker.py).

    mpirun -n 3 python -m mpi4py tests/mpi/check_collectives.py --replicas 1,2,3
"""

from __future__ import annotations

import collections
import gc
import itertools
import os
import sys
import weakref

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import (
    ENGINE_DTYPES,
    OPS,
    expect,
    expect_close,
    expect_raises,
    finish,
    layout,
    make_strategy,
    parse_args,
    reference,
    tolerance,
    value_for,
)

import distvals as dv

Pair = collections.namedtuple("Pair", "first second")


def main() -> int:
    a = parse_args()
    rank, size, counts, total, offset = layout(a.replicas)
    n = counts[rank]
    s = make_strategy(a.replicas, a.timeout)
    ext = s.extended
    checks = 0

    # ---- where everyone stands ---------------------------------------------------------------
    expect(s.num_replicas_in_sync == total, rank, f"num_replicas_in_sync {s.num_replicas_in_sync} != {total}")
    cr = s.cluster_resolver
    expect((cr.task_id, cr.num_workers, cr.is_chief) == (rank, size, rank == 0), rank, f"cluster info {cr!r}")
    expect(len(cr.cluster_spec()["worker"]) == size, rank, "cluster_spec lists every worker")
    expect(
        ext.worker_devices == tuple(f"/job:worker/replica:0/task:{rank}/device:CPU:{i}" for i in range(n)),
        rank,
        f"worker_devices {ext.worker_devices}",
    )
    expect(ext.should_checkpoint == (rank == 0), rank, "should_checkpoint on the chief only")
    ids = s.run(
        lambda: (dv.get_replica_context().replica_id_in_sync_group, dv.get_replica_context().num_replicas_in_sync)
    )
    got_ids = list(s.experimental_local_results(ids[0]))
    expect(got_ids == list(range(offset, offset + n)), rank, f"replica ids {got_ids}")
    expect(all(t == total for t in s.experimental_local_results(ids[1])), rank, "context num_replicas_in_sync")
    vals = s.experimental_distribute_values_from_function(
        lambda c: (c.replica_id_in_sync_group, c.num_replicas_in_sync)
    )
    expect(
        [v for v in s.experimental_local_results(vals)] == [(offset + r, total) for r in range(n)],
        rank,
        "values_from_function contexts",
    )
    checks += 5

    # ---- ReplicaContext.all_reduce: every op and dtype, several shapes ------------------------------
    for dtype in ENGINE_DTYPES:
        for op in OPS:
            for shape in [(), (7,), (3, 5)]:

                def fn(dtype=dtype, op=op, shape=shape):
                    ctx = dv.get_replica_context()
                    return ctx.all_reduce(op, value_for(ctx.replica_id_in_sync_group, shape, dtype, op))

                out = s.run(fn)
                want = reference([value_for(g, shape, dtype, op) for g in range(total)], op)
                for r, got in enumerate(s.experimental_local_results(out)):
                    want_dtype = np.dtype(dtype)
                    if op == "mean" and want_dtype.kind in "iu":
                        # TensorFlow's true division: float32 for 8- and 16-bit integers.
                        want_dtype = np.dtype(np.float32 if want_dtype.itemsize <= 2 else np.float64)
                    expect(
                        np.asarray(got).dtype == want_dtype,
                        rank,
                        f"all_reduce {op} {dtype}: result dtype {np.asarray(got).dtype}, expected {want_dtype}",
                    )
                    tol = tolerance(dtype) if op != "mean" or np.dtype(dtype).kind == "f" else tolerance(want_dtype)
                    expect_close(got, want, rank, f"all_reduce {op} {dtype} {shape} replica {offset + r}", tol)
                checks += 1

    # Dtypes the engine does not reduce go through a gather of raw bytes.
    for dtype, ops in [("int16", ["sum", "max"]), ("complex128", ["sum"]), ("bool", ["min", "max"])]:
        for op in ops:
            out = s.run(
                lambda dtype=dtype, op=op: dv.get_replica_context().all_reduce(
                    op, value_for(dv.get_replica_context().replica_id_in_sync_group, (4,), dtype, op)
                )
            )
            want = reference([value_for(g, (4,), dtype, op) for g in range(total)], op)
            for r, got in enumerate(s.experimental_local_results(out)):
                expect_close(got, want, rank, f"all_reduce {op} {dtype} replica {offset + r}")
            checks += 1

    # Integer sums and products that overflow wrap around modulo 2**bits, as numpy's do,
    # small (the flagged single call) and large (agreed first), every width. (Open MPI's
    # AVX reductions saturate 8- and 16-bit sums instead: 100 + 100 gave 127 in int8.)
    for dtype in ["int8", "uint8", "int16", "uint16", "int32", "uint64"]:
        info = np.iinfo(dtype)
        for op in ["sum", "prod"]:
            for count in (1000, 300_001):

                def full_range(g, dtype=dtype, count=count, info=info):
                    rng = np.random.default_rng([g, count, info.bits])
                    return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)

                out = s.run(
                    lambda op=op, full_range=full_range: dv.get_replica_context().all_reduce(
                        op, full_range(dv.get_replica_context().replica_id_in_sync_group)
                    )
                )
                want = full_range(0)
                for g in range(1, total):
                    want = want + full_range(g) if op == "sum" else want * full_range(g)
                for r, got in enumerate(s.experimental_local_results(out)):
                    wrong = int(np.count_nonzero(np.asarray(got) != want))
                    expect(
                        np.asarray(got).dtype == want.dtype and wrong == 0,
                        rank,
                        f"all_reduce {op} {dtype} x{count} (wrapping) replica {offset + r}: {wrong} elements wrong",
                    )
                checks += 1

    # 16-bit floats accumulate in float32 across the workers too, from the local step on,
    # and are rounded once: in float16 a worker's 2048 + 1 is 2048, and its 40000 + 40000
    # inf (so their MEAN would be inf too); bfloat16's 256 + 1 is 256.
    import ml_dtypes

    for dt, big in [(np.dtype(np.float16), 2048.0), (np.dtype(ml_dtypes.bfloat16), 256.0)]:
        for values in ([big] + [1.0] * (total - 1), [40000.0] * total):
            for op in ("sum", "mean"):
                for count in (4, 100_000):
                    out = s.run(
                        lambda dt=dt, values=values, op=op, count=count: dv.get_replica_context().all_reduce(
                            op, np.full(count, values[dv.get_replica_context().replica_id_in_sync_group], dt)
                        )
                    )
                    exact = float(np.sum(np.array(values, np.float64).astype(dt).astype(np.float64)))
                    with np.errstate(over="ignore"):
                        want = np.float32(exact if op == "sum" else exact / total).astype(dt)
                    for r, got in enumerate(s.experimental_local_results(out)):
                        got = np.asarray(got)
                        expect(
                            got.dtype == dt and bool(np.all(got.astype(np.float64) == float(want))),
                            rank,
                            f"all_reduce {op} {dt.name} of {values[:2]}... x{count} replica {offset + r}: "
                            f"{got[:2]} where {want} (float32 accumulation, rounded once)",
                        )
                    checks += 1

    # Large buffers: the pipelined path (several chunks), every element checked. Two
    # local replicas are reduced with numpy or with the engine (as the host's cores
    # decide): both ways, whichever this machine picks. Every worker runs both rounds
    # (the same collectives everywhere); the choice only applies where there are two.
    coll = s.extended._coll
    chosen = coll._numpy_pair_reduce
    applies = coll.num_local == 2 and not coll._on_gpu
    for numpy_pair, (dtype, op, count) in itertools.product(
        (True, False),
        [
            ("float32", "sum", 700_000),
            ("float16", "max", 1_300_000),
            ("int64", "sum", 300_001),
            ("float64", "mean", 262_145),
            ("float32", "min", 300_000),
            ("int64", "product", 200_003),  # at most 116**5: no wrap
        ],
    ):
        coll._numpy_pair_reduce = numpy_pair if applies else chosen

        def big(dtype=dtype, op=op, count=count):
            g = dv.get_replica_context().replica_id_in_sync_group
            x = (np.arange(count, dtype=np.int64) % 97 + 5 * g).astype(dtype)
            return dv.get_replica_context().all_reduce(op, x)

        out = s.run(big)
        want = reference([(np.arange(count, dtype=np.int64) % 97 + 5 * g).astype(dtype) for g in range(total)], op)
        for r, got in enumerate(s.experimental_local_results(out)):
            expect_close(
                got,
                want,
                rank,
                f"large all_reduce {op} {dtype} x{count} replica {offset + r} (numpy pair {numpy_pair})",
                tolerance(dtype),
            )
        checks += 1
    coll._numpy_pair_reduce = chosen

    # Nested values of mixed dtypes, many small tensors (packed per dtype), two pack sizes.
    for bytes_per_pack in (0, 64):
        options = dv.CommunicationOptions(bytes_per_pack=bytes_per_pack)

        def nested(options=options):
            ctx = dv.get_replica_context()
            g = ctx.replica_id_in_sync_group
            value = {
                "w": [value_for(g, (i + 1,), "float32", salt=i) for i in range(12)],
                "step": np.int64(g),
                "pair": Pair(value_for(g, (2, 2), "float64"), value_for(g, (), "int32")),
            }
            return ctx.all_reduce("sum", value, options=options)

        out = s.run(nested)
        for r, got in enumerate(s.experimental_local_results(out)):
            expect(isinstance(got["pair"], Pair), rank, "namedtuple kept")
            for i in range(12):
                want = reference([value_for(g, (i + 1,), "float32", salt=i) for g in range(total)], "sum")
                expect_close(got["w"][i], want, rank, f"nested w[{i}] (pack {bytes_per_pack})", 1e-6)
                expect(got["w"][i].dtype == np.float32, rank, "nested dtype kept")
            expect_close(got["step"], sum(range(total)), rank, "nested step")
            expect(isinstance(got["step"], np.int64), rank, f"a scalar stays a scalar: {type(got['step'])}")
            expect_close(
                got["pair"].first,
                reference([value_for(g, (2, 2), "float64") for g in range(total)], "sum"),
                rank,
                "nested pair.first",
                1e-12,
            )
            expect_close(
                got["pair"].second,
                reference([value_for(g, (), "int32") for g in range(total)], "sum"),
                rank,
                "nested pair.second",
            )
        checks += 1

    # ---- ReplicaContext.all_gather: uneven sizes along the axis, axis 1, 0-d, nested -----------------
    def gather_fn():
        ctx = dv.get_replica_context()
        g = ctx.replica_id_in_sync_group
        return (
            ctx.all_gather(np.full((g + 1, 3), g, np.float32), 0),
            ctx.all_gather(np.full((2, g % 2 + 1), g, np.int32), 1),
            ctx.all_gather(np.float64(g), 0),
            ctx.all_gather({"b": np.array([g % 2 == 0, True])}, 0),
        )

    out = s.run(gather_fn)
    want0 = np.concatenate([np.full((g + 1, 3), g, np.float32) for g in range(total)], axis=0)
    want1 = np.concatenate([np.full((2, g % 2 + 1), g, np.int32) for g in range(total)], axis=1)
    want2 = np.arange(total, dtype=np.float64)
    want3 = np.concatenate([np.array([g % 2 == 0, True]) for g in range(total)])
    for r in range(n):
        parts = [s.experimental_local_results(o)[r] for o in out]
        expect_close(parts[0], want0, rank, f"all_gather axis 0 uneven, replica {offset + r}")
        expect_close(parts[1], want1, rank, f"all_gather axis 1 uneven, replica {offset + r}")
        expect_close(parts[2], want2, rank, f"all_gather 0-d, replica {offset + r}")
        expect(parts[3]["b"].dtype == bool, rank, "all_gather bool dtype")
        expect_close(parts[3]["b"], want3, rank, f"all_gather nested bool, replica {offset + r}")
    checks += 1

    # ---- strategy.reduce and strategy.gather of run results ----------------------------------------------
    for dtype in ["float32", "int32", "float64"]:
        for op in OPS:
            per = s.run(
                lambda dtype=dtype, op=op: value_for(
                    dv.get_replica_context().replica_id_in_sync_group, (3, 2), dtype, op
                )
            )
            got = s.reduce(op, per, axis=None)
            want = reference([value_for(g, (3, 2), dtype, op) for g in range(total)], op)
            expect_close(got, want, rank, f"strategy.reduce {op} {dtype}", tolerance(dtype) or 1e-12)
            if op == "mean" and dtype == "int32":
                expect(np.asarray(got).dtype == np.float64, rank, "integer MEAN gives float64")
            # With an axis, MEAN weighs replicas by their (uneven) counts.
            uneven = s.run(
                lambda dtype=dtype, op=op: value_for(
                    dv.get_replica_context().replica_id_in_sync_group,
                    (dv.get_replica_context().replica_id_in_sync_group % 3 + 1, 2),
                    dtype,
                    op,
                )
            )
            got = s.reduce(op, uneven, axis=0)
            rows = np.concatenate([value_for(g, (g % 3 + 1, 2), dtype, op) for g in range(total)], axis=0)
            want = reference(list(rows), op)
            expect_close(got, want, rank, f"strategy.reduce {op} {dtype} axis 0", tolerance(dtype) or 1e-12)
            checks += 2

    per = s.run(
        lambda: {
            "a": np.float32(dv.get_replica_context().replica_id_in_sync_group),
            "b": [np.arange(3) * dv.get_replica_context().replica_id_in_sync_group],
        }
    )
    got = s.reduce("SUM", per, axis=None)
    expect_close(got["a"], sum(range(total)), rank, "nested reduce a")
    expect_close(got["b"][0], np.arange(3) * sum(range(total)), rank, "nested reduce b")
    gathered = s.gather(per, axis=0)
    expect_close(gathered["a"], np.arange(total, dtype=np.float32), rank, "gather of 0-d parts")
    expect_close(gathered["b"][0], np.concatenate([np.arange(3) * g for g in range(total)]), rank, "nested gather")
    uneven = s.run(
        lambda: np.full(
            (2, dv.get_replica_context().replica_id_in_sync_group + 1),
            1.0 + dv.get_replica_context().replica_id_in_sync_group,
        )
    )
    expect_close(
        s.gather(uneven, axis=1),
        np.concatenate([np.full((2, g + 1), 1.0 + g) for g in range(total)], 1),
        rank,
        "gather uneven axis 1",
    )
    checks += 3

    # Once run has returned, the strategy keeps none of the step's inputs: small, large
    # (past the 64 KiB flat buffers) and 16-bit float all-reduces, in every layout.
    for count, dtype in ((100, "float32"), (40_000, "float32"), (300, "float16")):
        made = []

        def step(count=count, dtype=dtype):
            x = np.full(count, 1.0 + dv.get_replica_context().replica_id_in_sync_group, dtype)
            made.append(weakref.ref(x))
            return dv.get_replica_context().all_reduce("SUM", x)

        out = s.experimental_local_results(s.run(step))
        expect_close(out[0], np.full(count, float(sum(g + 1 for g in range(total)))), rank, f"sum of {count} {dtype}")
        gc.collect()
        alive = [i for i, ref in enumerate(made) if ref() is not None]
        expect(
            not alive, rank, f"all_reduce of {count} {dtype}: the inputs of local replicas {alive} kept after the step"
        )
        checks += 2

    # A plain value: MEAN gives it back; SUM is refused, except that, as in TensorFlow,
    # it counts as the replica's own value when every worker has one replica.
    expect_close(s.reduce("MEAN", np.float32(5.0), axis=None), 5.0, rank, "MEAN of a plain value")
    if max(counts) > 1:
        expect_raises(
            ValueError,
            lambda: s.reduce("SUM", np.float32(5.0), axis=None),
            rank,
            "SUM of a plain value",
            "non-distributed",
        )
    elif size > 1:
        expect_close(
            s.reduce("SUM", np.float32(rank + 1), axis=None),
            sum(r + 1 for r in range(size)),
            rank,
            "SUM of one local replica's plain value",
        )
    checks += 1

    # ---- extended.reduce_to / batch_reduce_to (packed across pairs) / broadcast_to ----------------------
    per_a = s.run(lambda: value_for(dv.get_replica_context().replica_id_in_sync_group, (4,), "float32"))
    per_b = s.run(lambda: value_for(dv.get_replica_context().replica_id_in_sync_group, (2, 2), "int64"))
    per_c = s.run(lambda: value_for(dv.get_replica_context().replica_id_in_sync_group, (3,), "float32", salt=3))
    want_a = reference([value_for(g, (4,), "float32") for g in range(total)], "mean")
    red = ext.reduce_to("MEAN", per_a, per_a)
    for r, part in enumerate(s.experimental_local_results(red)):
        expect_close(part, want_a, rank, f"reduce_to MEAN copy {r}", 1e-6)
    one = ext.reduce_to("SUM", per_b, "CPU:0")
    expect_close(
        one, reference([value_for(g, (2, 2), "int64") for g in range(total)], "sum"), rank, "reduce_to one device"
    )
    batch = ext.batch_reduce_to("MAX", [(per_a, per_a), (per_b, per_b), (per_c, "CPU:0")])
    wants = [
        reference([value_for(g, (4,), "float32") for g in range(total)], "max"),
        reference([value_for(g, (2, 2), "int64") for g in range(total)], "max"),
        reference([value_for(g, (3,), "float32", salt=3) for g in range(total)], "max"),
    ]
    for i, (res, want) in enumerate(zip(batch, wants)):
        for part in s.experimental_local_results(res):
            expect_close(part, want, rank, f"batch_reduce_to item {i}")
    mirrored = ext.broadcast_to(np.arange(3.0), per_a)
    expect(len(s.experimental_local_results(mirrored)) == n, rank, "broadcast_to gives one copy per local device")
    checks += 4

    # ---- merge_call reaches cross-replica context, where reduce spans the workers -------------------
    def merge_step():
        ctx = dv.get_replica_context()
        g = ctx.replica_id_in_sync_group
        return ctx.merge_call(lambda strategy, v: strategy.reduce("SUM", v, axis=None), args=(np.float64(g),))

    out = s.run(merge_step)
    for part in s.experimental_local_results(out):
        expect_close(part, sum(range(total)), rank, "merge_call + reduce")
    checks += 1

    # ---- NaN, 0-d values and dtypes that numpy reduces, across workers ----------------------------
    # MIN and MAX propagate NaN like np.minimum / np.maximum at every size (MPI's own MIN and
    # MAX drop it); each replica has NaN in its own places.
    import ml_dtypes

    for dt in ("float16", ml_dtypes.bfloat16, "float32", "float64"):
        for length in (1, 7, 300, 70_000):

            def nan_value(g, length=length, dt=dt):
                x = value_for(g, (length,), "float32", salt=7)
                x[g :: total + 1] = np.nan
                return x.astype(dt)

            per = s.run(lambda: nan_value(dv.get_replica_context().replica_id_in_sync_group))
            for op, ufunc in (("MIN", np.minimum), ("MAX", np.maximum)):
                want = nan_value(0).astype(np.float64)
                for g in range(1, total):
                    want = ufunc(want, nan_value(g).astype(np.float64))
                got = s.reduce(op, per, axis=None)
                in_run = s.run(lambda op=op, per=per: dv.get_replica_context().all_reduce(op, per))
                for what, y in [("reduce", got)] + [("all_reduce", y) for y in s.experimental_local_results(in_run)]:
                    expect(
                        y.dtype == np.dtype(dt) and np.array_equal(y.astype(np.float64), want, equal_nan=True),
                        rank,
                        f"{what} {op} with NaN, {np.dtype(dt).name} x {length}: got {y[:8]!r}, expected {want[:8]!r}",
                    )
    checks += 1

    # Arrays that are C-contiguous but misaligned (a view one byte into a buffer) on every
    # route across workers: the small call, the pair and the ring (and blocking Allreduce
    # with 3 workers), with every other replica misaligned, into new results and in run.
    for length in (100, 20_000, 300_000, 600_001):

        def misaligned(g, length=length):
            x = value_for(g, (length,), "float32", salt=11)
            if g % 2:
                return x
            raw = np.zeros(x.nbytes + 1, np.uint8)
            a = np.frombuffer(raw.data, dtype=np.float32, count=length, offset=1)
            a[...] = x
            return a

        per = s.experimental_distribute_values_from_function(lambda c: misaligned(c.replica_id_in_sync_group))
        want = reference([misaligned(g) for g in range(total)], "sum")
        got = s.reduce("SUM", per, axis=None)
        in_run = s.run(lambda per=per: dv.get_replica_context().all_reduce("SUM", per))
        for what, y in [("reduce", got)] + [("all_reduce", y) for y in s.experimental_local_results(in_run)]:
            expect_close(y, want, rank, f"{what} of misaligned float32 x {length}", tolerance("float32"))
        for r, part in enumerate(s.experimental_local_results(per)):
            expect(np.array_equal(part, misaligned(offset + r)), rank, f"misaligned x {length}: input {r} changed")
    checks += 1

    # A 0-d value stays 0-d, also on the path where the workers' values are gathered and
    # numpy reduces them (8-bit sums, bools).
    for dt, op in (("int8", "SUM"), ("uint8", "SUM"), ("int16", "SUM"), ("bool", "MAX"), ("float32", "SUM")):
        per = s.run(lambda dt=dt: np.array(dv.get_replica_context().replica_id_in_sync_group % 2 + 1).astype(dt))
        parts = [np.array(g % 2 + 1).astype(dt) for g in range(total)]
        want = reference(parts, op.lower())
        for what, y in [("reduce", s.reduce(op, per, axis=None))] + [
            ("all_reduce", y)
            for y in s.experimental_local_results(
                s.run(lambda op=op, per=per: dv.get_replica_context().all_reduce(op, per))
            )
        ]:
            expect(np.shape(y) == (), rank, f"{what} {op} of 0-d {dt}: shape {np.shape(y)}")
            expect_close(y, want, rank, f"{what} {op} of 0-d {dt}")
    checks += 1

    # ---- workers that disagree get a clear error on every worker, and the strategy goes on ----------
    if size > 1:
        bad = s.run(lambda: np.zeros(3 if rank != size - 1 else 4))
        e = expect_raises(
            ValueError, lambda: s.reduce("SUM", bad, axis=None), rank, "shape mismatch", f"worker {size - 1}"
        )
        expect(isinstance(e, dv.MismatchError), rank, f"mismatch error type {type(e).__name__}")
        bad = s.run(lambda: np.zeros((2, 3) if rank != size - 1 else (2, 4)))
        expect_raises(ValueError, lambda: s.gather(bad, axis=0), rank, "gather shape mismatch", f"worker {size - 1}")
        # Same-named dtypes that differ (byte order, fields) are mismatches, not bytes
        # read as another type.
        last = rank == size - 1
        bad = s.run(lambda: np.arange(2, dtype=">f4" if last else "<f4"))
        expect_raises(ValueError, lambda: s.gather(bad, axis=0), rank, "gather byte order", f"worker {size - 1}")
        fields = [("a", "i4"), ("b", "i4")] if last else [("a", "f4"), ("b", "f4")]
        bad = s.run(lambda: np.zeros(2, dtype=fields))
        expect_raises(ValueError, lambda: s.gather(bad, axis=0), rank, "gather fields", f"worker {size - 1}")
        checks += 2
        again = s.run(lambda: np.float64(1.0))
        expect_close(s.reduce("SUM", again, axis=None), float(total), rank, "a collective after a mismatch")
        checks += 2

    return finish(rank, checks, s)


if __name__ == "__main__":
    sys.exit(main())
