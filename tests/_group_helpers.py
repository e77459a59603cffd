"""Helpers shared by the ReplicaGroup test files (test_group_*.py): numpy references,
per-replica test data, one thread per replica, and calling a collective in either style."""

from __future__ import annotations

import threading

import numpy as np
from conftest import tolerance

ALGOS = ["ring", "tree", "direct", "auto"]


def check_all(outs, want, dtype):
    tol = tolerance(dtype)
    for r, out in enumerate(outs):
        got = np.asarray(out, dtype=np.float64)
        assert got.shape == want.shape, f"replica {r}"
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"replica {r}")


def reduce_ref(arrays, op: str, dtype) -> np.ndarray:
    """numpy's answer: integers wrap in their own dtype (numpy's rule), floats are
    reduced in float64 and rounded once to the dtype (the engine accumulates in at
    least float32, so inputs here are small integers, where both are exact)."""
    dt = np.dtype(dtype)
    stack = np.stack([np.asarray(a) for a in arrays])
    op = op.lower()
    if dt.kind in "iu":
        ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        return ufunc.reduce(stack, axis=0, dtype=dt)
    s = stack.astype(np.float64)
    with np.errstate(all="ignore"):
        if op == "sum":
            out = s.sum(axis=0)
        elif op == "mean":
            out = s.sum(axis=0) / len(arrays)
        elif op == "prod":
            out = s.prod(axis=0)
        elif op == "min":
            out = np.minimum.reduce(s, axis=0)
        else:
            out = np.maximum.reduce(s, axis=0)
        return out.astype(dt)


def assert_same(got, want, what: str, dtype=None) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if dtype is not None and np.dtype(dtype).name == "float16" and want.size:
        # float16 mean: one rounding in the engine (float32 accumulate) vs numpy's
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3, atol=1e-3, err_msg=what)
        return
    np.testing.assert_array_equal(got, want, err_msg=what)


def values(n: int, shape, dtype, op: str, rng) -> list:
    """Distinct per replica, exact for the op in every engine dtype."""
    dt = np.dtype(dtype)
    out = []
    for r in range(n):
        if op == "prod":
            base = rng.choice([1, 2] if dt.kind == "u" else [1, 2, -1], size=shape)
        elif dt.kind == "u":
            base = rng.integers(0, 9, size=shape) + r
        else:
            base = rng.integers(-8, 9, size=shape) + r
        out.append(np.array(base, dtype=dt))
    return out


def run_threads(n: int, fn, timeout: float = 60.0):
    """fn(r) on n threads; returns (results, errors), one entry per replica."""
    results = [None] * n
    errors = [None] * n

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # reported to the test
            errors[r] = e

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a replica thread did not finish"
    return results, errors


def _call(g, method: str, arrays):
    """Runs `method` of g with `arrays` (one per replica); the replica_* methods run on
    one thread per replica. Returns the list of exceptions (or the single one)."""
    n = g.num_replicas
    if not method.startswith("replica_"):
        try:
            getattr(g, method)(arrays)
        except Exception as e:
            return [e]
        return [None]
    _, errs = run_threads(n, lambda r: getattr(g, method)(r, arrays[r], timeout_seconds=5))
    return errs


SINGLE = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter"]
PER_REPLICA = [
    "replica_all_reduce",
    "replica_reduce",
    "replica_broadcast",
    "replica_all_gather",
    "replica_reduce_scatter",
]
