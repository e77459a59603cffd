"""Microbenchmarks of the hot paths (pytest-benchmark).

The test suite runs them with ``--benchmark-disable`` (set in pyproject's addopts): each
body then runs once, so the paths are exercised and their results checked, but nothing is
timed. ``pytest tests/test_microbench.py --benchmark-enable`` prints the timings. Every benchmark checks the result
of the calls it timed against a float64 reference computed from distinct inputs.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import pytest

import distvals

pytest.importorskip("pytest_benchmark")

needs_strategy = pytest.mark.skipif(
    not (hasattr(distvals, "MirroredStrategy") and hasattr(distvals, "get_replica_context")),
    reason="this distvals has no MirroredStrategy",
)

N = 2


def distinct_inputs(n: int, count: int, seed: int):
    rng = np.random.default_rng(seed)
    # Small integers: the float32 sum is exact in any order.
    return [rng.integers(-50, 50, size=count).astype(np.float32) + 100 * r for r in range(n)]


@pytest.fixture
def group():
    with distvals.ReplicaGroup(N) as g:
        yield g


# 16 MiB: past the CPU kernels' streaming-store threshold on common caches, so the
# out-of-place outputs go through non-temporal stores.
@pytest.mark.parametrize("nbytes", [1024, 1 << 20, 16 << 20], ids=["1KiB", "1MiB", "16MiB"])
def test_group_all_reduce(benchmark, group, nbytes):
    inputs = distinct_inputs(N, nbytes // 4, seed=nbytes)
    before = [a.copy() for a in inputs]
    outs = [np.empty_like(a) for a in inputs]
    # Out of place: every timed call reads the same inputs and rewrites the same result.
    benchmark(group.all_reduce, inputs, "sum", "auto", out=outs)
    want = np.sum([a.astype(np.float64) for a in before], axis=0)
    for r in range(N):
        np.testing.assert_array_equal(inputs[r], before[r], err_msg=f"replica {r} input changed")
        np.testing.assert_array_equal(outs[r].astype(np.float64), want, err_msg=f"replica {r}")


@pytest.fixture
def strategy():
    s = distvals.MirroredStrategy([f"CPU:{i}" for i in range(N)])
    yield s
    if hasattr(s, "close"):
        s.close()


@needs_strategy
def test_strategy_run_trivial(benchmark, strategy):
    def replica_id():
        return distvals.get_replica_context().replica_id_in_sync_group

    out = benchmark(strategy.run, replica_id)
    assert tuple(strategy.experimental_local_results(out)) == tuple(range(N))


def nested_20(replica: int) -> Dict[str, Dict[str, np.ndarray]]:
    """Ten layers of kernel and bias: 20 arrays of several shapes, distinct per replica."""
    rng = np.random.default_rng(1000 + replica)
    out = {}
    for layer in range(10):
        width = 4 + 3 * layer
        out[f"layer{layer}"] = {
            "kernel": rng.integers(-9, 10, size=(width, 8)).astype(np.float32),
            "bias": rng.integers(-9, 10, size=(8,)).astype(np.float32),
        }
    return out


@needs_strategy
def test_strategy_all_reduce_nested_structure(benchmark, strategy):
    def step(x):
        return distvals.get_replica_context().all_reduce("SUM", x)

    def values():
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: nested_20(ctx.replica_id_in_sync_group)
        )

    timed = benchmark(strategy.run, step, args=(values(),))
    want = {
        k: {p: sum(nested_20(r)[k][p].astype(np.float64) for r in range(N)) for p in ("kernel", "bias")}
        for k in nested_20(0)
    }
    # The timed calls may reduce in place; a fresh call checks the exact values.
    fresh = strategy.run(step, args=(values(),))
    for out in (timed, fresh):
        results = strategy.experimental_local_results(out)
        assert len(results) == N
        for r, res in enumerate(results):
            assert set(res) == set(want), f"replica {r}"
            assert sum(len(v) for v in res.values()) == 20
    for r, res in enumerate(strategy.experimental_local_results(fresh)):
        for k, parts in want.items():
            for p, w in parts.items():
                got = np.asarray(res[k][p])
                assert got.shape == w.shape, f"replica {r} {k}/{p}"
                np.testing.assert_array_equal(got.astype(np.float64), w, err_msg=f"replica {r} {k}/{p}")


@needs_strategy
def test_distribute_dataset_batch_split(benchmark, strategy):
    """One 256-row batch of 8 float32 features from an in-memory dataset, split over the
    replicas: the per-step cost of the input pipeline (no collective)."""
    rows = np.arange(256 * 64 * 8, dtype=np.float32).reshape(-1, 8)
    ds = distvals.data.Dataset.from_tensor_slices(rows).batch(256).repeat()
    it = iter(strategy.experimental_distribute_dataset(ds))
    timed = benchmark(next, it)
    parts = [np.asarray(p) for p in strategy.experimental_local_results(timed)]
    assert [p.shape for p in parts] == [(256 // N, 8)] * N
    # Every batch is 256 consecutive rows, split in order: replica r holds its share.
    start = int(parts[0][0, 0]) // 8
    assert start % 256 == 0
    np.testing.assert_array_equal(np.concatenate(parts), rows[start : start + 256])
