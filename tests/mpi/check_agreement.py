"""Worker script: how the workers agree on each collective, and what disagreeing gives.

- A training loop that repeats the same collectives pays one MPI call per collective
  after its first step: the agreement rides in the data call (no separate exchange).
- Workers that pass different shapes, dtypes, keys or nestings to one collective all
  get a MismatchError naming the first difference (never a wrong result, never a hang),
  and the next collective works.
- Large collectives (which agree first with one small exchange, or carry the flag on
  their point-to-point exchanges) and small ones mixed in one loop keep every worker's
  MPI calls matched.
"""

from __future__ import annotations

import os
import sys
from fractions import Fraction

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import ctrl_c_after, expect, expect_close, expect_raises, finish, make_strategy, parse_args
from mpi4py import MPI

import distvals as dv
from distvals.devices import to_host as devices_host


def main() -> int:
    a = parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    s = make_strategy(a.replicas, a.timeout)
    ext = s.extended
    total, n = s.num_replicas_in_sync, ext._n
    coll = ext._coll
    checks = 0

    def small_and_large(i):
        ctx = dv.get_replica_context()
        g = ctx.replica_id_in_sync_group
        grads = {"w": np.full((3, 2), g + i, np.float32), "b": np.full(2, 2.0 * g, np.float32)}
        big = np.full(40_000, float(g + i), np.float64)  # 320 KB: agrees first
        return ctx.all_reduce("sum", grads), ctx.all_reduce("mean", big), ctx.all_reduce("max", np.int64(g))

    steady = None
    for i in range(6):
        grads, big, top = s.run(small_and_large, args=(i,))
        local = s.experimental_local_results
        for r in range(n):
            expect_close(local(grads["w"])[r], np.full((3, 2), sum(range(total)) + total * i), rank, f"step {i}: w")
            expect_close(local(grads["b"])[r], np.full(2, 2.0 * sum(range(total))), rank, f"step {i}: b")
            expect_close(local(big)[r], np.full(40_000, np.mean(np.arange(total)) + i), rank, f"step {i}: big", 1e-12)
            expect_close(local(top)[r], total - 1, rank, f"step {i}: max")
        checks += 1
        if i == 2:
            steady = dict(coll.stats)
    # Steady state: per step, one data call per small collective (2) and the large one's
    # data call, after an exchange unless its exchanges carry the flag; no other exchange.
    per_step = {k: (coll.stats[k] - steady[k]) / 3 for k in coll.stats}
    big_exchanges = 0 if coll.carries_agreement(40_000, np.dtype(np.float64)) else 1
    expect(per_step["exchanges"] == big_exchanges, rank, f"exchanges per step in the steady state: {per_step}")
    expect(per_step["flagged"] == 0, rank, f"flagged calls in the steady state: {per_step}")
    expect(per_step["data_calls"] == 3, rank, f"data calls per step in the steady state: {per_step}")
    checks += 1

    # Disagreements, outside run (so that no worker aborts the job): every worker gets a
    # MismatchError naming the first difference, and the next collective works.
    def parts(make):
        return s.experimental_distribute_values_from_function(lambda c: make(c.replica_id_in_sync_group))

    cases = [
        ("shape", lambda g: np.ones(4 if rank == 0 else 3, np.float32), ["shape (4,)", "shape (3,)"]),
        ("dtype", lambda g: np.ones(2, np.int16 if rank == 0 else np.int64), ["int16", "int64"]),
        (
            "keys",
            lambda g: {"a": np.ones(2), "b": np.ones(2)} if rank == 0 else {"b": np.ones(2), "c": np.ones(2)},
            ["'a'", "'c'"],
        ),
        (
            "nesting",
            lambda g: (
                {"weights": np.ones(2), "bias": np.ones(1)}
                if rank == 0
                else {"weights": np.ones(1), "bias": np.ones(2)}
            ),
            ["['bias']", "['weights']"],
        ),
    ]
    for what, make, needles in cases:
        value = parts(make)
        expect_raises(
            dv.MismatchError, lambda: s.reduce("sum", value, axis=None), rank, what, "the workers disagree", *needles
        )
        ok = s.reduce("sum", parts(lambda g: np.full(3, float(g), np.float32)), axis=None)
        expect_close(ok, np.full(3, float(sum(range(total)))), rank, f"after the {what} mismatch")
        checks += 1

    # A loop's steady call (the flagged single call expected next) met by a gather on one
    # worker, and a loop's steady gather met by an all-reduce: every worker's MPI calls
    # must still match, and each gets a MismatchError that names both calls.
    steady = parts(lambda g: np.full(3, float(g), np.float32))
    want_sum = np.full(3, float(sum(range(total))))
    for first, second in [("reduce", "gather"), ("gather", "reduce")]:

        def call(kind, steady=steady):
            return s.reduce("sum", steady, axis=None) if kind == "reduce" else s.gather(steady, axis=0)

        for _ in range(3):
            call(first)  # the memory now expects this call after itself
        e = expect_raises(
            dv.MismatchError,
            lambda first=first, second=second: call(first if rank == 0 else second),
            rank,
            f"{first} expected, {second} on worker 1",
            "the workers disagree",
        )
        expect(str(e).isprintable(), rank, f"the mismatch message is readable text: {str(e)!r}")
        expect_close(s.reduce("sum", steady, axis=None), want_sum, rank, f"after the {first}/{second} mismatch")
        checks += 1

    # The largest flagged call (64 KiB of data and its flag, past the size from which
    # buffers cross by point-to-point exchanges) in a loop, met once by another shape on
    # worker 1: the expected call and the stand-in for it must make the same MPI calls.
    edge = 16384  # float32: 64 KiB
    for i in range(4):
        size = edge - 1 if (i == 3 and rank == 1) else edge
        value = parts(lambda g, size=size: np.full(size, float(g + 1), np.float32))
        if i < 3:
            got = s.reduce("sum", value, axis=None)
            expect_close(got, np.full(edge, float(sum(range(1, total + 1)))), rank, f"64 KiB loop, step {i}")
        else:
            expect_raises(
                dv.MismatchError,
                lambda value=value: s.reduce("sum", value, axis=None),
                rank,
                "a 64 KiB loop met by another shape",
                "the workers disagree",
                f"shape ({edge},)",
                f"shape ({edge - 1},)",
            )
    got = s.reduce("sum", parts(lambda g: np.full(edge, float(g + 1), np.float32)), axis=None)
    expect_close(got, np.full(edge, float(sum(range(1, total + 1)))), rank, "after the 64 KiB mismatch")
    checks += 1

    # Large calls whose flag rides their exchanges (a pair swap, a ring), in a loop met
    # once by another call on worker 1 (another shape, a small call, a gather), or by
    # the same other call on every worker: every worker's MPI calls still match, a
    # difference is a MismatchError on every worker, and the loop's call then works.
    W = coll.num_workers
    sizes = [n for n in (128 << 10, 256 << 10, 1 << 20) if coll.carries_agreement(n, np.dtype(np.float32))]
    expect(bool(sizes), rank, f"no carried size for {W} workers")
    for size in sizes:
        want = np.arange(size, dtype=np.float64) * total + sum(range(1, total + 1))

        def loop_value(size=size):
            return parts(lambda g: np.arange(size, dtype=np.float32) + (g + 1))

        def loop_call(size=size):
            return s.reduce("sum", loop_value(size), axis=None)

        others = [
            (
                "another shape",
                lambda size=size: s.reduce("sum", parts(lambda g: np.ones(size - 4, np.float32)), axis=None),
            ),
            ("a small call", lambda: s.reduce("sum", parts(lambda g: np.ones(3, np.float32)), axis=None)),
            ("a gather", lambda size=size: s.gather(parts(lambda g: np.ones(size, np.float32)), axis=0)),
        ]
        for what, other in others:
            for i in range(3):
                before = dict(coll.stats)
                expect_close(loop_call(), want, rank, f"{size} elements, step {i} before {what}")
            # The steady call crossed with its flag: one data call and no exchange.
            expect(coll.stats["exchanges"] == before["exchanges"], rank, f"{size}: an exchange in the steady loop")
            expect(coll.stats["data_calls"] == before["data_calls"] + 1, rank, f"{size}: data calls {coll.stats}")
            expect_raises(
                dv.MismatchError,
                lambda other=other, loop_call=loop_call: other() if rank == 1 else loop_call(),
                rank,
                f"a {size}-element loop met by {what} on worker 1",
                "the workers disagree",
            )
            expect_close(loop_call(), want, rank, f"{size} elements after {what} on worker 1")
            checks += 1
        # Every worker leaves the loop for the same other call: it works (every worker
        # stands in for the expected call, then agrees on the new one).
        for i in range(3):
            loop_call()
        got = s.reduce("sum", parts(lambda g, size=size: np.full(size // 2, float(g), np.float32)), axis=None)
        expect_close(got, np.full(size // 2, float(sum(range(total)))), rank, f"{size}: every worker's other call")
        expect_close(loop_call(), want, rank, f"{size}: the loop's call after every worker's other call")
        checks += 1

    # A collective that fails on worker 0 alone before it communicates (its replicas'
    # shapes differ, an axis out of range, an op it does not know, a pair that is not
    # one) in a loop of like calls: every other worker's call fails with it (a
    # MismatchError naming worker 0's error), never pairing with worker 0's next call
    # (the same description: a wrong result), and the loop goes on in step.
    def step_value(i, bad_shape=False):
        return parts(lambda g: np.full(5000 - (g if bad_shape else 0), float(100 * i + g), np.float32))

    failures = {
        "an axis out of range": lambda i, bad: s.reduce("sum", step_value(i), axis=3 if bad else None),
        "an unknown op": lambda i, bad: s.reduce("bogus" if bad else "sum", step_value(i), axis=None),
        "a gather along a missing axis": lambda i, bad: s.gather(step_value(i), axis=2 if bad else 0),
        "a batch_reduce_to item that is not a pair": lambda i, bad: ext.batch_reduce_to(
            "sum", [(step_value(i),)] if bad else [(step_value(i), ext.worker_devices[0])]
        )[0],
    }
    if coll.local_counts[0] > 1:  # worker 0's replicas can differ (every worker runs this case)
        failures["replicas of different shapes"] = lambda i, bad: s.reduce("sum", step_value(i, bad), axis=None)
    for what, call in failures.items():
        for i in range(5):
            bad = i == 2 and rank == 0
            if i == 2:
                expected_error = ValueError if rank == 0 else dv.MismatchError
                needles = () if rank == 0 else ("worker 0 calls nothing", "failed before it communicated")
                if what.startswith("a batch_reduce_to") and rank == 0:
                    expected_error = TypeError
                expect_raises(expected_error, lambda i=i, bad=bad: call(i, bad), rank, f"{what}, step 2", *needles)
                continue
            got = np.asarray(devices_host(call(i, False)))
            column = np.full(5000, float(sum(100 * i + g for g in range(total))))
            want = (
                np.concatenate([np.full(5000, float(100 * i + g)) for g in range(total)])
                if "gather" in what
                else column
            )
            expect_close(got.reshape(-1), want, rank, f"{what}: step {i}")
        checks += 1

    # A non-distributed value where the other workers pass a distributed one (step 2 of
    # a loop, worker 0), and non-distributed values that differ between workers. Where
    # some worker has several local replicas, each worker reduces a plain value alone:
    # it still agrees on the call and the value's fingerprint with the others, so every
    # worker gets an error (never a pairing of the others' call with worker 0's next
    # one) and the loop goes on in step. With one replica everywhere a plain value is
    # that replica's value, reduced across the workers.
    alone = not ext._plain_is_local
    column_0 = np.full(5000, float(sum(range(total))))
    for op in ("mean", "sum"):
        for i in range(5):
            plain = i == 2 and rank == 0
            value = np.full(5000, 7.0, np.float32) if plain else step_value(i)
            column = [float(100 * i + g) for g in range(total)]
            if plain and alone:
                # worker 0's own error for a SUM it cannot make, a MismatchError otherwise.
                expected = ValueError if op == "sum" else dv.MismatchError
                expect_raises(expected, lambda: s.reduce(op, value, axis=None), rank, f"plain {op}, step 2")
                continue
            if i == 2 and alone:
                needles = ("non-distributed value",) if op == "mean" else ("failed before it communicated",)
                expect_raises(
                    dv.MismatchError, lambda: s.reduce(op, value, axis=None), rank, f"plain {op}, step 2", *needles
                )
                continue
            if i == 2:
                column[0] = 7.0  # worker 0's one replica contributes its plain value
            want = np.full(5000, np.mean(column) if op == "mean" else np.sum(column))
            got = np.asarray(devices_host(s.reduce(op, value, axis=None)))
            expect_close(got, want, rank, f"plain {op}: step {i}")
        checks += 1
    mine = np.full(3, float(rank), np.float64)
    if alone:
        expect_raises(
            dv.MismatchError, lambda: s.reduce("max", mine, axis=None), rank, "plain values that differ", "fingerprint"
        )
        same = np.arange(3.0)
        expect_close(np.asarray(s.reduce("max", same, axis=None)), same, rank, "plain values alike")
    else:
        want = np.full(3, float(coll.num_workers - 1))
        expect_close(np.asarray(devices_host(s.reduce("max", mine, axis=None))), want, rank, "plain values across")
    checks += 1

    # A Mirrored value under MEAN needs no MPI call: its copies are the value. Passed on
    # worker 0 where the others reduce a PerReplica, or differing between workers, it is
    # a MismatchError on every worker; alike everywhere, it is the value.
    def mirrored(value):
        return dv.Mirrored(tuple(np.array(value) for _ in range(n)))

    for i in range(5):
        odd = i == 2 and rank == 0
        value = mirrored(np.full(5000, 7.0, np.float32)) if odd else step_value(i)
        if i == 2:
            expect_raises(dv.MismatchError, lambda: s.reduce("mean", value, axis=None), rank, "Mirrored MEAN, step 2")
            continue
        want = np.full(5000, np.mean([float(100 * i + g) for g in range(total)]))
        expect_close(np.asarray(devices_host(s.reduce("mean", value, axis=None))), want, rank, f"MEAN: step {i}")
    expect_raises(
        dv.MismatchError,
        lambda: s.reduce("mean", mirrored(np.full(4, float(rank))), axis=None),
        rank,
        "Mirrored values that differ",
        "a Mirrored value of",
        "fingerprint",
    )
    alike = np.asarray(s.reduce("mean", mirrored(np.arange(4.0)), axis=None))
    expect_close(alike, np.arange(4.0), rank, "Mirrored values alike")
    checks += 1

    # Plain values alike but reduced with another op or axis on worker 0: a MismatchError
    # on every worker (each would reduce its own way), in every layout.
    same = np.arange(4.0)
    for what, call in {
        "another op": lambda: s.reduce("mean" if rank == 0 else "max", same, axis=0),
        "another axis": lambda: s.reduce("max", same, axis=None if rank == 0 else 0),
    }.items():
        needles = ("non-distributed value",) if alone else ()
        expect_raises(dv.MismatchError, call, rank, f"plain values, {what}", *needles)
        expect_close(np.asarray(devices_host(s.reduce("sum", step_value(0), axis=None))), column_0, rank, what)
    checks += 1

    # A batch_reduce_to whose fused item fails on worker 0 after an item that is reduced
    # on its own (a plain value): every other worker's fused all-reduce fails with it,
    # and the next batches give the right result on every worker.
    here = ext.worker_devices
    split = coll.local_counts[0] > 1  # worker 0's replicas can differ (every worker runs this)
    for i in range(4):
        items = [(np.ones(3), here), (step_value(i, bad_shape=i == 2 and rank == 0), here)]
        if i == 2 and split:
            expected_error = ValueError if rank == 0 else dv.MismatchError
            expect_raises(expected_error, lambda items=items: ext.batch_reduce_to("max", items), rank, "batch, step 2")
            continue
        got = s.experimental_local_results(ext.batch_reduce_to("max", items)[1])
        for r, g in enumerate(got):
            expect_close(np.asarray(devices_host(g)), np.full(5000, 100.0 * i + total - 1), rank, f"batch {i}, {r}")
    checks += 1

    # Object values (Python numbers numpy reduces as objects) cannot cross MPI: a
    # TypeError on every worker, not this worker's replicas alone; the next call works.
    fractions = parts(lambda g: np.array([Fraction(g + 1, 3)], dtype=object))
    expect_raises(
        TypeError, lambda: s.reduce("sum", fractions, axis=None), rank, "objects", "cannot be reduced across workers"
    )
    expect_close(np.asarray(devices_host(s.reduce("sum", step_value(0), axis=None))), column_0, rank, "after objects")
    checks += 1

    # reduce_to of a structure of distributed values, in every layout.
    tree = {"a": step_value(1), "b": [step_value(2)]}
    got = ext.reduce_to("mean", tree, ext.worker_devices)
    for key, i, leaf in (("a", 1, got["a"]), ("b", 2, got["b"][0])):
        for r, g in enumerate(s.experimental_local_results(leaf)):
            want = np.full(5000, np.mean([100.0 * i + g for g in range(total)]))
            expect_close(np.asarray(devices_host(g)), want, rank, f"reduce_to of a structure: {key}, {r}")
    checks += 1

    # A reduce refused inside run (and caught there) makes no agreement step: the step's
    # own all_reduce still pairs on every worker.
    def refused_then_all_reduce():
        ctx = dv.get_replica_context()
        try:
            s.reduce("mean", np.ones(2))
        except RuntimeError:
            pass
        return ctx.all_reduce("sum", np.full(2, float(ctx.replica_id_in_sync_group)))

    for r, got in enumerate(s.experimental_local_results(s.run(refused_then_all_reduce))):
        expect_close(np.asarray(devices_host(got)), np.full(2, float(sum(range(total)))), rank, f"run, replica {r}")
    checks += 1

    # Structures whose difference lies below the top level, or in the keys and leaf count
    # of a structure handled leaf by leaf, or an empty one: every worker gets a
    # MismatchError, and an identical call afterwards gives the right result.
    want3 = np.full(3, float(sum(range(1, total + 1))))

    def leaf():
        return parts(lambda g: np.full(3, float(g + 1), np.float32))

    def reduce(value):
        return s.reduce("sum", value, axis=None)

    def gather(value):
        return s.gather(value, axis=0)

    def one(name):
        return {name: leaf()}

    try:
        import ml_dtypes

        bf16 = ml_dtypes.bfloat16
    except ImportError:  # pragma: no cover - ml_dtypes is a test requirement
        bf16 = None
    for _ in range(3):  # the memory now expects a list of one dict with key 'a'
        expect_close(reduce([one("a")])[0]["a"], want3, rank, "a list of one dict, steady")
    structure_cases = [
        ("a key inside a list", reduce, lambda: [one("a" if rank == 0 else "b")], ["'a'", "'b'"]),
        (
            "a list inside against a tuple",
            reduce,
            lambda: [leaf(), [leaf()] if rank == 0 else (leaf(),)],
            ["[*]", "(*,)"],
        ),
        ("an empty structure", reduce, lambda: {} if rank == 0 else one("a"), ["dict of 0", "'a'"]),
        ("gathered keys", gather, lambda: one("a" if rank == 0 else "b"), ["'a'", "'b'"]),
        ("gathered leaf count", gather, lambda: {"a": leaf(), "b": leaf()} if rank == 0 else one("a"), ["'b'"]),
    ]
    if bf16 is not None:
        # A bfloat16 leaf sends strategy.reduce leaf by leaf.
        def with_bf16(name):
            return {name: leaf(), "z": parts(lambda g: np.full(2, g + 1, bf16))}

        structure_cases.append(
            ("keys beside a bfloat16 leaf", reduce, lambda: with_bf16("a" if rank == 0 else "c"), ["'a'", "'c'"])
        )
    for what, call, make, needles in structure_cases:
        value = make()
        expect_raises(dv.MismatchError, lambda: call(value), rank, what, "the workers disagree", *needles)
        expect_close(reduce([one("c")])[0]["c"], want3, rank, f"an identical call after {what}")
        expect_close(
            gather({"g": leaf()})["g"],
            np.concatenate([np.full(3, float(g + 1)) for g in range(total)]),
            rank,
            f"a gather after {what}",
        )
        checks += 1
    # all_gather of structures, the call inside run makes: the leaves' calls name the keys.
    x = np.full((1, 2), float(rank), np.float32)
    rows = [[x] for _ in range(n)]
    expect_raises(
        dv.MismatchError,
        lambda: coll.all_gather(rows, [0], value={"a" if rank == 0 else "b": x}),
        rank,
        "all_gather keys",
        "the workers disagree",
        "'a'",
        "'b'",
    )
    got = coll.all_gather(rows, [0], value={"k": x})
    # Every local replica's row, worker by worker (each worker's rows hold its rank).
    want_rows = np.concatenate([np.full(c, float(w)) for w, c in enumerate(coll.local_counts)])
    for r in range(n):
        expect_close(got[r][0][:, 0], want_rows, rank, f"all_gather after the keys mismatch, replica {r}")
    checks += 1

    checks += _persistent_requests(s, coll, rank)
    return finish(rank, checks, s)


def use_plans(coll, on: bool) -> None:
    """Whether the collectives' small calls repeat through native plans (off: the Python
    path), from the next repeat on."""
    coll._native_plans = on
    for expected in coll._expected.values():
        expected.plan = None  # made again, or not, at its next repeat


def _persistent_requests(s, coll, rank: int) -> int:
    """Small calls in a steady loop start persistent MPI requests (MPI 4's
    Allreduce_init), one per remembered call, bound to a buffer that lives from call to
    call: several kinds interleaved, more remembered calls than requests may be held, a
    worker whose call takes another path (its own buffer, copied in and out), and a wait
    that Ctrl-C ends on one worker. Every result is checked on every replica."""
    import time

    from distvals.mpi_collectives import _MAX_PERSISTENT

    checks = 0
    total, n, offset = s.num_replicas_in_sync, coll.num_local, coll.offset
    ids = range(total)
    SUM = dv.ReduceOp.SUM

    # Three kinds in one loop, distinct values per replica and per step.
    def step(i):
        ctx = dv.get_replica_context()
        g = ctx.replica_id_in_sync_group
        a = ctx.all_reduce("sum", np.arange(6, dtype=np.float32) * (g + 1) + i)
        b = ctx.all_reduce("max", np.full((2, 3), 10.0 * g - i, np.float64))
        c = ctx.all_reduce("min", np.full(5, 7 * g + i, np.int32))
        return a, b, c

    for i in range(6):
        if i == 3:
            before = dict(coll.stats)
        a, b, c = s.run(step, args=(i,))
        for r in range(n):
            local = s.experimental_local_results
            want_a = sum(np.arange(6, dtype=np.float64) * (g + 1) + i for g in ids)
            expect_close(local(a)[r], want_a, rank, f"persistent loop step {i}: sum, replica {r}")
            expect_close(local(b)[r], np.full((2, 3), 10.0 * (total - 1) - i), rank, f"step {i}: max, replica {r}")
            expect_close(local(c)[r], np.full(5, i), rank, f"step {i}: min, replica {r}")
    per_step = {k: (coll.stats[k] - before[k]) / 3 for k in coll.stats}
    # With persistent requests, each of the three calls is one native call (where
    # distvals found MPI_Start and MPI_Test).
    native = per_step.pop("native")
    expect(per_step == {"data_calls": 3, "exchanges": 0, "flagged": 0}, rank, f"steady MPI calls: {per_step}")
    if coll._persistent:
        expect(coll._persistent_count >= 3, rank, f"persistent requests held: {coll._persistent_count}")
        if coll._native_plans:
            expect(native == 3, rank, f"native calls per step: {native}")
    checks += 1

    # Cross-replica reductions repeat the same way (reduce_to onto the replicas' own
    # devices, strategy.reduce): each is one native call once it repeats.
    def value(ctx, i):
        return np.arange(8, dtype=np.float32).reshape(2, 4) * (ctx.replica_id_in_sync_group + 2) - i

    general = []
    general_path = coll._all_reduce_collective

    def counted(*args, **kwargs):
        general.append(args[0])
        return general_path(*args, **kwargs)

    for i in range(6):
        if i == 3:
            before = dict(coll.stats)
            coll._all_reduce_collective = counted  # every repeat from here is planned
        pv = s.experimental_distribute_values_from_function(lambda ctx, i=i: value(ctx, i))
        got = s.extended.reduce_to("MEAN", pv, pv)
        want = sum(np.arange(8.0).reshape(2, 4) * (g + 2) - i for g in ids) / total
        for r in range(n):
            expect_close(s.experimental_local_results(got)[r], want, rank, f"reduce_to loop step {i}, replica {r}")
        total_sum = s.reduce("SUM", pv, axis=None)
        expect_close(total_sum, sum(np.arange(8.0).reshape(2, 4) * (g + 2) - i for g in ids), rank, f"reduce {i}")
    per_step = {k: (coll.stats[k] - before[k]) / 3 for k in coll.stats}
    native = per_step.pop("native")
    expect(per_step == {"data_calls": 2, "exchanges": 0, "flagged": 0}, rank, f"steady reduce MPI calls: {per_step}")
    del coll._all_reduce_collective
    if coll._persistent and coll._native_plans:
        expect(native == 2, rank, f"native calls per reduce step: {native}")
        expect(general == [], rank, f"repeats that took the general path: {general}")
    checks += 1

    # The native steady state on one worker, the Python path on the others: their MPI
    # calls pair up, and every result is the reference, for each op and dtype the native
    # call takes (float MIN and MAX reduce across workers with a Python MPI op, called
    # from inside the native call), one array or two per replica, new or given outputs.
    native_plans = coll._native_plans
    if rank == 0:
        use_plans(coll, False)
    cases = [
        ("sum", np.float32, 0),
        ("mean", np.float32, 0),
        ("min", np.float64, np.nan),
        ("max", np.float32, 0),
        ("sum", np.int32, 0),
        ("max", np.int64, 0),
        ("min", np.uint8, 0),
    ]
    for i in range(4):
        for op, dtype, special in cases:

            def step(i=i, op=op, dtype=dtype, special=special):
                ctx = dv.get_replica_context()
                g = ctx.replica_id_in_sync_group
                x = (np.arange(10) % 7 + 3 * g + i).astype(dtype)
                if special != 0 and g == total - 1:
                    x[4] = special  # NaN on the last replica only: MIN keeps it
                return ctx.all_reduce(op, x)

            got = s.experimental_local_results(s.run(step))
            rows = []
            for g in ids:
                x = (np.arange(10) % 7 + 3 * g + i).astype(np.float64)
                if special != 0 and g == total - 1:
                    x[4] = special
                rows.append(x)
            ref = {"sum": np.sum, "mean": np.mean, "min": np.min, "max": np.max}[op](np.stack(rows), axis=0)
            for r in range(n):
                expect(np.asarray(got[r]).dtype == dtype, rank, f"{op} {dtype}: dtype {np.asarray(got[r]).dtype}")
                what = f"mixed native/Python paths: {op} {dtype} step {i}, replica {r}"
                expect_close(np.asarray(got[r]), ref, rank, what, tol=1e-6 if op == "mean" else 0.0)
    use_plans(coll, native_plans)
    checks += 1

    # More remembered calls than requests may be held: every shape twice in a row (so
    # that each is expected after itself), then the whole round again.
    for rnd in range(2):
        for k in range(_MAX_PERSISTENT + 8):
            for rep in range(2):
                rows = [[np.full(k + 1, float(1000 * rnd + 10 * k + rep + offset + r))] for r in range(n)]
                got = coll.all_reduce(SUM, rows)
                want = np.full(k + 1, float(sum(1000 * rnd + 10 * k + rep + g for g in ids)))
                for r in range(n):
                    expect_close(got[r][0], want, rank, f"shape {k + 1}, round {rnd}, call {rep}, replica {r}")
    expect(coll._persistent_count <= _MAX_PERSISTENT, rank, f"{coll._persistent_count} persistent requests held")
    checks += 1

    # Worker 0's arrays are a subclass of ndarray (the general path, with a buffer of
    # its own), the others' plain arrays (their kind's buffer): one request per worker,
    # paired, in a loop.
    class Sub(np.ndarray):
        pass

    for i in range(5):
        rows = [[np.full(12, float(100 * i + offset + r))] for r in range(n)]
        if rank == 0:
            rows = [[x.view(Sub)] for (x,) in rows]
        got = coll.all_reduce(SUM, rows)
        want = np.full(12, float(sum(100 * i + g for g in ids)))
        for r in range(n):
            expect_close(np.asarray(got[r][0]), want, rank, f"mixed paths, step {i}, replica {r}")
    checks += 1

    # Ctrl-C while worker 0 waits for the others (late by a second): MPI cannot cancel
    # its call, which pairs with theirs when they come; worker 0's next call first waits
    # for it, so neither its late result lands in the next call's buffer nor do the
    # workers' calls shift by one.
    def rows_of(i):
        return [[np.full(8, float(100 * i + offset + r), np.float32)] for r in range(n)]

    def want_of(i):
        return np.full(8, float(sum(100 * i + g for g in ids)))

    for i in range(3):
        got = coll.all_reduce(SUM, rows_of(i))
        expect_close(got[0][0], want_of(i), rank, f"before the interrupt, step {i}")
    if rank == 0:
        with ctrl_c_after(0.3):
            expect_raises(KeyboardInterrupt, lambda: coll.all_reduce(SUM, rows_of(3)), rank, "the interrupted call")
        expect(len(coll._interrupted) == 1, rank, "the interrupted request is kept")
    else:
        time.sleep(1.0)
        got = coll.all_reduce(SUM, rows_of(3))
        for r in range(n):
            expect_close(got[r][0], want_of(3), rank, f"the call worker 0 left, replica {r}")
    for i in (4, 5):
        got = coll.all_reduce(SUM, rows_of(i))
        for r in range(n):
            expect_close(got[r][0], want_of(i), rank, f"after the interrupt, step {i}, replica {r}")
    expect(not coll._interrupted, rank, "the interrupted request was waited for")
    checks += 1
    return checks


if __name__ == "__main__":
    sys.exit(main())
