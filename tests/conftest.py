"""Shared fixtures for the distvals test suite."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest

ENGINE_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]


def distinct_values(n: int, shape, dtype, op: str = "sum", seed: int = 0):
    """One array per replica, distinct per replica, small enough that reductions are exact."""
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


@pytest.fixture
def g2():
    """A ReplicaGroup of two CPU replicas, closed after the test."""
    import distvals as dv

    with dv.ReplicaGroup(2) as g:
        yield g


def fork_with_deadline(body, seconds: float) -> int:
    """Forks; the child runs ``body()`` and exits 0 when it returns. The child's exit
    status, or -1 (after killing it) when it is still running after ``seconds``."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            body()
            code = 0
        except BaseException as e:
            try:
                sys.stderr.write(f"child failed: {e!r}\n")
            finally:
                code = 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    # A hung child is told to abort first: where faulthandler is on (pytest turns it on
    # before forking), the child writes its Python stack to the run's stderr, which shows
    # where it hung. SIGKILL follows if it does not die.
    os.kill(pid, signal.SIGABRT)
    for _ in range(500):
        if os.waitpid(pid, os.WNOHANG)[0]:
            return -1
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1
