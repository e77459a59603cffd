"""ReplicaGroup refuses bad input before anything is touched, with ValueError or TypeError
naming the replica: layouts, read-only arrays, dtypes, counts, shapes, overlapping
buffers, names and sizes, and replicas whose calls disagree (MismatchError). In the
per-replica style the replica with bad arguments still meets the others, so every
replica hears of it at once."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from _group_helpers import ALGOS, PER_REPLICA, SINGLE, _call, run_threads

import distvals as dv

# ---- the single-call style: one array per replica, alike and apart -------------------------


def test_non_contiguous_is_rejected(g2):
    a = np.ones((4, 4), np.float32)
    b = np.ones((4, 4), np.float32)[:, ::2].copy()
    with pytest.raises(ValueError, match="replica 1: array is not C-contiguous"):
        g2.all_reduce([a[:, :2].copy(), np.ones((4, 4), np.float32)[:, ::2]])
    np.testing.assert_array_equal(a, 1)
    assert b.shape == (4, 2)


def test_masked_array_is_rejected(g2):
    # Its mask would be dropped and the masked-out values reduced: refused, nothing written.
    a = np.ones(3)
    m = np.ma.array([1.0, 5.0, 2.0], mask=[False, True, False])
    with pytest.raises(TypeError, match="replica 1: .*masked array"):
        g2.all_reduce([a, m])
    np.testing.assert_array_equal(a, 1)
    np.testing.assert_array_equal(m.data, [1.0, 5.0, 2.0])
    # Other ndarray subclasses are still arrays.
    b = np.arange(3.0).view(type("Sub", (np.ndarray,), {}))
    g2.all_reduce([a, b])
    np.testing.assert_array_equal(np.asarray(b), np.arange(3.0) + 1)


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


def test_buffer_protocol_and_lists(g2):
    a = bytearray(b"\x01\x02\x03")
    b = bytearray(b"\x10\x20\x30")
    g2.all_reduce([a, b])
    assert bytes(a) == bytes(b) == b"\x11\x22\x33"
    with pytest.raises(TypeError, match="replica 0: expected an array"):
        g2.all_reduce([[1.0, 2.0], [3.0, 4.0]])


# ---- both call styles: layout, read-only, dtype --------------------------------------------

WRITES_INPUT = {"all_reduce", "broadcast", "replica_all_reduce", "replica_broadcast"}


def _bad_layouts():
    base = np.arange(32, dtype=np.float32).reshape(4, 8)
    strided = base[:, ::2]
    transposed = np.asfortranarray(np.arange(32, dtype=np.float32).reshape(4, 8))
    reversed_ = np.arange(16, dtype=np.float32)[::-1]
    return {"strided": strided, "fortran": transposed, "negative_stride": reversed_}


@pytest.mark.parametrize("method", SINGLE + PER_REPLICA)
@pytest.mark.parametrize("layout", ["strided", "fortran", "negative_stride"])
def test_non_contiguous_input_is_refused_untouched(method, layout):
    bad = _bad_layouts()[layout]
    n = 2
    arrays = [np.ascontiguousarray(bad) * 0 + 3, bad]
    keep = [a.copy() for a in arrays]
    with dv.ReplicaGroup(n, timeout_seconds=5) as g:
        errs = _call(g, method, arrays)
        for e in errs:
            assert isinstance(e, ValueError), (method, e)
        assert any("not C-contiguous" in str(e) and "replica 1" in str(e) for e in errs), errs
        for a, k in zip(arrays, keep):
            np.testing.assert_array_equal(a, k)
        # The group still works after the refusal.
        good = [np.full(4, r + 1.0, np.float32) for r in range(n)]
        g.all_reduce(good)
        for x in good:
            np.testing.assert_array_equal(x, np.full(4, 3.0, np.float32))


@pytest.mark.parametrize("method", SINGLE + PER_REPLICA)
def test_read_only_inputs(method):
    n = 2
    arrays = [np.arange(6, dtype=np.float64) + 10 * r for r in range(n)]
    arrays[1].setflags(write=False)
    keep = [a.copy() for a in arrays]
    with dv.ReplicaGroup(n, timeout_seconds=5) as g:
        errs = _call(g, method, arrays)
    if method in WRITES_INPUT:
        # Written in place: refused, naming the replica, before anything moved.
        assert all(isinstance(e, ValueError) for e in errs), errs
        assert any("replica 1" in str(e) and "read-only" in str(e) for e in errs), errs
        for a, k in zip(arrays, keep):
            np.testing.assert_array_equal(a, k)
    else:
        # Only read (reduce writes the root, replica 0 here): read-only is fine.
        assert errs == [None] * len(errs), errs
        np.testing.assert_array_equal(arrays[1], keep[1])


UNSUPPORTED = [
    np.array([1, 2], dtype=object),
    np.ones(2, np.complex64),
    np.ones(2, np.complex128),
    np.array(["ab", "cd"]),
    np.array([b"ab", b"cd"]),
    np.ones(2, bool),
    np.ones(2, np.uint16),
    np.ones(2, np.uint32),
    np.ones(2, np.uint64),
    np.ones(2, np.longdouble),
    np.array(["2020-01-01", "2021-01-01"], dtype="datetime64[D]"),
    np.zeros(2, dtype=[("a", np.float32), ("b", np.int32)]),
    np.ones(2, np.dtype(">f4")),
]


@pytest.mark.parametrize("method", SINGLE + PER_REPLICA)
@pytest.mark.parametrize("bad", UNSUPPORTED, ids=lambda a: a.dtype.str)
def test_unsupported_dtypes_are_type_errors(method, bad):
    n = 2
    arrays = [bad.copy(), bad.copy()]
    keep = [a.copy() for a in arrays]
    with dv.ReplicaGroup(n, timeout_seconds=5) as g:
        errs = _call(g, method, arrays)
    for e in errs:
        assert isinstance(e, TypeError), (method, bad.dtype, e)
        assert "replica" in str(e) and "not supported" in str(e), str(e)
    for a, k in zip(arrays, keep):
        assert a.tobytes() == k.tobytes()


# ---- the group's own arguments -------------------------------------------------------------


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


@pytest.mark.parametrize("n", [2**31, 2**70, 10**6])
def test_a_group_too_large_is_a_value_error(n):
    with pytest.raises(ValueError, match="too large"):
        dv.ReplicaGroup(n)
    with pytest.raises(ValueError, match="too large"):
        dv._core.Group(n)


# ---- the per-replica style: one replica's bad call reaches every replica at once -----------


@pytest.mark.parametrize(
    "bad,kind,match",
    [
        (np.ones((4, 4), np.float32)[:, ::2], ValueError, "replica 1: array is not C-contiguous"),
        (np.ones(8, np.complex64), TypeError, "replica 1: dtype complex64 is not supported"),
        ([1.0, 2.0], TypeError, "replica 1: expected an array"),
    ],
)
def test_per_replica_bad_input_reaches_every_replica_at_once(bad, kind, match):
    """A replica whose own arguments are bad still meets the others, so every replica
    raises the same error at once instead of waiting for the timeout."""
    with dv.ReplicaGroup(2, timeout_seconds=60) as g:
        good = np.arange(8, dtype=np.float32)
        keep = good.copy()
        t0 = time.monotonic()
        _, errs = run_threads(2, lambda r: g.replica_all_reduce(r, (good, bad)[r]))
        assert time.monotonic() - t0 < 5
        for r, e in enumerate(errs):
            assert isinstance(e, kind), (r, e)
            assert match in str(e), str(e)
        assert "(reported by replica 1)" in str(errs[0])
        np.testing.assert_array_equal(good, keep)
        assert not g.aborted  # nothing failed: the group runs the next call as usual
        a, b = np.ones(3, np.float32), np.full(3, 2.0, np.float32)
        _, errs = run_threads(2, lambda r: g.replica_all_reduce(r, (a, b)[r]))
        assert errs == [None, None]
        np.testing.assert_array_equal(a, np.full(3, 3.0, np.float32))


class _RaisingDLPack:
    def __dlpack__(self, **kw):
        raise OSError("the device went away")

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize(
    "bad,kind,other_kind,match",
    [
        (dict(op=None), TypeError, TypeError, "op must be a string"),
        (dict(opp="sum"), TypeError, TypeError, "unexpected keyword argument 'opp'"),
        (dict(timeout_seconds="5"), TypeError, TypeError, "timeout_seconds must be a number"),
        (dict(array=_RaisingDLPack()), OSError, ValueError, "the device went away"),
        (dict(replica=5), ValueError, dv.AbortedError, "out of range"),
        (dict(replica="1"), TypeError, dv.AbortedError, "replica must be an int"),
    ],
)
def test_failures_before_the_meeting_reach_every_replica_at_once(bad, kind, other_kind, match):
    """Whatever is wrong with one replica's call (not only the array checks), the other
    replica hears of it at once instead of waiting for the timeout."""
    with dv.ReplicaGroup(2, timeout_seconds=60) as g:
        good = np.arange(8, dtype=np.float32)
        keep = good.copy()

        def call(r):
            if r == 0:
                time.sleep(0.05)  # arrive after the bad replica, too
                return g.replica_all_reduce(0, good)
            kwargs = dict(replica=1, array=np.ones(8, np.float32))
            kwargs.update(bad)
            return g.replica_all_reduce(**kwargs)

        t0 = time.monotonic()
        _, errs = run_threads(2, call)
        assert time.monotonic() - t0 < 5
        assert isinstance(errs[1], kind), errs[1]
        assert match in str(errs[1]), str(errs[1])
        assert isinstance(errs[0], other_kind), errs[0]
        if other_kind is not dv.AbortedError:
            assert match in str(errs[0]) and "reported by replica 1" in str(errs[0]), str(errs[0])
        np.testing.assert_array_equal(good, keep)
        if g.aborted:
            g.reset()
        xs = [np.ones(3, np.float32), np.full(3, 2.0, np.float32)]
        _, errs = run_threads(2, lambda r: g.replica_all_reduce(r, xs[r]))
        assert errs == [None, None], errs
        np.testing.assert_array_equal(xs[0], np.full(3, 3.0, np.float32))


# ---- the per-replica style: buffers of several replicas that overlap -----------------------


@pytest.mark.parametrize("algo", ALGOS)
def test_per_replica_same_array_on_several_replicas_is_refused_everywhere(algo):
    """Three replicas passing one array would sum into it concurrently; every replica is
    refused before anything is written, and the group stays usable."""
    with dv.ReplicaGroup(3, timeout_seconds=60) as g:
        s = np.ones(1000, np.float32)
        _, errs = run_threads(3, lambda r: g.replica_all_reduce(r, s, algorithm=algo))
        for r, e in enumerate(errs):
            assert isinstance(e, ValueError) and "overlaps" in str(e), (r, e)
        np.testing.assert_array_equal(s, np.ones(1000, np.float32))
        assert not g.aborted
        xs = [np.full(4, r + 1.0, np.float32) for r in range(3)]
        _, errs = run_threads(3, lambda r: g.replica_all_reduce(r, xs[r], algorithm=algo))
        assert errs == [None] * 3
        for x in xs:
            np.testing.assert_array_equal(x, np.full(4, 6.0, np.float32))


@pytest.mark.parametrize("method", ["replica_all_reduce", "replica_broadcast", "replica_reduce"])
def test_per_replica_overlapping_slices_of_one_base_are_refused(method):
    """Two replicas writing overlapping slices of one base gave results that changed from
    run to run; now both are refused and the base is untouched."""
    base = np.arange(60000, dtype=np.float32)
    keep = base.copy()
    parts = (base[:40000], base[20000:])
    with dv.ReplicaGroup(2, timeout_seconds=60) as g:
        _, errs = run_threads(2, lambda r: getattr(g, method)(r, parts[r]))
    for r, e in enumerate(errs):
        assert isinstance(e, ValueError) and "overlaps" in str(e), (r, e)
    np.testing.assert_array_equal(base, keep)


def test_per_replica_overlapping_inputs_that_are_only_read_are_fine():
    base = np.arange(60000, dtype=np.float32)
    parts = (base[:40000], base[20000:])
    with dv.ReplicaGroup(2, timeout_seconds=60) as g:
        res, errs = run_threads(2, lambda r: g.replica_all_gather(r, parts[r]))
    assert errs == [None, None]
    for r in range(2):
        np.testing.assert_array_equal(res[r], np.concatenate(parts), err_msg=f"replica {r}")


# ---- replicas whose calls disagree: the same MismatchError everywhere, nothing written -----


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


def test_per_replica_shapes_must_agree():
    """Equal element counts are not enough: (2, 3) and (3, 2) would gather into (4, 3)
    on one replica and (6, 2) on the other."""
    with dv.ReplicaGroup(2, timeout_seconds=60) as g:
        parts = (np.zeros((2, 3), np.float32), np.ones((3, 2), np.float32))
        _, errs = run_threads(2, lambda r: g.replica_all_gather(r, parts[r]))
        for r, e in enumerate(errs):
            assert isinstance(e, dv.MismatchError), (r, e)
            assert "replica 0 passed shape (2, 3), replica 1 passed shape (3, 2)" in str(e), str(e)
        # the same bytes as different dtypes
        parts = (np.zeros(2, np.float32), np.ones(2, np.int32))
        _, errs = run_threads(2, lambda r: g.replica_all_reduce(r, parts[r]))
        for r, e in enumerate(errs):
            assert isinstance(e, dv.MismatchError), (r, e)
            assert "replica 0 passed dtype float32, replica 1 passed dtype int32" in str(e), str(e)
        np.testing.assert_array_equal(parts[1], np.ones(2, np.int32))
        assert not g.aborted


@pytest.mark.parametrize("method", ["replica_all_reduce", "replica_broadcast", "replica_all_gather"])
def test_per_replica_a_scalar_and_a_vector_of_one_element_differ(method):
    """A 0-d array has shape (), a bytearray of one byte (1,): the same element count but
    not the same shape, so every replica refuses, as for any other shape difference."""
    with dv.ReplicaGroup(3, timeout_seconds=60) as g:
        parts = [bytearray(b"\x05"), np.array(7, np.uint8), np.array(9, np.uint8)]
        keep = [bytes(parts[0]), parts[1].copy(), parts[2].copy()]
        _, errs = run_threads(3, lambda r: getattr(g, method)(r, parts[r]))
        for r, e in enumerate(errs):
            assert isinstance(e, dv.MismatchError), (r, e)
            assert "replica 0 passed shape (1,), replica 1 passed shape ()" in str(e), str(e)
        assert bytes(parts[0]) == keep[0]
        np.testing.assert_array_equal(parts[1], keep[1])
        np.testing.assert_array_equal(parts[2], keep[2])
        # Scalars on every replica are fine, and reduce like numpy.
        scalars = [np.array(r + 1, np.float64) for r in range(3)]
        _, errs = run_threads(3, lambda r: g.replica_all_reduce(r, scalars[r]))
        assert errs == [None, None, None]
        for r in range(3):
            assert scalars[r].shape == () and float(scalars[r]) == 6.0, (r, scalars[r])


@pytest.mark.parametrize(
    "first,second,match",
    [
        ("all_reduce", "all_gather", "replica 1 called all_gather"),
        ("all_reduce:sum", "all_reduce:max", "op=max"),
        ("broadcast:0", "broadcast:1", "root=1"),
        ("all_reduce:shape", "all_reduce", "count="),
        ("all_reduce:float64", "all_reduce", "dtype="),
    ],
)
def test_replicas_calling_different_collectives(first, second, match):
    """Every replica gets the same MismatchError; nothing is written."""
    n = 2
    arrays = [np.arange(8, dtype=np.float32) + r for r in range(n)]
    arrays[0] = arrays[0].astype(np.float64) if first.endswith("float64") else arrays[0]
    arrays[0] = arrays[0][:4].copy() if first.endswith("shape") else arrays[0]
    keep = [a.copy() for a in arrays]

    def call(r):
        what = (first, second)[r]
        name, _, arg = what.partition(":")
        if name == "all_reduce":
            op = arg if arg in ("sum", "max") else "sum"
            return g.replica_all_reduce(r, arrays[r], op=op, timeout_seconds=10)
        if name == "all_gather":
            return g.replica_all_gather(r, arrays[r], timeout_seconds=10)
        return g.replica_broadcast(r, arrays[r], root=int(arg), timeout_seconds=10)

    with dv.ReplicaGroup(n) as g:
        _, errs = run_threads(n, call)
        for r, e in enumerate(errs):
            assert isinstance(e, dv.MismatchError), (r, e)
            assert "replicas called different collectives" in str(e) and match in str(e), str(e)
        for a, k in zip(arrays, keep):
            np.testing.assert_array_equal(a, k)
        # A mismatch fails nobody's group: the next agreeing call works.
        good = [np.full(3, r + 1, np.int32) for r in range(n)]
        _, errs = run_threads(n, lambda r: g.replica_all_reduce(r, good[r], timeout_seconds=10))
        assert errs == [None] * n, errs
        for x in good:
            np.testing.assert_array_equal(x, np.full(3, 3, np.int32))


# ---- the fuzz target, over pseudo-random inputs --------------------------------------------


def test_fuzz_target_over_pseudo_random_inputs():
    """tests/fuzz/fuzz_group.py's checks (valid calls match numpy, invalid ones raise
    ValueError/TypeError on every replica with inputs untouched) over 3000 inputs; CI
    also runs it coverage-guided under atheris (.ci/fuzz.sh)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "fuzz", "fuzz_group.py")
    spec = importlib.util.spec_from_file_location("fuzz_group", path)
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    rng = np.random.default_rng(2024)
    for _ in range(3000):
        fuzz.one_input(rng.integers(0, 256, size=int(rng.integers(0, 200)), dtype=np.uint8).tobytes())
    for g in fuzz._groups.values():
        g.close()


def _misaligned(values, dtype=np.float32):
    """A C-contiguous array whose data starts one byte past an element boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = bytearray(itemsize * len(values) + 1)
    a = np.frombuffer(raw, dtype=dtype, count=len(values), offset=1)
    a[:] = values
    assert a.flags.c_contiguous and not a.flags.aligned
    return a


def test_misaligned_arrays_are_refused_by_the_group_and_copied_by_strategies():
    # The engine reads whole, aligned elements: a group call names the problem before
    # touching anything; inside strategy.run the array is copied first, in every path.
    g = dv.ReplicaGroup(2)
    x = [_misaligned(np.arange(8) + 1.0), np.arange(8, dtype=np.float32) * 10]
    keep = [a.copy() for a in x]
    with pytest.raises(ValueError, match=r"replica 0: array is not aligned to its 4-byte elements"):
        g.all_reduce(x)
    np.testing.assert_array_equal(x[0], keep[0])
    want = keep[0].astype(np.float64) + keep[1]
    for execution in ("inline", "threads"):
        s = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution=execution)
        try:
            v = s.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group])
            ctx = dv.get_replica_context
            one = s.run(lambda a: ctx().all_reduce("SUM", a), args=(v,))
            tree = s.run(lambda a: ctx().all_reduce("SUM", {"a": a, "b": [a]}), args=(v,))
            for r in range(2):
                np.testing.assert_array_equal(s.experimental_local_results(one)[r], want, err_msg=execution)
                parts = s.experimental_local_results(tree)[r]
                np.testing.assert_array_equal(parts["a"], want, err_msg=execution)
                np.testing.assert_array_equal(parts["b"][0], want, err_msg=execution)
            np.testing.assert_array_equal(s.reduce("SUM", v, axis=None), want)
            np.testing.assert_array_equal(x[0], keep[0])  # the input is left alone
        finally:
            s.close()
