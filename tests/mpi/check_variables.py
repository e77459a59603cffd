"""Worker script: variables stay in sync across workers; checkpoints come from the chief.

``--dir`` is a directory every worker can see (the tests give a temporary one).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import counts_of, expect, expect_close, expect_raises, finish, make_strategy, parse_args
from mpi4py import MPI

import distvals as dv


def copies_equal(var, want, rank: int, what: str, tol: float = 0.0) -> None:
    for i, c in enumerate(var.values):
        expect_close(c.numpy(), want, rank, f"{what}: copy {i}", tol)


def main() -> int:
    a = parse_args()
    if not a.dir:
        # Checkpoints go there: without it they would land in the working directory.
        raise SystemExit("check_variables.py needs --dir DIR, a directory every worker can see")
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    counts = counts_of(a.replicas, size)
    total, offset, n = sum(counts), sum(counts[:rank]), counts[rank]
    s = make_strategy(a.replicas, a.timeout)
    gid = lambda: dv.get_replica_context().replica_id_in_sync_group  # noqa: E731
    checks = 0

    with s.scope():
        # Every worker passes its own initial value: all start from the chief's.
        w = dv.Variable(np.full(3, 10.0 * (rank + 1), np.float32), name="w", aggregation=dv.VariableAggregation.MEAN)
        c = dv.Variable(np.zeros(2, np.int64), name="c", aggregation=dv.VariableAggregation.SUM)
        first = dv.Variable(np.float64(-1.0), name="first", aggregation=dv.VariableAggregation.ONLY_FIRST_REPLICA)
        own = dv.Variable(np.float32(0.0), name="own")  # aggregation NONE: each copy its own
        sor_sum = dv.Variable(
            np.float32(0.0),
            name="sor_sum",
            synchronization=dv.VariableSynchronization.ON_READ,
            aggregation=dv.VariableAggregation.SUM,
        )
        sor_mean = dv.Variable(
            np.float64(0.0),
            name="sor_mean",
            synchronization=dv.VariableSynchronization.ON_READ,
            aggregation=dv.VariableAggregation.MEAN,
        )
    expect(isinstance(w, dv.MirroredVariable) and len(w.values) == n, rank, "a MirroredVariable with local copies")
    copies_equal(w, np.full(3, 10.0), rank, "initial value from the chief")
    checks += 2

    def step():
        g = gid()
        w.assign_add(np.full(3, float(g), np.float32))  # MEAN over all replicas
        c.assign_add(np.array([g, 1], np.int64))  # SUM over all replicas
        first.assign(np.float64(100 + g))  # replica 0's value everywhere
        own.assign(np.float32(g))
        sor_sum.assign_add(np.float32(g + 1))
        sor_mean.assign(np.float64(g))
        return w.read_value()

    out = s.run(step)
    mean_id = sum(range(total)) / total
    copies_equal(w, np.full(3, 10.0 + mean_id), rank, "MEAN update", 1e-6)
    copies_equal(c, [sum(range(total)), total], rank, "SUM update")
    copies_equal(first, 100.0, rank, "ONLY_FIRST_REPLICA update")
    expect(
        [float(v.numpy()) for v in own.values] == [float(offset + r) for r in range(n)],
        rank,
        "NONE updates only the replica's own copy",
    )
    for part in s.experimental_local_results(out):
        expect_close(part, np.full(3, 10.0 + mean_id), rank, "the value read inside run after the update", 1e-6)
    expect_close(sor_sum.read_value(), sum(g + 1 for g in range(total)), rank, "SyncOnRead SUM read", 1e-6)
    expect_close(sor_mean.read_value(), mean_id, rank, "SyncOnRead MEAN read", 1e-12)
    checks += 7

    # Cross-replica context: a PerReplica argument is reduced over every worker first.
    # (With one replica per worker, run returns plain values, as in TensorFlow.)
    def distributed(v):
        return v if isinstance(v, dv.DistributedValues) else dv.PerReplica((v,))

    per = distributed(s.run(lambda: np.full(3, 2.0 * gid(), np.float32)))
    w.assign(per)
    copies_equal(w, np.full(3, 2.0 * mean_id), rank, "cross-replica assign of a PerReplica (MEAN)", 1e-6)
    c.assign_sub(distributed(s.run(lambda: np.array([1, gid()], np.int64))))
    copies_equal(c, [sum(range(total)) - total, total - sum(range(total))], rank, "cross-replica assign_sub (SUM)")
    sor_sum.assign(np.float32(total * 3.0))  # value/N per copy, so that the sum reads back
    expect_close(sor_sum.read_value(), total * 3.0, rank, "SyncOnRead SUM assign in cross-replica context", 1e-6)
    checks += 3

    # ONLY_FIRST_REPLICA means global replica 0 (the chief's first): a cross-replica
    # assign of a PerReplica, and the read of a sync-on-read copy, on every worker.
    first.assign(distributed(s.run(lambda: np.float64(50 + gid()))))
    copies_equal(first, 50.0, rank, "cross-replica assign of a PerReplica (ONLY_FIRST_REPLICA)")
    with s.scope():
        sor_first = dv.Variable(
            np.float32(0.0),
            name="sor_first",
            synchronization=dv.VariableSynchronization.ON_READ,
            aggregation=dv.VariableAggregation.ONLY_FIRST_REPLICA,
        )
    s.run(lambda: sor_first.assign(np.float32(5 + 2 * gid())))
    expect_close(sor_first.read_value(), 5.0, rank, "SyncOnRead ONLY_FIRST_REPLICA read: global replica 0's copy")
    expect(np.shape(sor_first.read_value()) == (), rank, "a 0-d copy reads as 0-d")
    checks += 3

    # Sparse updates combine every replica of every worker: SUM and MEAN concatenate all
    # replicas' rows, ONLY_FIRST_REPLICA takes global replica 0's; replicas pass
    # different numbers of rows (replica g: rows g % 5 .. g % 5 + g % 2), and nd indices
    # of different leading shapes.
    with s.scope():
        sp = {
            agg: dv.Variable(np.zeros((5, 2), np.float32), name=f"sp_{agg}", aggregation=agg)
            for agg in ("SUM", "MEAN", "ONLY_FIRST_REPLICA")
        }
        sp_nd = dv.Variable(np.zeros((5, 2), np.float64), name="sp_nd", aggregation="SUM")

    def rows_of(g):
        idx = np.arange(g % 5, g % 5 + 1 + g % 2) % 5
        return idx, np.stack([np.full(2, 10.0 * g + k + 1, np.float32) for k in range(len(idx))])

    def sparse_step():
        g = gid()
        idx, vals = rows_of(g)
        sp["SUM"].scatter_add(dv.IndexedSlices(vals, idx))
        sp["MEAN"].scatter_add(dv.IndexedSlices(vals, idx))
        sp["ONLY_FIRST_REPLICA"].scatter_update(dv.IndexedSlices(vals, idx))
        nd = np.array([[i, j] for i in idx for j in range(2)], np.int64)
        upd = np.array([float(v[j]) for v in vals for j in range(2)])
        if g % 2:
            nd, upd = nd.reshape(-1, 2, 2), upd.reshape(-1, 2)  # another leading shape
        sp_nd.scatter_nd_add(nd, upd)

    s.run(sparse_step)
    want = np.zeros((5, 2))
    for g in range(total):
        idx, vals = rows_of(g)
        np.add.at(want, idx, vals.astype(np.float64))
    first_want = np.zeros((5, 2))
    first_want[rows_of(0)[0]] = rows_of(0)[1]
    copies_equal(sp["SUM"], want, rank, "scatter_add SUM inside run, every worker's rows", 1e-6)
    copies_equal(sp["MEAN"], want / total, rank, "scatter_add MEAN inside run, over every replica", 1e-6)
    copies_equal(sp["ONLY_FIRST_REPLICA"], first_want, rank, "scatter_update ONLY_FIRST_REPLICA: global replica 0's")
    copies_equal(sp_nd, want, rank, "scatter_nd_add SUM of nd indices of different leading shapes", 1e-12)
    checks += 4
    # In cross-replica context, with a PerReplica of every replica's rows.
    sp["SUM"].assign(np.zeros((5, 2), np.float32))
    per_rows = distributed(s.run(lambda: dv.IndexedSlices(rows_of(gid())[1], rows_of(gid())[0])))
    sp["SUM"].scatter_add(per_rows)
    copies_equal(sp["SUM"], want, rank, "cross-replica scatter_add of a PerReplica, every worker's rows", 1e-6)
    checks += 1

    # A plain value in cross-replica context (each worker its own here: an unseeded
    # random value, or run's result with one replica per worker) is the chief's on every
    # worker, so the variable stays the same everywhere: dense and sparse updates, and a
    # sync-on-read assign. Rows of another number on one worker: MismatchError on all.
    def same_everywhere(var, want, what, tol=0.0):
        copies_equal(var, want, rank, what, tol)
        everyone = world.allgather(var.values[0].numpy().tobytes())
        expect(all(b == everyone[0] for b in everyone), rank, f"{what}: the same bits on every worker")

    saved_w = w.numpy().copy()
    w.assign(np.full(3, 1000.0 * (rank + 1), np.float32))
    same_everywhere(w, np.full(3, 1000.0), "cross-replica assign of each worker's own plain value")
    w.assign_add(np.full(3, 7.0 * (rank + 1), np.float32))
    same_everywhere(w, np.full(3, 1007.0), "cross-replica assign_add of each worker's own plain value")
    sp["SUM"].assign(np.zeros((5, 2), np.float32))
    sp["SUM"].scatter_add(dv.IndexedSlices(np.full((1, 2), 3.0 + rank, np.float32), np.array([rank % 5])))
    want_rows = np.zeros((5, 2))
    want_rows[0] = 3.0
    same_everywhere(sp["SUM"], want_rows, "cross-replica scatter_add of each worker's own rows")
    sor_sum.assign(np.float32(40.0 * (rank + 1)))
    expect_close(sor_sum.read_value(), 40.0, rank, "SyncOnRead SUM assign of each worker's own plain value", 1e-6)
    checks += 4
    if size > 1:
        k = 1 + (rank == size - 1)
        expect_raises(
            dv.MismatchError,
            lambda: sp["SUM"].scatter_add(dv.IndexedSlices(np.ones((k, 2), np.float32), np.arange(k))),
            rank,
            "cross-replica scatter_add of another number of rows on one worker",
            "scatter_add of variable 'sp_SUM",
        )
        same_everywhere(sp["SUM"], want_rows, "the variable after the refused scatter_add")
        checks += 2
    w.assign(saved_w)
    sor_sum.assign(np.float32(total * 3.0))

    # A few training-like steps keep every copy on every worker identical (bitwise).
    for i in range(5):
        s.run(lambda i=i: w.assign_sub(np.full(3, 0.01 * (gid() + i), np.float32)))
    mine = w.values[0].numpy()
    everyone = world.allgather(mine.tobytes())
    expect(all(b == everyone[0] for b in everyone), rank, "copies identical on every worker after 5 steps")
    checks += 1

    # save_variables: every worker calls it, the chief alone writes, all return after.
    path = os.path.join(a.dir, "shared.npz")
    dv.save_variables(path, [w, c, sor_sum])
    expect(os.path.exists(path), rank, "the checkpoint exists once save_variables returns")
    with np.load(path) as data:
        expect_close(data["w"], w.numpy(), rank, "saved w")
        expect_close(data["sor_sum"], total * 3.0, rank, "saved SyncOnRead value", 1e-6)
    own_path = os.path.join(a.dir, f"worker{rank}.npz")
    dv.save_variables(own_path, {"w": w})
    world.Barrier()
    written = sorted(f for f in os.listdir(a.dir) if f.startswith("worker"))
    expect(written == ["worker0.npz"], rank, f"only the chief writes: found {written}")
    leftovers = [f for f in os.listdir(a.dir) if f.endswith(".tmp")]
    expect(not leftovers, rank, f"no temporary files left: {leftovers}")
    # Every worker has looked before the chief, which writes the next file at once, starts it.
    world.Barrier()
    # Variables of no strategy (each process's own, here of distinct values): the chief
    # process alone writes them (a worker that called it first returns without waiting).
    plain = dv.Variable(np.float64(100 + rank), name="step")
    plain_path = os.path.join(a.dir, "plain.npz")
    dv.save_variables(plain_path, [plain])
    dv.save_variables(os.path.join(a.dir, f"plain{rank}.npz"), [plain])
    world.Barrier()
    with np.load(plain_path) as data:
        expect(
            float(data["step"]) == 100.0, rank, f"a plain variable's file holds {float(data['step'])}, not the chief's"
        )
    written = sorted(f for f in os.listdir(a.dir) if f.startswith("plain") and f != "plain.npz")
    expect(written == ["plain0.npz"], rank, f"only the chief process writes plain variables: found {written}")
    checks += 2
    # Variables of a local MirroredStrategy in this multi-worker process (its own copies,
    # not synced between workers), saved as theirs and under its scope: likewise the
    # chief process alone writes them.
    local = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    with local.scope():
        mine = dv.Variable(np.float64(200 + rank), name="local_step")

    def save_in_scope(path, variables):
        with local.scope():
            dv.save_variables(path, variables)

    for name, save in [("its own", dv.save_variables), ("in its scope", save_in_scope)]:
        tag = name.replace(" ", "_")
        shared_path = os.path.join(a.dir, f"local_{tag}.npz")
        save(shared_path, [mine])
        save(os.path.join(a.dir, f"local_{tag}_{rank}.npz"), [mine])
        world.Barrier()
        with np.load(shared_path) as data:
            got = float(data["local_step"])
            expect(got == 200.0, rank, f"a local strategy's variable ({name}): the file holds {got}, not the chief's")
        written = sorted(f for f in os.listdir(a.dir) if f.startswith(f"local_{tag}_"))
        expect(written == [f"local_{tag}_0.npz"], rank, f"a local strategy's variable ({name}): written {written}")
        checks += 1
    # A local strategy's variable listed before a multi-worker one: the multi-worker
    # strategy still decides, so the chief writes and every worker returns once the file
    # is there (whichever variable comes first).
    for order, variables in (("local first", [mine, w]), ("multi-worker first", [w, mine])):
        mixed_path = os.path.join(a.dir, f"mixed_{order.replace(' ', '_').replace('-', '_')}.npz")
        dv.save_variables(mixed_path, variables)
        expect(os.path.exists(mixed_path), rank, f"a mixed checkpoint ({order}) exists once save_variables returns")
        with np.load(mixed_path) as data:
            expect(float(data["local_step"]) == 200.0, rank, f"a mixed checkpoint ({order}) holds the chief's value")
            expect_close(data["w"], w.numpy(), rank, f"a mixed checkpoint ({order})'s w")
        checks += 1
    # Loading (every worker reads the chief's file) restores the saved values everywhere.
    w.assign(np.zeros(3, np.float32))
    dv.load_variables(path, [w, c, sor_sum])
    with np.load(path) as data:
        copies_equal(w, data["w"], rank, "loaded w")
    checks += 5

    # Workers that create their variables in different orders get an error on every
    # worker, not each other's initial values.
    if size > 1:
        names = ["order_a", "order_b"] if rank != size - 1 else ["order_b", "order_a"]
        with s.scope():
            expect_raises(
                dv.MismatchError,
                lambda: [dv.Variable(np.full(2, float(i)), name=nm) for i, nm in enumerate(names)],
                rank,
                "variables created in different orders",
                "order_",
            )
        checks += 1

    # Workers that create differently shaped variables get an error on every worker.
    if size > 1:
        with s.scope():
            expect_raises(
                ValueError,
                lambda: dv.Variable(np.zeros(2 + (rank == size - 1))),
                rank,
                "variable shape mismatch",
                f"worker {size - 1}",
            )
        checks += 1

    # Workers that create one variable with another synchronization or aggregation get an
    # error on every worker (its updates would be other collectives on each worker).
    if size > 1:
        last = rank == size - 1
        kinds = [
            (
                "synchronization",
                dict(
                    synchronization=dv.VariableSynchronization.ON_READ if last else dv.VariableSynchronization.ON_WRITE,
                    aggregation=dv.VariableAggregation.SUM,
                ),
            ),
            ("aggregation", dict(aggregation=dv.VariableAggregation.NONE if last else dv.VariableAggregation.SUM)),
        ]
        for what, kw in kinds:
            with s.scope():
                expect_raises(
                    dv.MismatchError,
                    lambda kw=kw, what=what: dv.Variable(np.zeros(2, np.float32), name=f"kind_{what}", **kw),
                    rank,
                    f"one variable with another {what} on one worker",
                    f"kind_{what}",
                )
            checks += 1

    # Reads and updates of two variables of one name, dtype and shape, made in one order
    # three times and then in the other order on the last worker: each call names its
    # variable between the workers (by its number among the strategy's variables, the
    # same on every worker), so every worker gets a MismatchError, never the other
    # variable's value or update.
    if size > 1:
        last = rank == size - 1
        on_read = dict(synchronization=dv.VariableSynchronization.ON_READ, aggregation=dv.VariableAggregation.SUM)
        with s.scope():
            sors = [dv.Variable(np.zeros(2), **on_read) for _ in range(2)]
            sums = [dv.Variable(np.zeros(2), aggregation=dv.VariableAggregation.SUM) for _ in range(2)]

        def fill() -> None:
            for k, v in enumerate(sors):
                v.assign(np.full(2, 100.0 * k + gid()))

        s.run(fill)
        every = float(sum(range(total)))
        for _ in range(3):
            for k, v in enumerate(sors):
                expect_close(v.read_value(), np.full(2, 100.0 * k * total + every), rank, f"read of variable {k}")
        expect_raises(
            dv.MismatchError,
            lambda: [v.read_value() for v in (sors[::-1] if last else sors)],
            rank,
            "sync-on-read variables read in different orders",
            "read of variable #",
        )
        per = s.run(lambda: np.full(2, 1.0 + gid()))
        rows = s.run(lambda: dv.IndexedSlices(np.full(1, 1.0 + gid()), np.array([gid() % 2]), np.array([2])))
        for kind, value in (("assign_add", per), ("scatter_add", rows)):
            for _ in range(3):
                for k, v in enumerate(sums):
                    getattr(v, kind)(value)
            before = [v.numpy().copy() for v in sums]
            expect_raises(
                dv.MismatchError,
                lambda kind=kind, value=value: [getattr(v, kind)(value) for v in (sums[::-1] if last else sums)],
                rank,
                f"{kind} of variables in different orders",
                f"{kind} of variable #",
            )
            for k, v in enumerate(sums):
                copies_equal(v, before[k], rank, f"variable {k} after the refused {kind}")
        # Every replica's 1 + g three times on both elements, then three times as a row at
        # element g % 2. (With one replica on every worker, run's results are plain
        # arrays, and a plain value updates a variable with the chief's: replica 0's.)
        adds = range(total) if isinstance(per, dv.DistributedValues) else range(1)
        rows_in = [3 * sum(1.0 + g for g in adds if g % 2 == j) for j in (0, 1)]
        for k, v in enumerate(sums):
            want = 3 * sum(1.0 + g for g in adds) + np.array(rows_in)
            copies_equal(v, want, rank, f"variable {k} after its updates")
        checks += 8

    # reduce_to, batch_reduce_to and broadcast_to onto the replicas give every worker the
    # same kind of value (a worker with one replica among workers with several a Mirrored
    # of one copy), so later collectives of it pair across workers; checked by the next
    # collective's result.
    per = s.run(lambda: np.full(2, float(gid()), np.float32))
    per2 = s.run(lambda: np.full(2, 100.0 + gid(), np.float32))
    made = [
        ("reduce_to", lambda: s.extended.reduce_to("SUM", per, per), float(sum(range(total)))),
        ("batch_reduce_to", lambda: s.extended.batch_reduce_to("SUM", [(per, per)])[0], float(sum(range(total)))),
        ("broadcast_to", lambda: s.extended.broadcast_to(np.full(2, 7.0, np.float32), per), 7.0),
    ]
    for what, make, value in made:
        m = make()
        for part in s.experimental_local_results(m):
            expect_close(part, np.full(2, value), rank, f"{what}: the result")
        expect_close(s.reduce("MAX", m, axis=None), np.full(2, value), rank, f"{what}: MAX of the result")
        expect_close(s.reduce("MAX", per2, axis=None), np.full(2, 100.0 + total - 1), rank, f"{what}: the next reduce")
        checks += 1

    return finish(rank, checks, s)


if __name__ == "__main__":
    sys.exit(main())
