"""Worker script: distributed input over several workers, checked on every worker.

Global batches are split over the global replica list by the floor/ceil rule; gathering
every replica's part in replica order must give back the global batch exactly.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import (
    counts_of,
    ctrl_c_after,
    expect,
    expect_close,
    expect_raises,
    finish,
    make_strategy,
    parse_args,
)
from mpi4py import MPI

import distvals as dv
from distvals.input import split_batch_sizes


def main() -> int:
    a = parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    counts = counts_of(a.replicas, size)
    total, offset, n = sum(counts), sum(counts[:rank]), counts[rank]
    s = make_strategy(a.replicas, a.timeout)
    checks = 0

    # 23 elements in global batches of 10: 10, 10, 3 (with 4+ replicas some get nothing).
    x = np.arange(23 * 3, dtype=np.float32).reshape(23, 3)
    y = np.arange(23, dtype=np.int64) * 10
    ds = dv.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(10)
    batches = 0
    for step, element in enumerate(s.experimental_distribute_dataset(ds)):
        start, stop = 10 * step, min(23, 10 * step + 10)
        sizes = split_batch_sizes(stop - start, total)
        mine = sizes[offset : offset + n]
        parts = s.experimental_local_results(element["x"])
        expect(
            [len(p) for p in parts] == mine,
            rank,
            f"step {step}: local batch sizes {[len(p) for p in parts]}, expected {mine} of {sizes}",
        )
        for p in parts:
            expect(p.shape[1:] == (3,) and p.dtype == np.float32, rank, "an empty part keeps trailing shape and dtype")
        # The replicas' parts, gathered in global replica order, are the global batch.
        expect_close(s.gather(element["x"], axis=0), x[start:stop], rank, f"step {step}: gathered x")
        expect_close(s.gather(element["y"], axis=0), y[start:stop], rank, f"step {step}: gathered y")
        # A step on the parts: the global sum of y over the batch.
        sums = s.run(lambda e: np.int64(e["y"].sum()), args=(element,))
        expect_close(s.reduce("SUM", sums, axis=None), y[start:stop].sum(), rank, f"step {step}: run on the parts")
        batches += 1
        checks += 4
    expect(batches == 3, rank, f"{batches} global batches, expected 3")

    # Only the chief asks for the spec of a generator dataset whose order comes from its
    # own seeded source: every worker still reads the same global batches (the pass that
    # told the spec is the chief's first pass, not an extra one), a permutation of 0..7.
    def shuffled():
        rng = np.random.default_rng(0)

        def gen():
            yield from rng.permutation(8)

        return dv.data.Dataset.from_generator(gen).batch(4)

    spec_ds = s.experimental_distribute_dataset(shuffled())
    if rank == 0:
        expect(spec_ds.element_spec is not None, rank, "the chief reads the spec")
    rows = [s.gather(el, axis=0).tolist() for el in spec_ds]
    expect(sorted(v for r in rows for v in r) == list(range(8)), rank, f"rows after the chief's spec: {rows}")
    everyone = world.allgather(rows)
    expect(all(r == everyone[0] for r in everyone), rank, "the same global batches on every worker")
    checks += 2

    # distribute_datasets_from_function, each worker its own data (pipeline w: rows
    # 100 w .. 100 w + 7, one per element); the last worker's element 3 raises. Only
    # that element is skipped: every other element reaches a replica once, in order.
    def from_fn(ctx):
        w = ctx.input_pipeline_id

        def m(v):
            if w == size - 1 and int(v[0]) == 100 * w + 3:
                raise ValueError("element 3 failed")
            return v

        return dv.data.Dataset.from_tensor_slices(np.arange(8, dtype=np.int64) + 100 * w).batch(1).map(m)

    got_rows, failed = [], 0
    it = iter(s.distribute_datasets_from_function(from_fn))
    while True:
        try:
            el = next(it)
        except StopIteration:
            break
        except (ValueError, dv.AbortedError):
            failed += 1
            continue
        got_rows.extend(np.concatenate([np.atleast_1d(p) for p in s.experimental_local_results(el)]).tolist())
    want_rows = [v for v in range(100 * rank, 100 * rank + 8) if not (rank == size - 1 and v == 100 * rank + 3)]
    expect(failed == 1, rank, f"one failed step, got {failed}")
    expect(sorted(got_rows) == want_rows, rank, f"this worker's rows {got_rows}, expected {want_rows}")
    checks += 2

    # A tuple element and a generator source.
    def gen():
        for i in range(2):
            yield (np.full((7, 2), i, np.int32), np.arange(7) + 100 * i)

    for step, (feat, lab) in enumerate(s.experimental_distribute_dataset(gen())):
        expect_close(s.gather(lab, axis=0), np.arange(7) + 100 * step, rank, f"generator step {step}")
        checks += 1

    # distribute_datasets_from_function: one pipeline per worker.
    seen = []

    def dataset_fn(ctx: dv.InputContext):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        # Each pipeline yields batches of 2 tagged with its id, one per local replica and step.
        return [np.full((2,), 100 * ctx.input_pipeline_id + i) for i in range(2 * n)]

    dist = s.distribute_datasets_from_function(dataset_fn)
    expect(seen == [(size, rank, total)], rank, f"InputContext {seen}, expected {[(size, rank, total)]}")
    steps = list(dist)
    expect(len(steps) == 2, rank, f"{len(steps)} steps from the function's dataset, expected 2")
    for step, element in enumerate(steps):
        parts = s.experimental_local_results(element)
        expect(
            [int(p[0]) for p in parts] == [100 * rank + step * n + r for r in range(n)],
            rank,
            f"from_function step {step}: consecutive elements to consecutive local replicas",
        )
        gathered = s.gather(element, axis=0)
        want = np.concatenate(
            [np.full((2,), 100 * w + step * counts[w] + r) for w in range(size) for r in range(counts[w])]
        )
        expect_close(gathered, want, rank, f"from_function step {step}: gathered over workers")
        checks += 2

    # The canonical pipeline: every worker reads the same rows and keeps its shard;
    # over all steps, the replicas of all workers see every row exactly once.
    rows = np.arange(10 * size + 3, dtype=np.float64)

    def sharded_fn(ctx: dv.InputContext):
        return dv.data.Dataset.from_tensor_slices(rows).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2)

    sharded = s.distribute_datasets_from_function(sharded_fn)
    got = [v for element in sharded for v in s.gather(element, axis=0).tolist()]
    expect(sorted(got) == rows.tolist(), rank, f"sharded pipelines gave rows {sorted(got)}, expected each row once")
    # The workers' shards differ in length and the steps last until every one has
    # ended: a count from this worker's shard alone would differ between workers (and
    # a loop sized by it would leave the others waiting).
    card = sharded.cardinality
    batches = -(-len(rows) // 2)
    want = dv.data.UNKNOWN_CARDINALITY if size > 1 else -(-batches // counts[rank])
    expect(card == want, rank, f"sharded pipelines: cardinality {card}, expected {want}")
    checks += 1

    checks += check_agreement_on_every_element(s, rank, size, counts)
    checks += check_auto_shard_policies(s, rank, size, counts)
    return finish(rank, checks, s)


def check_auto_shard_policies(s, rank: int, size: int, counts) -> int:
    """auto_shard_policy OFF: each worker reads its own dataset, each of its batches is
    cut into num_replicas_in_sync pieces, and its replicas take consecutive pieces; every
    row of every worker's data reaches one replica of that worker, once, and workers
    that run out give empty batches until all have. Options that differ between workers
    are a MismatchError on each; FILE is refused with more than one worker."""
    checks = 0
    total, n = sum(counts), counts[rank]
    off = dv.data.Options()
    off.experimental_distribute.auto_shard_policy = dv.data.AutoShardPolicy.OFF

    def rows_of(w):
        # Worker w's own data: 23 rows of 2 features, tagged with the worker.
        return np.arange(23 * 2, dtype=np.float32).reshape(23, 2) + 1000 * w

    def pieces_of(w):
        # tf.data's rebatch of worker w's rows: sizes cycling through the split of the
        # global batch of 10 over every replica, from worker w's first replica's size;
        # the rows left at the end one shorter piece.
        sizes = split_batch_sizes(10, total)
        first = sum(counts[:w]) % total
        sizes = sizes[first:] + sizes[:first]
        rows, out, at = rows_of(w), [], 0
        while at < len(rows):
            size = sizes[len(out) % total]
            out.append(rows[at : at + size])
            at += size
        return out

    def local(w, k):
        # Worker w's replicas' parts at step k (empty once its pieces have run out).
        pieces = pieces_of(w)
        return [
            pieces[k * counts[w] + r] if k * counts[w] + r < len(pieces) else np.empty((0, 2), np.float32)
            for r in range(counts[w])
        ]

    dist = s.experimental_distribute_dataset(
        dv.data.Dataset.from_tensor_slices(rows_of(rank)).batch(10).with_options(off)
    )
    steps = max(-(-len(pieces_of(w)) // counts[w]) for w in range(size))
    card = 3 if size == 1 else dv.data.UNKNOWN_CARDINALITY  # each worker reads its own data
    expect(dist.cardinality == card, rank, f"OFF: cardinality {dist.cardinality}, expected {card}")
    k = -1
    for k, element in enumerate(dist):
        parts = s.experimental_local_results(element)
        want = local(rank, k)
        expect(len(parts) == n, rank, f"OFF step {k}: {len(parts)} parts")
        for r, (got, exp) in enumerate(zip(parts, want)):
            expect(
                got.dtype == np.float32 and got.shape[1:] == (2,) and np.array_equal(got, exp),
                rank,
                f"OFF step {k} replica {r}: {got.tolist()}, expected {exp.tolist()}",
            )
        # A step over every worker's parts: the global sum, against numpy's.
        sums = s.run(lambda e: np.float64(e.sum()), args=(element,))
        want_sum = sum(float(p.astype(np.float64).sum()) for w in range(size) for p in local(w, k))
        expect_close(s.reduce("SUM", sums, axis=None), want_sum, rank, f"OFF step {k}: global sum")
        # With equal replica counts, each step of the first two batches takes 10 rows in all.
        rows = s.reduce("SUM", s.run(lambda e: np.int64(len(e)), args=(element,)), axis=None)
        if len(set(counts)) == 1 and k < 2 * size:
            expect(int(rows) == 10, rank, f"OFF step {k}: {int(rows)} rows over the workers, expected 10")
        checks += 3
    expect(k + 1 == steps, rank, f"OFF: {k + 1} steps, expected {steps}")
    checks += 2
    if size > 1:
        # Options that differ between the workers: every worker hears of it at once.
        ds = dv.data.Dataset.from_tensor_slices(rows_of(0)).batch(10)
        mixed = s.experimental_distribute_dataset(ds.with_options(off) if rank == 0 else ds)
        expect_raises(dv.MismatchError, lambda: next(iter(mixed)), rank, "OFF on one worker", "divide")
        file = dv.data.Options()
        file.experimental_distribute.auto_shard_policy = dv.data.AutoShardPolicy.FILE
        expect_raises(
            ValueError, lambda: s.experimental_distribute_dataset(ds.with_options(file)), rank, "FILE", "FILE"
        )
        checks += 2
    return checks


def check_batches_after_a_failure_on_one_worker(s, rank: int, size: int, bad) -> int:
    """A pipeline that fails on one worker only and thereby drops elements the others
    keep (a failure before a batch not right after its map, or before a shuffle) never
    gives a step whose rows come from different global batches: every step's global sum
    is the one of this worker's own batch, and once the batches differ every worker
    raises MismatchError from the same next on."""
    from mpi4py import MPI

    checks = 0
    pipelines = {
        "map, prefetch, batch": lambda d: d.map(bad).prefetch(2).batch(4),
        "map, shuffle, batch": lambda d: d.map(bad).shuffle(4, seed=3).batch(4),
    }
    for name, make in pipelines.items():
        source = dv.data.Dataset.from_tensor_slices(np.arange(24, dtype=np.float64))
        it = iter(s.experimental_distribute_dataset(make(source)))
        # This worker's own global batches, with its own failures, read without the strategy.
        own, local = [], iter(make(source))
        while True:
            try:
                own.append(float(next(local).sum()))
            except StopIteration:
                break
            except ValueError:
                own.append(None)
        outcomes = []
        for k in range(9):  # more than any worker's batches
            try:
                element = next(it)
            except StopIteration:
                outcomes.append("end")
                break
            except dv.MismatchError as e:
                expect("global batches differ" in str(e), rank, f"{name}: {e}")
                outcomes.append("mismatch")
                continue
            except (ValueError, dv.AbortedError):
                outcomes.append("failed")
                continue
            out = s.run(lambda e: dv.get_replica_context().all_reduce("sum", np.float64(e.sum())), args=(element,))
            got = float(np.asarray(s.experimental_local_results(out)[0]))
            expect(
                k < len(own) and got == own[k],
                rank,
                f"{name}: step {k} sums to {got}, this worker's batch to {own[k : k + 1]}",
            )
            outcomes.append("ok")
        everyone = MPI.COMM_WORLD.allgather(outcomes)
        expect(all(o == outcomes for o in everyone), rank, f"{name}: workers' outcomes differ: {everyone}")
        expect(
            "failed" in outcomes and "mismatch" in outcomes and outcomes.index("failed") < outcomes.index("mismatch"),
            rank,
            f"{name}: outcomes {outcomes}",
        )
        expect(all(o == "mismatch" for o in outcomes[outcomes.index("mismatch") :]), rank, f"{name}: {outcomes}")
        checks += 4
    return checks


def check_agreement_on_every_element(s, rank: int, size: int, counts) -> int:
    """The workers agree on every element of a distributed iterator: uneven data gives
    the workers that ran out empty batches, an error on one worker fails that element on
    every worker (and a loop that goes on stays in step), iterators out of step raise
    MismatchError everywhere, and reading element_spec loses no element."""
    checks = 0
    total = sum(counts)
    # Uneven pipelines: worker w has 2 + w batches of one row per local replica,
    # each row tagged with its worker, step and replica; two passes over the dataset.
    steps_of = [2 + w for w in range(size)]

    def dataset_fn(ctx):
        w = ctx.input_pipeline_id
        rows = [np.full((1, 2), 1000.0 * w + 10.0 * k + r) for k in range(steps_of[w]) for r in range(counts[w])]
        return rows

    dist = s.distribute_datasets_from_function(dataset_fn)
    for epoch in range(2):
        got = 0
        for k, element in enumerate(dist):
            out = s.run(lambda e: dv.get_replica_context().all_reduce("sum", np.float64(e.sum())), args=(element,))
            # Workers whose data has ended contribute empty batches (a sum of 0).
            want = sum(
                2.0 * (1000.0 * w + 10.0 * k + r) for w in range(size) if k < steps_of[w] for r in range(counts[w])
            )
            for r, v in enumerate(s.experimental_local_results(out)):
                expect_close(v, want, rank, f"uneven epoch {epoch} step {k}: replica {r}")
            for p in s.experimental_local_results(element):
                expect(p.shape == ((1, 2) if k < steps_of[rank] else (0, 2)), rank, f"uneven step {k}: {p.shape}")
            got += 1
        expect(got == max(steps_of), rank, f"uneven epoch {epoch}: {got} steps, expected {max(steps_of)}")
        checks += 1

    # An error in one worker's pipeline: that worker raises it, the others AbortedError
    # naming it; every worker skips that element, so the loop that goes on stays in step.
    def bad_on_last_worker(v):
        if rank == size - 1 and float(v) == 5.0:
            raise ValueError(f"bad element on worker {rank}")
        return v

    ds = dv.data.Dataset.from_tensor_slices(np.arange(12, dtype=np.float64)).map(bad_on_last_worker).batch(4)
    it = iter(s.experimental_distribute_dataset(ds))
    sums, failures = [], []
    while True:
        try:
            element = next(it)
        except StopIteration:
            break
        except (ValueError, dv.AbortedError) as e:
            failures.append(e)
            continue
        out = s.run(lambda e: dv.get_replica_context().all_reduce("sum", np.float64(e.sum())), args=(element,))
        sums.append(float(np.asarray(s.experimental_local_results(out)[0])))
    expect(sums == [6.0, 38.0], rank, f"sums around a failed element: {sums}")
    expect(len(failures) == 1, rank, f"{len(failures)} failures, expected 1")
    if rank == size - 1:
        expect(isinstance(failures[0], ValueError), rank, f"own error: {failures[0]!r}")
    else:
        expect(
            isinstance(failures[0], dv.AbortedError) and f"worker {size - 1}'s input raised" in str(failures[0]),
            rank,
            f"released: {failures[0]!r}",
        )
    checks += 1

    if size > 1:
        checks += check_batches_after_a_failure_on_one_worker(s, rank, size, bad_on_last_worker)

    # element_spec read before (and during) the pass over a one-shot generator loses nothing.
    def gen():
        for i in range(3):
            yield np.full((total, 2), float(i), np.float32)

    dist = s.experimental_distribute_dataset(gen())
    expect(dist.element_spec is not None, rank, "element_spec of a generator")
    it = iter(dist)
    expect(it.element_spec is not None, rank, "the iterator's element_spec")
    firsts = []
    for element in it:
        _ = dist.element_spec
        firsts.append(float(np.asarray(s.experimental_local_results(element)[0]).flat[0]))
    expect(firsts == [0.0, 1.0, 2.0], rank, f"generator batches after element_spec: {firsts}")
    checks += 1
    # An iterator made but never advanced (to read its element_spec, say) on one worker
    # only changes nothing.
    if rank == 0:
        iter(dist)

    if size > 1:
        # A worker whose data gives nothing while the others' goes on cannot make empty
        # batches: every worker raises from the same next (none goes on to a step alone).
        empty_last = s.distribute_datasets_from_function(
            lambda ctx: [] if ctx.input_pipeline_id == size - 1 else [np.ones((2, 3))] * counts[rank]
        )
        expect_raises(ValueError, lambda: next(iter(empty_last)), rank, "no element anywhere", "gave no element")
        checks += 1
        # Two datasets read by two threads taking turns in the same order on every
        # worker: each gets its own elements.
        import threading

        a = s.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(np.arange(8.0)).batch(total))
        b = s.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(-np.arange(8.0)).batch(total))
        turns = [threading.Semaphore(1), threading.Semaphore(0)]
        seen: dict = {"a": [], "b": []}

        def reader(name, dist, mine, other):
            try:
                for element in dist:
                    part = np.asarray(s.experimental_local_results(element)[0])
                    seen[name].append(float(part.flat[0]) if part.size else None)  # a last batch's empty part
                    other.release()
                    mine.acquire()
            finally:
                other.release()

        turns[0].acquire()
        threads = [
            threading.Thread(target=reader, args=("a", a, turns[0], turns[1])),
            threading.Thread(target=reader, args=("b", b, turns[1], turns[0])),
        ]
        threads[0].start()
        turns[1].acquire()  # a has taken its first element: b may start
        threads[1].start()
        for t in threads:
            t.join(60)
        first = sum(counts[:rank])
        want = [float(k * total + first) if k * total + first < 8 else None for k in range(-(-8 // total))]
        expect(seen["a"] == want, rank, f"thread a: {seen['a']}, expected {want}")
        expect(seen["b"] == [None if v is None else -v for v in want], rank, f"thread b: {seen['b']}")
        checks += 1

        # Ctrl-C while worker 0's next() waits for the others (a second late): its
        # exchange completes when theirs comes, in its own buffers, before its next
        # next() exchanges again; worker 0 loses that batch, and every later batch is
        # the same on every worker.
        checks += check_next_interrupted_on_worker_zero(s, rank, counts)

        # Iterators out of step (last: the workers stay out of step after it): every
        # worker but the last asks its iterator for a second element, while the last
        # asks a new iterator for its first.
        data = dv.data.Dataset.from_tensor_slices(np.arange(8.0)).batch(4)
        dist = s.experimental_distribute_dataset(data)
        it = iter(dist)
        next(it)
        if rank == size - 1:
            it = iter(dist)
        expect_raises(dv.MismatchError, lambda: next(it), rank, "iterators out of step", "out of step")
        checks += 1
    return checks


def check_next_interrupted_on_worker_zero(s, rank: int, counts) -> int:
    """Ctrl-C in worker 0's next() while the others are late: see the caller."""
    import time

    total, offset = sum(counts), sum(counts[:rank])
    starts = np.concatenate([[0], np.cumsum(split_batch_sizes(8, total))])

    def expect_batch(value, k, what):
        for r, part in enumerate(s.experimental_local_results(value)):
            g = offset + r
            want = np.arange(8 * k + starts[g], 8 * k + starts[g + 1], dtype=np.float64)
            expect_close(part, want, rank, f"{what}: replica {g}")

    it = iter(s.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(np.arange(64.0)).batch(8)))
    expect_batch(next(it), 0, "before the interrupt")
    if rank == 0:
        with ctrl_c_after(0.3):
            expect_raises(KeyboardInterrupt, lambda: next(it), rank, "the interrupted next()")
        expect(s.extended._input_pending is not None, rank, "the interrupted exchange is kept")
    else:
        time.sleep(1.0)
        expect_batch(next(it), 1, "the batch worker 0 was interrupted in")
    for k in (2, 3):
        expect_batch(next(it), k, f"after the interrupt, batch {k}")
    expect(s.extended._input_pending is None, rank, "the interrupted exchange was waited for")
    return 1


if __name__ == "__main__":
    sys.exit(main())
