"""Shared helpers of the worker scripts run under mpirun by tests/test_multi_worker.py.

Every worker computes every global replica's input from the replica id alone, so each
one can check its results against a float64 numpy reference of all replicas' values.
A failed check raises AssertionError naming the worker; the scripts run under
``python -m mpi4py``, which aborts the whole job on an uncaught exception, so the job
exits non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
from typing import Iterator, List, Sequence, Tuple

import numpy as np

OPS = ["sum", "mean", "min", "max", "product"]
ENGINE_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--replicas", default="2", help="local replicas per worker: one count for all, or a comma list by rank"
    )
    p.add_argument("--mode", default="")
    p.add_argument("--dir", default="")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--execution", default="auto", choices=["auto", "inline", "threads"])
    return p.parse_args(argv)


def local_count(spec: str, rank: int) -> int:
    counts = [int(c) for c in spec.split(",")]
    return counts[rank] if len(counts) > 1 else counts[0]


def counts_of(spec: str, size: int) -> List[int]:
    return [local_count(spec, r) for r in range(size)]


def layout(spec: str) -> Tuple[int, int, List[int], int, int]:
    """(rank, workers, every worker's replica count, total replicas, this worker's first
    global replica id) of this job for a ``--replicas`` spec."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    counts = counts_of(spec, size)
    return rank, size, counts, sum(counts), sum(counts[:rank])


def make_strategy(spec: str, timeout: float = 60.0, execution: str = "auto"):
    from mpi4py import MPI

    import distvals as dv

    rank = MPI.COMM_WORLD.Get_rank()
    n = local_count(spec, rank)
    return dv.MultiWorkerMirroredStrategy(
        [f"CPU:{i}" for i in range(n)],
        communication_options=dv.CommunicationOptions(timeout_seconds=timeout),
        execution=execution,
    )


def value_for(g: int, shape, dtype, op: str = "sum", salt: int = 0) -> np.ndarray:
    """Replica ``g``'s distinct input, small enough that every reduction is exact."""
    rng = np.random.default_rng([salt, g, 7])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return np.array(rng.integers(0, 2, size=shape), dtype=bool)
    if op in ("prod", "product"):
        base = rng.choice([1, 2, -1] if dt.kind != "u" else [1, 2], size=shape)
    else:
        base = rng.integers(0, 11, size=shape) + 3 * g
        if dt.kind != "u":
            base = base - 8
    if dt.kind == "c":
        return np.array(base + 1j * (base % 3), dtype=dt)
    return np.array(base, dtype=dt)


def reference(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    kind = np.asarray(arrays[0]).dtype.kind
    work = np.complex128 if kind == "c" else np.float64
    stack = np.stack([np.asarray(a, dtype=work) for a in arrays])
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


def tolerance(dtype) -> float:
    return {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}.get(np.dtype(dtype).name, 0.0)


def expect(cond: bool, rank: int, msg: str) -> None:
    if not cond:
        raise AssertionError(f"worker {rank}: {msg}")


def expect_close(got, want, rank: int, what: str, tol: float = 0.0) -> None:
    got = np.asarray(got)
    want = np.asarray(want)
    expect(got.shape == want.shape, rank, f"{what}: shape {got.shape}, expected {want.shape}")
    work = np.complex128 if got.dtype.kind == "c" or want.dtype.kind == "c" else np.float64
    g = got.astype(work)
    w = want.astype(work)
    if tol:
        ok = np.allclose(g, w, rtol=tol, atol=tol)
    else:
        ok = np.array_equal(g, w, equal_nan=True)  # NaN only where the reference has one
    expect(ok, rank, f"{what}: got {got!r}, expected {want!r}")


@contextlib.contextmanager
def ctrl_c_after(seconds: float) -> Iterator[None]:
    """Within the block, KeyboardInterrupt is raised on this process after ``seconds``,
    as Ctrl-C would raise it; the timer is stopped and the handler restored after it."""

    def ctrl_c(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, ctrl_c)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def expect_raises(exc_type, fn, rank: int, what: str, *needles: str) -> BaseException:
    try:
        fn()
    except exc_type as e:
        for needle in needles:
            expect(needle in str(e), rank, f"{what}: message {str(e)!r} lacks {needle!r}")
        return e
    raise AssertionError(f"worker {rank}: {what}: no {exc_type.__name__} raised")


def finish(rank: int, checks: int, strategy=None) -> int:
    """Closes ``strategy`` (when given) and reports this worker's passed checks; returns
    the script's exit status."""
    if strategy is not None:
        strategy.close()
    print(f"worker {rank}: {checks} checks passed", flush=True)
    return 0
