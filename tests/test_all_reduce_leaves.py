"""distvals._core.all_reduce_leaves: the all-reduce of a structure's leaves in one engine
call (small leaves packed per dtype, large ones straight into pooled outputs), and the
batch it opens so that the group's workers linger between the calls."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import distinct_values, reference, tolerance
from hypothesis import given, settings
from hypothesis import strategies as st

import distvals as dv
from distvals import _core

FUSE = 32 << 10


def run(group, leaves, op="sum", fuse_bytes=FUSE, bytes_per_pack=0):
    trace: list = []
    out = _core.all_reduce_leaves(group._group, leaves, op, "auto", fuse_bytes, bytes_per_pack, trace=trace)
    return out, trace


def check(out, leaves, op):
    n = len(leaves)
    assert len(out) == n
    for r in range(n):
        assert len(out[r]) == len(leaves[0])
        for i, got in enumerate(out[r]):
            want = reference([leaves[j][i] for j in range(n)], op)
            assert got.shape == leaves[0][i].shape and got.dtype == leaves[0][i].dtype, (r, i)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tolerance(got.dtype), err_msg=f"{r},{i}")


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "prod"])
def test_mixed_leaves_match_the_float64_reference_on_every_replica(n, op):
    shapes = [(3, 2), (), (5,), (FUSE // 4 + 7,), (0,), (2, 2, 2)]
    dtypes = ["float32", "float64", "float32", "float32", "float32", "float64"]
    per_leaf = [distinct_values(n, s, d, op, seed=i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    leaves = [[per_leaf[i][r] for i in range(len(shapes))] for r in range(n)]
    before = [[x.copy() for x in row] for row in leaves]
    with dv.ReplicaGroup(n) as g:
        out, trace = run(g, leaves, op)
    check(out, before, op)
    for row, kept in zip(leaves, before):  # the inputs are only read
        for x, y in zip(row, kept):
            np.testing.assert_array_equal(x, y)
    # The small float32 leaves (3x2, 5 and the empty one) in one pack, the float64 ones
    # (0-d, 2x2x2) in another; the large float32 leaf on its own.
    assert sorted(trace) == sorted([("float32", 6 + 5 + 0), ("float64", 1 + 8), ("float32", FUSE // 4 + 7)])


def test_integer_leaves_are_exact():
    n = 3
    leaves = [[np.arange(10, dtype=np.int64) * (r + 1), np.full(4, r - 1, np.int8)] for r in range(n)]
    with dv.ReplicaGroup(n) as g:
        out, _ = run(g, leaves)
    for r in range(n):
        np.testing.assert_array_equal(out[r][0], np.arange(10) * 6)
        np.testing.assert_array_equal(out[r][1], np.full(4, 0, np.int8))


def test_results_are_independent_writable_arrays(g2):
    leaves = [[np.full(3, 1.0 + r, np.float32), np.full(2, 10.0 * r, np.float32)] for r in range(2)]
    out, trace = run(g2, leaves)
    assert trace == [("float32", 5)]
    out[0][0][:] = -1.0  # a view of replica 0's pack: nothing else changes
    np.testing.assert_array_equal(out[0][1], [10.0, 10.0])
    np.testing.assert_array_equal(out[1][0], [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(out[1][1], [10.0, 10.0])


def test_bytes_per_pack_splits_packs_in_order(g2):
    leaves = [[np.full(k, 1.0 + r, np.float32) for k in (2, 2, 3, 8)] for r in range(2)]
    out, trace = run(g2, leaves, bytes_per_pack=16)
    assert trace == [("float32", 4), ("float32", 3), ("float32", 8)]
    for r in range(2):
        for got, k in zip(out[r], (2, 2, 3, 8)):
            np.testing.assert_array_equal(got, np.full(k, 3.0, np.float32))


def test_non_contiguous_leaves_are_reduced_from_a_copy(g2):
    base = [np.arange(12, dtype=np.float64).reshape(3, 4) * (r + 1) for r in range(2)]
    leaves = [[b[:, ::2], b.T] for b in base]
    out, _ = run(g2, leaves)
    for r in range(2):
        np.testing.assert_array_equal(out[r][0], (base[0] * 3)[:, ::2])
        np.testing.assert_array_equal(out[r][1], (base[0] * 3).T)


@pytest.mark.parametrize(
    "leaf, op",
    [
        (lambda r: np.arange(3, dtype=np.int32), "mean"),  # integer MEAN runs in float64
        (lambda r: np.array([True, False]), "sum"),  # bool: numpy reduces it
        (lambda r: np.arange(3, dtype=">f4"), "sum"),  # big-endian
        (lambda r: [1.0, 2.0], "sum"),  # not an array
        # A masked array: its mask would be dropped (the strategies refuse it by name).
        (lambda r: np.ma.masked_array([1.0, 2.0], mask=[False, True]), "sum"),
        (lambda r: np.arange(3.0).view(np.recarray), "sum"),  # any other ndarray subclass
    ],
)
def test_leaves_it_does_not_take_give_none_and_touch_nothing(g2, leaf, op):
    leaves = [[np.ones(2, np.float32), leaf(r)] for r in range(2)]
    assert run(g2, leaves, op)[0] is None


def test_mismatches_name_the_leaf_and_the_replica(g2):
    with pytest.raises(ValueError, match="one list of leaves per replica: 2 expected, got 1"):
        run(g2, [[np.ones(2)]])
    with pytest.raises(ValueError, match="replica 1 passes 1 leaves, replica 0 passes 2"):
        run(g2, [[np.ones(2), np.ones(2)], [np.ones(2)]])
    with pytest.raises(TypeError, match="leaf 1 of replica 1 has dtype float64, replica 0's has float32"):
        run(g2, [[np.ones(2), np.ones(2, np.float32)], [np.ones(2), np.ones(2)]])
    with pytest.raises(ValueError, match=r"leaf 0 of replica 1 has shape \(3, 2\), replica 0's has shape \(2, 3\)"):
        run(g2, [[np.ones((2, 3))], [np.ones((3, 2))]])


def test_a_batch_is_closed_after_the_call_and_leaves_the_linger_alone(g2):
    assert g2.set_linger_us(7) == 0
    leaves = [[np.ones(FUSE, np.float32), np.ones(FUSE, np.float32)] for _ in range(2)]
    run(g2, leaves)
    assert g2.set_linger_us(0) == 7
    assert g2._group.batch(True) == 1  # no batch was left open
    assert g2._group.batch(False) == 0
    with pytest.raises(ValueError, match="another shape|has shape"):
        run(g2, [[np.ones((2, 3))], [np.ones((3, 2))]])  # refused before the batch opens
    assert g2._group.batch(True) == 1
    assert g2._group.batch(False) == 0
    assert g2.set_linger_us(10**9) == 0
    assert g2.set_linger_us(2**40) == 100_000  # clamped, also past a C int
    assert g2.set_linger_us(-(2**40)) == 100_000
    assert g2.set_linger_us(0) == 0


def test_results_keep_each_replicas_spelling_of_the_dtype(g2):
    # np.longlong and np.int64 are the same engine dtype; each replica gets its own back,
    # packed (small) or not (large).
    spellings = [np.dtype(np.longlong), np.dtype(np.int64)]
    leaves = [
        [np.full(3, r + 1, spellings[r]), np.full(FUSE, r + 1, spellings[r]), np.ones(2, spellings[r])]
        for r in range(2)
    ]
    out, _ = run(g2, leaves)
    for r in range(2):
        for got in out[r]:
            assert got.dtype.char == spellings[r].char, (r, got.dtype.char)
        np.testing.assert_array_equal(out[r][0], np.full(3, 3))


@pytest.mark.timeout(120)
def test_overlapping_batches_from_two_threads_all_close(g2):
    # Two threads reducing structures on one group at once: each call opens and closes
    # its own batch, so none stays open after them (the workers would spin forever).
    errors: list = []

    def work(seed):
        try:
            for k in range(60):
                leaves = [[np.full(64, r + seed + k, np.float32), np.full(9000, r, np.float64)] for r in range(2)]
                out, _ = run(g2, leaves)
                np.testing.assert_array_equal(out[1][0], np.full(64, 2 * (seed + k) + 1, np.float32))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (0, 100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert g2._group.batch(True) == 1
    assert g2._group.batch(False) == 0


def test_batch_context_opens_and_closes_around_its_body_even_on_error(g2):
    xs = [np.arange(5.0) + r for r in range(2)]
    with g2.batch():
        with g2.batch():  # nested (or another thread's) batches are counted
            assert g2._group.batch(True) == 3
            assert g2._group.batch(False) == 2
            g2.all_reduce(xs)
        assert g2._group.batch(True) == 2
        assert g2._group.batch(False) == 1
    np.testing.assert_array_equal(xs[1], np.arange(5.0) * 2 + 1)
    with pytest.raises(ValueError, match="shape"), g2.batch():
        g2.all_reduce([np.ones(2), np.ones(3)])
    assert g2._group.batch(True) == 1  # closed although the body raised
    assert g2._group.batch(False) == 0


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 4),
    sizes=st.lists(st.integers(0, 3 * FUSE // 4), min_size=1, max_size=6),
    dtype=st.sampled_from(["float32", "float64", "int32"]),
    op=st.sampled_from(["sum", "max", "min"]),
    per_pack=st.sampled_from([0, 64, 4096]),
)
def test_any_set_of_leaves_matches_the_reference(n, sizes, dtype, op, per_pack):
    per_leaf = [distinct_values(n, (k,), dtype, op, seed=i) for i, k in enumerate(sizes)]
    leaves = [[per_leaf[i][r] for i in range(len(sizes))] for r in range(n)]
    with dv.ReplicaGroup(n) as g:
        out, trace = run(g, leaves, op, bytes_per_pack=per_pack)
    check(out, leaves, op)
    # Every element crosses the engine exactly once.
    assert sum(c for _, c in trace) == sum(sizes)
