"""Property tests: reduce, all_reduce, gather and all_gather equal the numpy computation
for random replica counts, shapes, dtypes and ops."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distvals as dv

DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64", "int16"]
OPS = ["SUM", "MEAN", "MIN", "MAX", "PRODUCT"]
_STRATEGIES: dict = {}

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def strategy(n: int) -> dv.MirroredStrategy:
    # Built once per replica count: each strategy owns threads and an engine group.
    if n not in _STRATEGIES:
        _STRATEGIES[n] = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    return _STRATEGIES[n]


@pytest.fixture(scope="module", autouse=True)
def _close_strategies():
    yield
    for s in _STRATEGIES.values():
        s.close()
    _STRATEGIES.clear()


def values(rng: np.random.Generator, n: int, shape, dtype: str, op: str):
    dt = np.dtype(dtype)
    if op == "PRODUCT":
        choices = [1, 2] if dt.kind == "u" else [-1, 1, 2]
        parts = [rng.choice(choices, size=shape) for _ in range(n)]
    else:
        low = 0 if dt.kind == "u" else -9
        parts = [rng.integers(low, 10, size=shape) + (r if dt.kind != "u" else 0) for r in range(n)]
    return [np.array(p, dtype=dt) for p in parts]


def reference(parts, op: str) -> np.ndarray:
    stack = np.stack([p.astype(np.float64) for p in parts])
    return {
        "SUM": stack.sum(0),
        "MEAN": stack.mean(0),
        "MIN": stack.min(0),
        "MAX": stack.max(0),
        "PRODUCT": stack.prod(0),
    }[op]


def expected_dtype(dtype: str, op: str) -> np.dtype:
    dt = np.dtype(dtype)
    # Integer MEAN: TensorFlow's true division, float32 for 8- and 16-bit integers.
    if op == "MEAN" and dt.kind in "iu":
        return np.dtype(np.float32 if dt.itemsize <= 2 else np.float64)
    return dt


def check(got, parts, op, dtype):
    want = reference(parts, op)
    assert np.asarray(got).dtype == expected_dtype(dtype, op)
    assert np.asarray(got).shape == parts[0].shape
    tol = {"float16": 2e-3, "float32": 1e-6}.get(expected_dtype(dtype, op).name, 1e-12)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@SETTINGS
@given(
    n=st.integers(1, 5),
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    seed=st.integers(0, 2**32 - 1),
)
def test_reduce_matches_numpy(n, shape, dtype, op, seed):
    parts = values(np.random.default_rng(seed), n, shape, dtype, op)
    s = strategy(n)
    value = dv.PerReplica(tuple(parts)) if n > 1 else dv.PerReplica((parts[0],))
    check(s.reduce(op, value, axis=None), parts, op, dtype)


@SETTINGS
@given(
    n=st.integers(1, 5),
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    seed=st.integers(0, 2**32 - 1),
    nested=st.booleans(),
)
def test_all_reduce_matches_numpy_on_every_replica(n, shape, dtype, op, seed, nested):
    rng = np.random.default_rng(seed)
    parts = values(rng, n, shape, dtype, op)
    other = values(rng, n, (3,), "float32" if op != "PRODUCT" else "int32", op)
    s = strategy(n)

    def fn(x, y):
        value = {"x": x, "more": [y]} if nested else x
        return dv.get_replica_context().all_reduce(op, value)

    out = s.run(fn, args=(dv.PerReplica(tuple(parts)), dv.PerReplica(tuple(other))))
    locals_ = s.experimental_local_results(out)
    for r in range(n):
        got = locals_[r]["x"] if nested else locals_[r]
        check(got, parts, op, dtype)
        if nested:
            check(locals_[r]["more"][0], other, op, str(other[0].dtype))


@SETTINGS
@given(
    n=st.integers(1, 5),
    op=st.sampled_from(["SUM", "MEAN"]),
    dtype=st.sampled_from(["float32", "float64", "int32"]),
    sizes=st.lists(st.integers(0, 4), min_size=5, max_size=5),
    tail=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_reduce_with_axis_matches_numpy(n, op, dtype, sizes, tail, seed):
    sizes = sizes[:n]
    if sum(sizes) == 0:
        sizes[0] = 1
    rng = np.random.default_rng(seed)
    parts = [np.array(rng.integers(-9, 10, size=(k, tail)), dtype=dtype) for k in sizes]
    s = strategy(n)
    got = s.reduce(op, dv.PerReplica(tuple(parts)), axis=0)
    whole = np.concatenate([p.astype(np.float64) for p in parts])
    want = whole.sum(0) if op == "SUM" else whole.mean(0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6)
    if op == "MEAN" and dtype == "int32":
        assert got.dtype == np.float64


@SETTINGS
@given(
    n=st.integers(1, 5),
    dtype=st.sampled_from(DTYPES),
    rank=st.integers(1, 3),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_and_all_gather_match_concatenate(n, dtype, rank, data, seed):
    axis = data.draw(st.integers(-rank, rank - 1))
    base = list(data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)))
    along = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    rng = np.random.default_rng(seed)
    parts = []
    for k in along:
        shape = list(base)
        shape[axis] = k
        parts.append(np.array(rng.integers(0, 100, size=shape), dtype=dtype))
    want = np.concatenate(parts, axis=axis)
    s = strategy(n)
    got = s.gather(dv.PerReplica(tuple(parts)), axis=axis)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)
    out = s.run(lambda x: dv.get_replica_context().all_gather(x, axis=axis), args=(dv.PerReplica(tuple(parts)),))
    for r, local in enumerate(s.experimental_local_results(out)):
        assert local.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(local, want)
