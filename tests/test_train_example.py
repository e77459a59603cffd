"""examples/train.py: N replicas train exactly like one replica on the same global batches."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

import distvals as dv

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train.py"


@pytest.fixture(scope="module")
def train_module():
    spec = importlib.util.spec_from_file_location("distvals_example_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def numpy_reference(m, x, y, *, epochs, batch, lr=0.5, hidden=32):
    """The same training in plain numpy, one process, no strategy, float64 weights."""
    params = {k: v.astype(np.float64) for k, v in m.init_params(x.shape[1], hidden, int(y.max()) + 1).items()}
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            xb, yb = x[start : start + batch].astype(np.float64), y[start : start + batch]
            _, _, grads = m.loss_and_grads(params, xb, yb, 1.0 / len(yb))
            params = {k: params[k] - lr * grads[k] for k in params}
    return params


def run_training(m, devices, x, y, **kw):
    strategy = dv.MirroredStrategy(devices)
    try:
        weights, losses = m.train(strategy, x, y, **kw)
        for v in weights.values():
            assert isinstance(v, dv.MirroredVariable)
            copies = [c.numpy() for c in v.values]
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0])  # the copies stay identical
        return {k: v.numpy() for k, v in weights.items()}, losses
    finally:
        strategy.close()


@pytest.mark.parametrize("replicas", [2, 4])
def test_n_replicas_equal_one_replica(train_module, replicas):
    m = train_module
    # 410 examples in global batches of 50: 8 full batches (50 = 13+13+12+12 on 4
    # replicas) and a last one of 10 (3+3+2+2), so uneven splits are covered too.
    x, y = m.make_data(410, seed=3)
    kw = dict(epochs=3, batch=50)
    many, losses_many = run_training(m, [f"CPU:{i}" for i in range(replicas)], x, y, **kw)
    one, losses_one = run_training(m, ["CPU:0"], x, y, **kw)
    reference = numpy_reference(m, x, y, **kw)
    for k in one:
        # Not a trivial fixed point: the weights moved.
        assert np.abs(one[k] - m.init_params(x.shape[1], 32, int(y.max()) + 1)[k]).max() > 1e-3
        np.testing.assert_allclose(many[k], one[k], rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(many[k], reference[k], rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(losses_many, losses_one, rtol=1e-4)
    assert losses_many[-1] < losses_many[0]


def test_main_prints_a_short_log_and_the_comparison(train_module, capsys, execution):
    assert (
        train_module.main(
            ["--epochs", "3", "--examples", "512", "--batch", "64", "--hidden", "32", "--execution", execution]
        )
        == 0
    )
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    replicas = train_module.DEFAULT_REPLICAS
    assert 2 <= replicas <= 4 and f"{replicas} replicas" in lines[0] and f"execution {execution!r}" in lines[0]
    assert sum(line.startswith("epoch") for line in lines) == 3
    assert lines[-2].startswith("done: 24 steps") and "ms per step" in lines[-2]
    assert lines[-1].startswith("one process, plain numpy, same global batches:") and "distvals/numpy:" in lines[-1]
    first = float(lines[2].split("loss")[1].split()[0])
    last = float(lines[4].split("loss")[1].split()[0])
    assert last < first
    # The plain numpy loop trains the same model on the same batches: the same losses.
    ours = [float(x) for x in lines[-2].split("loss")[1].split("->")]
    numpy_losses = [float(x.strip(" ()")) for x in lines[-1].split("(loss")[1].split(")")[0].split("->")]
    np.testing.assert_allclose(ours, numpy_losses, rtol=1e-3)
