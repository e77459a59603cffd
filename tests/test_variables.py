"""Variables: plain, MirroredVariable and SyncOnReadVariable, with TensorFlow's numbers;
saving and restoring them."""

from __future__ import annotations

import os

import numpy as np
import pytest
from strategy_checks import engine_all_reduces

import distvals as dv

SUM = dv.VariableAggregation.SUM
MEAN = dv.VariableAggregation.MEAN
FIRST = dv.VariableAggregation.ONLY_FIRST_REPLICA
ON_READ = dv.VariableSynchronization.ON_READ


def rid():
    return dv.get_replica_context().replica_id_in_sync_group


def copies(v):
    return [c.numpy() for c in v.values]


# ---- creation -----------------------------------------------------------------------------


def test_plain_variable_outside_any_scope():
    v = dv.Variable([1.0, 2.0], name="w")
    assert type(v) is dv.Variable and not isinstance(v, dv.DistributedValues)
    assert v.dtype == np.float32 and v.shape == (2,) and v.name == "w:0" and v.trainable
    assert v.synchronization is dv.VariableSynchronization.AUTO and v.aggregation is dv.VariableAggregation.NONE
    assert repr(v) == "<Variable 'w:0' shape=(2,) dtype=float32, numpy=array([1., 2.], dtype=float32)>"
    assert dv.Variable(3).dtype == np.int32
    assert dv.Variable(3, dtype=np.float64).dtype == np.float64
    assert dv.Variable(lambda: np.zeros((2, 3))).shape == (2, 3)
    assert dv.Variable(1.0, trainable=False).trainable is False


def test_under_scope_gives_mirrored_and_sync_on_read(s3):
    calls = []

    def init():
        calls.append(1)
        return np.arange(4.0)

    with s3.scope():
        m = dv.Variable(init, name="m")
        auto = dv.Variable(1.0, synchronization="ON_WRITE")
        r = dv.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
    assert len(calls) == 1  # the initial value is computed once, then copied
    assert isinstance(m, dv.MirroredVariable) and isinstance(m, dv.Mirrored) and isinstance(m, dv.Variable)
    assert isinstance(auto, dv.MirroredVariable)
    assert isinstance(r, dv.SyncOnReadVariable) and not isinstance(r, dv.Mirrored)
    assert len(m.values) == 3
    assert [c.device for c in m.values] == list(s3.extended.worker_devices)
    assert [c.name for c in m.values] == ["m:0", "m/replica_1:0", "m/replica_2:0"]
    for c in copies(m):
        np.testing.assert_array_equal(c, np.arange(4.0))
    # Each copy has its own memory.
    assert not np.shares_memory(m.values[0].value(), m.values[1].value())
    assert repr(m).startswith("MirroredVariable:{\n  0: <Variable 'm:0' shape=(4,) dtype=float64")


def test_one_device_strategy_gives_plain_variables():
    s = dv.OneDeviceStrategy("CPU:0")
    try:
        with s.scope():
            v = dv.Variable(1.0)
        assert type(v) is dv.Variable
    finally:
        s.close()


def test_creation_errors(s2):
    with s2.scope():
        with pytest.raises(ValueError, match="aggregation MEAN needs a floating dtype, got int32"):
            dv.Variable(1, aggregation=MEAN)
        with pytest.raises(ValueError, match="synchronization NONE is not supported under a distribution strategy"):
            dv.Variable(1.0, synchronization=dv.VariableSynchronization.NONE)
        with pytest.raises(ValueError, match="aggregation must be one of"):
            dv.Variable(1.0, aggregation="median")
    # Outside a strategy, synchronization NONE is fine.
    assert dv.Variable(1.0, synchronization="NONE").synchronization is dv.VariableSynchronization.NONE


# ---- reading ------------------------------------------------------------------------------


def test_reading_a_mirrored_variable(s2):
    with s2.scope():
        v = dv.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), name="v")
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    np.testing.assert_array_equal(v.value(), a)
    np.testing.assert_array_equal(v.read_value(), a)
    np.testing.assert_array_equal(np.asarray(v), a)
    assert isinstance(v.numpy(), np.ndarray) and v.numpy().flags.writeable
    assert v.shape == (2, 2) and v.dtype == np.float32 and v.name == "v:0"
    np.testing.assert_array_equal(v + 1, a + 1)
    np.testing.assert_array_equal(2 * v, 2 * a)
    np.testing.assert_array_equal(v @ np.ones(2, np.float32), a @ np.ones(2))
    np.testing.assert_array_equal(np.ones(2) - v, np.ones(2) - a)
    np.testing.assert_array_equal(v[1], a[1])
    # A read value is a snapshot: later updates leave it alone, and it cannot be written.
    snapshot = v.value()
    v.assign(a * 10)
    np.testing.assert_array_equal(snapshot, a)
    with pytest.raises(ValueError):
        snapshot[0, 0] = 5


def test_reading_inside_run_uses_the_replica_copy(s2):
    with s2.scope():
        v = dv.Variable(1.0)
    v.values[1].assign(5.0)  # make the copies differ, to see which one is read
    out = s2.run(lambda: (v + 1, v.numpy(), float(v)))
    assert out[0].values == (2.0, 6.0)
    assert out[1].values == (1.0, 5.0)
    assert out[2].values == (1.0, 5.0)
    assert float(v) == 1.0 and v.numpy() == 1.0  # outside: the first copy


def test_run_returns_the_variable(s2):
    with s2.scope():
        v = dv.Variable(0.0)
    assert s2.run(lambda: v) is v
    assert s2.run(lambda x: x, args=(v,)) is v  # passed whole, not as copies


# ---- MirroredVariable updates ----------------------------------------------------------------


def test_mean_assign_of_replica_ids_gives_half(s2):
    with s2.scope():
        v = dv.Variable(0.0, aggregation=MEAN)
    s2.run(lambda: v.assign(np.float32(rid())))
    assert copies(v) == [0.5, 0.5]


@pytest.mark.parametrize("agg", [SUM, MEAN])
def test_replica_updates_all_reduce_through_the_engine(s3, agg, monkeypatch):
    calls = engine_all_reduces(monkeypatch, s3)
    with s3.scope():
        v = dv.Variable(np.array([10.0, 20.0]), aggregation=agg)
    deltas = [np.array([r + 1.0, 2.0 * r]) for r in range(3)]
    s3.run(lambda: v.assign_add(deltas[rid()]))
    total = np.sum(deltas, axis=0) if agg is SUM else np.mean(deltas, axis=0)
    for c in copies(v):
        np.testing.assert_allclose(c, np.array([10.0, 20.0]) + total)
    assert len(calls) == 1  # one single-call all-reduce for every replica
    s3.run(lambda: v.assign_sub(deltas[rid()], read_value=False))
    for c in copies(v):
        np.testing.assert_allclose(c, [10.0, 20.0], atol=1e-12)


def test_replica_update_without_aggregation_is_local(s2):
    with s2.scope():
        v = dv.Variable(1.0)
    returned = s2.run(lambda: v.assign_add(np.float32(rid() + 1)))
    assert returned is v
    assert copies(v) == [2.0, 3.0]


def test_only_first_replica(s3):
    with s3.scope():
        v = dv.Variable(0.0, aggregation=FIRST)
    s3.run(lambda: v.assign(np.float32(rid() + 7)))
    assert copies(v) == [7.0, 7.0, 7.0]
    s3.run(lambda: v.assign_sub(np.float32(rid() + 1)))
    assert copies(v) == [6.0, 6.0, 6.0]


def test_sum_with_the_same_plain_value_is_an_error(s2):
    with s2.scope():
        v = dv.Variable(1.0, aggregation=SUM)
    with pytest.raises(
        ValueError,
        match=r"^replica \d: a SUM update \(assign_add\) of variable 'Variable:0' got "
        "the same plain value on every replica",
    ):
        s2.run(lambda: v.assign_add(1.0))
    assert copies(v) == [1.0, 1.0]  # untouched
    with s2.scope():
        m = dv.Variable(1.0, aggregation=MEAN)
    s2.run(lambda: m.assign_add(1.0))  # MEAN of the same value is that value
    assert copies(m) == [2.0, 2.0]


def test_sum_of_small_python_ints_computed_by_each_replica_is_summed(s2):
    """Each replica's own count (a Python int: its batch size) is summed, although
    Python keeps one object for each small int, so that the replicas pass the very same
    object (it used to be refused as one value passed by every replica)."""
    with s2.scope():
        seen = dv.Variable(0, aggregation=SUM)
    ds = dv.data.Dataset.from_tensor_slices(np.arange(10.0, dtype=np.float32)).batch(4)
    for batch in s2.experimental_distribute_dataset(ds):
        s2.run(lambda xb: seen.assign_add(xb.shape[0]), args=(batch,))
    assert copies(seen) == [10, 10]
    s2.run(lambda: seen.assign_add(rid() == 0))  # a bool per replica: True + False
    assert copies(seen) == [11, 11]


def test_sum_with_a_per_replica_the_function_captured_uses_each_replicas_part(s3):
    # A PerReplica is not one plain value: captured by the replica function instead of
    # passed as an argument, each replica still contributes its own part.
    with s3.scope():
        v = dv.Variable(np.zeros(2), aggregation=SUM)
    parts = s3.run(lambda: np.array([rid() + 1.0, 10.0 * (rid() + 1)]))
    s3.run(lambda: v.assign_add(parts))
    want = np.sum([[r + 1.0, 10.0 * (r + 1)] for r in range(3)], axis=0)
    for c in v.values:
        np.testing.assert_array_equal(np.asarray(c), want)


@pytest.mark.parametrize("op", ["+=", "-=", "*=", "/=", "//=", "%=", "**=", "@="])
def test_an_in_place_operator_on_a_variable_is_an_error_not_a_rebinding(s2, op):
    # v += x would rebind v to a new array and leave the variable as it was.
    with s2.scope():
        mirrored = dv.Variable(np.ones(2), aggregation=MEAN)
    for v in (dv.Variable(np.ones(2)), mirrored):
        w = v
        with pytest.raises(RuntimeError, match=r"variable .*= value: variable 'Variable:0' would stay as it is") as e:
            exec(f"w {op} np.ones(2)")
        assert f"out = variable {op[:-1]} value" in str(e.value)
        assert w is v and np.asarray(v).tolist() == [1.0, 1.0]


def test_read_value_false_returns_none(s2):
    with s2.scope():
        v = dv.Variable(1.0, aggregation=MEAN)
    assert v.assign(2.0, read_value=False) is None
    assert v.assign_add(1.0) is v
    out = s2.run(lambda: v.assign_sub(np.float32(1.0), read_value=False))
    assert out is None
    assert copies(v) == [2.0, 2.0]


def test_cross_replica_updates_every_copy(s3):
    with s3.scope():
        v = dv.Variable(np.zeros(2), aggregation=SUM)
    v.assign([1.0, 2.0])
    v.assign_add(np.array([1.0, 1.0]))
    v.assign_sub(np.array([0.5, 0.5]))
    for c in copies(v):
        np.testing.assert_array_equal(c, [1.5, 2.5])
    per_replica = dv.PerReplica(tuple(np.array([r, 1.0]) for r in range(3)))
    v.assign(per_replica)  # reduced with the aggregation (SUM) first
    for c in copies(v):
        np.testing.assert_array_equal(c, [3.0, 3.0])
    with s3.scope():
        mean = dv.Variable(np.zeros(2), aggregation=MEAN)
        first = dv.Variable(np.zeros(2), aggregation=FIRST)
        none = dv.Variable(np.zeros(2))
    mean.assign(per_replica)
    first.assign(per_replica)
    np.testing.assert_array_equal(copies(mean)[2], [1.0, 1.0])
    np.testing.assert_array_equal(copies(first)[1], [0.0, 1.0])
    with pytest.raises(ValueError, match="aggregation is NONE"):
        none.assign(per_replica)


def test_update_shape_and_dtype_errors(s2):
    with s2.scope():
        v = dv.Variable(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"value has shape \(2,\), the variable \(3,\)"):
        v.assign(np.zeros(2))
    with pytest.raises(TypeError, match="cannot use a complex128 value for a float32 variable"):
        v.assign(np.zeros(3, complex))
    i = dv.Variable(np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="cannot use a float64 value for a int32 variable"):
        i.assign(np.array([1.5, 2.5]))


def test_masked_arrays_are_refused_by_variables_and_nothing_changes(s2):
    """A masked array's mask would be dropped (the masked-out values stored or added as
    any other): creating, assigning and updating refuse it, in and out of run, and the
    copies keep their values."""
    m = np.ma.array([1.0, 2.0, 3.0], mask=[0, 1, 0])
    masked = "a numpy masked array, whose mask would be dropped"
    with pytest.raises(TypeError, match=f"the initial value of variable 'w': {masked}"):
        dv.Variable(m, name="w")
    with s2.scope():
        mirrored = dv.Variable(np.array([10.0, 20.0, 30.0]), aggregation=SUM)
        on_read = dv.Variable(np.array([1.0, 2.0, 3.0]), synchronization=ON_READ, aggregation=MEAN)
    for v in (mirrored, on_read):
        before = [c.copy() for c in copies(v)]
        for update in (v.assign, v.assign_add, v.assign_sub):
            with pytest.raises(TypeError, match=masked):
                update(m)
            with pytest.raises(TypeError, match=r"replica \d: assign.* of variable .*" + masked):
                s2.run(lambda: update(m * (rid() + 1)))
        for c, b in zip(copies(v), before):
            np.testing.assert_array_equal(c, b)
    # Filled, the same values go in.
    s2.run(lambda: mirrored.assign_add(m.filled(0.0) * (rid() + 1)))
    for c in copies(mirrored):
        np.testing.assert_array_equal(c, [13.0, 20.0, 39.0])


# ---- SyncOnReadVariable --------------------------------------------------------------------


def test_sync_on_read_sum_numbers_of_tensorflow(s2):
    with s2.scope():
        v = dv.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
    s2.run(lambda: v.assign_add(np.float32(1.0)))
    assert copies(v) == [1.0, 1.0]  # local copies only
    assert v.numpy() == 2.0 and float(s2.extended.read_var(v)) == 2.0
    v.assign(6.0)
    assert copies(v) == [3.0, 3.0]
    assert float(v.read_value()) == 6.0 and float(s2.extended.read_var(v)) == 6.0


def test_sync_on_read_aggregations(s3):
    with s3.scope():
        mean = dv.Variable(np.zeros(2), synchronization=ON_READ, aggregation=MEAN)
        first = dv.Variable(np.zeros(2), synchronization=ON_READ, aggregation=FIRST)
        none = dv.Variable(np.zeros(2), synchronization=ON_READ)

    def fn():
        r = rid()
        for v in (mean, first, none):
            v.assign(np.array([r, 10.0 * r]))
        return mean.value()

    local = s3.run(fn)
    np.testing.assert_array_equal(local.values[2], [2.0, 20.0])  # in replica context: the local copy
    np.testing.assert_array_equal(mean.read_value(), [1.0, 10.0])
    np.testing.assert_array_equal(np.asarray(first), [0.0, 0.0])
    with pytest.raises(ValueError, match="aggregation is NONE"):
        none.read_value()
    np.testing.assert_array_equal(none.values[1].numpy(), [1.0, 10.0])
    mean.assign(np.array([4.0, 4.0]))
    np.testing.assert_array_equal(copies(mean)[1], [4.0, 4.0])
    mean.assign_add(np.array([1.0, 1.0]))
    np.testing.assert_array_equal(mean.read_value(), [5.0, 5.0])


def test_sync_on_read_sum_cross_replica_add_is_an_error(s2):
    with s2.scope():
        v = dv.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
    with pytest.raises(ValueError, match="does not support assign_add in cross-replica context"):
        v.assign_add(1.0)


def test_sync_on_read_integer_sum_assign_keeps_the_sum_exactly(s2, s3):
    # TensorFlow stores 7 // N in every copy, so a counter of 7 reads back as 6; here
    # the remainder goes to the first copies and the sum is the assigned value.
    with s3.scope():
        v = dv.Variable(0, synchronization=ON_READ, aggregation=SUM)
    v.assign(7)
    assert copies(v) == [3, 2, 2]
    assert v.numpy() == 7
    with s3.scope():
        a = dv.Variable(np.zeros(4, np.int64), synchronization=ON_READ, aggregation=SUM)
    value = np.array([-7, 0, 5, 2**40 + 1], np.int64)
    a.assign(value)
    np.testing.assert_array_equal(np.sum(copies(a), axis=0), value)
    assert all(np.all(np.abs(c - value / 3) < 1) for c in copies(a))  # balanced: no copy off by more than 1
    with s2.scope():
        u = dv.Variable(np.uint8(0), synchronization=ON_READ, aggregation=SUM)
    u.assign(np.uint8(255))
    assert copies(u) == [128, 127] and u.numpy() == 255


def test_sum_sync_on_read_float_split_sums_back_to_the_value(s3, tmp_path):
    # float16 65504 over 3 copies: 21840 each would sum to 65520, past float16's range.
    with s3.scope():
        h = dv.Variable(np.zeros(4, np.float16), synchronization=ON_READ, aggregation=SUM, name="h")
    value = np.array([65504, 60000, -65504, 0.1], np.float16)
    h.assign(value)
    np.testing.assert_array_equal(h.numpy(), value)
    path = tmp_path / "h.npz"
    dv.save_variables(path, [h])
    h.assign(np.zeros(4, np.float16))
    dv.load_variables(path, [h])
    np.testing.assert_array_equal(h.numpy(), value)
    # inf and NaN stay themselves; float64 thirds sum back to the value.
    h.assign(np.array([np.inf, -np.inf, np.nan, 1], np.float16))
    np.testing.assert_array_equal(h.numpy(), np.array([np.inf, -np.inf, np.nan, 1], np.float16))
    with s3.scope():
        d = dv.Variable(0.0, synchronization=ON_READ, aggregation=SUM)
    d.assign(1.0)
    assert d.numpy() == 1.0 and len(set(copies(d))) <= 2


def _float_dtypes():
    import ml_dtypes

    return [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8])
def test_sum_sync_on_read_float_split_sums_back_exactly_in_every_order(n):
    # value/n on every copy (TensorFlow's split) reads float64 0.3 over 4 copies back as
    # 0.30000000000000004, and float64's largest value as inf.
    import itertools

    from distvals.distributed_variables import _split_sum

    rng = np.random.default_rng(n)
    for dtype in _float_dtypes() + [np.complex64, np.complex128]:
        import ml_dtypes

        real = np.dtype(dtype).kind != "c"
        finfo = ml_dtypes.finfo(dtype) if real else np.finfo(dtype)
        top, tiny, eps = float(finfo.max), float(finfo.smallest_subnormal), float(finfo.eps)
        specials = [0.3, 1.3, 2.1, -7.0, top, -top, tiny, -tiny, 0.0, -0.0, np.inf, -np.inf, np.nan]
        values = np.concatenate([specials, rng.standard_normal(200) * 10.0 ** rng.integers(-3, 4, 200)])
        if real:
            value = values.astype(dtype)
        else:
            value = np.empty(len(values), dtype)
            value.real, value.imag = values, values[::-1]
        parts = _split_sum(value, n)
        assert len(parts) == n and all(p.dtype == value.dtype and p.shape == value.shape for p in parts)
        orders = list(itertools.permutations(range(n))) if n <= 4 else [tuple(rng.permutation(n)) for _ in range(30)]
        for order in orders:
            total = parts[order[0]].copy()
            for r in order[1:]:
                total = (total + parts[r]).astype(value.dtype)  # rounded to the dtype at every step
            # Equal bits: NaN stays NaN and -0.0 stays -0.0.
            np.testing.assert_array_equal(total.view(np.uint8), value.view(np.uint8), err_msg=f"{dtype} {n} {order}")
        # Each copy close to value/n: within n units of the last place of the value.
        finite = np.isfinite(value)
        wide = value[finite].astype(np.float64 if real else np.complex128)
        for p in parts:
            err = np.abs(p[finite].astype(wide.dtype) - wide / n)
            assert np.all(err <= np.abs(wide) * eps * n + tiny * n), (dtype, n)


def test_sum_sync_on_read_float64_reads_back_what_it_was_assigned_and_loaded(tmp_path):
    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    rng = np.random.default_rng(4)
    value = np.concatenate([[0.3, 1.3, 2.1, np.finfo(np.float64).max, -0.0], rng.standard_normal(2000)])
    with s.scope():
        t = dv.Variable(np.zeros(len(value)), name="total", synchronization=ON_READ, aggregation=SUM)
    t.assign(value)
    np.testing.assert_array_equal(t.numpy().view(np.uint64), value.view(np.uint64))
    path = tmp_path / "t.npz"
    dv.save_variables(path, [t])
    t.assign(np.ones(len(value)))
    dv.load_variables(path, [t])
    np.testing.assert_array_equal(t.numpy().view(np.uint64), value.view(np.uint64))
    # Each replica's own copy is about a quarter of the value (as in TensorFlow).
    for c in copies(t):
        np.testing.assert_allclose(c, value / 4, rtol=1e-14, atol=0)


def test_sum_sync_on_read_integer_checkpoint_loads_its_count(s2, s3, tmp_path):
    # A counter of 3 + 4 over 2 replicas is saved as 7 and loads as 7 (TensorFlow: 6);
    # 21 saved from 3 replicas loads as 21 on 2.
    with s2.scope():
        c = dv.Variable(0, synchronization=ON_READ, aggregation=SUM, name="count")
    s2.run(lambda: c.assign_add(np.int32(3 + rid())))
    path = tmp_path / "count.npz"
    dv.save_variables(path, [c])
    c.assign(0)
    dv.load_variables(path, [c])
    assert c.numpy() == 7 and copies(c) == [4, 3]
    with s3.scope():
        c3 = dv.Variable(0, synchronization=ON_READ, aggregation=SUM, name="count")
    s3.run(lambda: c3.assign_add(np.int32(6 + rid())))
    dv.save_variables(path, [c3])
    with s2.scope():
        c2 = dv.Variable(0, synchronization=ON_READ, aggregation=SUM, name="count")
    dv.load_variables(path, [c2])
    assert c2.numpy() == 21 and copies(c2) == [11, 10]


# ---- extended.update and read_var ---------------------------------------------------------------


def test_extended_update_and_read_var(s3):
    with s3.scope():
        v = dv.Variable(np.zeros(2))
    seen = []

    def fn(copy, delta, scale=1.0):
        seen.append(copy)
        return copy.assign_add(delta * scale)

    per_replica = dv.PerReplica(tuple(np.full(2, float(r)) for r in range(3)))
    out = s3.extended.update(v, fn, args=(per_replica,), kwargs={"scale": 2.0})
    assert seen == list(v.values)
    assert isinstance(out, dv.Mirrored) and out.values == v.values
    assert [c.tolist() for c in copies(v)] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
    np.testing.assert_array_equal(s3.extended.read_var(v), [0.0, 0.0])
    grouped = s3.extended.update(v, lambda c: c.assign([1.0, 1.0]), group=False)
    assert isinstance(grouped, tuple) and len(grouped) == 3
    with pytest.raises(TypeError, match="var must be a variable"):
        s3.extended.update(np.zeros(2), fn)
    with pytest.raises(RuntimeError, match="cross-replica"):
        s3.run(lambda: s3.extended.read_var(v))


def test_update_fn_that_updates_variables_updates_their_matching_copy_once(s3):
    """Inside extended.update's function for copy i, the strategy's distributed variables
    (the variable itself, an optimizer's slot, a sync-on-read one) read and update their
    copy i only, once, as in TensorFlow: here every copy starts different, so a copy
    updated with another copy's value, or updated N times, shows."""
    with s3.scope():
        v = dv.Variable(np.zeros(2))
        slot = dv.Variable(np.zeros(2))
        acc = dv.Variable(np.zeros(2), synchronization=ON_READ, aggregation=SUM)
    for i in range(3):
        v.values[i].assign(np.array([10.0 * i, 10.0 * i + 1]))
        slot.values[i].assign(np.array([float(i), -float(i)]))
    start_v, start_slot = [c.copy() for c in copies(v)], [c.copy() for c in copies(slot)]
    grads = dv.PerReplica(tuple(np.array([1.0 + r, 100.0 * (r + 1)]) for r in range(3)))
    reads = []

    def apply(copy, g):
        slot.assign_add(g)  # the container, not the copy: its copy i only
        acc.assign_add(g)
        reads.append((np.array(v.read_value()), np.array(slot.read_value()), np.array(acc.read_value())))
        return v.assign_sub(slot.read_value())  # the container too

    s3.extended.update(v, apply, args=(grads,))
    for i in range(3):
        g = np.array([1.0 + i, 100.0 * (i + 1)])
        want_slot = start_slot[i] + g
        np.testing.assert_array_equal(copies(slot)[i], want_slot)
        np.testing.assert_array_equal(copies(acc)[i], g)
        np.testing.assert_array_equal(copies(v)[i], start_v[i] - want_slot)
        np.testing.assert_array_equal(reads[i][0], start_v[i])
        np.testing.assert_array_equal(reads[i][1], want_slot)
        np.testing.assert_array_equal(reads[i][2], g)
    # Outside the function the variables are cross-replica values again.
    np.testing.assert_array_equal(acc.read_value(), sum(np.array([1.0 + r, 100.0 * (r + 1)]) for r in range(3)))


@pytest.mark.parametrize(
    ("var_dtype", "part_dtype", "parts", "want"),
    [
        (np.int64, np.int32, (2_000_000_000, 2_000_000_001), 4_000_000_001),
        (np.int32, np.int8, (100, 101), 201),
        (np.float32, np.int32, (1, 4), 5.0),
    ],
)
def test_cross_replica_assign_of_per_replica_sums_in_the_variable_dtype(s2, var_dtype, part_dtype, parts, want):
    """A PerReplica assigned in cross-replica context is summed in the variable's dtype,
    as inside run: int32 parts of an int64 variable do not wrap in int32 first."""
    with s2.scope():
        v = dv.Variable(np.zeros((), var_dtype), aggregation=SUM)
    v.assign(dv.PerReplica(tuple(np.array(p, part_dtype) for p in parts)))
    assert [c.item() for c in copies(v)] == [want, want]
    assert all(c.dtype == var_dtype for c in copies(v))


def test_sum_update_with_a_sync_on_read_variable_uses_each_replicas_copy(s2):
    """A sync-on-read variable passed to a SUM update inside run is each replica's own
    copy, not one value on every replica: the copies are summed (TensorFlow: [4, 5])."""
    with s2.scope():
        v = dv.Variable(np.array([1.0, 2.0], np.float32), aggregation=SUM)
        w = dv.Variable(np.zeros(2, np.float32), synchronization=ON_READ, aggregation=SUM)

    def step():
        w.assign(np.full(2, rid() + 1.0, np.float32))
        v.assign_add(w)

    s2.run(step)
    assert [c.tolist() for c in copies(v)] == [[4.0, 5.0], [4.0, 5.0]]


def test_replica_threads_updating_one_plain_variable_lose_no_update():
    """With threads, replicas that update one plain variable at once (a counter, an
    accumulator made outside the scope) lose none of the updates."""
    with dv.MirroredStrategy([f"CPU:{i}" for i in range(4)], execution="threads") as s:
        counter = dv.Variable(np.int64(0))
        acc = dv.Variable(np.zeros(20_000))
        ticks = dv.Variable(np.int32(0))

        def step():
            for _ in range(300):
                counter.assign_add(np.int64(rid() + 1))
            for _ in range(5):
                acc.assign_add(np.full(20_000, float(rid() + 1)))
            for _ in range(25):
                ticks.count_up_to(1_000_000)

        for _ in range(5):
            s.run(step)
    assert counter.numpy() == 5 * 300 * (1 + 2 + 3 + 4)
    np.testing.assert_array_equal(acc.numpy(), np.full(20_000, 5 * 5 * 10.0))
    assert ticks.numpy() == 5 * 25 * 4


@pytest.mark.parametrize("execution", ["inline", "threads"])
def test_threads_updating_one_mirrored_variable_lose_no_update_and_keep_its_copies_equal(execution):
    """Updates of one distributed variable from several Python threads at once (cross-
    replica updates, and steps that update it) are each applied whole to every copy: an
    update landing between another's read and write of the copies was lost on some
    copies and kept on others."""
    import threading

    with dv.MirroredStrategy(["CPU:0", "CPU:1"], execution=execution) as s:
        with s.scope():
            summed = dv.Variable(np.zeros(1000), aggregation=SUM)
            local = dv.Variable(np.zeros(1000))  # aggregation NONE
            counted = dv.Variable(np.zeros(10), aggregation=SUM)
        errors = []

        def cross(k):
            try:
                for _ in range(200):
                    summed.assign_add(np.full(1000, float(k)))
                    local.assign_sub(np.full(1000, float(k)))
                    counted.assign_add(np.full(10, 1.0))
            except BaseException as e:  # reported below
                errors.append(e)

        def steps():
            try:
                for _ in range(100):
                    s.run(lambda: counted.assign_add(np.full(10, rid() + 10.0)))
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=cross, args=(k,)) for k in (1, 2, 3)] + [threading.Thread(target=steps)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for r in range(2):
            np.testing.assert_array_equal(copies(summed)[r], np.full(1000, 200.0 * 6), err_msg=f"copy {r}")
            np.testing.assert_array_equal(copies(local)[r], np.full(1000, -200.0 * 6), err_msg=f"copy {r}")
            # 3 threads x 200 cross-replica adds of 1, and 100 steps adding 10 + 11.
            np.testing.assert_array_equal(copies(counted)[r], np.full(10, 600.0 + 100 * 21.0), err_msg=f"copy {r}")


def test_count_up_to_of_a_sum_mirrored_variable_inside_run_is_refused(s2):
    with s2.scope():
        total = dv.Variable(np.int32(0), aggregation=SUM)
        first = dv.Variable(np.int32(0), aggregation=FIRST)
    with pytest.raises(
        ValueError, match="count_up_to of variable 'Variable:0' inside strategy.run: with aggregation SUM"
    ):
        s2.run(lambda: total.count_up_to(10))
    assert copies(total) == [0, 0]
    olds = s2.experimental_local_results(s2.run(lambda: first.count_up_to(10)))
    assert [int(o) for o in olds] == [0, 0] and copies(first) == [1, 1]
    assert int(total.count_up_to(10)) == 0 and copies(total) == [1, 1]


def test_python_float_initial_value_for_an_integer_variable_is_a_type_error():
    with pytest.raises(TypeError, match="cannot convert a Python float to int32"):
        dv.Variable(2.7, dtype="int32")
    with pytest.raises(TypeError, match="cannot convert a Python float to int32"):
        dv.Variable([1.5, 2.0], dtype="int32")
    assert dv.Variable([1, 2], dtype="float32").numpy().tolist() == [1.0, 2.0]


# ---- save and restore ---------------------------------------------------------------------


def test_save_and_load_round_trip(s2, tmp_path):
    with s2.scope():
        w = dv.Variable(np.arange(4.0, dtype=np.float32), name="w", aggregation=MEAN)
        count = dv.Variable(0.0, name="count", synchronization=ON_READ, aggregation=SUM)
    s2.run(lambda: count.assign_add(np.float32(rid() + 1)))  # copies 1 and 2: reads 3
    path = tmp_path / "ckpt.npz"
    dv.save_variables(path, [w, count])
    with np.load(path) as data:
        assert sorted(data.files) == ["count", "w"]
        assert float(data["count"]) == 3.0  # the aggregated value is stored
        np.testing.assert_array_equal(data["w"], np.arange(4.0))
    w.assign(np.zeros(4, np.float32))
    count.assign(0.0)
    dv.load_variables(path, [w, count])
    for c in copies(w):
        np.testing.assert_array_equal(c, np.arange(4.0))
    assert copies(count) == [1.5, 1.5]  # divided across the replicas, as TF does
    assert count.numpy() == 3.0
    plain = dv.Variable(np.zeros(4, np.float32))
    dv.load_variables(path, {"w": plain})
    np.testing.assert_array_equal(plain.numpy(), np.arange(4.0))


def test_save_and_load_names_that_are_savez_arguments(tmp_path):
    # np.savez(f, **arrays) took these keys for its own "file" and "allow_pickle"
    # arguments: the first failed with a TypeError, the second was silently not saved.
    a = dv.Variable(np.arange(3.0), name="file")
    b = dv.Variable(np.ones(2, np.float32), name="allow_pickle")
    path = tmp_path / "ckpt.npz"
    dv.save_variables(path, [a, b])
    with np.load(path) as data:
        assert sorted(data.files) == ["allow_pickle", "file"]
        np.testing.assert_array_equal(data["file"], np.arange(3.0))
    a.assign(np.zeros(3))
    b.assign(np.zeros(2, np.float32))
    dv.load_variables(path, {"file": a, "allow_pickle": b})
    np.testing.assert_array_equal(a.numpy(), np.arange(3.0))
    np.testing.assert_array_equal(b.numpy(), np.ones(2, np.float32))


def test_save_and_load_keys_that_end_like_member_names(s2, tmp_path):
    # Key k is stored as the member "k.npy": a key "a.npy" (member "a.npy.npy") loaded
    # the value of key "a" (member "a.npy") through numpy's lookup by key.
    with s2.scope():
        a = dv.Variable(np.array([1.0, 2.0], np.float32))
        b = dv.Variable(np.array([10.0, 20.0], np.float32))
        a2 = dv.Variable(np.zeros(2, np.float32))
        b2 = dv.Variable(np.zeros(2, np.float32))
    path = tmp_path / "ckpt.npz"
    dv.save_variables(path, {"a": a, "a.npy": b})
    dv.load_variables(path, {"a.npy": b2, "a": a2})
    for copy in s2.experimental_local_results(b2):
        np.testing.assert_array_equal(np.asarray(copy), [10.0, 20.0])
    for copy in s2.experimental_local_results(a2):
        np.testing.assert_array_equal(np.asarray(copy), [1.0, 2.0])
    with pytest.raises(KeyError, match=r"has no value for 'b' \(it holds: a, a.npy\)"):
        dv.load_variables(path, {"b": b2})


def test_a_checkpoint_gets_the_mode_of_any_new_file(tmp_path):
    # (tempfile.mkstemp's file is readable by its owner only: workers running as other
    # users could not load the chief's checkpoint.)
    old = os.umask(0o027)
    try:
        path = tmp_path / "ckpt.npz"
        dv.save_variables(path, [dv.Variable(np.ones(2), name="v")])
        np.savez(tmp_path / "plain.npz", v=np.ones(2))
        assert (path.stat().st_mode & 0o777) == 0o640 == ((tmp_path / "plain.npz").stat().st_mode & 0o777)
    finally:
        os.umask(old)


def test_a_variable_whose_shape_may_change_loads_a_value_of_another_shape(s2, tmp_path):
    with s2.scope():
        v = dv.Variable(np.arange(2.0), shape=[None])
        w = dv.Variable(np.zeros(2), shape=[None])
    v.assign(np.arange(5.0))
    path = tmp_path / "ckpt.npz"
    dv.save_variables(path, {"v": v})
    dv.load_variables(path, {"v": w})
    for copy in s2.experimental_local_results(w):
        np.testing.assert_array_equal(np.asarray(copy), np.arange(5.0))


def test_save_is_atomic(s2, tmp_path, monkeypatch):
    v = dv.Variable(np.ones(3), name="v")
    path = tmp_path / "ckpt.npz"
    dv.save_variables(path, [v])
    before = path.read_bytes()
    v.assign(np.zeros(3))

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        dv.save_variables(path, [v])
    monkeypatch.undo()
    assert path.read_bytes() == before  # the old checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]  # no temporary left behind


def test_load_checks_everything_first(tmp_path):
    a = dv.Variable(np.ones(2), name="a")
    b = dv.Variable(np.ones(3), name="b")
    path = tmp_path / "c.npz"
    dv.save_variables(path, [a, b])
    a2 = dv.Variable(np.zeros(2), name="a")
    b2 = dv.Variable(np.zeros(4), name="b")
    with pytest.raises(ValueError, match=r"'b' is stored with shape \(3,\), the variable has \(4,\)"):
        dv.load_variables(path, [a2, b2])
    np.testing.assert_array_equal(a2.numpy(), [0.0, 0.0])  # nothing was assigned
    with pytest.raises(KeyError, match="has no value for 'c'"):
        dv.load_variables(path, {"c": a2})
    with pytest.raises(ValueError, match="two variables are named 'a'"):
        dv.save_variables(path, [a, a2])
    f32 = dv.Variable(np.zeros(2, np.float32), name="a")
    with pytest.raises(TypeError, match="stored as float64, the variable is float32"):
        dv.load_variables(path, [f32])


def test_save_inside_run_is_an_error(s2, tmp_path):
    v = dv.Variable(1.0)
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s2.run(lambda: dv.save_variables(tmp_path / "x.npz", [v]))


@pytest.mark.parametrize("execution", ["inline", "threads"])
def test_save_and_load_inside_an_update_function_are_errors(execution, tmp_path):
    # There a SUM SyncOnReadVariable reads one copy: the file would hold one replica's
    # part, and a load would put the whole value into every copy.
    s3 = dv.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], execution=execution)
    with s3.scope():
        v = dv.Variable(
            np.zeros(2), synchronization=dv.VariableSynchronization.ON_READ, aggregation=dv.VariableAggregation.SUM
        )
    for r, copy in enumerate(s3.experimental_local_results(v)):
        copy.assign(np.array([1.0, 10.0]) * (r + 1))
    path = tmp_path / "c.npz"
    dv.save_variables(path, {"v": v})
    for call in (dv.save_variables, dv.load_variables):
        with pytest.raises(RuntimeError, match=r"not inside the function of extended.update \(which is updating copy"):
            s3.extended.update(v, lambda var: call(path, {"v": v}))
    np.testing.assert_array_equal(v.read_value(), [6.0, 60.0])
    with np.load(path) as data:
        np.testing.assert_array_equal(data["v"], [6.0, 60.0])
    dv.load_variables(path, {"v": v})
    np.testing.assert_array_equal(v.read_value(), [6.0, 60.0])
    for copy in s3.experimental_local_results(v):
        np.testing.assert_array_equal(np.asarray(copy), [2.0, 20.0])


def test_a_shape_with_unknown_dimensions_still_fixes_the_others(s2, tmp_path):
    path = tmp_path / "c.npz"
    dv.save_variables(path, {"m": dv.Variable(np.zeros((2, 3)))})
    with s2.scope():
        v = dv.Variable(np.zeros(3), shape=[None])
        w = dv.Variable(np.zeros((2, 3)), shape=[None, 3])
    with pytest.raises(ValueError, match=r"stored with shape \(2, 3\), the variable has \(3,\) \(declared \(None,\)\)"):
        dv.load_variables(path, {"m": v})
    with pytest.raises(ValueError, match=r"value has shape \(2, 3\), the variable \(3,\) \(declared \(None,\)\)"):
        v.assign(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"value has shape \(2, 2\)"):
        w.assign(np.ones((2, 2)))
    np.testing.assert_array_equal(v.numpy(), np.zeros(3))
    w.assign(np.ones((5, 3)))  # the unknown dimension changes
    dv.load_variables(path, {"m": w})
    assert w.shape == (2, 3)

    class TensorShape:  # what a shape of unknown rank (tf.TensorShape(None)) says of itself
        dims = None

    u = dv.Variable(np.zeros(3), shape=TensorShape())
    dv.load_variables(path, {"m": u})
    assert u.shape == (2, 3)


def test_save_refuses_keys_that_cannot_name_a_member(tmp_path):
    a, b = dv.Variable(1.0), dv.Variable(2.0)
    path = tmp_path / "c.npz"
    for keys, why in [(("b\0x", "b"), "NUL"), (("a" * 70_000, "b"), "bytes long"), (("\ud800", "b"), "UTF-8")]:
        with pytest.raises(ValueError, match=why):
            dv.save_variables(path, dict(zip(keys, (a, b))))
    assert not path.exists()


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_save_and_load_extension_float_dtypes(s2, tmp_path, name):
    """ml_dtypes' floats (stored by .npy as raw bytes) load back as their own dtype, and
    not into a variable of another dtype of the same size."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dt = np.dtype(getattr(ml_dtypes, name))
    values = np.array([1.5, -2.0, 0.25], np.float32).astype(dt)
    with s2.scope():
        v = dv.Variable(values, name="v")
    plain = dv.Variable(values[::-1].copy(), name="p")
    path = tmp_path / "ckpt.npz"
    dv.save_variables(path, [v, plain])
    v.assign(np.zeros(3, dt))
    plain.assign(np.zeros(3, dt))
    dv.load_variables(path, [v, plain])
    for c in copies(v):
        assert c.dtype == dt and c.astype(np.float32).tolist() == [1.5, -2.0, 0.25]
    assert plain.numpy().dtype == dt and plain.numpy().astype(np.float32).tolist() == [0.25, -2.0, 1.5]
    other = np.dtype(ml_dtypes.float8_e5m2 if name == "float8_e4m3fn" else ml_dtypes.float8_e4m3fn)
    if other.itemsize == dt.itemsize:
        wrong = dv.Variable(np.zeros(3, other), name="v")
        with pytest.raises(TypeError, match=f"'v' is stored as {name}, the variable is {other.name}"):
            dv.load_variables(path, [wrong])
        assert wrong.numpy().astype(np.float32).tolist() == [0.0, 0.0, 0.0]
