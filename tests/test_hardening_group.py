"""ReplicaGroup under stress: bad input, extreme sizes, NaN and overflow, concurrency,
interrupts, resource release, and property tests against numpy references."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import ENGINE_DTYPES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from process_stats import needs_plain_malloc, os_threads, rss_bytes, settle_threads

import distvals as dv

ALGOS = ["ring", "tree", "direct", "auto"]
INT_DTYPES = ["int8", "uint8", "int32", "int64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]


# ---- helpers ------------------------------------------------------------------------


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


# ---- sizes: beyond 2**31 elements, zero-size, 0-d -----------------------------------


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_more_than_2_31_int8_elements():
    n = 2**31 + 4099
    if _mem_available() < 3 * n:
        pytest.skip("needs about 7 GiB of free memory")
    # Distinct values at the 2**31 boundary, where 32-bit indexing would wrap.
    idx = np.array([0, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 17, n - 1])
    a = np.ones(n, np.int8)
    b = np.full(n, 2, np.int8)
    a[idx] = np.array([5, 100, -100, 127, 3, -128], np.int8)
    b[idx] = np.array([7, 100, -100, 1, 9, -1], np.int8)
    want_idx = reduce_ref([a[idx], b[idx]], "sum", np.int8)
    with dv.ReplicaGroup(2, timeout_seconds=600) as g:
        g.all_reduce([a, b], algorithm="direct")
        for r, x in enumerate((a, b)):
            np.testing.assert_array_equal(x[idx], want_idx, err_msg=f"replica {r}")
        # Everywhere else 1 + 2 = 3; checked in slices to keep memory small.
        step = 1 << 28
        for r, x in enumerate((a, b)):
            wrong = 0
            for s in range(0, n, step):
                wrong += int(np.count_nonzero(x[s : s + step] != 3))
            assert wrong == np.count_nonzero(want_idx != 3), f"replica {r}: {wrong} wrong elements"
        # The per-replica style with a ring (offsets past 2**31 in every step), in place.
        b[idx] = np.array([1, 2, 3, 4, 5, 6], np.int8)
        want_idx = reduce_ref([a[idx], b[idx]], "sum", np.int8)
        _, errs = run_threads(2, lambda r: g.replica_all_reduce(r, (a, b)[r], algorithm="ring"), timeout=600)
        assert errs == [None, None], errs
        for r, x in enumerate((a, b)):
            np.testing.assert_array_equal(x[idx], want_idx, err_msg=f"replica {r}")
            assert x[1] == 6 and x[n // 2] == 6 and x[n - 2] == 6, f"replica {r}"


@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (3, 0), (1,)])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_zero_size_and_0d_arrays_single_call(n, shape):
    rng = np.random.default_rng(n)
    with dv.ReplicaGroup(n) as g:
        for algo in ALGOS:
            bufs = values(n, shape, np.float32, "sum", rng)
            want = reduce_ref(bufs, "sum", np.float32)
            g.all_reduce(bufs, algorithm=algo)
            for r, b in enumerate(bufs):
                assert_same(b, want, f"all_reduce {algo} replica {r}")
        bufs = values(n, shape, np.int32, "sum", rng)
        gathered = g.all_gather(bufs)
        want = np.stack(bufs) if shape == () else np.concatenate(bufs, axis=0)
        for r, x in enumerate(gathered):
            assert_same(x, want, f"all_gather replica {r}")
        src = bufs[n - 1].copy()
        g.broadcast(bufs, root=n - 1)
        for r, b in enumerate(bufs):
            assert_same(b, src, f"broadcast replica {r}")
        bufs = values(n, shape, np.int64, "sum", rng)
        keep = [b.copy() for b in bufs]
        g.reduce(bufs, root=0, op="max")
        assert_same(bufs[0], reduce_ref(keep, "max", np.int64), "reduce root")
        if shape and shape[0] % n == 0:
            parts = g.reduce_scatter(keep, op="sum")
            full = reduce_ref(keep, "sum", np.int64)
            m = shape[0] // n
            for r, p in enumerate(parts):
                assert_same(p, full[r * m : (r + 1) * m], f"reduce_scatter replica {r}")
        elif n > 1:
            with pytest.raises(ValueError, match="reduce_scatter needs a first dimension divisible"):
                g.reduce_scatter(keep)


@pytest.mark.parametrize("shape", [(), (0,), (4, 0)])
def test_zero_size_and_0d_arrays_per_replica(shape):
    n = 3
    rng = np.random.default_rng(5)
    bufs = values(n, shape, np.float64, "sum", rng)
    want = reduce_ref(bufs, "sum", np.float64)
    with dv.ReplicaGroup(n, timeout_seconds=30) as g:

        def replica(r):
            g.replica_all_reduce(r, bufs[r])
            return g.replica_all_gather(r, bufs[r])

        res, errs = run_threads(n, replica)
        assert errs == [None] * n, errs
    gathered_want = np.stack([want] * n) if shape == () else np.concatenate([want] * n, axis=0)
    for r in range(n):
        assert_same(bufs[r], want, f"replica {r}")
        assert_same(res[r], gathered_want, f"all_gather replica {r}")


# ---- values: NaN and infinity, integer overflow ----------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean"])
@pytest.mark.parametrize("algo", ALGOS)
def test_nan_and_inf_propagate_like_numpy(dtype, op, algo):
    n = 3
    specials = [np.nan, np.inf, -np.inf, 0.0, 1.0, -2.0]
    # Every combination of two specials somewhere, in a buffer long enough to span chunks.
    rng = np.random.default_rng(7)
    bufs = [rng.choice(specials, size=3001).astype(dtype) for _ in range(n)]
    want = reduce_ref(bufs, op, dtype)
    with dv.ReplicaGroup(n, chunk_bytes=512) as g:
        g.all_reduce(bufs, op=op, algorithm=algo)
    for r, b in enumerate(bufs):
        if op == "mean" and dtype == "float16":  # one rounding apart; NaN and inf exact
            np.testing.assert_allclose(b.astype(np.float64), want.astype(np.float64), rtol=1e-3, err_msg=f"replica {r}")
        else:
            np.testing.assert_array_equal(b, want, err_msg=f"replica {r}")  # NaN == NaN here
    assert np.isnan(want).any() and np.isinf(want).any()


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
@pytest.mark.parametrize("algo", ALGOS)
def test_integer_overflow_wraps_like_numpy(dtype, op, algo):
    info = np.iinfo(dtype)
    n = 4
    rng = np.random.default_rng(11)
    edge = np.array(
        [info.min, info.max, info.max - 1, info.min + 1, 0, 1, -1 if info.min < 0 else 2, info.max // 2 + 1],
        dtype=np.int64,
    )
    bufs = [rng.choice(edge, size=257).astype(dtype) for _ in range(n)]
    want = reduce_ref(bufs, op, dtype)
    with dv.ReplicaGroup(n, chunk_bytes=64) as g:
        g.all_reduce(bufs, op=op, algorithm=algo)
    for r, b in enumerate(bufs):
        np.testing.assert_array_equal(b, want, err_msg=f"replica {r}")


# ---- bad input: refused before anything is touched, naming the replica ---------------


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


@pytest.mark.parametrize("method", SINGLE + PER_REPLICA)
def test_closed_group_refuses_every_method(method):
    g = dv.ReplicaGroup(2)
    g.close()
    arrays = [np.ones(4, np.float32), np.ones(4, np.float32)]
    errs = _call(g, method, arrays)
    for e in errs:
        assert isinstance(e, dv.ClosedError), e
    np.testing.assert_array_equal(arrays[0], 1)


# ---- concurrency --------------------------------------------------------------------


def test_two_groups_from_two_threads_at_once():
    """Single-call groups driven from two Python threads, plus two per-replica groups
    driven by their own replica threads, all at the same time."""
    errors = []

    def single_call_loop(k):
        with dv.ReplicaGroup(3) as g:
            for it in range(200):
                bufs = [np.full(1000 + k, k * 100 + r + it, np.int64) for r in range(3)]
                want = reduce_ref(bufs, "sum", np.int64)
                g.all_reduce(bufs, algorithm=ALGOS[it % 4])
                for r, b in enumerate(bufs):
                    if not np.array_equal(b, want):
                        errors.append(f"group {k} iteration {it} replica {r}")
                        return

    def per_replica_group(k, n):
        g = dv.ReplicaGroup(n, timeout_seconds=30)

        def replica(r):
            for it in range(100):
                x = np.full(17, k * 1000 + r + it, np.float64)
                g.replica_all_reduce(r, x)
                want = sum(k * 1000 + j + it for j in range(n))
                if not np.all(x == want):
                    raise AssertionError(f"group {k} iteration {it} replica {r}: {x[0]} != {want}")

        _, errs = run_threads(n, replica)
        g.close()
        errors.extend(str(e) for e in errs if e is not None)

    ts = [threading.Thread(target=single_call_loop, args=(k,)) for k in range(2)]
    ts += [threading.Thread(target=per_replica_group, args=(k + 2, n)) for k, n in enumerate((2, 3))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)
    assert errors == []


def test_many_groups_alive_together_release_their_threads():
    base = settle_threads(os_threads())
    groups = [dv.ReplicaGroup(2 + i % 3) for i in range(40)]
    assert os_threads() > base  # the groups' workers are running
    for it in range(3):
        for i, g in enumerate(groups):
            n = g.num_replicas
            bufs = [np.full(5000, i + r + it, np.float32) for r in range(n)]  # workers take part
            g.all_reduce(bufs)
            want = np.float32(sum(i + r + it for r in range(n)))
            for b in bufs:
                np.testing.assert_array_equal(b, np.full(5000, want))
    for g in groups:
        g.close()
    assert settle_threads(base) <= base


def test_groups_collected_without_close_release_their_threads():
    base = settle_threads(os_threads())
    for _ in range(20):
        g = dv.ReplicaGroup(4, threads=4)
        g.all_reduce([np.ones(50000, np.float32) for _ in range(4)])
        del g
    gc.collect()
    assert settle_threads(base) <= base


@pytest.mark.parametrize("method", ["replica_all_reduce", "replica_all_gather", "replica_broadcast"])
def test_close_while_another_thread_waits(method):
    g = dv.ReplicaGroup(3, timeout_seconds=60)
    out = {}

    def waiter():
        t0 = time.monotonic()
        try:
            getattr(g, method)(0, np.ones(8, np.float32))
        except BaseException as e:
            out["error"] = e
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    g.close()
    t.join(5)
    assert not t.is_alive()
    assert isinstance(out["error"], dv.ClosedError), out
    assert out["took"] < 5
    with pytest.raises(dv.ClosedError):
        g.all_reduce([np.ones(2, np.float32)] * 3)


def test_64_replicas_on_few_cores_both_styles():
    n = 64
    rng = np.random.default_rng(64)
    with dv.ReplicaGroup(n, timeout_seconds=120) as g:
        for algo in ["ring", "tree", "direct"]:
            bufs = values(n, (1031,), np.float32, "sum", rng)
            want = reduce_ref(bufs, "sum", np.float32)
            g.all_reduce(bufs, algorithm=algo)
            for r, b in enumerate(bufs):
                assert_same(b, want, f"{algo} replica {r}")
        bufs = values(n, (n * 3,), np.int32, "sum", rng)
        keep = [b.copy() for b in bufs]
        want = reduce_ref(keep, "sum", np.int32)

        def replica(r):
            g.replica_all_reduce(r, bufs[r], algorithm="ring")
            gathered = g.replica_all_gather(r, keep[r][:2])
            part = g.replica_reduce_scatter(r, keep[r])
            return gathered, part

        res, errs = run_threads(n, replica, timeout=120)
        assert errs == [None] * n, [e for e in errs if e][:3]
        gathered_want = np.concatenate([k[:2] for k in keep])
        for r in range(n):
            assert_same(bufs[r], want, f"all_reduce replica {r}")
            assert_same(res[r][0], gathered_want, f"all_gather replica {r}")
            assert_same(res[r][1], want[3 * r : 3 * r + 3], f"reduce_scatter replica {r}")


# ---- interrupts ----------------------------------------------------------------------


def _sigint_main_after(delay: float) -> threading.Thread:
    main = threading.main_thread().ident

    def fire():
        time.sleep(delay)
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_keyboard_interrupt_during_a_blocked_collective_returns_within_a_second():
    # Replica 2 never arrives; the timeout is a minute. Ctrl-C must end the wait.
    g = dv.ReplicaGroup(3, timeout_seconds=60)
    other = {}

    def replica1():
        t0 = time.monotonic()
        try:
            g.replica_all_reduce(1, np.ones(8, np.float32))
        except BaseException as e:
            other["error"] = e
        other["at"] = time.monotonic()
        other["took"] = other["at"] - t0

    t1 = threading.Thread(target=replica1, daemon=True)
    t1.start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        firing = _sigint_main_after(0.3)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            g.replica_all_reduce(0, np.ones(8, np.float32))
        returned = time.monotonic()
        firing.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert returned - t0 < 0.3 + 1.0, f"returned after {returned - t0:.2f} s"
    t1.join(5)
    assert not t1.is_alive()
    # The other waiting replica is released too, with AbortedError naming no replica.
    assert isinstance(other["error"], dv.AbortedError), other
    assert other["error"].replica == -1 and "interrupted" in str(other["error"])
    assert other["at"] - t0 < 0.3 + 1.0
    # The group is usable again after reset().
    assert g.aborted
    g.reset()
    bufs = [np.full(4, r, np.float32) for r in range(3)]
    _, errs = run_threads(3, lambda r: g.replica_all_reduce(r, bufs[r], timeout_seconds=10))
    assert errs == [None] * 3
    for b in bufs:
        np.testing.assert_array_equal(b, np.full(4, 3.0, np.float32))
    g.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_custom_signal_handler_exception_reaches_the_caller():
    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop("stop requested")

    g = dv.ReplicaGroup(2, timeout_seconds=60)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        _sigint_main_after(0.2)
        t0 = time.monotonic()
        with pytest.raises(Stop, match="stop requested"):
            g.replica_all_gather(0, np.ones(3, np.int32))
        assert time.monotonic() - t0 < 1.2
    finally:
        signal.signal(signal.SIGINT, previous)
    g.reset()
    g.close()


# ---- resources -----------------------------------------------------------------------


@needs_plain_malloc
def test_memory_is_stable_over_many_groups_and_calls():
    def cycle(k):
        with dv.ReplicaGroup(3) as g:
            bufs = [np.full(300, k + r, np.float64) for r in range(3)]
            g.all_reduce(bufs)
            g.all_gather(bufs)
            g.reduce_scatter([np.ones(6, np.float32) for _ in range(3)])
            assert bufs[2][0] == 3 * k + 3

    for k in range(300):
        cycle(k)
    gc.collect()
    before = rss_bytes()
    for k in range(3000):
        cycle(k)
    gc.collect()
    grown = rss_bytes() - before
    assert grown < 4 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 3000 groups"


# ---- properties against numpy -----------------------------------------------------------

_shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
_chunks = st.sampled_from([0, 1, 16, 24, 64, 100, 4096])


@st.composite
def _case(draw):
    n = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(ENGINE_DTYPES))
    ops = ["sum", "prod", "min", "max"] + (["mean"] if np.dtype(dtype).kind == "f" else [])
    op = draw(st.sampled_from(ops))
    algo = draw(st.sampled_from(ALGOS))
    shape = draw(_shapes)
    chunk = draw(_chunks)
    threads = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    return n, dtype, op, algo, shape, chunk, threads, seed


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_property_single_call_collectives_match_numpy(case):
    n, dtype, op, algo, shape, chunk, threads, seed = case
    rng = np.random.default_rng(seed)
    bufs = values(n, shape, dtype, op, rng)
    keep = [b.copy() for b in bufs]
    want = reduce_ref(keep, op, dtype)
    with dv.ReplicaGroup(n, chunk_bytes=chunk, threads=threads) as g:
        outs = [np.empty_like(b) for b in bufs]
        g.all_reduce(bufs, op=op, algorithm=algo, out=outs)
        for r in range(n):
            assert_same(outs[r], want, f"all_reduce replica {r}", dtype)
            np.testing.assert_array_equal(bufs[r], keep[r])  # out of place: input untouched
        g.all_reduce(bufs, op=op, algorithm=algo)
        for r in range(n):
            assert_same(bufs[r], want, f"in-place all_reduce replica {r}", dtype)
        gathered = g.all_gather(keep)
        gwant = np.stack(keep) if shape == () else np.concatenate(keep, axis=0)
        for r in range(n):
            assert_same(gathered[r], gwant, f"all_gather replica {r}")
        root = seed % n
        cur = [k.copy() for k in keep]
        g.broadcast(cur, root=root)
        for r in range(n):
            assert_same(cur[r], keep[root], f"broadcast replica {r}")
        cur = [k.copy() for k in keep]
        g.reduce(cur, root=root, op=op)
        for r in range(n):
            assert_same(cur[r], want if r == root else keep[r], f"reduce replica {r}", dtype)
        if shape and shape[0] % n == 0:
            parts = g.reduce_scatter(keep, op=op)
            m = shape[0] // n
            for r in range(n):
                assert_same(parts[r], want[r * m : (r + 1) * m], f"reduce_scatter replica {r}", dtype)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_property_per_replica_collectives_match_numpy(case):
    n, dtype, op, algo, shape, chunk, _, seed = case
    rng = np.random.default_rng(seed)
    bufs = values(n, shape, dtype, op, rng)
    keep = [b.copy() for b in bufs]
    want = reduce_ref(keep, op, dtype)
    root = seed % n
    with dv.ReplicaGroup(n, chunk_bytes=chunk, timeout_seconds=60) as g:

        def replica(r):
            g.replica_all_reduce(r, bufs[r], op=op, algorithm=algo)
            gathered = g.replica_all_gather(r, keep[r])
            b = keep[r].copy()
            g.replica_broadcast(r, b, root=root)
            red = keep[r].copy()
            g.replica_reduce(r, red, root=root, op=op)
            return gathered, b, red

        res, errs = run_threads(n, replica)
    assert errs == [None] * n, errs
    gwant = np.stack(keep) if shape == () else np.concatenate(keep, axis=0)
    for r in range(n):
        assert_same(bufs[r], want, f"all_reduce replica {r}", dtype)
        assert_same(res[r][0], gwant, f"all_gather replica {r}")
        assert_same(res[r][1], keep[root], f"broadcast replica {r}")
        assert_same(res[r][2], want if r == root else keep[r], f"reduce replica {r}", dtype)


# ---- the fuzz target, over pseudo-random inputs -----------------------------------------


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


# ---- per-replica calls: agreement across replicas, held buffers, early failures ----------


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


def _run_script(body: str, timeout: float = 120):
    """Runs `body` in a fresh interpreter (a crash must fail the test, not end the run)."""
    import subprocess
    import sys
    import textwrap

    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_buffer_export_is_held_while_the_replica_waits():
    """A bytearray passed to a per-replica call cannot be resized while the engine may
    still write into it: the resize raises BufferError, and the result is right."""
    out = _run_script("""
        import threading, time
        import numpy as np
        import distvals as dv

        g = dv.ReplicaGroup(2, timeout_seconds=60)
        for attempt in range(3):
            ba = bytearray(range(64))
            other = np.arange(64, dtype=np.uint8)
            errors = []
            t = threading.Thread(target=lambda: g.replica_all_reduce(0, ba))
            t.start()
            time.sleep(0.1)  # replica 0 now waits inside the engine for replica 1
            try:
                ba.extend(b"x" * 100000)
                errors.append("resized while the engine held it")
            except BufferError:
                pass
            g.replica_all_reduce(1, other)
            t.join(30)
            assert not t.is_alive()
            assert errors == [], errors
            want = (np.arange(64) * 2).astype(np.uint8)
            assert bytes(ba) == want.tobytes(), bytes(ba)
            ba.extend(b"ok")  # released once the call returned
        print("fine")
    """)
    assert "fine" in out


def test_both_call_styles_from_three_threads_never_crash_or_corrupt():
    """One thread in the single-call style, two in the per-replica style, on one group:
    the engine serializes them; every result is right and nobody fails."""
    out = _run_script("""
        import threading, time
        import numpy as np
        import distvals as dv

        g = dv.ReplicaGroup(2, timeout_seconds=60)
        rounds = 400  # both replicas run the same number of per-replica collectives
        done = threading.Event()
        problems = []
        counts = [0, 0]

        def per_replica(r):
            x = np.zeros(5000, np.float32)
            for it in range(rounds):
                x[:] = r + 1 + it
                try:
                    g.replica_all_reduce(r, x)
                except Exception as e:
                    problems.append(repr(e)); return
                if not np.all(x == 3 + 2 * it):
                    problems.append(f"replica {r} round {it}: {x[:3]}")
                if r == 0:
                    counts[0] += 1

        def single():
            a, b = np.zeros(5000, np.float32), np.zeros(5000, np.float32)
            while not done.is_set():
                a[:] = 10; b[:] = 20
                try:
                    g.all_reduce([a, b])
                except Exception as e:
                    problems.append(repr(e)); return
                if not (np.all(a == 30) and np.all(b == 30)):
                    problems.append("single call wrong")
                counts[1] += 1

        ts = [threading.Thread(target=per_replica, args=(r,)) for r in range(2)]
        s = threading.Thread(target=single)
        for t in ts + [s]:
            t.start()
        for t in ts:
            t.join(120)
        done.set()
        s.join(60)
        assert not any(t.is_alive() for t in ts + [s]), "a thread hung"
        assert problems == [], problems[:5]
        assert counts[0] == rounds and counts[1] > 0, counts
        print("fine", counts)
    """)
    assert "fine" in out


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


def test_timeout_seconds_must_be_a_number():
    with pytest.raises(TypeError, match="timeout_seconds must be a number"):
        dv.ReplicaGroup(2, timeout_seconds="5")
    with pytest.raises(TypeError, match="timeout_seconds must be a number"):
        dv.ReplicaGroup(2, timeout_seconds=True)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_seconds must be positive"):
            dv.ReplicaGroup(2, timeout_seconds=bad)


@pytest.mark.parametrize("seconds", [0.0004, 1e-4])
def test_sub_millisecond_timeouts_are_kept(seconds):
    with dv.ReplicaGroup(2, timeout_seconds=seconds) as g:
        assert g.timeout_seconds == pytest.approx(seconds)
        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError, match="never arrived"):
            g.replica_all_reduce(0, np.ones(4, np.float32))
        assert time.monotonic() - t0 < 2
        g.reset()
    with dv.ReplicaGroup(2, timeout_seconds=60) as g:  # per call, too
        t0 = time.monotonic()
        with pytest.raises(dv.CollectiveTimeoutError):
            g.replica_all_reduce(0, np.ones(4, np.float32), timeout_seconds=seconds)
        assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("seconds", [float("inf"), 2.0**70, 1e308])
def test_infinite_and_huge_timeouts_mean_no_timeout(seconds):
    with dv.ReplicaGroup(2, timeout_seconds=seconds) as g:
        assert g.timeout_seconds == float("inf")
        # still cancellable: abort releases the waiter at once
        timer = threading.Timer(0.1, g.abort, args=(1, "stop"))
        timer.start()
        with pytest.raises(dv.AbortedError, match="stop"):
            g.replica_all_reduce(0, np.ones(4, np.float32))
        timer.join()


@pytest.mark.parametrize(
    "value,want", [("inf", float("inf")), ("1e308", float("inf")), ("0.0004", 0.0004), ("  7.5 ", 7.5)]
)
def test_timeout_environment_variable(monkeypatch, value, want):
    monkeypatch.setenv("DISTVALS_TIMEOUT_SECONDS", value)
    with dv.ReplicaGroup(2) as g:
        assert g.timeout_seconds == pytest.approx(want)


@pytest.mark.parametrize("value", ["five", "-3", "0", "nan", "5s"])
def test_garbage_timeout_environment_variable_warns_and_uses_the_default(monkeypatch, value):
    monkeypatch.setenv("DISTVALS_TIMEOUT_SECONDS", value)
    with pytest.warns(RuntimeWarning, match="DISTVALS_TIMEOUT_SECONDS"):
        g = dv.ReplicaGroup(2)
    with g:
        assert g.timeout_seconds == 300.0


@pytest.mark.parametrize("n", [2**31, 2**70, 10**6])
def test_a_group_too_large_is_a_value_error(n):
    with pytest.raises(ValueError, match="too large"):
        dv.ReplicaGroup(n)
    with pytest.raises(ValueError, match="too large"):
        dv._core.Group(n)
