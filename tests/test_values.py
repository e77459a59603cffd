"""DistributedValues, PerReplica and Mirrored: construction, printing, array behaviour."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import distvals as dv


def test_values_tuple_in_replica_order():
    a, b = np.arange(3.0), np.arange(3.0) + 10
    pr = dv.PerReplica([a, b])
    assert isinstance(pr.values, tuple)
    assert pr.values[0] is a and pr.values[1] is b
    m = dv.Mirrored((a, a.copy()))
    assert m.values[0] is a


def test_isinstance_relations():
    pr = dv.PerReplica((1, 2))
    m = dv.Mirrored((1, 1))
    assert isinstance(pr, dv.DistributedValues)
    assert isinstance(m, dv.DistributedValues)
    assert not isinstance(pr, dv.Mirrored)
    assert not isinstance(m, dv.PerReplica)


def test_base_class_is_not_built_directly():
    with pytest.raises(TypeError, match="base class"):
        dv.DistributedValues((1, 2))


def test_bad_construction():
    with pytest.raises(TypeError, match="list or tuple"):
        dv.PerReplica(np.arange(3))
    with pytest.raises(ValueError, match="at least one"):
        dv.Mirrored(())


def test_repr_is_tensorflow_form():
    pr = dv.PerReplica((np.array([5.0], np.float32), np.array([6.0], np.float32)))
    expected = "PerReplica:{\n  0: array([5.], dtype=float32),\n  1: array([6.], dtype=float32)\n}"
    assert repr(pr) == expected
    m = dv.Mirrored((np.int64(3), np.int64(3)))
    assert repr(m) == f"Mirrored:{{\n  0: {np.int64(3)!r},\n  1: {np.int64(3)!r}\n}}"


def test_str_uses_str_of_parts():
    parts = (np.array([1.5, 2.0]), np.array([3.0, 4.0]))
    pr = dv.PerReplica(parts)
    assert str(pr) == f"PerReplica:{{\n  0: {parts[0]!s},\n  1: {parts[1]!s}\n}}"
    assert str(dv.Mirrored(("a", "a"))) == "Mirrored:{\n  0: a,\n  1: a\n}"
    three = dv.PerReplica((0, 1, 2))
    assert repr(three) == "PerReplica:{\n  0: 0,\n  1: 1,\n  2: 2\n}"


@pytest.mark.parametrize(
    "use",
    [
        lambda v: v + 1,
        lambda v: 1 + v,
        lambda v: v * 2,
        lambda v: -v,
        lambda v: v @ np.ones(2),
        lambda v: v < 1,
        lambda v: np.asarray(v),
        lambda v: np.array(v),
        lambda v: np.add(v, 1),
        lambda v: np.ones(2) + v,
        lambda v: v[0],
        lambda v: float(v),
        lambda v: list(iter(v)),
    ],
)
def test_per_replica_is_not_one_array_outside_run(use):
    pr = dv.PerReplica((np.array([1.0, 2.0]), np.array([3.0, 4.0])))
    with pytest.raises(TypeError, match=r"strategy\.run"):
        use(pr)


def test_per_replica_error_inside_scope_too(s2):
    pr = dv.PerReplica((np.array([1.0]), np.array([2.0])))
    with s2.scope(), pytest.raises(TypeError, match="outside a replica context"):
        pr + 1


def test_per_replica_is_its_part_inside_run(s2):
    parts = (np.array([1.0, 2.0]), np.array([30.0, 40.0]))
    pr = dv.PerReplica(parts)

    def fn():
        # Captured (not passed): inside run it still stands for this replica's part.
        return pr * 2 + 1, np.asarray(pr).copy(), pr[1]

    doubled, arr, second = s2.run(fn)
    for r in range(2):
        np.testing.assert_array_equal(doubled.values[r], parts[r] * 2 + 1)
        np.testing.assert_array_equal(arr.values[r], parts[r])
        assert second.values[r] == parts[r][1]


def test_mirrored_behaves_as_first_part_outside_run():
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    m = dv.Mirrored((a, a.copy()))
    np.testing.assert_array_equal(m + 1, a + 1)
    np.testing.assert_array_equal(2 * m, 2 * a)
    np.testing.assert_array_equal(np.ones(2) + m, np.ones(2) + a)
    np.testing.assert_array_equal(m @ np.ones(2), a @ np.ones(2))
    np.testing.assert_array_equal(np.exp(m), np.exp(a))
    np.testing.assert_array_equal(np.asarray(m), a)
    np.testing.assert_array_equal(m[1], a[1])
    assert m.shape == (2, 2) and m.dtype == np.float32
    assert float(m.sum()) == float(a.sum())
    np.testing.assert_array_equal(m.T, a.T)
    np.testing.assert_array_equal(-m, -a)
    np.testing.assert_array_equal(abs(-m), a)
    np.testing.assert_array_equal(m >= 2, a >= 2)


def test_mirrored_uses_the_replica_part_inside_run(s2):
    # Parts that differ (only a test would do that) show which one each replica sees.
    m = dv.Mirrored((np.array([1.0]), np.array([100.0])))

    def fn():
        return m + 1, m.shape

    plus, shape = s2.run(fn)
    np.testing.assert_array_equal(plus.values[0], [2.0])
    np.testing.assert_array_equal(plus.values[1], [101.0])
    # m.shape delegates to each replica's part; the very same int on every replica comes
    # back as it is, as in TensorFlow.
    assert shape == (1,)


def test_mirrored_scalars_convert():
    m = dv.Mirrored((np.float64(2.5), np.float64(2.5)))
    assert float(m) == 2.5
    assert int(dv.Mirrored((7, 7))) == 7
    assert [10, 20, 30][dv.Mirrored((1, 1))] == 20


def test_identity_equality_and_hash():
    m1 = dv.Mirrored((1, 1))
    m2 = dv.Mirrored((1, 1))
    assert m1 != m2 and m1 == m1
    assert len({m1, m2}) == 2


def test_copy_and_pickle_keep_the_container():
    m = dv.Mirrored((np.arange(3), np.arange(3)))
    c = copy.deepcopy(m)
    assert isinstance(c, dv.Mirrored)
    np.testing.assert_array_equal(c.values[1], np.arange(3))
    p = pickle.loads(pickle.dumps(dv.PerReplica((1, 2))))
    assert isinstance(p, dv.PerReplica) and p.values == (1, 2)


@pytest.mark.parametrize("sync", ["ON_WRITE", "ON_READ"])
def test_a_shallow_copy_of_a_distributed_variable_shares_its_copies(s2, sync):
    # As TensorFlow's copy.copy: the same per-replica copies (their values live in a
    # slot of DistributedValues, which the variable's state must carry too).
    with s2.scope():
        v = dv.Variable(
            np.arange(3.0),
            synchronization=getattr(dv.VariableSynchronization, sync),
            aggregation=dv.VariableAggregation.SUM,
        )
    c = copy.copy(v)
    assert type(c) is type(v) and c.values == v.values
    c.assign(np.full(3, 2.0))  # (ON_READ SUM: half in each copy)
    assert np.asarray(v).tolist() == np.asarray(c).tolist() == [2.0] * 3


def test_copy_of_a_variable_is_the_variable_and_a_deep_copy_is_its_own():
    # As TensorFlow: a shallow copy that an update would leave behind is never wanted.
    v = dv.Variable(np.arange(3.0), name="plain")
    assert copy.copy(v) is v
    d = copy.deepcopy(v)
    assert d is not v and d.name == v.name and d.dtype == v.dtype
    v.assign_add(np.ones(3))
    d.assign(np.full(3, 7.0))
    assert np.asarray(v).tolist() == [1.0, 2.0, 3.0] and np.asarray(d).tolist() == [7.0] * 3


def test_mirrored_missing_attribute():
    m = dv.Mirrored((np.arange(3), np.arange(3)))
    with pytest.raises(AttributeError):
        _ = m.no_such_attribute
