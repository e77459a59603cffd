"""ReplicaGroup's collectives against numpy references: every collective, algorithm and
dtype in both call styles; shapes from 0-d and zero-size to more than 2**31 elements;
NaN, infinities and integer overflow; 64 replicas; property tests over random cases."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _group_helpers import ALGOS, assert_same, check_all, reduce_ref, run_threads, values
from conftest import ENGINE_DTYPES, distinct_values, reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distvals as dv

OPS = ["sum", "prod", "min", "max", "mean"]
INT_DTYPES = ["int8", "uint8", "int32", "int64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]


DTYPE_OPS = [(d, op) for d in ENGINE_DTYPES for op in OPS if op != "mean" or np.dtype(d).kind == "f"]


# ---- every collective, algorithm and dtype, single call ------------------------------------


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


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("root", [0, -1])
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("int64", "max"), ("float64", "mean"), ("int8", "prod")])
@pytest.mark.parametrize("shape", [(), (7,), (3, 1031)])
def test_reduce_out_of_place(n, root, dtype, op, shape):
    root = root % n
    bufs = distinct_values(n, shape, dtype, op, seed=n)
    keep = [b.copy() for b in bufs]
    out = np.full(shape, 77, dtype)
    with dv.ReplicaGroup(n) as g:
        g.reduce(bufs, root=root, op=op, out=out)
    check_all([out], reference(keep, op), dtype)
    for r in range(n):
        np.testing.assert_array_equal(bufs[r], keep[r], err_msg=f"replica {r}'s input was written")


def test_reduce_out_errors_leave_everything_untouched():
    bufs = distinct_values(3, (8,), np.float32)
    keep = [b.copy() for b in bufs]
    with dv.ReplicaGroup(3) as g:
        for out, match in [
            (
                np.zeros(7, np.float32),
                r"out must have the inputs' dtype and shape \(float32 \(8,\)\), got float32 \(7,\)",
            ),
            (np.zeros(8, np.float64), r"got float64 \(8,\)"),
            (np.zeros(16, np.float32)[::2], "replica 1: reduce output is not C-contiguous"),
            (bufs[2], "replica 2's input overlaps replica 1's output"),
        ]:
            before = out.copy()
            with pytest.raises(ValueError, match=match):
                g.reduce(bufs, root=1, out=out)
            np.testing.assert_array_equal(out, before)
        ro = np.zeros(8, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="replica 1"):
            g.reduce(bufs, root=1, out=ro)
        # The group is still usable, and nothing was written.
        out = np.zeros(8, np.float32)
        g.reduce(bufs, root=1, out=out)
    np.testing.assert_allclose(out, reference(keep, "sum"))
    for r in range(3):
        np.testing.assert_array_equal(bufs[r], keep[r])


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


# ---- the per-replica style: one call per replica, each from its own thread -----------------


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


# ---- sizes: beyond 2**31 elements, zero-size, 0-d, 64 replicas -----------------------------


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


# ---- values: NaN and infinity, integer overflow --------------------------------------------


def test_nan_and_inf_propagate(g2):
    a = np.array([np.nan, 1.0, np.inf], np.float32)
    b = np.array([1.0, np.nan, 1.0], np.float32)
    g2.all_reduce([a, b], op="max")
    for x in (a, b):
        assert np.isnan(x[0]) and np.isnan(x[1]) and np.isinf(x[2])


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


# ---- properties against numpy --------------------------------------------------------------

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
