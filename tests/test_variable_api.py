"""The TensorFlow 2 Variable API beyond assign: initial_value, constraint, shapes, the
scatter and scatter_nd families, sparse_read, gather_nd and count_up_to, on plain and
distributed variables, with the replica-context and aggregation rules of assign."""

from __future__ import annotations

import numpy as np
import pytest

import distvals as dv

SUM = dv.VariableAggregation.SUM
MEAN = dv.VariableAggregation.MEAN
FIRST = dv.VariableAggregation.ONLY_FIRST_REPLICA
ON_READ = dv.VariableSynchronization.ON_READ


def rid():
    return dv.get_replica_context().replica_id_in_sync_group


def copies(v):
    return [c.numpy() for c in v.values]


def slices(values, indices):
    return dv.IndexedSlices(np.asarray(values, np.float32), np.asarray(indices))


# ---- creation arguments -----------------------------------------------------------------------------


def test_initial_value_and_constraint(s2):
    clip = lambda x: np.clip(x, 0, 1)  # noqa: E731
    v = dv.Variable([1.0, 2.0], constraint=clip)
    v.assign([5.0, 6.0])
    np.testing.assert_array_equal(v.initial_value, [1.0, 2.0])
    assert v.initial_value.dtype == np.float32 and not v.initial_value.flags.writeable
    assert v.constraint is clip and dv.Variable(1.0).constraint is None
    with s2.scope():
        m = dv.Variable(lambda: np.arange(3.0), constraint=clip)
    m.assign([7.0, 8.0, 9.0])
    np.testing.assert_array_equal(m.initial_value, [0.0, 1.0, 2.0])
    assert m.constraint is clip
    with pytest.raises(ValueError, match="constraint must be None or a callable, got int"):
        dv.Variable(1.0, constraint=3)


def test_tensorflow_signature_binds_positionally():
    # Variable(initial_value, trainable, validate_shape, caching_device, name, ...)
    v = dv.Variable(1.0, False, True, None, "pos")
    assert not v.trainable and v.name == "pos:0"
    with pytest.raises(NotImplementedError, match="variable_def and import_scope belong to TensorFlow graphs"):
        dv.Variable(1.0, variable_def=object())


def test_shapes(s2):
    v = dv.Variable(np.zeros((2, 3), np.float32))
    assert v.get_shape() == (2, 3) == v.shape
    v.set_shape([2, 3])
    v.set_shape((None, 3))
    with pytest.raises(ValueError, match=r"shape \(3, 3\) is not compatible with the variable's shape \(2, 3\)"):
        v.set_shape([3, 3])
    with pytest.raises(ValueError, match="value has shape"):
        v.assign(np.zeros((3, 3)))
    # An unknown dimension (or validate_shape=False) lets assignments change the shape.
    free = dv.Variable(np.zeros(2), shape=(None,))
    free.assign(np.arange(5.0))
    assert free.shape == (5,)
    loose = dv.Variable(np.zeros(2), validate_shape=False)
    loose.assign(np.zeros((4, 4)))
    assert loose.get_shape() == (4, 4)
    with pytest.raises(ValueError, match="not the given shape"):
        dv.Variable(np.zeros(2), shape=(3,))
    with s2.scope():
        m = dv.Variable(np.zeros(4))
    m.set_shape([4])
    assert m.get_shape() == (4,)


# ---- scatter on a plain variable ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["update", "add", "sub", "mul", "div", "min", "max"])
def test_scatter_family_matches_numpy(op):
    start = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], np.float32)
    v = dv.Variable(start)
    indices = np.array([2, 0, 2])
    values = np.array([[2.0, 3.0], [4.0, 5.0], [0.5, 8.0]], np.float32)
    out = getattr(v, f"scatter_{op}")(dv.IndexedSlices(values, indices))
    assert out is v
    want = start.astype(np.float64)
    for i, row in zip(indices, values.astype(np.float64)):
        # Repeated rows compose one update after another (update: the last one wins).
        want[i] = {
            "update": row,
            "add": want[i] + row,
            "sub": want[i] - row,
            "mul": want[i] * row,
            "div": want[i] / row,
            "min": np.minimum(want[i], row),
            "max": np.maximum(want[i], row),
        }[op]
    np.testing.assert_allclose(v.numpy(), want, rtol=1e-6)
    assert v.dtype == np.float32


def test_scatter_div_of_integers_truncates_toward_zero():
    v = dv.Variable(np.array([7, -7, 9, 100], np.int32))
    v.scatter_div(dv.IndexedSlices(np.array([2, 2, 4, 3], np.int32), np.array([0, 1, 2, 3])))
    np.testing.assert_array_equal(v.numpy(), [3, -3, 2, 33])
    with pytest.raises(ValueError, match="division by zero"):
        v.scatter_div(dv.IndexedSlices(np.array([0], np.int32), np.array([0])))
    np.testing.assert_array_equal(v.numpy(), [3, -3, 2, 33])


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])
def test_scatter_div_of_integers_in_the_variables_own_dtype_at_its_extremes(dtype):
    """C's division in the variable's dtype, checked against Python's integers: uint64
    values from 2**63 on and int64's minimum went through int64 (a wrong sign, or an
    overflowed absolute value). Repeated indices divide one after another."""
    info = np.iinfo(dtype)
    lo, hi = int(info.min), int(info.max)
    start = [hi, hi - 1, lo, lo + 1, 7, lo // 2 + 3, hi // 3, 1] if lo else [hi, hi - 1, 7, 1, hi // 3, 0, 5, 2]
    divisors = [2, hi, 3, -2 if lo else 3, -3 if lo else 2, 5, hi, 1]
    index = [0, 1, 2, 3, 4, 5, 6, 7]
    # Index 2 again, then index 0 again: their quotients are divided once more.
    divisors += [-7 if lo else 7, 3]
    index += [2, 0]

    def c_div(a, b):  # truncation toward zero
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q

    want = list(start)
    for i, b in zip(index, divisors):
        want[i] = c_div(want[i], b)
    v = dv.Variable(np.array(start, dtype))
    v.scatter_div(dv.IndexedSlices(np.array(divisors, dtype), np.array(index)))
    assert v.dtype == dtype
    assert [int(x) for x in v.numpy()] == want


@pytest.mark.parametrize("op", ["update", "add", "sub", "min", "max"])
def test_scatter_nd_family_matches_numpy(op):
    start = np.arange(12, dtype=np.float64).reshape(3, 4)
    v = dv.Variable(start)
    indices = np.array([[0, 1], [2, 3], [0, 1]])
    updates = np.array([10.0, -5.0, 2.0])
    assert getattr(v, f"scatter_nd_{op}")(indices, updates) is v
    want = start.copy()
    for (i, j), u in zip(indices, updates):
        want[i, j] = {
            "update": u,
            "add": want[i, j] + u,
            "sub": want[i, j] - u,
            "min": min(want[i, j], u),
            "max": max(want[i, j], u),
        }[op]
    np.testing.assert_array_equal(v.numpy(), want)
    # Whole rows, addressed by the first axis only.
    v.scatter_nd_update(np.array([[1]]), np.full((1, 4), -1.0))
    np.testing.assert_array_equal(v.numpy()[1], [-1.0] * 4)


def test_sparse_read_and_gather_nd():
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    v = dv.Variable(a)
    np.testing.assert_array_equal(v.sparse_read([3, 0, 3]), a[[3, 0, 3]])
    np.testing.assert_array_equal(v.gather_nd([[1, 2], [3, 0]]), [a[1, 2], a[3, 0]])
    np.testing.assert_array_equal(v.gather_nd([[2]]), a[[2]])
    with pytest.raises(ValueError, match=r"index 4 is out of range for shape \(4,\)"):
        v.sparse_read([4])
    with pytest.raises(dv.errors.InvalidArgumentError, match=r"index \[0, 3\] is out of range for shape \(4, 3\)"):
        v.gather_nd([[0, 3]])


def test_scatter_argument_errors():
    v = dv.Variable(np.zeros((3, 2), np.float32))
    with pytest.raises(TypeError, match="sparse_delta must be an IndexedSlices"):
        v.scatter_add(([0], [[1.0, 1.0]]))
    with pytest.raises(TypeError, match="indices must be integers, got float64"):
        v.scatter_add(dv.IndexedSlices(np.ones((1, 2)), np.array([0.5])))
    with pytest.raises(ValueError, match=r"values have shape \(1, 3\), 1 rows of the variable need \(1, 2\)"):
        v.scatter_add(dv.IndexedSlices(np.ones((1, 3)), np.array([0])))
    with pytest.raises(ValueError, match="index -1 is out of range"):
        v.scatter_add(dv.IndexedSlices(np.ones((1, 2)), np.array([-1])))
    with pytest.raises(TypeError, match="cannot use a float64 value"):
        dv.Variable(np.zeros(3, np.int32)).scatter_add(dv.IndexedSlices(np.ones(1), np.array([0])))
    with pytest.raises(ValueError, match="cannot address a variable of shape"):
        v.scatter_nd_add(np.array([[0, 0, 0]]), np.ones(1))
    with pytest.raises(ValueError, match="a scalar variable has no rows"):
        dv.Variable(1.0).scatter_add(dv.IndexedSlices(np.ones(1), np.array([0])))
    np.testing.assert_array_equal(v.numpy(), np.zeros((3, 2)))  # no failed call changed it


def test_tensorflow_style_indexed_slices_are_accepted():
    class Slices:  # what tf.IndexedSlices offers
        def __init__(self, values, indices):
            self.values, self.indices, self.dense_shape = values, indices, None

    v = dv.Variable(np.zeros(3))
    v.scatter_add(Slices(np.array([1.0, 2.0]), np.array([0, 2])))
    np.testing.assert_array_equal(v.numpy(), [1.0, 0.0, 2.0])
    assert "indices=" in repr(dv.IndexedSlices(np.ones(1), np.zeros(1, int)))


def test_count_up_to():
    v = dv.Variable(3)
    assert v.count_up_to(5) == 3 and v.count_up_to(5) == 4
    with pytest.raises(dv.errors.OutOfRangeError, match="reached limit of 5"):
        v.count_up_to(5)
    assert v.numpy() == 5
    with pytest.raises(TypeError, match="needs an int32 or int64 variable"):
        dv.Variable(1.0).count_up_to(3)


# ---- the same rules as assign on distributed variables -------------------------------------------------------


def test_cross_replica_scatter_updates_every_copy(s3):
    with s3.scope():
        v = dv.Variable(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    v.scatter_add(slices([10.0, 20.0], [0, 2]))
    v.scatter_sub(slices([1.0], [3]))
    v.scatter_nd_max(np.array([[1]]), np.array([50.0], np.float32))
    for c in copies(v):
        np.testing.assert_array_equal(c, [11.0, 50.0, 23.0, 3.0])
    np.testing.assert_array_equal(v.sparse_read([2]), [23.0])
    np.testing.assert_array_equal(v.gather_nd([[0], [1]]), [11.0, 50.0])


@pytest.mark.parametrize(
    "agg,want",
    [
        ("NONE", None),
        ("SUM", [1.0 + 10 + 20 + 30, 2.0, 3.0 + 20 + 40 + 60, 4.0]),
        ("MEAN", [1.0 + 20, 2.0, 3.0 + 40, 4.0]),
        ("ONLY_FIRST_REPLICA", [11.0, 2.0, 23.0, 4.0]),
    ],
)
def test_replica_scatter_follows_the_aggregation(s3, agg, want):
    # TensorFlow concatenates the replicas' IndexedSlices (MEAN scales them by 1/N).
    with s3.scope():
        v = dv.Variable(np.array([1.0, 2.0, 3.0, 4.0], np.float32), aggregation=agg)

    def fn():
        r = rid()
        out = v.scatter_add(slices(np.array([10.0, 20.0]) * (r + 1), [0, 2]))
        assert out is v
        return v.read_value()

    seen = s3.run(fn)
    if want is None:  # NONE: each replica's own copy
        for r, c in enumerate(copies(v)):
            np.testing.assert_array_equal(c, [1.0 + 10 * (r + 1), 2.0, 3.0 + 20 * (r + 1), 4.0])
    else:
        for c, s in zip(copies(v), seen.values):
            np.testing.assert_allclose(c, want, rtol=1e-6)
            np.testing.assert_allclose(s, want, rtol=1e-6)


def test_replica_scatter_nd_sum_gathers_every_replica(s2):
    with s2.scope():
        v = dv.Variable(np.zeros((2, 2), np.float32), aggregation=SUM)
    s2.run(lambda: v.scatter_nd_add(np.array([[rid(), rid()]]), np.array([rid() + 1.0], np.float32)))
    for c in copies(v):
        np.testing.assert_array_equal(c, [[1.0, 0.0], [0.0, 2.0]])


def test_replica_scatter_sum_of_one_object_is_refused(s2):
    with s2.scope():
        v = dv.Variable(np.zeros(2, np.float32), aggregation=SUM)
    shared = slices([1.0], [0])
    with pytest.raises(
        ValueError,
        match=r"SUM update \(scatter_add\) of variable 'Variable:0' got the same plain "
        "value on every replica",
    ):
        s2.run(lambda: v.scatter_add(shared))
    assert [c.tolist() for c in copies(v)] == [[0.0, 0.0]] * 2
    with s2.scope():
        m = dv.Variable(np.zeros(2, np.float32), aggregation=MEAN)
    s2.run(lambda: m.scatter_add(shared))  # the mean of one value is that value
    assert [c.tolist() for c in copies(m)] == [[1.0, 0.0]] * 2


def test_replica_scatter_error_in_one_replica_changes_no_copy(s2):
    with s2.scope():
        v = dv.Variable(np.zeros(3, np.float32), aggregation=SUM)

    def fn():
        return v.scatter_add(slices([1.0], [7 if rid() == 1 else 0]))

    with pytest.raises(ValueError, match=r"^replica 1: scatter_add of variable 'Variable:0': index 7 is out of range"):
        s2.run(fn)
    assert [c.tolist() for c in copies(v)] == [[0.0, 0.0, 0.0]] * 2
    s2.run(lambda: v.scatter_add(slices([1.0], [rid()])))  # and the strategy still works
    assert [c.tolist() for c in copies(v)] == [[1.0, 1.0, 0.0]] * 2


def test_sync_on_read_scatter(s2):
    with s2.scope():
        v = dv.Variable(np.zeros(3, np.float32), synchronization=ON_READ, aggregation=SUM)
    s2.run(lambda: v.scatter_add(slices([rid() + 1.0], [rid()])))
    assert [c.tolist() for c in copies(v)] == [[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]  # local copies only
    np.testing.assert_array_equal(v.read_value(), [1.0, 2.0, 0.0])
    # TensorFlow: "Variables with synchronization=ON_READ doesn't support scatter_add".
    with pytest.raises(NotImplementedError, match="does not support scatter_add in cross-replica context"):
        v.scatter_add(slices([1.0], [0]))


def test_count_up_to_on_distributed_variables(s2):
    with s2.scope():
        steps = dv.Variable(0, aggregation=FIRST)
        local = dv.Variable(0, synchronization=ON_READ, aggregation=SUM)
    assert steps.count_up_to(2) == 0
    assert copies(steps) == [1, 1]
    out = s2.run(lambda: steps.count_up_to(2))
    assert int(out.values[0]) == 1 and copies(steps) == [2, 2]
    with pytest.raises(dv.errors.OutOfRangeError, match="reached limit of 2"):
        s2.run(lambda: steps.count_up_to(2))
    assert copies(steps) == [2, 2]
    s2.run(lambda: local.count_up_to(10))
    assert copies(local) == [1, 1] and local.numpy() == 2
    with pytest.raises(ValueError, match="does not support count_up_to in cross-replica context"):
        local.count_up_to(10)


def test_extended_update_inside_run_meets_in_merge_call(s3):
    # TensorFlow: extended.update in replica context goes through merge_call, so every
    # copy is updated once, with its own replica's argument.
    with s3.scope():
        v = dv.Variable(np.zeros(2, np.float32))
    calls = []

    def update(copy, delta):
        calls.append(copy)
        return copy.assign_add(delta)

    out = s3.run(lambda: s3.extended.update(v, update, args=(np.full(2, rid() + 1.0, np.float32),)))
    assert len(calls) == 3 and all(a is b for a, b in zip(calls, v.values))
    assert [c.tolist() for c in copies(v)] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert isinstance(out, dv.PerReplica) and all(o is c for o, c in zip(out.values, v.values))
    with s3.extended.colocate_vars_with(v):
        pass


@pytest.mark.parametrize("aggregation", ["SUM", "MEAN"])
@pytest.mark.parametrize("kind", ["scatter_update", "scatter_min", "scatter_max"])
def test_one_writer_scatter_updates_of_summed_or_averaged_variables_are_refused(s3, aggregation, kind):
    # A row that one replica overwrites (or keeps the least or greatest of) has no sum or
    # mean across replicas: refused before anything changes, in run and outside it, as
    # TensorFlow refuses them; ONLY_FIRST_REPLICA applies replica 0's.
    with s3.scope():
        v = dv.Variable(np.zeros((4, 2)), aggregation=getattr(dv.VariableAggregation, aggregation))
        first = dv.Variable(np.zeros((4, 2)), aggregation=dv.VariableAggregation.ONLY_FIRST_REPLICA)

    def delta():
        r = dv.get_replica_context().replica_id_in_sync_group
        return dv.IndexedSlices(np.full((1, 2), 5.0 + r), np.array([1]))

    with pytest.raises(NotImplementedError, match=f"{kind} of variable .* {aggregation} aggregation"):
        s3.run(lambda: getattr(v, kind)(delta()))
    with pytest.raises(NotImplementedError, match=kind):
        getattr(v, kind)(dv.IndexedSlices(np.full((1, 2), 5.0), np.array([1])))
    for copy in v.values:
        np.testing.assert_array_equal(copy.numpy(), np.zeros((4, 2)))
    s3.run(lambda: getattr(first, kind)(delta()))
    want = np.zeros((4, 2))
    want[1] = {"scatter_update": 5.0, "scatter_min": 0.0, "scatter_max": 5.0}[kind]
    for copy in first.values:
        np.testing.assert_array_equal(copy.numpy(), want)


def test_a_scalar_variable_or_value_is_not_an_empty_sequence(s2):
    # Iterating a 0-d value raises as numpy does; a vector iterates over its elements.
    # (Python's fallback protocol, __getitem__ until an IndexError, made a scalar an empty
    # sequence: sum(v) == 0, 5.0 in v was False, all(Variable(0.0)) was True.)
    plain = dv.Variable(5.0)
    with s2.scope():
        mirrored = dv.Variable(5.0)
        on_read = dv.Variable(5.0, synchronization=ON_READ, aggregation=dv.VariableAggregation.SUM)
    for v in (plain, mirrored):
        with pytest.raises(TypeError, match="0-d"):
            iter(v)
        with pytest.raises(TypeError):
            sum(v)
    vec = dv.Variable([1.0, 2.0, 4.0])
    assert list(vec) == [1.0, 2.0, 4.0] and 2.0 in vec and sum(vec) == 7.0

    def step():
        g = rid()
        out = []
        for x in (on_read, dv.get_replica_context().all_reduce("SUM", np.float32(g + 1))):
            try:
                iter(x)
            except TypeError:
                out.append("refused")
            else:
                out.append("iterated")
        out.append(list(dv.get_replica_context().all_reduce("SUM", np.array([g, 10.0]))))
        return out

    for got in s2.experimental_local_results(s2.run(step)):
        assert got[:2] == ["refused", "refused"]
        assert got[2] == [1.0, 20.0]
    m = s2.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))

    def iterate_part(x):
        try:
            return list(x), rid()
        except TypeError:
            return "refused", rid()

    assert s2.experimental_local_results(s2.run(iterate_part, args=(m,))) == (("refused", 0), ("refused", 1))


# ---- v[key].assign: writing part of a variable ---------------------------------------------------------


KEYS = [
    (slice(1, 3), None),
    ((0, slice(None, None, 2)), None),
    ((slice(None), -1), None),
    (([2, 0],), None),
    (np.array([[True, False, True], [False, True, False], [True, True, False]]), None),
    ((Ellipsis, slice(1, None)), None),
]


@pytest.mark.parametrize("key", [k for k, _ in KEYS], ids=["rows", "strided", "column", "fancy", "mask", "ellipsis"])
def test_assigning_a_part_of_a_plain_variable_matches_numpy(key):
    start = np.arange(9, dtype=np.float32).reshape(3, 3) * 1.5
    v = dv.Variable(start)
    part = v[key]
    want_part = start[key]
    assert isinstance(part, np.ndarray) and np.array_equal(part, want_part) and not part.flags.writeable
    new = -np.arange(want_part.size, dtype=np.float32).reshape(want_part.shape) - 1
    assert part.assign(new) is v
    want = start.copy()
    want[key] = new
    assert np.array_equal(v.numpy(), want)
    # A scalar broadcasts over the part, as in numpy.
    v[key].assign(7.0)
    want[key] = 7.0
    assert np.array_equal(v.numpy(), want)
    # What was read before is a snapshot: unchanged.
    assert np.array_equal(part, want_part)


def test_arrays_computed_from_a_part_are_plain_and_cannot_write_back():
    v = dv.Variable(np.arange(6.0))
    part = v[1:4]
    for derived in (part * 2, part + part, np.sqrt(part), np.concatenate([part, part]), part.sum(keepdims=True)):
        assert type(derived) is np.ndarray
    assert type(part[0]) is np.float64
    assert type(np.asarray(part)) is np.ndarray
    with pytest.raises(TypeError, match="only the part read by indexing"):
        part.copy().assign([1.0, 2.0, 3.0])
    assert np.array_equal(v.numpy(), np.arange(6.0))
    # A whole-element index gives numpy's scalar, as before.
    assert type(v[2]) is np.float64


def test_a_bad_value_for_a_part_is_refused_and_nothing_changes():
    v = dv.Variable(np.arange(6, dtype=np.int64))
    with pytest.raises(ValueError, match=r"shape \(3,\) does not fit the part's shape \(2,\)"):
        v[1:3].assign([1, 2, 3])
    with pytest.raises(TypeError, match="float64 value for a int64 variable") as err:
        v[1:3].assign([1.5, 2.0])
    assert str(err.value).count("of variable") == 1
    assert np.array_equal(v.numpy(), np.arange(6))


def test_a_part_assigned_in_cross_replica_context_changes_every_copy(s3):
    with s3.scope():
        v = dv.Variable(np.arange(12.0).reshape(3, 4))
        r = dv.Variable(np.zeros(4), synchronization=ON_READ, aggregation=SUM)
    assert v[1:, ::3].assign([[10.0, 11.0], [12.0, 13.0]]) is v
    want = np.arange(12.0).reshape(3, 4)
    want[1:, ::3] = [[10.0, 11.0], [12.0, 13.0]]
    for c in copies(v):
        assert np.array_equal(c, want)
    r[2:].assign([6.0, 9.0])
    assert np.array_equal(r.numpy(), [0.0, 0.0, 6.0, 9.0])


def test_a_part_assigned_inside_run_follows_the_aggregation(s3):
    with s3.scope():
        first = dv.Variable(np.zeros(5), aggregation=FIRST)
        own = dv.Variable(np.zeros(5))
        mean = dv.Variable(np.zeros(5), aggregation=MEAN)

    def step():
        g = rid()
        first[1:3].assign([10.0 + g, 20.0 + g])
        own[g : g + 2].assign(float(g + 1))
        return g

    s3.run(step)
    for c in copies(first):
        assert np.array_equal(c, [0.0, 10.0, 20.0, 0.0, 0.0])
    for g, c in enumerate(copies(own)):
        want = np.zeros(5)
        want[g : g + 2] = g + 1
        assert np.array_equal(c, want)
    with pytest.raises(NotImplementedError, match="MEAN aggregation"):
        s3.run(lambda: mean[0:2].assign(float(rid())))
    for c in copies(mean):
        assert np.array_equal(c, np.zeros(5))
