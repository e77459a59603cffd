"""Worker script: distributed input over several workers, checked on every worker.

Global batches are split over the global replica list by the floor/ceil rule; gathering
every replica's part in replica order must give back the global batch exactly.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import counts_of, expect, expect_close, finish, make_strategy, parse_args
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

    return finish(rank, checks, s)


if __name__ == "__main__":
    sys.exit(main())
