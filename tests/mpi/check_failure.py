"""Worker script: a failing or missing worker ends the whole job quickly, with a message
naming the worker, instead of leaving the others waiting forever.

--mode raise:    worker 1's replica raises inside strategy.run at step 3; the other
                 workers are then waiting inside an all-reduce.
--mode timeout:  worker 1 never calls strategy.reduce (it sleeps); the others give up
                 after --timeout seconds.
--mode gather0d: worker 1's replicas all-gather a 1-element vector where the others pass
                 a 0-d value: a MismatchError on every worker (ranks differ), not a
                 gather of what happens to be the same bytes.
--mode ok:       everyone behaves (the control: the job succeeds).

The job must never succeed in the failing modes: the script exits 0 only at the end.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _check import make_strategy, parse_args
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
    if a.mode == "gather0d":
        s.run(lambda: dv.get_replica_context().all_gather(np.ones(1) if rank == 1 else np.float64(1.0), axis=0))
    per = s.run(lambda: np.float64(rank))
    if a.mode == "timeout" and rank == 1:
        time.sleep(600)  # never reaches the reduce below
    s.reduce("SUM", per, axis=None)
    print(f"worker {rank}: finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
