"""Data-parallel training of a small MLP with distvals, in plain numpy.

A 2-layer MLP (tanh hidden layer, softmax output) learns a generated 3-class problem.
``MirroredStrategy`` runs 4 CPU replicas; the weights are MirroredVariables; each step
splits the global batch over the replicas, every replica computes its gradients on its
part, and ``assign_sub`` with MEAN aggregation all-reduces them on the engine and
applies the same update to every copy. The result equals one replica training on the
whole batch (the test suite checks it).

    python examples/train.py [--replicas 4] [--epochs 12] [--batch 64]
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

import distvals as dv

Params = Dict[str, np.ndarray]


def make_data(n: int = 2048, features: int = 8, classes: int = 3, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Points around ``classes`` random centres, labelled by the nearest centre after a
    random nonlinear warp (so a linear model is not enough)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    warp = np.tanh(x @ rng.normal(size=(features, features)).astype(np.float32))
    centres = rng.normal(size=(classes, features)).astype(np.float32)
    dist = ((warp[:, None, :] - centres[None, :, :]) ** 2).sum(-1)
    return x, dist.argmin(1).astype(np.int32)


def init_params(features: int, hidden: int, classes: int, seed: int = 1) -> Params:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(features, hidden)) / np.sqrt(features)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.normal(size=(hidden, classes)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }


def loss_and_grads(p: Params, x: np.ndarray, y: np.ndarray, scale: float) -> Tuple[np.float32, np.int64, Params]:
    """Cross-entropy summed over this batch part times ``scale``, the number of correct
    predictions, and the gradients of that scaled sum."""
    h = np.tanh(x @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    logits = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    prob = e / e.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = np.float32(-np.log(prob[rows, y] + 1e-12).sum() * scale)
    # A numpy integer: one object per replica, so run returns a PerReplica of them (the
    # very same Python int on every replica would come back as one plain int).
    correct = np.int64((prob.argmax(axis=1) == y).sum())
    d_logits = prob.copy()
    d_logits[rows, y] -= 1.0
    d_logits *= scale
    d_h = (d_logits @ p["w2"].T) * (1.0 - h * h)
    grads = {
        "w1": x.T @ d_h,
        "b1": d_h.sum(axis=0),
        "w2": h.T @ d_logits,
        "b2": d_logits.sum(axis=0),
    }
    return loss, correct, {k: g.astype(np.float32) for k, g in grads.items()}


def train(strategy: dv.Strategy, x: np.ndarray, y: np.ndarray, *, epochs: int, batch: int, lr: float = 0.5,
          hidden: int = 32, log: Optional[callable] = None) -> Tuple[Dict[str, dv.Variable], List[float]]:
    """Trains with ``strategy``; returns the weights (variables) and the loss per epoch."""
    n = strategy.num_replicas_in_sync
    classes = int(y.max()) + 1
    with strategy.scope():
        weights = {
            k: dv.Variable(v, name=k, aggregation=dv.VariableAggregation.MEAN)
            for k, v in init_params(x.shape[1], hidden, classes).items()
        }
    dataset = dv.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    def step(features: np.ndarray, labels: np.ndarray, global_batch: int):
        params = {k: v.value() for k, v in weights.items()}  # this replica's copies
        # Scaled so that the MEAN over replicas of each replica's update is the gradient
        # of the mean loss over the global batch, however it was split.
        loss, correct, grads = loss_and_grads(params, features, labels, n / global_batch)
        for k, g in grads.items():
            weights[k].assign_sub(lr * g, read_value=False)
        return loss / n, correct

    losses = []
    for epoch in range(epochs):
        total_loss, total_correct, steps = 0.0, 0, 0
        for features, labels in strategy.experimental_distribute_dataset(dataset):
            global_batch = sum(len(p) for p in strategy.experimental_local_results(labels))
            loss, correct = strategy.run(step, args=(features, labels, global_batch))
            total_loss += float(strategy.reduce(dv.ReduceOp.SUM, loss))
            total_correct += int(strategy.reduce(dv.ReduceOp.SUM, correct))
            steps += 1
        losses.append(total_loss / steps)
        if log is not None:
            log(f"epoch {epoch + 1:2d}  loss {losses[-1]:.4f}  accuracy {total_correct / len(y):6.1%}")
    return weights, losses


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--examples", type=int, default=2048)
    args = ap.parse_args(argv)

    x, y = make_data(args.examples)
    strategy = dv.MirroredStrategy([f"CPU:{i}" for i in range(args.replicas)])
    print(f"{strategy!r}: {strategy.num_replicas_in_sync} replicas")
    print(f"data: {len(x)} examples, {x.shape[1]} features, {y.max() + 1} classes; global batch {args.batch} "
          f"(about {args.batch // args.replicas} per replica)")
    t0 = time.perf_counter()
    weights, losses = train(strategy, x, y, epochs=args.epochs, batch=args.batch, log=print)
    seconds = time.perf_counter() - t0
    steps = args.epochs * -(-len(x) // args.batch)
    print(f"done: {steps} steps in {seconds:.2f} s ({1e3 * seconds / steps:.2f} ms per step); "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    strategy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
