"""Data-parallel training over several processes with ``MultiWorkerMirroredStrategy``.

The model, data and loss of ``examples/train.py`` (a 2-layer MLP in plain numpy),
trained by every replica of every worker in lockstep: each global batch is split over
all replicas of all workers, and ``assign_sub`` with MEAN aggregation all-reduces the
updates on the engine inside each worker and over MPI between workers. 2 workers x 2
replicas train exactly like 1 process x 4 replicas (the test suite checks it).

    mpirun -n 2 --bind-to none python examples/train_multi_worker.py --replicas 2
    python examples/train_multi_worker.py --replicas 4          # one worker, no mpirun

(as root add ``--allow-run-as-root``; with more processes than cores ``--oversubscribe``)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

import distvals as dv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train as single  # noqa: E402  (examples/train.py: data, model, gradients)


def train(strategy: dv.Strategy, x: np.ndarray, y: np.ndarray, *, epochs: int, batch: int, lr: float = 0.5,
          hidden: int = 32, log: Optional[callable] = None) -> Tuple[Dict[str, dv.Variable], List[float]]:
    """Trains with ``strategy`` (any strategy; every worker passes the same data);
    returns the weights and the mean loss per epoch."""
    n = strategy.num_replicas_in_sync
    classes = int(y.max()) + 1
    with strategy.scope():
        weights = {
            k: dv.Variable(v, name=k, aggregation=dv.VariableAggregation.MEAN)
            for k, v in single.init_params(x.shape[1], hidden, classes).items()
        }
    dataset = dv.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    def step(features: np.ndarray, labels: np.ndarray, global_batch: int):
        params = {k: v.value() for k, v in weights.items()}
        # Scaled so that the MEAN over all replicas of the updates is the gradient of
        # the mean loss over the global batch, however it was split.
        loss, correct, grads = single.loss_and_grads(params, features, labels, n / global_batch)
        for k, g in grads.items():
            weights[k].assign_sub(lr * g, read_value=False)
        return loss / n, np.int64(correct)

    losses = []
    for epoch in range(epochs):
        total_loss, total_correct, steps = 0.0, 0, 0
        for i, (features, labels) in enumerate(strategy.experimental_distribute_dataset(dataset)):
            # Every worker reads the same global batches, so each knows the global size.
            global_batch = min(batch, len(x) - i * batch)
            loss, correct = strategy.run(step, args=(features, labels, global_batch))
            total_loss += float(strategy.reduce(dv.ReduceOp.SUM, loss, axis=None))
            total_correct += int(strategy.reduce(dv.ReduceOp.SUM, correct, axis=None))
            steps += 1
        losses.append(total_loss / steps)
        if log is not None:
            log(f"epoch {epoch + 1:2d}  loss {losses[-1]:.4f}  accuracy {total_correct / len(y):6.1%}")
    return weights, losses


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2, help="replicas per worker")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--examples", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="data seed")
    ap.add_argument("--save", default=None, metavar="NPZ", help="write the final weights here (the chief writes)")
    args = ap.parse_args(argv)

    strategy = dv.MultiWorkerMirroredStrategy([f"CPU:{i}" for i in range(args.replicas)])
    chief = strategy.cluster_resolver.is_chief
    log = print if chief else None
    x, y = single.make_data(args.examples, seed=args.seed)
    if chief:
        print(f"{strategy!r}: {strategy.cluster_resolver.num_workers} worker(s), "
              f"{strategy.num_replicas_in_sync} replicas in sync")
    t0 = time.perf_counter()
    weights, losses = train(strategy, x, y, epochs=args.epochs, batch=args.batch, log=log)
    seconds = time.perf_counter() - t0
    if args.save:
        dv.save_variables(args.save, weights)
    if chief:
        steps = args.epochs * -(-len(x) // args.batch)
        print(f"done: {steps} steps in {seconds:.2f} s ({1e3 * seconds / steps:.2f} ms per step); "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    strategy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
