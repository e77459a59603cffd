"""Data-parallel training over several processes with ``MultiWorkerMirroredStrategy``.

The model, data, loss and training step of ``examples/train.py`` (a 2-layer MLP in plain
numpy; gradients applied with one fused ``batch_reduce_to`` per step, as TensorFlow's
optimizers do), trained by every replica of every worker in lockstep: each global batch
is split over all replicas of all workers, the engine reduces inside each worker and MPI
between workers. 2 workers x 2 replicas train exactly like 1 process x 4 replicas (the
test suite checks it). The chief prints the time per step.

    mpirun -n 2 --bind-to none python examples/train_multi_worker.py --replicas 2
    python examples/train_multi_worker.py --replicas 4          # one worker, no mpirun

(as root add ``--allow-run-as-root``; with more processes than cores ``--oversubscribe``)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

import distvals as dv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train as single

# The training loop of examples/train.py works with any strategy.
train = single.train


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2, help="replicas per worker")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--examples", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="data seed")
    ap.add_argument("--save", default=None, metavar="NPZ", help="write the final weights here (the chief writes)")
    args = ap.parse_args(argv)

    strategy = dv.MultiWorkerMirroredStrategy([f"CPU:{i}" for i in range(args.replicas)])
    chief = strategy.cluster_resolver.is_chief
    log = print if chief else None
    x, y = single.make_data(args.examples, seed=args.seed)
    if chief:
        print(
            f"{strategy!r}: {strategy.cluster_resolver.num_workers} worker(s), "
            f"{strategy.num_replicas_in_sync} replicas in sync"
        )
    t0 = time.perf_counter()
    weights, losses = train(strategy, x, y, epochs=args.epochs, batch=args.batch, hidden=args.hidden, log=log)
    seconds = time.perf_counter() - t0
    if args.save:
        dv.save_variables(args.save, weights)
    if chief:
        steps = args.epochs * -(-len(x) // args.batch)
        print(
            f"done: {steps} steps in {seconds:.2f} s ({1e3 * seconds / steps:.3f} ms per step); "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        )
    strategy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
