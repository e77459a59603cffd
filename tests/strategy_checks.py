"""Helpers shared by the strategy tests: a CPU strategy with a given timeout and execution
mode, the current replica's id, a check that a strategy still computes right on every
replica, and the function names on an error's traceback."""

from __future__ import annotations

import threading
import traceback

import numpy as np
import pytest

import distvals as dv

# Long enough that a test which passes by hitting it would be slow and obvious; every
# failure checked with it must be seen long before it.
LONG = 60.0

on_main_thread = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals are delivered to the main thread"
)


def mirrored(n: int, timeout: float = LONG, execution: str = "auto") -> dv.MirroredStrategy:
    """n CPU replicas; every wait of theirs ends after ``timeout`` seconds."""
    return dv.MirroredStrategy(
        [f"CPU:{i}" for i in range(n)],
        communication_options=dv.CommunicationOptions(timeout_seconds=timeout),
        execution=execution,
    )


def replica_id() -> int:
    return dv.get_replica_context().replica_id_in_sync_group


def assert_usable(s: dv.MirroredStrategy) -> None:
    """One more step with a collective, checked on every replica against numpy."""
    n = s.num_replicas_in_sync
    vals = [np.arange(5, dtype=np.float64) * (r + 1) for r in range(n)]
    out = s.run(lambda: dv.get_replica_context().all_reduce("sum", vals[replica_id()]))
    want = np.sum(vals, axis=0)
    for r in range(n):
        np.testing.assert_array_equal(out.values[r], want, err_msg=f"replica {r}")


def frames_of(error: BaseException) -> list:
    """Function names on the traceback of ``error`` and of its cause."""
    names = []
    for e in (error, error.__cause__):
        if e is not None and e.__traceback__ is not None:
            names += [f.name for f in traceback.extract_tb(e.__traceback__)]
    return names


def engine_all_reduces(monkeypatch, strategy) -> list:
    """The list that gets (dtype name, elements, op) for every engine all-reduce the CPU
    ``strategy`` makes from now on: those made leaf by leaf from Python and those made
    in one call for a whole structure (distvals._core.all_reduce_leaves, and the inline
    replicas' meeting distvals._core.quick_all_reduce_tree)."""
    from distvals import host_collectives, local_extended

    calls: list = []
    group = strategy.extended._group
    one = group.all_reduce

    def counting(buffers, op="sum", algorithm="auto", out=None):
        calls.append((buffers[0].dtype.name, buffers[0].size, op))
        return one(buffers, op, algorithm, out=out)

    many = host_collectives._all_reduce_leaves

    def traced(g, leaves, op, algorithm="auto", fuse_bytes=32768, bytes_per_pack=0):
        trace: list = []
        out = many(g, leaves, op, algorithm, fuse_bytes, bytes_per_pack, trace=trace)
        calls.extend((dtype, count, op) for dtype, count in trace)
        return out

    meeting = local_extended._quick_all_reduce_tree

    def traced_meeting(g, requests, marker, algorithm, fuse_bytes, bytes_per_pack):
        trace: list = []
        out = meeting(g, requests, marker, algorithm, fuse_bytes, bytes_per_pack, trace=trace)
        op = requests[0][1].engine_name
        calls.extend((dtype, count, op) for dtype, count in trace)
        return out

    monkeypatch.setattr(group, "all_reduce", counting)
    monkeypatch.setattr(local_extended, "_quick_all_reduce_tree", traced_meeting)
    monkeypatch.setattr(host_collectives, "_all_reduce_leaves", traced)
    return calls
