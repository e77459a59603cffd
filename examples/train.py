"""Data-parallel training of a small MLP with distvals, in plain numpy.

A 2-layer MLP (tanh hidden layer, softmax output) learns a generated 3-class problem.
``MirroredStrategy`` runs one CPU replica per core (at least 2, at most 4); the weights
are MirroredVariables. Each step
splits the global batch over the replicas, every replica computes its gradients on its
part, and ``merge_call`` applies them the way TensorFlow's optimizers do: one
``batch_reduce_to`` sums every replica's gradients (and the step's loss and accuracy
counts) in one fused collective, then ``extended.update`` applies the same update to every
copy. The result equals one replica training on the whole batch (the test suite checks
it).

At the end it prints the time per step, next to the time per step of a plain numpy loop
doing the same training on the same global batches in one process, measured in the same
run.

    python examples/train.py [--replicas N] [--epochs 12] [--batch 512] [--hidden 128]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

import distvals as dv

Params = Dict[str, np.ndarray]

# One replica per core, from 2 to 4: inline replicas take turns on one thread, so more
# replicas than cores only add each replica's Python overhead to every step.
DEFAULT_REPLICAS = max(2, min(4, os.cpu_count() or 2))


def make_data(n: int = 8192, features: int = 16, classes: int = 3, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
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


def loss_and_grads(p: Params, x: np.ndarray, y: np.ndarray, scale: float) -> Tuple[float, int, Params]:
    """Cross-entropy summed over this batch part times ``scale``, the number of correct
    predictions, and the gradients of that scaled sum."""
    h = np.tanh(x @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    logits = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    prob = e / e.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(-np.log(prob[rows, y] + 1e-12).sum() * scale)
    correct = int((prob.argmax(axis=1) == y).sum())
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
    return loss, correct, {k: g.astype(p[k].dtype, copy=False) for k, g in grads.items()}


def train(
    strategy: dv.Strategy,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    batch: int,
    lr: float = 0.5,
    hidden: int = 32,
    log: Optional[callable] = None,
) -> Tuple[Dict[str, dv.Variable], List[float]]:
    """Trains with ``strategy``; returns the weights (variables) and the loss per epoch."""
    classes = int(y.max()) + 1
    with strategy.scope():
        weights = {k: dv.Variable(v, name=k) for k, v in init_params(x.shape[1], hidden, classes).items()}
    names = sorted(weights)
    dataset = dv.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    def apply_gradients(strategy: dv.Strategy, grads: Dict[str, np.ndarray], stats: np.ndarray) -> dv.Mirrored:
        # Cross-replica context: one fused all-reduce of every gradient and the step's
        # statistics, then the same update on every copy of every weight.
        pairs = [(grads[k], weights[k]) for k in names] + [(stats, weights[names[0]])]
        reduced = strategy.extended.batch_reduce_to(dv.ReduceOp.SUM, pairs)
        for k, g in zip(names, reduced):
            strategy.extended.update(weights[k], lambda var, d: var.assign_sub(lr * d, read_value=False), args=(g,))
        return reduced[-1]

    def step(features: np.ndarray, labels: np.ndarray, global_batch: int) -> np.ndarray:
        params = {k: v.value() for k, v in weights.items()}  # this replica's copies
        # Scaled by the global batch, so that the SUM over replicas is the gradient (and
        # the loss) of the mean over the global batch, however it was split.
        loss, correct, grads = loss_and_grads(params, features, labels, 1.0 / global_batch)
        stats = np.array([loss, correct], np.float32)
        return dv.get_replica_context().merge_call(apply_gradients, args=(grads, stats))

    losses = []
    for epoch in range(epochs):
        total_loss, total_correct, steps = 0.0, 0, 0
        for i, (features, labels) in enumerate(strategy.experimental_distribute_dataset(dataset)):
            # Every process reads the same global batches, so each knows their size.
            global_batch = min(batch, len(x) - i * batch)
            stats = strategy.experimental_local_results(strategy.run(step, args=(features, labels, global_batch)))[0]
            total_loss += float(stats[0])
            total_correct += round(float(stats[1]))
            steps += 1
        losses.append(total_loss / steps)
        if log is not None:
            log(f"epoch {epoch + 1:2d}  loss {losses[-1]:.4f}  accuracy {total_correct / len(y):6.1%}")
    return weights, losses


def train_numpy(
    x: np.ndarray, y: np.ndarray, *, epochs: int, batch: int, lr: float = 0.5, hidden: int = 32
) -> Tuple[Params, List[float]]:
    """The same training in one process with plain numpy: the comparison point."""
    params = init_params(x.shape[1], hidden, int(y.max()) + 1)
    losses = []
    for _ in range(epochs):
        total, steps = 0.0, 0
        for start in range(0, len(x), batch):
            xb, yb = x[start : start + batch], y[start : start + batch]
            loss, _, grads = loss_and_grads(params, xb, yb, 1.0 / len(yb))
            for k in params:
                params[k] -= lr * grads[k]
            total += loss
            steps += 1
        losses.append(total / steps)
    return params, losses


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--replicas",
        type=int,
        default=DEFAULT_REPLICAS,
        help=f"CPU replicas (default {DEFAULT_REPLICAS}: one per core, from 2 to 4)",
    )
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=512, help="global batch size")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--examples", type=int, default=8192)
    ap.add_argument("--execution", default="auto", choices=["auto", "inline", "threads"])
    args = ap.parse_args(argv)

    x, y = make_data(args.examples)
    strategy = dv.MirroredStrategy([f"CPU:{i}" for i in range(args.replicas)], execution=args.execution)
    print(f"{strategy!r}: {strategy.num_replicas_in_sync} replicas, execution {strategy.execution!r}")
    print(
        f"data: {len(x)} examples, {x.shape[1]} features, {y.max() + 1} classes; global batch {args.batch} "
        f"(about {args.batch // args.replicas} per replica); hidden layer {args.hidden}"
    )
    steps = args.epochs * -(-len(x) // args.batch)
    t0 = time.perf_counter()
    weights, losses = train(strategy, x, y, epochs=args.epochs, batch=args.batch, hidden=args.hidden, log=print)
    seconds = time.perf_counter() - t0
    strategy.close()
    t0 = time.perf_counter()
    _, numpy_losses = train_numpy(x, y, epochs=args.epochs, batch=args.batch, hidden=args.hidden)
    numpy_seconds = time.perf_counter() - t0
    per_step, numpy_per_step = 1e3 * seconds / steps, 1e3 * numpy_seconds / steps
    print(
        f"done: {steps} steps in {seconds:.2f} s ({per_step:.3f} ms per step); loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    print(
        f"one process, plain numpy, same global batches: {numpy_per_step:.3f} ms per step "
        f"(loss {numpy_losses[0]:.4f} -> {numpy_losses[-1]:.4f}); distvals/numpy: {per_step / numpy_per_step:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
