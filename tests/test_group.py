"""ReplicaGroup: the engine's collectives from Python, against numpy float64 references."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import ENGINE_DTYPES, distinct_values, reference, tolerance

import distvals as dv

ALGOS = ["ring", "tree", "direct", "auto"]
OPS = ["sum", "prod", "min", "max", "mean"]


def check_all(outs, want, dtype):
    tol = tolerance(dtype)
    for r, out in enumerate(outs):
        got = np.asarray(out, dtype=np.float64)
        assert got.shape == want.shape, f"replica {r}"
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"replica {r}")


DTYPE_OPS = [(d, op) for d in ENGINE_DTYPES for op in OPS if op != "mean" or np.dtype(d).kind == "f"]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_all_reduce_in_place(n, algo, dtype, op):
    bufs = distinct_values(n, (3, 37), dtype, op, seed=n)
    want = reference(bufs, op)
    with dv.ReplicaGroup(n) as g:
        g.all_reduce(bufs, op=op, algorithm=algo)
    check_all(bufs, want, dtype)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (1009,), (64, 1025)])
def test_all_reduce_shapes_out_of_place(shape):
    ins = distinct_values(3, shape, np.float32)
    keep = [a.copy() for a in ins]
    outs = [np.full(shape, np.nan, np.float32) for _ in range(3)]
    with dv.ReplicaGroup(["CPU:0", "/cpu:1", "/job:localhost/replica:0/task:0/device:CPU:2"]) as g:
        g.all_reduce(ins, op="SUM", out=outs)
    check_all(outs, reference(keep, "sum"), np.float32)
    for a, k in zip(ins, keep):
        np.testing.assert_array_equal(a, k)  # inputs untouched


def test_bfloat16_when_available():
    ml = pytest.importorskip("ml_dtypes")
    bufs = [np.arange(17, dtype=np.float32).astype(ml.bfloat16) * (r + 1) for r in range(2)]
    want = reference(bufs, "sum")
    with dv.ReplicaGroup(2) as g:
        g.all_reduce(bufs)
    check_all(bufs, want, np.float32)


@pytest.mark.parametrize("n", [1, 2, 4, 7])
@pytest.mark.parametrize("root", [0, -1])
def test_reduce_and_broadcast(n, root):
    root = root % n
    bufs = distinct_values(n, (5, 3), np.int64)
    keep = [b.copy() for b in bufs]
    with dv.ReplicaGroup(n) as g:
        g.reduce(bufs, root=root, op="max")
        np.testing.assert_array_equal(bufs[root], reference(keep, "max"))
        for r in range(n):
            if r != root:
                np.testing.assert_array_equal(bufs[r], keep[r])  # only the root is written
        bufs = distinct_values(n, (5, 3), np.float64, seed=7)
        src = bufs[root].copy()
        g.broadcast(bufs, root=root)
    for b in bufs:
        np.testing.assert_array_equal(b, src)


@pytest.mark.parametrize("n", [1, 2, 3, 6])
@pytest.mark.parametrize("dtype", ["float32", "int8", "float64"])
def test_all_gather_and_reduce_scatter(n, dtype):
    bufs = distinct_values(n, (4, 3), dtype)
    with dv.ReplicaGroup(n) as g:
        gathered = g.all_gather(bufs)
        for r, got in enumerate(gathered):
            np.testing.assert_array_equal(got, np.concatenate(bufs, axis=0), err_msg=f"replica {r}")
        big = distinct_values(n, (2 * n, 3), dtype, seed=3)
        parts = g.reduce_scatter(big, op="sum")
    want = reference(big, "sum").astype(np.dtype(dtype))
    for r, got in enumerate(parts):
        assert got.shape == (2, 3)
        np.testing.assert_array_equal(got, want[2 * r : 2 * r + 2], err_msg=f"replica {r}")


def test_all_gather_scalars_gives_vector():
    with dv.ReplicaGroup(3) as g:
        out = g.all_gather([np.array(1.5, np.float32), np.array(2.5, np.float32), np.array(3.5, np.float32)])
    for o in out:
        np.testing.assert_array_equal(o, np.array([1.5, 2.5, 3.5], np.float32))


def test_per_replica_style_from_threads():
    n = 4
    g = dv.ReplicaGroup(n, timeout_seconds=30)
    bufs = distinct_values(n, (1000,), np.float32)
    want = reference(bufs, "mean")
    gathered = [None] * n
    errors = []

    def replica(r):
        try:
            g.replica_all_reduce(r, bufs[r], op="mean")
            gathered[r] = g.replica_all_gather(r, np.full(2, r, np.int32))
        except Exception as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=replica, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors
    check_all(bufs, want, np.float32)
    for r in range(n):
        np.testing.assert_array_equal(gathered[r], np.repeat(np.arange(n, dtype=np.int32), 2))
    g.close()


def test_per_replica_mismatch_reaches_every_replica():
    g = dv.ReplicaGroup(2, timeout_seconds=30)
    errs = [None, None]

    def replica(r):
        try:
            g.replica_all_reduce(r, np.ones(4, np.float32), op="sum" if r == 0 else "max")
        except Exception as e:
            errs[r] = e

    ts = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    for e in errs:
        assert isinstance(e, dv.MismatchError) and isinstance(e, ValueError)
        assert "replica 1 called all_reduce(dtype=float32, op=max" in str(e)


def test_missing_replica_times_out_naming_it():
    g = dv.ReplicaGroup(3, timeout_seconds=0.2)
    errs = []

    def replica(r):
        try:
            g.replica_all_reduce(r, np.ones(4, np.float32))
        except Exception as e:
            errs.append(e)

    ts = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert len(errs) == 2
    assert any("replica(s) 2 never arrived" in str(e) for e in errs)
    assert all(isinstance(e, TimeoutError) for e in errs)
    assert g.aborted
    g.reset()
    bufs = [np.ones(4, np.float32) * (r + 1) for r in range(3)]
    g.all_reduce(bufs)
    check_all(bufs, np.full(4, 6.0), np.float32)


def test_abort_releases_waiters_with_replica_id():
    g = dv.ReplicaGroup(2, timeout_seconds=60)
    err = []

    def waiter():
        try:
            g.replica_all_reduce(0, np.ones(4, np.float32))
        except Exception as e:
            err.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    g.abort(1, "ValueError in replica 1")
    t.join(10)
    assert not t.is_alive()
    assert isinstance(err[0], dv.AbortedError) and err[0].replica == 1
    assert "ValueError in replica 1" in str(err[0])


# ---- bad input: clear errors naming the replica, nothing touched ----------------------


@pytest.fixture
def g2():
    with dv.ReplicaGroup(2) as g:
        yield g


def test_non_contiguous_is_rejected(g2):
    a = np.ones((4, 4), np.float32)
    b = np.ones((4, 4), np.float32)[:, ::2].copy()
    with pytest.raises(ValueError, match="replica 1: array is not C-contiguous"):
        g2.all_reduce([a[:, :2].copy(), np.ones((4, 4), np.float32)[:, ::2]])
    np.testing.assert_array_equal(a, 1)
    assert b.shape == (4, 2)


def test_read_only_is_rejected(g2):
    a = np.ones(4, np.float32)
    b = np.ones(4, np.float32)
    b.setflags(write=False)
    with pytest.raises(ValueError, match="replica 1: array is read-only"):
        g2.all_reduce([a, b])
    np.testing.assert_array_equal(a, 1)


def test_mismatched_shape_and_dtype(g2):
    with pytest.raises(ValueError, match=r"replica 1 has shape \(3,\), replica 0 has shape \(4,\)"):
        g2.all_reduce([np.ones(4, np.float32), np.ones(3, np.float32)])
    with pytest.raises(TypeError, match="replica 1 has dtype float64, replica 0 has float32"):
        g2.all_reduce([np.ones(4, np.float32), np.ones(4, np.float64)])


@pytest.mark.parametrize(
    "bad",
    [
        np.array(["a", "b"]),
        np.array([1, 2], dtype=object),
        np.ones(2, np.complex64),
        np.ones(2, np.uint16),
        np.ones(2, bool),
    ],
)
def test_unsupported_dtypes(g2, bad):
    with pytest.raises(TypeError, match="replica 0: dtype .* is not supported"):
        g2.all_reduce([bad, bad.copy()])


def test_wrong_count_and_aliasing(g2):
    with pytest.raises(ValueError, match="one array per replica: 2 expected, got 3"):
        g2.all_reduce([np.ones(2, np.float32)] * 3)
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        g2.all_reduce([a, a])
    np.testing.assert_array_equal(a, 1)


def test_mean_of_integers_is_a_type_error(g2):
    a, b = np.ones(3, np.int32), np.ones(3, np.int32)
    with pytest.raises(TypeError, match="mean"):
        g2.all_reduce([a, b], op="mean")


def test_bad_names(g2):
    x = [np.ones(2, np.float32), np.ones(2, np.float32)]
    with pytest.raises(ValueError, match="unknown reduce op 'avg2'"):
        g2.all_reduce(x, op="avg2")
    with pytest.raises(ValueError, match="unknown algorithm 'bus'"):
        g2.all_reduce(x, algorithm="bus")
    with pytest.raises(ValueError, match="listed twice"):
        dv.ReplicaGroup(["CPU:0", "/cpu:0"])
    with pytest.raises(ValueError, match="'TPU:0' is not a device"):
        dv.ReplicaGroup(["TPU:0"])
    with pytest.raises(ValueError, match="at least 1"):
        dv.ReplicaGroup(0)


def test_buffer_protocol_and_lists(g2):
    a = bytearray(b"\x01\x02\x03")
    b = bytearray(b"\x10\x20\x30")
    g2.all_reduce([a, b])
    assert bytes(a) == bytes(b) == b"\x11\x22\x33"
    with pytest.raises(TypeError, match="replica 0: expected an array"):
        g2.all_reduce([[1.0, 2.0], [3.0, 4.0]])


def test_integer_overflow_wraps_like_numpy(g2):
    a = np.array([100, -128, 127], np.int8)
    b = np.array([100, -1, 1], np.int8)
    want = (a.astype(np.int64) + b).astype(np.int8)
    g2.all_reduce([a, b])
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(b, want)


def test_nan_and_inf_propagate(g2):
    a = np.array([np.nan, 1.0, np.inf], np.float32)
    b = np.array([1.0, np.nan, 1.0], np.float32)
    g2.all_reduce([a, b], op="max")
    for x in (a, b):
        assert np.isnan(x[0]) and np.isnan(x[1]) and np.isinf(x[2])


def test_closed_group_raises():
    g = dv.ReplicaGroup(2)
    g.close()
    g.close()  # idempotent
    with pytest.raises(dv.ClosedError):
        g.all_reduce([np.ones(2, np.float32), np.ones(2, np.float32)])
    assert g.closed


def test_many_groups_and_64_replicas():
    groups = [dv.ReplicaGroup(3) for _ in range(20)]
    for i, g in enumerate(groups):
        bufs = [np.full(8, i + r, np.float64) for r in range(3)]
        g.all_reduce(bufs)
        for b in bufs:
            np.testing.assert_array_equal(b, np.full(8, 3 * i + 3))
        g.close()
    with dv.ReplicaGroup(64) as g:
        bufs = distinct_values(64, (4099,), np.float32)
        want = reference(bufs, "sum")
        for algo in ["ring", "tree", "direct"]:
            cur = [b.copy() for b in bufs]
            g.all_reduce(cur, algorithm=algo)
            check_all(cur, want, np.float32)


def test_per_replica_out_of_place_keeps_inputs():
    n = 3
    g = dv.ReplicaGroup(n, timeout_seconds=30)
    ins = distinct_values(n, (7, 5), np.float64)
    keep = [a.copy() for a in ins]
    outs = [np.full((7, 5), np.nan) for _ in range(n)]
    errors = []

    def replica(r):
        try:
            g.replica_all_reduce(r, ins[r], op="max", out=outs[r])
        except Exception as e:
            errors.append(e)

    ts = [threading.Thread(target=replica, args=(r,)) for r in range(n)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert not errors
    check_all(outs, reference(keep, "max"), np.float64)
    for a, k in zip(ins, keep):
        np.testing.assert_array_equal(a, k)
    with pytest.raises(ValueError, match="replica 0: out has dtype float32"):
        g.replica_all_reduce(0, ins[0], out=np.empty((7, 5), np.float32), timeout_seconds=1)
    g.close()
