"""TensorFlow's behaviour (2.21, eager, CPU) where a ported tf.distribute program would
notice a difference: each test states what TensorFlow does and checks distvals does
the same, in both execution modes."""

from __future__ import annotations

import numpy as np
import pytest

import distvals as dv

SUM = dv.VariableAggregation.SUM
MEAN = dv.VariableAggregation.MEAN
ON_READ = dv.VariableSynchronization.ON_READ


def rid():
    return dv.get_replica_context().replica_id_in_sync_group


# ---- identical objects come back as they are -----------------------------------------------------


def test_identical_objects_are_returned_as_they_are(s2):
    # TensorFlow: run(lambda: 2.5) is 2.5, and any object every replica returns is that object.
    assert s2.run(lambda: 2.5) == 2.5 and type(s2.run(lambda: 2.5)) is float
    assert s2.run(lambda: dv.get_replica_context().num_replicas_in_sync) == 2
    assert s2.run(lambda: dv.get_replica_context().strategy is s2) is True
    assert s2.run(lambda: "text") == "text"
    shared = np.arange(3.0)
    assert s2.run(lambda: shared) is shared
    out = s2.run(lambda: {"same": shared, "mine": np.float32(rid())})
    assert out["same"] is shared and isinstance(out["mine"], dv.PerReplica)


def test_distinct_objects_make_a_per_replica(s3):
    ids = s3.run(lambda: rid())
    assert isinstance(ids, dv.PerReplica) and ids.values == (0, 1, 2)
    # Equal but distinct arrays are per-replica values too.
    arrays = s3.run(lambda: np.zeros(2))
    assert isinstance(arrays, dv.PerReplica) and len({id(a) for a in arrays.values}) == 3


# ---- experimental_set_strategy --------------------------------------------------------------------


def test_experimental_set_strategy_is_a_plain_function(s2):
    try:
        assert dv.experimental_set_strategy(s2) is None
        assert dv.get_strategy() is s2 and dv.has_strategy()
        assert dv.get_replica_context() is None  # cross-replica context, as in the scope
        with dv.get_strategy().scope(), s2.scope():
            v = dv.Variable(1.0)
        assert isinstance(v, dv.MirroredVariable)
    finally:
        assert dv.experimental_set_strategy(None) is None
    assert not dv.has_strategy() and dv.get_strategy() is not s2


# ---- value_container -------------------------------------------------------------------------------


def test_value_container_of_every_component(s3):
    with s3.scope():
        m = dv.Variable(np.zeros(2))
        r = dv.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
    for v in (m, r):
        assert all(s3.extended.value_container(c) is v for c in v.values)
        assert s3.extended.value_container(v) is v
    plain = np.zeros(2)
    assert s3.extended.value_container(plain) is plain


# ---- experimental_distribute_values_from_function ---------------------------------------------------


def test_distribute_values_from_function_always_gives_a_per_replica(s2):
    same = object()
    out = s2.experimental_distribute_values_from_function(lambda ctx: same)
    assert isinstance(out, dv.PerReplica) and out.values == (same, same)
    one = dv.MirroredStrategy(["CPU:0"])
    try:
        single = one.experimental_distribute_values_from_function(lambda ctx: 7)
        assert isinstance(single, dv.PerReplica) and single.values == (7,)
        nested = one.experimental_distribute_values_from_function(lambda ctx: {"a": ctx.replica_id_in_sync_group})
        assert isinstance(nested["a"], dv.PerReplica) and nested["a"].values == (0,)
    finally:
        one.close()


def test_distribute_values_from_function_on_one_device_gives_the_plain_value():
    # As in TensorFlow: OneDeviceStrategy and the default strategy do not wrap the value.
    one = dv.OneDeviceStrategy("CPU:0")
    try:
        value = np.arange(3.0)
        out = one.experimental_distribute_values_from_function(lambda ctx: value + ctx.replica_id_in_sync_group)
        assert isinstance(out, np.ndarray) and out.tolist() == [0.0, 1.0, 2.0]
    finally:
        one.close()
    default = dv.get_strategy().experimental_distribute_values_from_function(
        lambda ctx: {"n": ctx.num_replicas_in_sync}
    )
    assert default == {"n": 1}


# ---- strict dtypes ---------------------------------------------------------------------------------------


def test_values_that_do_not_convert_exactly_are_type_errors(s2):
    with s2.scope():
        i = dv.Variable(1)
        f = dv.Variable(1.0)
    # TensorFlow: "Cannot convert 2.5 to EagerTensor of dtype int32" (for 2.0 too).
    with pytest.raises(TypeError, match="cannot convert a Python float to int32"):
        i.assign(2.5)
    with pytest.raises(TypeError, match="cannot convert a Python float to int32"):
        i.assign_add(2.0)
    with pytest.raises(TypeError, match="cannot use a float32 value for a int32 variable"):
        i.assign_add(np.float32(2.5))
    with pytest.raises(TypeError, match="1099511627776 does not fit in int32"):
        i.assign(2**40)
    with pytest.raises(TypeError, match="does not fit in int32"):
        i.assign(np.array(-(2**33), np.int64))
    with pytest.raises(TypeError, match="cannot convert a Python complex"):
        f.assign(1j)
    assert [c.numpy() for c in i.values] == [1, 1]  # nothing was written
    # What converts exactly is taken: ints into floats, in-range int64 into int32.
    i.assign(np.int64(5))
    f.assign(3)
    f.assign_add(np.float64(0.5))
    assert [c.numpy() for c in i.values] == [5, 5] and [c.numpy() for c in f.values] == [3.5, 3.5]
    assert all(c.dtype == np.int32 for c in i.values) and all(c.dtype == np.float32 for c in f.values)


def test_strict_dtypes_inside_run(s2):
    with s2.scope():
        i = dv.Variable(0, aggregation=SUM)
    with pytest.raises(TypeError, match=r"^replica \d: assign_add of variable 'Variable:0': cannot use a float64"):
        s2.run(lambda: i.assign_add(np.float64(rid() + 0.5)))
    s2.run(lambda: i.assign_add(np.int32(rid() + 1)))
    assert [c.numpy() for c in i.values] == [3, 3]


# ---- synchronization ---------------------------------------------------------------------------------------


def test_mirrored_variable_reports_on_write(s2):
    with s2.scope():
        auto = dv.Variable(1.0)
        on_read = dv.Variable(1.0, synchronization=ON_READ)
    assert auto.synchronization is dv.VariableSynchronization.ON_WRITE
    assert all(c.synchronization is dv.VariableSynchronization.ON_WRITE for c in auto.values)
    assert on_read.synchronization is ON_READ
    assert on_read.trainable is False and auto.trainable is True  # TensorFlow's defaults
    # Outside a strategy, AUTO stays AUTO.
    assert dv.Variable(1.0).synchronization is dv.VariableSynchronization.AUTO


# ---- equality, hashing, ref ---------------------------------------------------------------------------------


def test_variables_compare_element_wise_and_are_unhashable(s2):
    with s2.scope():
        v = dv.Variable([1.0, 2.0, 3.0])
    plain = dv.Variable([1.0, 2.0])
    eq = v == np.array([1.0, 0.0, 3.0])
    assert isinstance(eq, np.ndarray) and eq.tolist() == [True, False, True]
    assert (v != [1.0, 0.0, 3.0]).tolist() == [False, True, False]
    assert (plain == plain).tolist() == [True, True]
    assert (v == 2.0).tolist() == [False, True, False]
    # Shapes that do not broadcast compare unequal, as TensorFlow's incompatible_shape_error=False.
    assert (v == np.zeros(2)) is np.False_ and (v != np.zeros(2)) is np.True_
    with pytest.raises(ValueError, match="compare a variable with None"):
        v == None  # noqa: E711, B015 - the comparison is the point
    for x in (v, plain, v.values[0]):
        with pytest.raises(TypeError, match=r"Variable is unhashable .*use variable.ref\(\) as the key"):
            hash(x)
        with pytest.raises(TypeError):
            {x: 1}  # noqa: B018
    table = {v.ref(): "mirrored", plain.ref(): "plain"}
    assert table[v.ref()] == "mirrored" and v.ref().deref() is v and v.experimental_ref().deref() is v
    assert v.ref() == v.ref() and v.ref() != plain.ref() and len({v.ref(), v.ref(), plain.ref()}) == 2
    # Distributed values other than variables keep identity equality and hashing.
    pr = s2.run(lambda: np.float32(rid()))
    assert {pr: 1}[pr] == 1 and pr == pr and pr != s2.run(lambda: np.float32(rid()))


def test_bool_of_a_variable_is_its_value():
    assert not dv.Variable(0.0) and dv.Variable(2) and bool(dv.Variable([True]))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(dv.Variable([1.0, 2.0]))


# ---- scopes exited out of order ---------------------------------------------------------------------------------


def test_scopes_exited_out_of_order(s2):
    a, b = s2.scope(), s2.scope()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # no error; the strategy is no longer current (as TensorFlow)
    assert not dv.has_strategy()
    b.__exit__(None, None, None)
    assert not dv.has_strategy() and dv.get_replica_context() is not None
    # In order, nested scopes of one strategy keep it current until the outer one ends.
    with s2.scope():
        with s2.scope():
            assert dv.get_strategy() is s2
        assert dv.get_strategy() is s2
    assert not dv.has_strategy()
    # A scope object may be entered again.
    scope = s2.scope()
    with scope:
        with scope:
            assert dv.has_strategy()
        assert dv.has_strategy()
    assert not dv.has_strategy()


# ---- variables created inside run ------------------------------------------------------------------------------


@pytest.mark.parametrize("in_scope", [True, False])
def test_variable_created_inside_run_is_one_object(s3, in_scope):
    import contextlib

    made = []

    def fn():
        v = dv.Variable(np.full(2, rid() + 1.0, np.float32), name="made")
        made.append(v)
        v.assign_add(np.ones(2, np.float32))  # aggregation NONE: the replica's own copy
        return v

    with s3.scope() if in_scope else contextlib.nullcontext():
        out = s3.run(fn)
    assert isinstance(out, dv.MirroredVariable) and all(m is out for m in made) and len(made) == 3
    # Created from the first replica's value; each copy then got its replica's update.
    assert [c.numpy().tolist() for c in out.values] == [[2.0, 2.0]] * 3
    assert out.name == "made:0" and out.synchronization is dv.VariableSynchronization.ON_WRITE
    np.testing.assert_array_equal(out.initial_value, [1.0, 1.0])
    assert s3.extended.variable_created_in_scope(out)


def test_sync_on_read_variable_created_inside_run(s2):
    def fn():
        v = dv.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
        v.assign_add(np.float32(rid() + 1))
        return v

    v = s2.run(fn)
    assert isinstance(v, dv.SyncOnReadVariable) and v.numpy() == 3.0


def test_variable_created_inside_one_replica_run():
    s = dv.MirroredStrategy(["CPU:0"])
    try:
        v = s.run(lambda: dv.Variable(4.0))
        assert isinstance(v, dv.MirroredVariable) and len(v.values) == 1 and v.numpy() == 4.0
    finally:
        s.close()


def test_variables_created_in_different_orders_are_a_mismatch(s2):
    def fn():
        if rid() == 0:
            return dv.Variable(1.0)
        return dv.get_replica_context().all_reduce("SUM", np.float32(1))

    with pytest.raises(dv.MismatchError):
        s2.run(fn)
    assert s2.run(lambda: 5) == 5


# ---- MirroredStrategy() without devices ------------------------------------------------------------------------


@pytest.mark.skipif(dv.cuda.logical_device_count() > 0, reason="with a GPU, MirroredStrategy() uses the GPUs")
def test_mirrored_strategy_without_devices_uses_the_logical_cpus():
    before = dv.config.get_logical_cpus()
    try:
        s = dv.MirroredStrategy()
        assert s.num_replicas_in_sync == 1
        s.close()
        dv.config.set_logical_cpus(3)
        s = dv.MirroredStrategy()
        assert s.extended.worker_devices == tuple(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(3))
        out = s.run(lambda: dv.get_replica_context().all_reduce("SUM", np.float32(rid())))
        assert out.values == (3.0, 3.0, 3.0)
        s.close()
        with pytest.raises(ValueError, match="n >= 1"):
            dv.config.set_logical_cpus(0)
        with pytest.raises(TypeError, match="needs an int"):
            dv.config.set_logical_cpus(2.0)
    finally:
        dv.config.set_logical_cpus(before)


# ---- mismatch messages name what differs ----------------------------------------------------------------------


def test_all_reduce_mismatches_name_shapes_dtypes_and_structures(s2):
    def shapes():
        return dv.get_replica_context().all_reduce("SUM", np.zeros(3 + rid()))

    with pytest.raises(dv.MismatchError, match=r"replica 0 passed shape \(3,\), replica 1 passed shape \(4,\)"):
        s2.run(shapes)

    def dtypes():
        return dv.get_replica_context().all_reduce("SUM", np.zeros(3, [np.float32, np.float64][rid()]))

    with pytest.raises(dv.MismatchError, match="replica 0 passed dtype float32, replica 1 passed dtype float64"):
        s2.run(dtypes)

    def structures():
        value = {"w": np.zeros(2)} if rid() == 0 else {"w": np.zeros(2), "b": np.zeros(1)}
        return dv.get_replica_context().all_reduce("SUM", value)

    with pytest.raises(dv.MismatchError, match="replica 0 and replica 1 passed different structures"):
        s2.run(structures)

    def nested_shapes():
        return dv.get_replica_context().all_reduce("SUM", {"w": np.zeros(2), "b": np.zeros(1 + rid())})

    with pytest.raises(dv.MismatchError, match=r"replica 0 passed shape \(1,\), replica 1 passed shape \(2,\) at "):
        s2.run(nested_shapes)
    # A mismatch is not "replicas called different collectives", and the strategy still works.
    out = s2.run(lambda: dv.get_replica_context().all_reduce("SUM", np.float32(rid())))
    assert out.values == (1.0, 1.0)
