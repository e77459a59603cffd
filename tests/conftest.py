"""Shared fixtures for the distvals test suite."""

from __future__ import annotations

import threading

import numpy as np
import pytest

ENGINE_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
#: The engine's all-reduce algorithms ("auto" picks one of the others).
ALGORITHMS = ["ring", "tree", "direct", "auto"]


def distinct_values(n: int, shape, dtype, op: str = "sum", seed: int = 0, rng=None):
    """One array per replica, distinct per replica, small enough that reductions are exact
    (drawn from `rng` when given, else from a generator seeded with `seed`)."""
    if rng is None:
        rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    out = []
    for r in range(n):
        if op in ("prod", "product"):
            base = rng.choice([1, 2, -1] if dt.kind != "u" else [1, 2], size=shape)
        else:
            base = rng.integers(0, 11, size=shape) + r * 3
            if dt.kind != "u":
                base = base - 8
        out.append(np.array(base, dtype=dt))  # a fresh C-contiguous copy, 0-d kept 0-d
    return out


def reference(arrays, op: str):
    """The float64 reference of a reduction across replicas."""
    stack = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])
    op = op.lower()
    if op == "sum":
        return stack.sum(axis=0)
    if op == "mean":
        return stack.mean(axis=0)
    if op in ("prod", "product"):
        return stack.prod(axis=0)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    raise ValueError(op)


def tolerance(dtype):
    return {"float16": 1e-3, "float32": 1e-6, "float64": 1e-12}.get(np.dtype(dtype).name, 0)


def assert_replicas_close(outs, want, dtype) -> None:
    """Every replica's result equals the float64 reference `want`, within the dtype's tolerance."""
    tol = tolerance(dtype)
    for r, out in enumerate(outs):
        got = np.asarray(out, dtype=np.float64)
        assert got.shape == want.shape, f"replica {r}"
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"replica {r}")


def reference_in_dtype(arrays, op: str, dtype) -> np.ndarray:
    """numpy's answer in the dtype itself: integers wrap in their own dtype (numpy's rule),
    floats are reduced in float64 and rounded once to the dtype (the engine accumulates in
    at least float32, so inputs are small integers where both are exact, or NaN and inf)."""
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
    """`got` has the shape and dtype of `want` and its values (float16 means: within one rounding)."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if dtype is not None and np.dtype(dtype).name == "float16" and want.size:
        # float16 mean: one rounding in the engine (float32 accumulate) vs numpy's
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3, atol=1e-3, err_msg=what)
        return
    np.testing.assert_array_equal(got, want, err_msg=what)


def run_threads(n: int, fn, timeout: float = 60.0):
    """fn(r) on n threads, one per replica; returns (results, errors), one entry per replica."""
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


#: ReplicaGroup's collectives in the single-call style (one call, one array per replica)...
SINGLE_CALL_METHODS = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter"]
#: ...and in the per-replica style (one call per replica, each from its own thread).
PER_REPLICA_METHODS = [
    "replica_all_reduce",
    "replica_reduce",
    "replica_broadcast",
    "replica_all_gather",
    "replica_reduce_scatter",
]


def call_collective(g, method: str, arrays) -> list:
    """Runs `method` of g with `arrays` (one per replica); the replica_* methods run on one
    thread per replica. Returns the exceptions: one per replica, or one for a single call."""
    if not method.startswith("replica_"):
        try:
            getattr(g, method)(arrays)
        except Exception as e:
            return [e]
        return [None]
    _, errs = run_threads(g.num_replicas, lambda r: getattr(g, method)(r, arrays[r], timeout_seconds=5))
    return errs


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


#: How a strategy runs its replicas: every strategy test runs in both modes.
EXECUTION_MODES = ["inline", "threads"]


def _cpu_strategy(n: int, execution: str):
    import distvals as dv

    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=execution)
    yield s
    s.close()


@pytest.fixture(params=EXECUTION_MODES)
def execution(request):
    """The execution mode of a strategy a test makes itself."""
    return request.param


# Strategies over 2, 3 and 4 CPU replicas, one per test module and execution mode.
@pytest.fixture(scope="module", params=EXECUTION_MODES)
def s2(request):
    yield from _cpu_strategy(2, request.param)


@pytest.fixture(scope="module", params=EXECUTION_MODES)
def s3(request):
    yield from _cpu_strategy(3, request.param)


@pytest.fixture(scope="module", params=EXECUTION_MODES)
def s4(request):
    yield from _cpu_strategy(4, request.param)
