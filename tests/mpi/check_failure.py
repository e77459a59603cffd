"""Worker script: a failing or missing worker ends the whole job quickly, with a message
naming the worker, instead of leaving the others waiting forever.

--mode raise:    worker 1's replica raises inside strategy.run at step 3; the other
                 workers are then waiting inside an all-reduce.
--mode timeout:  worker 1 never calls strategy.reduce (it sleeps); the others give up
                 after --timeout seconds.
--mode gather0d: worker 1's replicas all-gather a 1-element vector where the others pass
                 a 0-d value: a MismatchError on every worker (ranks differ), not a
                 gather of what happens to be the same bytes.
--mode interrupt: worker 0's strategy.reduce of 1 MiB (a ring of point-to-point
                 exchanges) is ended by KeyboardInterrupt while the others are a second
                 late; they go on with it, so worker 0's next reduce must end the job,
                 naming the reduce that was cut short (its MPI calls would pair with the
                 rest of theirs: a wrong result on every worker, or a hang).
--mode interrupt-small: the same with a reduce of 1 KiB (one MPI call carrying the
                 agreement flag), where the late workers reduce another shape: worker 0's
                 interrupted call completes with the flag "some call differs", so the
                 others went on to an exchange it never made: the same end.
--mode update-order: inside strategy.run, two SUM variables of one name, dtype and
                 shape are updated in one order for three steps, then worker 1 swaps
                 them: a MismatchError on every worker naming both variables (each
                 update names its variable between the workers), not a job that goes on
                 with each variable holding the other's update.
--mode update-or-all-reduce: the same three steps, then worker 1 all-reduces the same
                 array where the others update the first variable: a MismatchError on
                 every worker (a repeated update runs on a native plan, which must not
                 take the unlabelled all-reduce of the same arrays for it).
--mode ok:       everyone behaves (the control: the job succeeds).

The job must never succeed in the failing modes: the script exits 0 only at the end.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import ctrl_c_after, make_strategy, parse_args
from mpi4py import MPI

import distvals as dv


def main() -> int:
    a = parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    s = make_strategy(a.replicas, a.timeout, a.execution)

    def step(i):
        ctx = dv.get_replica_context()
        if a.mode == "raise" and rank == 1 and i == 3 and ctx.replica_id_in_sync_group == s.extended._offset:
            raise ValueError(f"deliberate failure at step {i}")
        return ctx.all_reduce("sum", np.full(1000, float(i)))

    for i in range(6):
        s.run(step, args=(i,))
    if a.mode in ("update-order", "update-or-all-reduce", "ok"):
        _updates_out_of_order(s, rank, a.mode)
    if a.mode in ("interrupt", "ok"):
        _interrupted_reduce(s, rank, 1 << 18, 1 << 18, interrupt=a.mode == "interrupt")
    if a.mode in ("interrupt-small", "ok"):
        _interrupted_reduce(s, rank, 256, 255, interrupt=a.mode == "interrupt-small")
    if a.mode == "gather0d":
        s.run(lambda: dv.get_replica_context().all_gather(np.ones(1) if rank == 1 else np.float64(1.0), axis=0))
    per = s.run(lambda: np.float64(rank))
    if a.mode == "timeout" and rank == 1:
        time.sleep(600)  # never reaches the reduce below
    s.reduce("SUM", per, axis=None)
    print(f"worker {rank}: finished", flush=True)
    return 0


def _updates_out_of_order(s, rank: int, mode: str) -> None:
    """Aggregated updates of two variables inside run, checked on every step; at step 3
    worker 1 makes them differently (``mode``)."""
    total = s.num_replicas_in_sync
    with s.scope():
        # One name, dtype and shape: only the variables' numbers tell them apart.
        a, b = (dv.Variable(np.zeros(2), aggregation=dv.VariableAggregation.SUM) for _ in range(2))

    def step(i):
        ctx = dv.get_replica_context()
        x = np.full(2, 1.0 + ctx.replica_id_in_sync_group)
        pair = (a, b)
        if i == 3 and rank == 1:
            if mode == "update-order":
                pair = (b, a)
            elif mode == "update-or-all-reduce":
                ctx.all_reduce("SUM", x)
                pair = (b,)
        for v in pair:
            v.assign_add(x if v is a else 10 * x)

    per_step = sum(1.0 + g for g in range(total))
    for i in range(5):
        s.run(step, args=(i,))
        for v, scale in ((a, 1.0), (b, 10.0)):
            for copy in v.values:
                if not np.array_equal(copy.numpy(), np.full(2, scale * per_step * (i + 1))):
                    raise AssertionError(f"worker {rank}: step {i}: {v.name} holds {copy.numpy()}")


def _interrupted_reduce(s, rank: int, size: int, late_size: int, interrupt: bool) -> None:
    """Three reduces of ``size`` float32 per replica, checked against the float64
    reference on every worker; the second is interrupted on worker 0 (``interrupt``)
    while the others come a second late, with ``late_size`` elements."""
    total = s.num_replicas_in_sync
    offset = s.extended._offset

    def reduce_and_check(i, count=size):
        got = s.reduce(
            "SUM",
            s.experimental_distribute_values_from_function(
                lambda c: np.arange(count, dtype=np.float32) % 97 + 1000.0 * i + c.replica_id_in_sync_group
            ),
            axis=None,
        )
        want = sum(np.arange(count, dtype=np.float64) % 97 + 1000.0 * i + g for g in range(total))
        if not np.array_equal(np.asarray(got, np.float64), want):
            raise AssertionError(f"worker {rank}: reduce {i}: a wrong result")

    # Twice, so that the workers expect the call after itself: the second reduce then
    # carries the agreement with its data (no exchange of signatures before it).
    reduce_and_check(0)
    reduce_and_check(0)
    if rank == 0 and interrupt:
        try:
            with ctrl_c_after(0.3):
                reduce_and_check(1)
        except KeyboardInterrupt:
            print(f"worker {rank}: reduce 1 interrupted (replica {offset})", flush=True)
        else:
            raise AssertionError("worker 0: reduce 1 was not interrupted")
    else:
        if rank:
            time.sleep(1.0)
        reduce_and_check(1, late_size if interrupt else size)
    reduce_and_check(2)


if __name__ == "__main__":
    sys.exit(main())
