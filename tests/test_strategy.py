"""MirroredStrategy, OneDeviceStrategy and ReplicaContext: devices, run, reduce, gather,
extended, collectives in replica context, replicas that disagree, misplaced calls.

What happens when a replica fails, times out, is interrupted or closed is in
test_strategy_failures.py."""

from __future__ import annotations

import collections
import contextvars
import sys
import threading
import time
import types

import numpy as np
import pytest
from strategy_checks import assert_usable, engine_all_reduces, mirrored, replica_id

import distvals as dv
from distvals.device_names import canonical_devices as _canonical_devices

Pair = collections.namedtuple("Pair", ["first", "second"])


def per_replica(n, shape=(3,), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return dv.PerReplica(tuple((rng.integers(-5, 6, size=shape) + 10 * r).astype(dtype) for r in range(n)))


def ref(parts, op):
    stack = np.stack([np.asarray(p, np.float64) for p in parts])
    return {
        "SUM": stack.sum(0),
        "MEAN": stack.mean(0),
        "MIN": stack.min(0),
        "MAX": stack.max(0),
        "PRODUCT": stack.prod(0),
    }[op]


# ---- devices ------------------------------------------------------------------------------


def test_device_names_are_canonicalized():
    s = dv.MirroredStrategy(["/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:1", "cpu:2"])
    try:
        assert s.num_replicas_in_sync == 3
        assert s.extended.worker_devices == tuple(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(3))
        assert repr(s) == "MirroredStrategy(devices=['CPU:0', 'CPU:1', 'CPU:2'])"
    finally:
        s.close()


def test_duplicate_devices_are_an_error():
    with pytest.raises(ValueError, match=r"'/cpu:0' \(CPU:0\) is listed twice"):
        dv.MirroredStrategy(["CPU:0", "/cpu:0"])


def test_bad_devices():
    with pytest.raises(ValueError, match="TPU:0"):
        dv.MirroredStrategy(["TPU:0"])
    with pytest.raises(TypeError, match="not one string"):
        dv.MirroredStrategy("CPU:0")
    with pytest.raises(ValueError, match="must not be empty"):
        dv.MirroredStrategy([])
    with pytest.raises(TypeError, match="must be strings"):
        dv.MirroredStrategy([0, 1])


def test_devices_none_means_cpu0_without_gpus(monkeypatch):
    monkeypatch.delattr(dv, "cuda", raising=False)
    s = dv.MirroredStrategy()
    try:
        assert s.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    finally:
        s.close()


def test_devices_none_means_every_gpu(monkeypatch):
    import distvals.device_names as names

    monkeypatch.setattr(names, "gpu_count", lambda: 2)
    assert _canonical_devices(None, "MirroredStrategy") == ["GPU:0", "GPU:1"]


def test_devices_none_without_gpus_means_the_logical_cpus(monkeypatch):
    import distvals.device_names as names

    monkeypatch.setattr(names, "gpu_count", lambda: 0)
    assert _canonical_devices(None, "MirroredStrategy") == ["CPU:0"]
    dv.config.set_logical_cpus(3)
    try:
        assert _canonical_devices(None, "MirroredStrategy") == ["CPU:0", "CPU:1", "CPU:2"]
        with dv.MirroredStrategy() as s:
            assert s.num_replicas_in_sync == 3
    finally:
        dv.config.set_logical_cpus(1)
    with pytest.raises(ValueError, match="n >= 1"):
        dv.config.set_logical_cpus(0)


def test_gpu_requested_without_gpus(monkeypatch):
    monkeypatch.setattr(dv, "cuda", types.SimpleNamespace(device_count=lambda: 0), raising=False)
    with pytest.raises(ValueError, match="GPU:1 requested, but distvals sees 0 GPU"):
        dv.MirroredStrategy(["GPU:0", "GPU:1"])


def test_many_cpu_replicas():
    n = 24
    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    try:
        out = s.run(
            lambda: dv.get_replica_context().all_reduce(
                "sum", np.full(5, dv.get_replica_context().replica_id_in_sync_group, np.int64)
            )
        )
        for r in range(n):
            np.testing.assert_array_equal(out.values[r], np.full(5, n * (n - 1) // 2))
    finally:
        s.close()


# ---- run ----------------------------------------------------------------------------------


def test_run_replaces_distributed_values_at_any_depth(s2):
    a, b, c, d = (per_replica(2, seed=i) for i in range(4))
    shared = object()

    def fn(x, nested, pair, z=None):
        return {"x": x, "y": nested[1]["k"], "p": pair.first, "q": pair.second, "z": z, "same": shared}

    out = s2.run(fn, args=(a, [1, {"k": b}], Pair(c, 5)), kwargs={"z": d})
    assert set(out) == {"x", "y", "p", "q", "z", "same"}
    for r in range(2):
        assert out["x"].values[r] is a.values[r]
        assert out["y"].values[r] is b.values[r]
        assert out["p"].values[r] is c.values[r]
        assert out["z"].values[r] is d.values[r]
    # Leaves that are the identical object on every replica come back as they are...
    assert out["same"] is shared
    # ...Python numbers too, as in TensorFlow: the very same object on every replica.
    assert out["q"] == 5


def test_run_keeps_the_result_structure(s3):
    def fn():
        r = dv.get_replica_context().replica_id_in_sync_group
        return Pair([r, (r * 2,)], {"a": r + 0.5})

    out = s3.run(fn)
    assert isinstance(out, Pair) and isinstance(out.first, list) and isinstance(out.first[1], tuple)
    assert out.first[0].values == (0, 1, 2)
    assert out.first[1][0].values == (0, 2, 4)
    assert out.second["a"].values == (0.5, 1.5, 2.5)


def test_run_returns_identical_objects_as_they_are(s3):
    # As in TensorFlow: the very same object on every replica comes back as it is,
    # Python numbers, strings and bools included; distinct objects make a PerReplica.
    assert s3.run(lambda: 2.5) == 2.5
    assert s3.run(lambda: "text") == "text"
    assert s3.run(lambda: dv.get_replica_context().num_replicas_in_sync) == 3
    assert s3.run(lambda: dv.get_replica_context().strategy is s3) is True
    assert s3.run(lambda: None) is None
    ids = s3.run(lambda: dv.get_replica_context().replica_id_in_sync_group)
    assert isinstance(ids, dv.PerReplica) and ids.values == (0, 1, 2)
    counts = s3.run(lambda: np.int64(12))  # a new object per replica
    assert isinstance(counts, dv.PerReplica) and s3.reduce("SUM", counts) == 36


def test_run_different_structures_is_an_error(s3):
    def fn():
        r = dv.get_replica_context().replica_id_in_sync_group
        return (1, 2) if r != 2 else [1, 2, 3]

    with pytest.raises(ValueError, match="replicas 0 and 2 returned different structures"):
        s3.run(fn)


def test_run_validates_arguments(s2):
    with pytest.raises(ValueError, match="positional args must be a list or tuple"):
        s2.run(lambda x: x, args=np.arange(2))
    with pytest.raises(ValueError, match="kwargs must be a dict"):
        s2.run(lambda: 0, kwargs=[1])
    with pytest.raises(TypeError, match="fn must be callable"):
        s2.run(5)
    with pytest.raises(ValueError, match="PerReplica with 3 values was given to a strategy with 2"):
        s2.run(lambda x: x, args=(dv.PerReplica((1, 2, 3)),))


def test_run_inside_run_is_an_error(s2):
    def fn():
        return s2.run(lambda: 1)

    with pytest.raises(RuntimeError, match=r"replica \d: strategy.run cannot be called inside strategy.run"):
        s2.run(fn)


def test_thread_replicas_run_in_parallel():
    # Passing a barrier needs all four replicas inside fn at the same time.
    with dv.MirroredStrategy([f"CPU:{i}" for i in range(4)], execution="threads") as s4:
        barrier = threading.Barrier(4, timeout=10)
        out = s4.run(barrier.wait)
        assert sorted(out.values) == [0, 1, 2, 3]
        threads = s4.run(lambda: threading.get_ident())
        assert len(set(threads.values)) == 4


def test_inline_replicas_share_the_calling_thread():
    with dv.MirroredStrategy([f"CPU:{i}" for i in range(4)], execution="inline") as s4:
        assert s4.execution == "inline"
        threads = s4.run(lambda: np.int64(threading.get_ident()))
        assert set(threads.values) == {threading.get_ident()}


# ---- reduce -------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["SUM", "MEAN", "MIN", "MAX", "PRODUCT"])
def test_reduce_elementwise(s3, op):
    value = per_replica(3, shape=(2, 3), dtype=np.float64, seed=3)
    out = s3.reduce(op, value, axis=None)
    assert out.shape == (2, 3) and out.dtype == np.float64
    np.testing.assert_allclose(out, ref(value.values, op), rtol=1e-12)
    # Inputs are untouched.
    np.testing.assert_array_equal(value.values[0], per_replica(3, (2, 3), np.float64, 3).values[0])


def test_reduce_op_strings_any_case(s2):
    value = per_replica(2, seed=5)
    expected = ref(value.values, "SUM")
    for op in ("sum", "Sum", "SUM", dv.ReduceOp.SUM):
        np.testing.assert_allclose(s2.reduce(op, value), expected)
    np.testing.assert_allclose(s2.reduce("prod", value), ref(value.values, "PRODUCT"))
    with pytest.raises(ValueError, match="unknown reduce op 'avg_pool'"):
        s2.reduce("avg_pool", value)
    with pytest.raises(TypeError, match="expected a distvals.ReduceOp"):
        s2.reduce(3, value)


def test_reduce_with_axis_sum(s2):
    value = dv.PerReplica((np.array([5.0], np.float32), np.array([6.0], np.float32)))
    out = s2.reduce(dv.ReduceOp.SUM, value, axis=0)
    assert out.shape == () and out.dtype == np.float32 and float(out) == 11.0
    m = dv.PerReplica((np.arange(6.0).reshape(2, 3), np.arange(6.0, 12.0).reshape(2, 3)))
    np.testing.assert_allclose(s2.reduce("SUM", m, axis=1), m.values[0].sum(1) + m.values[1].sum(1))
    np.testing.assert_allclose(s2.reduce("MAX", m, axis=-1), np.maximum(m.values[0].max(1), m.values[1].max(1)))


def test_reduce_mean_with_axis_weighs_by_count(s2):
    value = dv.PerReplica((np.array([1, 1, 1]), np.array([2])))
    out = s2.reduce("MEAN", value, axis=0)
    assert out.dtype == np.float64 and float(out) == 1.25
    f = dv.PerReplica((np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.array([[5.0, 6.0]], np.float32)))
    out = s2.reduce("mean", f, axis=0)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.concatenate(f.values).mean(0))


def test_reduce_mean_with_empty_replica(s2):
    value = dv.PerReplica((np.array([2.0, 4.0]), np.zeros(0)))
    assert float(s2.reduce("MEAN", value, axis=0)) == 3.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_reduce_with_axis_accumulates_16_bit_floats_in_float32(s3, dtype, op):
    # In their own dtype a bfloat16 sum stops growing at 256 and a float16 sum of 100
    # values near 1000 overflows: every path accumulates in float32 and rounds once.
    dt = np.dtype(pytest.importorskip("ml_dtypes").bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    parts = [np.full(1000 + 100 * r, 1000.0 + r).astype(dt) for r in range(3)]
    value = dv.PerReplica(tuple(parts))
    exact = np.concatenate([p.astype(np.float64) for p in parts])
    with np.errstate(over="ignore"):  # a float16 sum past 65504 is infinite, as in numpy
        want = (exact.sum() if op == "SUM" else exact.mean()).astype(np.float32).astype(dt)
    out = s3.reduce(op, value, axis=0)
    assert np.asarray(out).dtype == dt
    # The values are whole numbers whose sums float32 holds exactly: rounded once, the
    # result is the exact one rounded to the dtype.
    assert float(out) == float(want), (out, want)
    plain = s3.reduce("MEAN", parts[0], axis=0)
    assert np.asarray(plain).dtype == dt and float(plain) == float(np.float32(1000.0).astype(dt))


@pytest.mark.parametrize("op, pick", [("MAX", np.max), ("MIN", np.min)])
def test_reduce_with_axis_skips_the_empty_parts_of_a_last_partial_batch(s3, op, pick):
    # 5 rows in batches of 4 over 3 replicas: the last batch splits as [5.], [], [].
    ds = dv.data.Dataset.from_tensor_slices(np.arange(5, dtype=np.float32) * 3 - 4).batch(4)
    batches = list(s3.experimental_distribute_dataset(ds))
    for b in batches:
        rows = np.concatenate(s3.experimental_local_results(b))
        out = s3.reduce(op, b, axis=0)
        assert float(out) == float(pick(rows)) and np.asarray(out).dtype == np.float32
    # Every part empty: the op's identity (as TensorFlow's reduce_max / reduce_min give).
    empty = dv.PerReplica(tuple(np.zeros(0, np.int32) for _ in range(3)))
    info = np.iinfo(np.int32)
    assert int(s3.reduce(op, empty, axis=0)) == (info.min if op == "MAX" else info.max)


@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MEAN", "MIN", "MAX"])
@pytest.mark.parametrize("dtype", [">f4", ">i8", ">f8"])
def test_reduce_with_axis_of_big_endian_values(s2, op, dtype):
    """Values in non-native byte order reduce along an axis like native ones."""
    parts = [np.array([[1, 2, -3], [4, 5, 6]], dtype=dtype) + 7 * r for r in range(2)]
    got = s2.reduce(op, dv.PerReplica(tuple(parts)), axis=0)
    rows = np.concatenate(parts).astype(np.float64)
    want = {"SUM": rows.sum(0), "PRODUCT": rows.prod(0), "MEAN": rows.mean(0), "MIN": rows.min(0), "MAX": rows.max(0)}[
        op
    ]
    np.testing.assert_array_equal(np.asarray(got, dtype=np.float64), want)


def test_reduce_axis_out_of_range(s2):
    with pytest.raises(ValueError, match="axis 1 is out of range for replica 0's value of rank 1"):
        s2.reduce("SUM", per_replica(2), axis=1)


@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX", "MIN"])
@pytest.mark.parametrize(
    "parts, error, match",
    [
        # Replica 0 integer, replica 1 float: met in int32 they were truncated (13 for 13.6).
        ((np.array([1, 2], np.int32), np.array([0.7, 9.9], np.float32)), TypeError, "replica 1 has dtype float32"),
        ((np.zeros((2, 3)), np.zeros(6)), ValueError, "replica 1 has rank 1, replica 0 has rank 2"),
        ((np.float64(5.0), np.arange(3.0)), ValueError, "replica 1 has rank 1, replica 0 has rank 0"),
        ((np.zeros((2, 3)), np.zeros((2, 4))), ValueError, r"replica 1 has shape \(2, 4\), replica 0 has shape"),
    ],
)
def test_reduce_with_axis_checks_the_parts_as_given_before_reducing_any(s2, op, parts, error, match):
    """The parts' dtypes and shapes are checked as given (as gather checks them), not
    after each is reduced alone along the axis."""
    with pytest.raises(error, match=f"strategy.reduce: {match}"):
        s2.reduce(op, dv.PerReplica(parts), axis=0)


def test_integer_mean_gives_float64(s2):
    value = dv.PerReplica((np.array([1, 2], np.int32), np.array([2, 5], np.int32)))
    out = s2.reduce("MEAN", value)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [1.5, 3.5])


def test_reduce_non_distributed(s2):
    x = np.array([1.0, 2.0])
    got = s2.reduce("MEAN", x)
    np.testing.assert_array_equal(got, x)
    assert not np.shares_memory(got, x)  # a new array, which the caller may change
    np.testing.assert_allclose(s2.reduce("MEAN", x, axis=0), 1.5)
    with pytest.raises(ValueError, match="non-distributed value cannot be reduced with SUM across 2 replicas"):
        s2.reduce("SUM", x)
    one = dv.MirroredStrategy(["CPU:0"])
    try:
        got = one.reduce("SUM", x)
        np.testing.assert_array_equal(got, x)
        assert not np.shares_memory(got, x)
    finally:
        one.close()


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_every_cross_replica_result_is_a_new_array_the_caller_may_change(s2, dtype):
    # The result of each call is written to in place; the value it came from (and every
    # other result of the call) must not change.
    x = np.arange(1, 5, dtype=dtype) * 3
    per = dv.PerReplica(tuple(x + r for r in range(2)))
    mirrored = dv.Mirrored(tuple(np.array(x) for _ in range(2)))
    ext = s2.extended
    calls = {
        "reduce_to one, Mirrored MEAN": lambda: ext.reduce_to("MEAN", mirrored, "CPU:0"),
        "reduce_to all, Mirrored MEAN": lambda: ext.reduce_to("MEAN", mirrored, mirrored),
        "batch_reduce_to, Mirrored MEAN": lambda: ext.batch_reduce_to("MEAN", [(mirrored, "CPU:1")])[0],
        "reduce_to one, PerReplica MAX": lambda: ext.reduce_to("MAX", per, "CPU:0"),
        "strategy.reduce, Mirrored MEAN": lambda: s2.reduce("MEAN", mirrored, axis=None),
        "broadcast_to one": lambda: ext.broadcast_to(x, "CPU:1"),
        "broadcast_to all": lambda: ext.broadcast_to(x, ["CPU:0", "CPU:1"]),
    }
    for what, call in calls.items():
        before = [np.array(v) for v in (x, *per.values, *mirrored.values)]
        got = call()
        results = list(got.values) if isinstance(got, dv.DistributedValues) else [got]
        want = [np.array(r) for r in results]
        for r in results:
            r += 1
        for i, (r, w) in enumerate(zip(results, want)):
            np.testing.assert_array_equal(r, w + 1, err_msg=f"{what}: result {i} changed by another's update")
        for b, v in zip(before, (x, *per.values, *mirrored.values)):
            np.testing.assert_array_equal(v, b, err_msg=f"{what}: changing the result changed its input")


def test_reduce_mirrored_mean_is_the_value(s2):
    m = dv.Mirrored((np.array([3, 4]), np.array([3, 4])))
    out = s2.reduce("MEAN", m)
    np.testing.assert_array_equal(out, [3, 4])
    np.testing.assert_array_equal(s2.reduce("SUM", m), [6, 8])


def test_reduce_python_scalars(s3):
    ids = s3.run(lambda: dv.get_replica_context().replica_id_in_sync_group)
    total = s3.reduce("SUM", ids)
    assert isinstance(total, np.integer) and total == 3
    assert s3.reduce("MEAN", ids) == 1.0


def test_reduce_nested(s2):
    value = {"a": per_replica(2, seed=1), "b": (per_replica(2, seed=2, dtype=np.int32),)}
    out = s2.reduce("SUM", value)
    np.testing.assert_allclose(out["a"], ref(value["a"].values, "SUM"))
    np.testing.assert_array_equal(out["b"][0], ref(value["b"][0].values, "SUM"))


def test_reduce_mismatched_parts(s2):
    with pytest.raises(TypeError, match="replica 1 has dtype int32, replica 0 has float32"):
        s2.reduce("SUM", dv.PerReplica((np.ones(2, np.float32), np.ones(2, np.int32))))
    with pytest.raises(ValueError, match=r"replica 1 has shape \(3,\), replica 0 has \(2,\)"):
        s2.reduce("SUM", dv.PerReplica((np.ones(2), np.ones(3))))


def test_reduce_uses_the_engine(s2, monkeypatch):
    calls = []
    group = s2.extended._group
    original = group.reduce

    def counting(buffers, root=0, op="sum", out=None):
        calls.append((op, out is None))
        return original(buffers, root=root, op=op, out=out)

    monkeypatch.setattr(group, "reduce", counting)
    values = per_replica(2)
    parts = [np.array(v, copy=True) for v in s2.experimental_local_results(values)]
    got = s2.reduce("MAX", values)
    # One engine call, straight from the replicas' values into a new result.
    assert calls == [("max", False)]
    np.testing.assert_array_equal(got, np.maximum(parts[0], parts[1]))
    for r, v in enumerate(s2.experimental_local_results(values)):
        np.testing.assert_array_equal(v, parts[r])


def test_strategy_reduce_of_objects_names_the_type(s3):
    parts = s3.run(lambda: object())
    with pytest.raises(TypeError, match="^strategy.reduce: cannot reduce replica 0's value of type object with SUM"):
        s3.reduce("sum", parts, axis=None)
    words = s3.run(lambda: "abc"[replica_id()])
    with pytest.raises(TypeError, match="strategy.reduce: cannot reduce .* str_ \\(dtype <U1\\) with MAX"):
        s3.reduce("max", words, axis=None)
    # Python numbers that numpy reduces as objects still work.
    from fractions import Fraction

    thirds = s3.run(lambda: Fraction(replica_id() + 1, 3))
    assert s3.reduce("sum", thirds, axis=None) == sum(Fraction(r + 1, 3) for r in range(3))


# ---- gather and local results ---------------------------------------------------------------


def test_gather(s3):
    value = per_replica(3, shape=(2, 3), seed=8)
    np.testing.assert_array_equal(s3.gather(value, axis=0), np.concatenate(value.values, 0))
    np.testing.assert_array_equal(s3.gather(value, axis=1), np.concatenate(value.values, 1))
    np.testing.assert_array_equal(s3.gather(value, axis=-1), np.concatenate(value.values, -1))


def test_gather_uneven_along_axis(s3):
    parts = (np.arange(6.0).reshape(2, 3), np.arange(3.0).reshape(1, 3), np.zeros((0, 3)))
    np.testing.assert_array_equal(s3.gather(dv.PerReplica(parts), axis=0), np.concatenate(parts))
    parts = tuple(np.arange(2 * k, dtype=np.int32).reshape(2, k) for k in (1, 3, 2))
    np.testing.assert_array_equal(s3.gather(dv.PerReplica(parts), axis=1), np.concatenate(parts, 1))


def test_gather_mismatch_names_the_shapes(s2):
    with pytest.raises(
        ValueError,
        match=r"replica 1 has shape \(2, 4\), replica 0 has shape \(2, 3\); "
        r"shapes may differ only along axis 0",
    ):
        s2.gather(dv.PerReplica((np.ones((2, 3)), np.ones((2, 4)))), axis=0)


def test_gather_scalars_and_plain(s2):
    out = s2.gather(dv.PerReplica((np.float32(1), np.float32(2))), axis=0)
    np.testing.assert_array_equal(out, np.array([1, 2], np.float32))
    np.testing.assert_array_equal(s2.gather(np.arange(3), axis=0), np.arange(3))
    with pytest.raises(RuntimeError, match="cross-replica"):
        s2.run(lambda: s2.gather(np.arange(3), axis=0))


def test_experimental_local_results(s2):
    value = per_replica(2)
    assert s2.experimental_local_results(value) == value.values
    x = np.arange(3)
    assert s2.experimental_local_results(x) == (x,)
    nested = s2.experimental_local_results({"v": value, "c": 1})
    assert nested[0]["v"] is value.values[0] and nested[1]["v"] is value.values[1] and nested[1]["c"] == 1
    # A structure without distributed leaves: one structure per replica (TensorFlow's).
    plain = s2.experimental_local_results({"a": x, "b": [1.5]})
    assert len(plain) == 2 and all(p["a"] is x and p["b"] == [1.5] for p in plain)


# ---- extended ---------------------------------------------------------------------------------


def test_extended_reduce_to(s3):
    value = per_replica(3, seed=11)
    out = s3.extended.reduce_to("SUM", value, destinations=s3.extended.worker_devices)
    assert isinstance(out, dv.Mirrored) and len(out.values) == 3
    for part in out.values:
        np.testing.assert_allclose(part, ref(value.values, "SUM"))
    assert len({id(p) for p in out.values}) == 3
    one = s3.extended.reduce_to("MEAN", value, destinations="CPU:0")
    np.testing.assert_allclose(one, ref(value.values, "MEAN"), rtol=1e-6)
    with pytest.raises(ValueError, match="non-distributed value"):
        s3.extended.reduce_to("SUM", np.ones(2), destinations="CPU:0")
    mirrored = s3.extended.reduce_to("MEAN", np.ones(2), destinations=value)
    assert isinstance(mirrored, dv.Mirrored) and len(mirrored.values) == 3
    # a host array as destinations means the host, as a tensor means its device in TF
    host = s3.extended.reduce_to("SUM", value, destinations=np.zeros(1))
    assert not isinstance(host, dv.DistributedValues)
    np.testing.assert_allclose(host, ref(value.values, "SUM"))
    # A structure of PerReplica values: reduced leaf by leaf, as TensorFlow does.
    other = per_replica(3, seed=12)
    pair = s3.extended.reduce_to("MAX", (value, {"o": other}), destinations="CPU:0")
    np.testing.assert_array_equal(pair[0], ref(value.values, "MAX"))
    np.testing.assert_array_equal(pair[1]["o"], ref(other.values, "MAX"))


@pytest.mark.parametrize(
    ("dtype", "want"),
    [("int8", "float32"), ("uint8", "float32"), ("int16", "float32"), ("int32", "float64"), ("int64", "float64")],
)
def test_integer_mean_has_the_dtype_of_tensorflows_division(s3, dtype, want):
    """Integer MEAN: float32 for 8- and 16-bit integers, float64 for wider ones, with
    the exact mean, in every way of reducing."""
    parts = [np.array([100, 3 + r, 7 * r + 1], dtype=dtype) for r in range(3)]
    value = dv.PerReplica(tuple(parts))
    exact = np.mean(np.stack(parts).astype(np.float64), axis=0)
    results = [
        s3.reduce("MEAN", value, axis=None),
        s3.extended.reduce_to("MEAN", value, destinations="CPU:0"),
        *s3.experimental_local_results(s3.run(lambda v: dv.get_replica_context().all_reduce("MEAN", v), args=(value,))),
    ]
    for got in results:
        assert np.asarray(got).dtype == np.dtype(want)
        np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=1e-7)
    along = s3.reduce("MEAN", value, axis=0)
    assert np.asarray(along).dtype == np.dtype(want)
    np.testing.assert_allclose(float(along), np.stack(parts).astype(np.float64).mean(), rtol=1e-7)


def test_numpy_bools_that_each_replica_computed_stay_per_replica(s2):
    # numpy keeps one True and one False: every replica's np.any(x), or a bool MAX, is
    # that one object, yet each replica's own value (a PerReplica, as for any other dtype).
    ctx = dv.get_replica_context

    def step():
        r = ctx().replica_id_in_sync_group
        return {
            "max": ctx().all_reduce("MAX", np.bool_(r == 0)),
            "min": ctx().all_reduce("MIN", np.bool_(r == 0)),
            "any": np.any(np.ones(2) * r >= 0),
            "float": ctx().all_reduce("MAX", np.float32(r)),
        }

    out = s2.run(step)
    for key, want in [("max", True), ("min", False), ("any", True), ("float", 1.0)]:
        assert isinstance(out[key], dv.PerReplica), key
        assert [v.item() for v in s2.experimental_local_results(out[key])] == [want, want], key
    np.testing.assert_array_equal(s2.gather(out["max"], axis=0), [True, True])
    assert s2.reduce("SUM", out["max"], axis=None) == 2
    # A Python bool is one shared object, as in TensorFlow.
    assert s2.run(lambda: True) is True


@pytest.mark.parametrize("n", [1, 2, 3])
def test_results_have_the_same_dtype_and_shape_with_any_number_of_replicas(execution, n):
    # With one replica run returns its plain value, and a Mirrored's copies are the
    # value: neither needs a collective, but each result has the dtype and shape that
    # several replicas' PerReplica values give (integer MEAN float32 or float64, the SUM
    # and PRODUCT of bools int64, a gather of 0-d values a vector), with exact values.
    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=execution)
    try:
        rid = lambda: dv.get_replica_context().replica_id_in_sync_group  # noqa: E731
        i8 = s.run(lambda: np.array([7 + rid(), -3], np.int8))
        i32 = s.run(lambda: np.array([2**31 - 1 - rid(), 5], np.int32))
        flags = s.run(lambda: np.array([True, rid() % 2 == 0, False]))
        exact8 = np.mean([[7 + r, -3] for r in range(n)], axis=0)
        exact32 = np.mean([[2**31 - 1 - r, 5] for r in range(n)], axis=0)
        for got, dt, want, what in [
            (s.reduce("MEAN", i8, axis=None), np.float32, exact8, "int8 MEAN"),
            (s.reduce("MEAN", i32, axis=None), np.float64, exact32, "int32 MEAN"),
            (s.extended.reduce_to("MEAN", i32, "CPU:0"), np.float64, exact32, "int32 MEAN reduce_to"),
            (s.reduce("MEAN", i8, axis=0), np.float32, np.mean([[7 + r, -3] for r in range(n)]), "int8 MEAN axis 0"),
            (s.reduce("SUM", flags, axis=None), np.int64, [n, (n + 1) // 2, 0], "bool SUM"),
            (s.reduce("PRODUCT", flags, axis=None), np.int64, [1, int(n == 1), 0], "bool PRODUCT"),
        ]:
            got = np.asarray(got)
            assert got.dtype == np.dtype(dt), (what, got.dtype)
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-12, err_msg=what)
        with s.scope():
            v = dv.Variable(np.array([3, -8], np.int32), aggregation=dv.VariableAggregation.SUM)
        mean_v = np.asarray(s.reduce("MEAN", v, axis=None))
        assert mean_v.dtype == np.float64 and mean_v.tolist() == [3.0, -8.0]
        zero_d = s.run(lambda: np.float32(rid() + 0.5))
        gathered = np.asarray(s.gather(zero_d, axis=0))
        np.testing.assert_array_equal(gathered, np.arange(n, dtype=np.float32) + 0.5)
        assert gathered.shape == (n,)
    finally:
        s.close()


def test_extended_batch_reduce_to(s2):
    a, b = per_replica(2, seed=1), per_replica(2, seed=2, dtype=np.int64)
    out = s2.extended.batch_reduce_to("MAX", [(a, "CPU:0"), (b, s2.extended.worker_devices)])
    np.testing.assert_allclose(out[0], ref(a.values, "MAX"))
    assert isinstance(out[1], dv.Mirrored)
    np.testing.assert_array_equal(out[1].values[1], ref(b.values, "MAX"))
    with pytest.raises(TypeError, match="item 0 is not a"):
        s2.extended.batch_reduce_to("SUM", [a])


@pytest.mark.parametrize(
    "parts, name",
    [
        (("a", "b"), r"str_ \(dtype <U1\)"),
        ((np.datetime64("2020-01-01"), np.datetime64("2021-01-01")), r"datetime64 \(dtype datetime64\[D\]\)"),
    ],
)
def test_reduce_to_and_batch_reduce_to_name_values_that_are_not_numbers(s2, parts, name):
    """As strategy.reduce does (numpy's own error came through before)."""
    value = dv.PerReplica(parts)
    for dests in (None, s2.extended.worker_devices):
        with pytest.raises(TypeError, match=f"^reduce_to: cannot reduce replica 0's value of type {name} with SUM"):
            s2.extended.reduce_to("SUM", value, dests)
    with pytest.raises(
        TypeError, match=rf"^batch_reduce_to \(item 1\): cannot reduce replica 0's value of type {name}"
    ):
        s2.extended.batch_reduce_to("SUM", [(per_replica(2), None), (value, None)])
    # Python numbers (Fractions) are reduced by numpy's object arithmetic onto every device.
    from fractions import Fraction

    out = s2.extended.reduce_to("SUM", dv.PerReplica((Fraction(1, 3), Fraction(1, 6))), s2.extended.worker_devices)
    assert [v for v in out.values] == [Fraction(1, 2)] * 2
    # batch_reduce_to reduces them as reduce_to does, beside the numbers it fuses.
    arrays = per_replica(2, seed=3)
    fractions = dv.PerReplica((Fraction(1, 3), Fraction(-1, 7)))
    objects = dv.PerReplica((np.array([Fraction(1, 2), 2], dtype=object), np.array([Fraction(1, 5), 3], dtype=object)))
    got = s2.extended.batch_reduce_to(
        "SUM", [(arrays, None), (fractions, s2.extended.worker_devices), (objects, None), (arrays, None)]
    )
    assert [v for v in got[1].values] == [Fraction(4, 21)] * 2
    assert list(got[2]) == [Fraction(7, 10), 5] and type(got[2][0]) is Fraction
    for k in (0, 3):
        np.testing.assert_allclose(np.asarray(got[k]), np.sum([np.asarray(v, np.float64) for v in arrays.values], 0))
    with pytest.raises(TypeError, match="cannot reduce replica 0's value of type object"):
        s2.extended.batch_reduce_to("SUM", [(arrays, None), (dv.PerReplica((object(), object())), None)])


def test_batch_reduce_to_names_the_item_and_replica_whose_part_differs(s2):
    a = per_replica(2, seed=1)
    kept = [v.copy() for v in a.values]
    shapes = dv.PerReplica([np.ones(3), np.ones(4)])
    dtypes = dv.PerReplica([np.ones(3), np.ones(3, np.float32)])
    with pytest.raises(ValueError, match=r"batch_reduce_to \(item 1\): replica 1 has shape \(4,\)"):
        s2.extended.batch_reduce_to("SUM", [(a, "CPU:0"), (shapes, "CPU:0")])
    with pytest.raises(TypeError, match=r"batch_reduce_to \(item 1\): replica 1 has dtype float32"):
        s2.extended.batch_reduce_to("SUM", [(a, "CPU:0"), (dtypes, "CPU:0")])
    for v, k in zip(a.values, kept):  # nothing was touched
        np.testing.assert_array_equal(v, k)
    out = s2.extended.batch_reduce_to("SUM", [(a, s2.extended.worker_devices)])  # and it still works
    for part in out[0].values:
        np.testing.assert_allclose(part, ref(a.values, "SUM"))


def test_extended_broadcast_to(s3):
    x = np.arange(4.0)
    out = s3.extended.broadcast_to(x, destinations=s3.extended.worker_devices)
    assert isinstance(out, dv.Mirrored)
    for part in out.values:
        np.testing.assert_array_equal(part, x)
        assert part is not x
    with pytest.raises(ValueError, match="PerReplica"):
        s3.extended.broadcast_to(per_replica(3), destinations="CPU:0")
    with pytest.raises(RuntimeError, match="cross-replica"):
        s3.run(lambda: s3.extended.broadcast_to(x, "CPU:0"))


def test_reduction_to_one_device():
    s = dv.MirroredStrategy(
        ["CPU:0", "CPU:1", "CPU:2"], cross_device_ops=dv.ReductionToOneDevice(reduce_to_device="/cpu:1")
    )
    try:
        value = per_replica(3, seed=4)
        np.testing.assert_allclose(s.reduce("SUM", value), ref(value.values, "SUM"))
        out = s.run(
            lambda: dv.get_replica_context().all_reduce(
                "mean", np.full(3, float(dv.get_replica_context().replica_id_in_sync_group))
            )
        )
        for r in range(3):
            np.testing.assert_array_equal(out.values[r], [1.0, 1.0, 1.0])
        mirrored = s.extended.reduce_to("MIN", value, destinations=s.extended.worker_devices)
        for part in mirrored.values:
            np.testing.assert_allclose(part, ref(value.values, "MIN"))
    finally:
        s.close()
    with pytest.raises(ValueError, match="not one of the strategy's devices"):
        dv.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=dv.ReductionToOneDevice("CPU:5"))


def test_cross_device_ops_and_options_validation():
    with pytest.raises(TypeError, match="cross_device_ops must be"):
        dv.MirroredStrategy(["CPU:0"], cross_device_ops="ring")
    with pytest.raises(TypeError, match="communication_options must be"):
        dv.MirroredStrategy(["CPU:0"], communication_options={"timeout_seconds": 1})
    with pytest.raises(ValueError, match="unknown algorithm 'star'"):
        dv.CollectiveAllReduce("star")
    with pytest.raises(ValueError, match="timeout_seconds must be positive"):
        dv.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="bytes_per_pack must be non-negative"):
        dv.CommunicationOptions(bytes_per_pack=-1)
    o = dv.CommunicationOptions(bytes_per_pack=64, timeout_seconds=2, implementation="RING")
    assert (o.bytes_per_pack, o.timeout_seconds, o.implementation) == (64, 2.0, "ring")
    assert repr(dv.CollectiveAllReduce("tree")) == "CollectiveAllReduce(algorithm='tree')"


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_collective_all_reduce_algorithms(algorithm):
    s = dv.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"], cross_device_ops=dv.CollectiveAllReduce(algorithm))
    try:
        xs = per_replica(3, shape=(1000,), dtype=np.float64, seed=9)
        out = s.run(lambda x: dv.get_replica_context().all_reduce("sum", x), args=(xs,))
        for r in range(3):
            np.testing.assert_allclose(out.values[r], ref(xs.values, "SUM"))
    finally:
        s.close()


def test_reduce_op_enum():
    assert [op.name for op in dv.ReduceOp] == ["SUM", "MEAN", "MIN", "MAX", "PRODUCT"]
    assert repr(dv.ReduceOp.MEAN) == "ReduceOp.MEAN"
    with pytest.raises(ValueError, match="only SUM and MEAN"):
        dv.ReduceOp.from_variable_aggregation("NONE")


# ---- ReplicaContext collectives -------------------------------------------------------------


@pytest.mark.parametrize("op", ["SUM", "MEAN", "MIN", "MAX", "PRODUCT"])
def test_all_reduce_every_replica_gets_the_result(s3, op):
    xs = per_replica(3, shape=(4, 5), dtype=np.float64, seed=21)
    out = s3.run(lambda x: dv.get_replica_context().all_reduce(op.lower(), x), args=(xs,))
    expected = ref(xs.values, op)
    for r in range(3):
        np.testing.assert_allclose(out.values[r], expected, rtol=1e-12)
        assert out.values[r] is not xs.values[r]


def test_all_reduce_nested_structure_and_fusion(s3, monkeypatch):
    calls = engine_all_reduces(monkeypatch, s3)
    xs = {
        "w": per_replica(3, shape=(3, 2), seed=1),
        "b": per_replica(3, shape=(2,), seed=2),
        "k": per_replica(3, shape=(4,), dtype=np.int32, seed=3),
    }

    def fn(d):
        r = dv.get_replica_context().replica_id_in_sync_group
        value = {"layers": [d["w"], (d["b"], Pair(d["k"], np.float32(r)))], "scale": float(r)}
        return dv.get_replica_context().all_reduce("SUM", value)

    out = s3.run(fn, args=(xs,))
    assert isinstance(out["layers"], list) and isinstance(out["layers"][1][1], Pair)
    for r in range(3):
        np.testing.assert_allclose(out["layers"][0].values[r], ref(xs["w"].values, "SUM"))
        np.testing.assert_allclose(out["layers"][1][0].values[r], ref(xs["b"].values, "SUM"))
        np.testing.assert_array_equal(out["layers"][1][1].first.values[r], ref(xs["k"].values, "SUM"))
        assert out["layers"][1][1].second.values[r] == np.float32(3)
        assert out["scale"].values[r] == 3.0
    # One single-call engine all-reduce per dtype, for every replica at once: float32
    # (w, b and the scalar packed together), int32 (k), float64 (the Python float).
    assert sorted(c[:2] for c in calls) == [("float32", 6 + 2 + 1), ("float64", 1), ("int32", 4)]


@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX"])
def test_a_structure_of_arrays_is_reduced_in_one_engine_call(s3, op, monkeypatch):
    calls = engine_all_reduces(monkeypatch, s3)
    w, b, big = per_replica(3, shape=(4, 3), seed=1), per_replica(3, seed=2), per_replica(3, shape=(9000,), seed=3)

    def fn():
        r = replica_id()
        value = {"layer": [w.values[r], b.values[r]], "big": big.values[r], "pair": Pair(b.values[r], w.values[r])}
        return dv.get_replica_context().all_reduce(op, value)

    out = s3.run(fn)
    assert list(out) == ["layer", "big", "pair"] and isinstance(out["pair"], Pair)
    for r in range(3):
        for got, parts in [
            (out["layer"][0], w),
            (out["layer"][1], b),
            (out["big"], big),
            (out["pair"].first, b),
            (out["pair"].second, w),
        ]:
            np.testing.assert_allclose(got.values[r], ref(parts.values, op), rtol=1e-6)
            assert got.values[r].dtype == np.float32
    # The small leaves packed into one call, the large one on its own.
    assert sorted(c[:2] for c in calls) == [("float32", 12 + 3 + 3 + 12), ("float32", 9000)]
    assert {c[2] for c in calls} == {op.lower()}


@pytest.mark.parametrize(
    "other, why",
    [
        (lambda r: {"a": np.ones(2), "c": np.ones(2)}, "different structures"),
        (lambda r: {"a": np.ones(2), "b": [np.ones(2), np.ones(2)]}, "different structures"),
        (lambda r: {"a": np.ones(2), "b": np.ones(3)}, "passed shape"),
        (lambda r: np.ones(2), "different structures"),
    ],
)
def test_structures_that_differ_between_replicas_are_named(s3, other, why):
    def fn():
        r = replica_id()
        value = other(r) if r == 2 else {"a": np.ones(2), "b": np.ones(2)}
        return dv.get_replica_context().all_reduce("sum", value)

    with pytest.raises(dv.MismatchError, match=why) as info:
        s3.run(fn)
    assert "replica 2" in str(info.value)
    assert_usable(s3)


@pytest.mark.parametrize("bare", [0, 2])
@pytest.mark.parametrize("wrapped", [lambda x: [x], lambda x: {"a": x}])
def test_a_bare_array_against_a_structure_is_named_whichever_replica_passes_it(s3, bare, wrapped):
    # Every leaf has the same shape and dtype: only the nesting differs, and the values
    # would reduce "correctly" if nobody compared it.
    def fn():
        r = replica_id()
        x = np.full(3, 1.0 + 10 * r)
        return dv.get_replica_context().all_reduce("sum", x if r == bare else wrapped(x))

    with pytest.raises(dv.MismatchError, match="different structures") as info:
        s3.run(fn)
    assert f"replica {bare}" in str(info.value)
    assert_usable(s3)


_shade = contextvars.ContextVar("shade", default="default")


def test_context_variables_a_replica_sets_reach_no_other_replica_no_later_step_and_not_the_caller(s3):
    def fn(step):
        r = replica_id()
        before = _shade.get()
        _shade.set(f"step {step} replica {r}")
        # A meeting between setting and reading: the other replicas run (and set theirs)
        # in between.
        total = dv.get_replica_context().all_reduce("sum", np.full(2, float(r + step)))
        return before, _shade.get(), total

    def check(step, caller):
        out = s3.run(fn, args=(step,))
        for r in range(3):
            # (A leaf that is the same object on every replica comes back as it is.)
            before, now, total = (x.values[r] if isinstance(x, dv.PerReplica) else x for x in out)
            assert before == caller, f"replica {r} started step {step} from {before!r}"
            assert now == f"step {step} replica {r}"
            np.testing.assert_array_equal(total, np.full(2, 3.0 + 3 * step))
        assert _shade.get() == caller

    def steps():
        # Without context variables in the caller: each step starts from the default.
        for step in range(3):
            check(step, "default")
        # With one: each step starts from the caller's value, and leaves it as it was.
        token = _shade.set("caller")
        try:
            for step in range(3, 5):
                check(step, "caller")
        finally:
            _shade.reset(token)
        check(5, "default")

    # From a context with no variable at all (the test runner's may hold some: numpy's
    # error state, say), and from one that holds another variable.
    contextvars.Context().run(steps)
    steps()


@pytest.mark.parametrize("inner_mode", ["inline", "threads"])
def test_a_step_of_another_strategy_inside_merge_fn_leaves_the_outer_step_working(execution, inner_mode):
    outer = mirrored(2, execution=execution)
    inner = mirrored(2, execution=inner_mode)
    vals = [np.arange(4.0) + 100 * r for r in range(2)]

    def inner_fn():
        return dv.get_replica_context().all_reduce("sum", vals[replica_id()] * 2)

    def outer_fn():
        ctx = dv.get_replica_context()
        got = ctx.merge_call(lambda st: inner.experimental_local_results(inner.run(inner_fn)))
        # The outer step's collectives still work on every replica's thread or greenlet.
        return ctx.all_reduce("sum", vals[replica_id()]), got

    try:
        total, got = outer.run(outer_fn)
        for r in range(2):
            np.testing.assert_array_equal(total.values[r], vals[0] + vals[1])
        for part in got.values[0] if isinstance(got, dv.PerReplica) else got:
            np.testing.assert_array_equal(part, 2 * (vals[0] + vals[1]))
        assert_usable(outer)
        assert_usable(inner)
    finally:
        outer.close()
        inner.close()


def test_replicas_mixing_quick_and_general_forms_still_meet(s2):
    # Replica 0's value takes the general path (a Python float leaf, options), replica
    # 1's the quick one: the meeting must still reduce, or name a real mismatch.
    def floats():
        x = [1.5, 2.0] if replica_id() == 0 else [np.array(1.5), np.array(2.0)]
        return dv.get_replica_context().all_reduce("sum", x)

    out = s2.run(floats)
    for r in range(2):
        assert float(out[0].values[r]) == 3.0 and float(out[1].values[r]) == 4.0

    def with_options():
        opts = dv.CommunicationOptions() if replica_id() == 0 else None
        return dv.get_replica_context().all_reduce("sum", {"a": np.ones(2) * (replica_id() + 1)}, options=opts)

    out = s2.run(with_options)
    for r in range(2):
        np.testing.assert_array_equal(out["a"].values[r], [3.0, 3.0])

    def other_collective():
        ctx = dv.get_replica_context()
        if replica_id() == 0:
            return ctx.all_gather(np.ones(2), axis=0)
        return ctx.all_reduce("sum", [np.ones(2)])

    with pytest.raises(dv.MismatchError, match="replicas called different collectives"):
        s2.run(other_collective)
    assert_usable(s2)


def test_a_replica_failing_before_a_structure_all_reduce_releases_the_others(s3):
    def fn():
        r = replica_id()
        if r == 1:
            raise KeyError("boom")
        return dv.get_replica_context().all_reduce("sum", [np.ones(2) * r, np.ones(3)])

    with pytest.raises(KeyError, match="replica 1: .*boom"):
        s3.run(fn)
    assert_usable(s3)


def test_all_reduce_bytes_per_pack_splits_packs(monkeypatch, execution):
    s = dv.MirroredStrategy(
        ["CPU:0", "CPU:1"], communication_options=dv.CommunicationOptions(bytes_per_pack=16), execution=execution
    )
    try:
        calls = engine_all_reduces(monkeypatch, s)
        leaves = [np.full(n, 1.0, np.float32) for n in (2, 2, 3, 8)]
        out = s.run(lambda: dv.get_replica_context().all_reduce("sum", leaves))
        assert [c[1] for c in calls] == [4, 3, 8]
        for got, leaf in zip(out, leaves):
            np.testing.assert_array_equal(got.values[1], leaf * 2)
    finally:
        s.close()


def test_host_packs_hold_at_most_host_pack_bytes_by_default(monkeypatch, execution):
    """Without bytes_per_pack, small leaves are still packed, but no host pack grows past
    HOST_PACK_BYTES (a larger one costs more than its leaves apart); distinct values per
    replica, every replica's result checked."""
    from distvals.engine_collectives import FUSE_LEAF_BYTES, HOST_PACK_BYTES

    s = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution=execution)
    try:
        calls = engine_all_reduces(monkeypatch, s)
        per_leaf = FUSE_LEAF_BYTES // 4 // 4  # float32 leaves of a quarter of the fuse size
        k = 3 * HOST_PACK_BYTES // (per_leaf * 4)  # three packs' worth
        leaves = [[np.arange(per_leaf, dtype=np.float32) * (i + 1) + 100 * r for i in range(k)] for r in range(2)]
        out = s.run(
            lambda: dv.get_replica_context().all_reduce(
                "sum", leaves[dv.get_replica_context().replica_id_in_sync_group]
            )
        )
        sizes = [c[1] * 4 for c in calls]
        assert len(sizes) >= 3 and max(sizes) <= HOST_PACK_BYTES and sum(sizes) == k * per_leaf * 4, sizes
        for i in range(k):
            want = leaves[0][i].astype(np.float64) + leaves[1][i]
            for r in range(2):
                np.testing.assert_array_equal(
                    out[i].values[r], want.astype(np.float32), err_msg=f"leaf {i} replica {r}"
                )
    finally:
        s.close()


def test_all_reduce_scalars_and_integer_mean(s2):
    def fn():
        r = dv.get_replica_context().replica_id_in_sync_group
        ctx = dv.get_replica_context()
        return (
            ctx.all_reduce("mean", r),
            ctx.all_reduce("sum", 1.5 + r),
            ctx.all_reduce("mean", np.array([r, 3 * r], np.int64)),
            ctx.all_reduce("max", np.array(r * 2.0)),
        )

    mean_ids, total, int_mean, zero_d = s2.run(fn)
    for r in range(2):
        assert isinstance(mean_ids.values[r], np.float64) and mean_ids.values[r] == 0.5
        assert isinstance(total.values[r], np.float64) and total.values[r] == 4.0
        assert int_mean.values[r].dtype == np.float64
        np.testing.assert_array_equal(int_mean.values[r], [0.5, 1.5])
        assert isinstance(zero_d.values[r], np.ndarray) and zero_d.values[r].shape == () and zero_d.values[r] == 2.0


def test_all_reduce_dtypes_beyond_the_engine(s2):
    def fn():
        r = dv.get_replica_context().replica_id_in_sync_group
        ctx = dv.get_replica_context()
        return (
            ctx.all_reduce("max", np.array([r == 0, False])),
            ctx.all_reduce("sum", np.array([r + 1, 300], np.int16)),
        )

    flags, shorts = s2.run(fn)
    for r in range(2):
        np.testing.assert_array_equal(flags.values[r], [True, False])
        assert shorts.values[r].dtype == np.int16
        np.testing.assert_array_equal(shorts.values[r], [3, 600])


def test_all_reduce_single_replica_strategy():
    s = dv.MirroredStrategy(["CPU:3"])
    try:
        x = np.arange(3.0)
        out = s.run(lambda: dv.get_replica_context().all_reduce("sum", x))
        np.testing.assert_array_equal(out, x)
        assert out is not x
    finally:
        s.close()


def test_all_gather(s3):
    xs = per_replica(3, shape=(2, 2), seed=6)

    def fn(x):
        ctx = dv.get_replica_context()
        r = ctx.replica_id_in_sync_group
        uneven = np.arange(r + 1, dtype=np.int64) + 10 * r
        return ctx.all_gather(x, axis=0), ctx.all_gather({"u": uneven, "t": (x,)}, axis=-1)

    first, nested = s3.run(fn, args=(xs,))
    uneven = [np.arange(r + 1, dtype=np.int64) + 10 * r for r in range(3)]
    for r in range(3):
        np.testing.assert_array_equal(first.values[r], np.concatenate(xs.values, 0))
        np.testing.assert_array_equal(nested["u"].values[r], np.concatenate(uneven))
        np.testing.assert_array_equal(nested["t"][0].values[r], np.concatenate(xs.values, -1))


def test_big_endian_and_timedelta_values_are_reduced(s2):
    def step():
        r = replica_id()
        big = np.arange(4, dtype=">f8") + r
        dt = np.array([r + 1, 2 * r], dtype="timedelta64[s]")
        ctx = dv.get_replica_context()
        return ctx.all_reduce("sum", big), ctx.all_reduce("sum", dt)

    big, dt = s2.run(step)
    for r in range(2):
        np.testing.assert_array_equal(big.values[r], 2 * np.arange(4) + 1)
        np.testing.assert_array_equal(dt.values[r], np.array([3, 2], dtype="timedelta64[s]"))


# ---- replicas that disagree -----------------------------------------------------------------


def test_a_replica_returning_while_others_wait_is_a_mismatch_at_once(s2):
    def fn():
        ctx = dv.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            ctx.all_reduce("sum", np.ones(2))

    t0 = time.monotonic()
    with pytest.raises(dv.MismatchError, match=r"replica 0 waits in all_reduce\(SUM\), but replica\(s\) 1 returned"):
        s2.run(fn)
    assert time.monotonic() - t0 < 5  # no timeout: seen at once


def test_replicas_calling_different_collectives(s3):
    def different():
        ctx = dv.get_replica_context()
        if replica_id() == 1:
            return ctx.all_gather(np.ones(3), axis=0)
        return ctx.all_reduce("sum", np.ones(3))

    t0 = time.monotonic()
    with pytest.raises(dv.MismatchError, match="replicas called different collectives") as info:
        s3.run(different)
    assert time.monotonic() - t0 < 5
    assert "all_reduce" in str(info.value) and "all_gather" in str(info.value)
    assert_usable(s3)

    def other_order():
        ctx = dv.get_replica_context()
        if replica_id() == 0:
            a = ctx.all_reduce("sum", np.ones(3))
            b = ctx.all_gather(np.ones(2), axis=0)
        else:
            b = ctx.all_gather(np.ones(2), axis=0)
            a = ctx.all_reduce("sum", np.ones(3))
        return a, b

    t0 = time.monotonic()
    with pytest.raises(dv.MismatchError, match="replicas called different collectives"):
        s3.run(other_order)
    assert time.monotonic() - t0 < 5
    assert_usable(s3)


def test_different_ops_shapes_and_dtypes_across_replicas(s3):
    """The engine's MismatchError (a ValueError) keeps its type and gains the replica."""
    for make in (
        lambda r: ("sum" if r else "max", np.ones(3)),
        lambda r: ("sum", np.ones(3 + r)),
        lambda r: ("sum", np.ones(3, np.float32 if r == 1 else np.float64)),
    ):

        def step():
            op, x = make(replica_id())
            return dv.get_replica_context().all_reduce(op, x)

        t0 = time.monotonic()
        with pytest.raises(dv.MismatchError, match="^replica \\d: ") as info:
            s3.run(step)
        assert time.monotonic() - t0 < 5
        assert isinstance(info.value, ValueError)
        assert_usable(s3)


@pytest.mark.parametrize("odd", [0, 2])
def test_dtype_differing_in_one_replica_names_it_and_both_dtypes(s3, odd):
    """complex128 goes through the engine as raw bytes while float64 is reduced by it:
    the error still speaks of dtypes, not of the engine calls."""

    def step():
        r = replica_id()
        x = np.arange(3, dtype=np.complex128 if r == odd else np.float64) + r
        return dv.get_replica_context().all_reduce("sum", x)

    t0 = time.monotonic()
    with pytest.raises(dv.MismatchError) as info:
        s3.run(step)
    assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert msg.startswith("replica "), msg
    assert f"replica {odd} passed dtype complex128" in msg and "passed dtype float64" in msg, msg
    assert "all_gather" not in msg and "uint8" not in msg, msg
    assert_usable(s3)

    # Same for nested values: every leaf dtype is shown.
    def nested():
        r = replica_id()
        return dv.get_replica_context().all_reduce(
            "sum", {"a": np.ones(2, np.float32), "b": np.ones(2, np.int32 if r == odd else np.int64)}
        )

    first, other = ("int32", "int64") if odd == 0 else ("int64", "int32")
    with pytest.raises(dv.MismatchError, match=f"passed dtype {first}, replica .* passed dtype {other} at \\['b'\\]"):
        s3.run(nested)
    assert_usable(s3)


def test_all_gather_mismatch_is_an_error(s2):
    def fn():
        r = dv.get_replica_context().replica_id_in_sync_group
        return dv.get_replica_context().all_gather(np.ones((2, 2 + r)), axis=0)

    with pytest.raises(
        dv.MismatchError,
        match=r"replica 0 passed shape \(2, 2\), replica 1 passed shape \(2, 3\); "
        "shapes may differ only along axis 0",
    ):
        s2.run(fn)


def test_a_ragged_list_is_named_with_its_replica_by_every_cross_replica_reduction(s2):
    ragged = dv.PerReplica(([1.0, 2.0], [1.0, [2.0, 3.0]]))
    calls = {
        "strategy.reduce": lambda: s2.reduce("SUM", ragged, axis=None),
        "reduce_to": lambda: s2.extended.reduce_to("SUM", ragged, s2.extended.worker_devices),
        "batch_reduce_to": lambda: s2.extended.batch_reduce_to("SUM", [(per_replica(2), None), (ragged, None)]),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{what}: replica 1's value of type list is not an array: "):
            call()


def test_a_mapping_that_is_not_a_dict_is_walked_like_one(s3):
    import types

    def step():
        r = replica_id()
        mine = {"w": np.full(2, r + 1.0)}
        return dv.get_replica_context().all_reduce("sum", types.MappingProxyType(mine) if r == 2 else mine)

    out = s3.run(step)
    for r, got in enumerate(s3.experimental_local_results(out)):
        assert isinstance(got, (dict, types.MappingProxyType)) and list(got) == ["w"]
        np.testing.assert_array_equal(got["w"], np.full(2, 6.0))
    assert_usable(s3)


@pytest.mark.parametrize("bad", [object(), "text", np.array([object(), object()])])
def test_values_that_are_not_numbers_are_refused_by_name(s3, bad):
    def step():
        r = replica_id()
        return dv.get_replica_context().all_reduce("sum", bad if r == 1 else np.ones(2))

    t0 = time.monotonic()
    with pytest.raises(TypeError, match="^replica 1: all_reduce cannot reduce a value of type") as info:
        s3.run(step)
    assert time.monotonic() - t0 < 5
    assert "Cannot change data-type" not in str(info.value)
    assert ("object" if not isinstance(bad, str) else "str") in str(info.value)
    assert info.value.replica == 1
    assert_usable(s3)

    if not isinstance(bad, str):
        with pytest.raises(TypeError, match="^replica 1: all_gather cannot send a value of type .*object"):
            s3.run(lambda: dv.get_replica_context().all_gather(bad if replica_id() == 1 else np.ones(2), axis=0))
        assert_usable(s3)


# ---- misplaced calls --------------------------------------------------------------------------


def test_reduce_inside_a_replica_context_is_an_error(s3):
    value = per_replica(3)
    for step, args in (
        (lambda: s3.reduce("sum", np.ones(2), axis=None), ()),
        (lambda x: s3.reduce("SUM", x), (value,)),
    ):
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="cross-replica context.*merge_call") as info:
            s3.run(step, args=args)
        assert time.monotonic() - t0 < 5
        assert str(info.value).startswith("replica ")
        assert_usable(s3)


def test_values_of_another_strategy(s3):
    other = mirrored(2)
    try:
        with other.scope():
            v = dv.Variable(np.zeros(2))
        with pytest.raises(RuntimeError, match="belongs to MirroredStrategy"):
            s3.run(lambda: v.assign_add(np.ones(2)))
        with pytest.raises(RuntimeError, match="belongs to MirroredStrategy"):
            s3.run(lambda: v + 1)  # reading it too
        pair = other.run(lambda: np.full(2, replica_id(), np.float64))
        with pytest.raises(ValueError, match="a PerReplica with 2 values"):
            s3.run(lambda x: x, args=(pair,))
        with pytest.raises(ValueError, match="a PerReplica with 2 values"):
            s3.reduce("sum", pair, axis=None)
        assert_usable(s3)
        assert_usable(other)
    finally:
        other.close()


# ---- OneDeviceStrategy ------------------------------------------------------------------------


def test_one_device_strategy():
    s = dv.OneDeviceStrategy("/cpu:0")
    try:
        assert s.num_replicas_in_sync == 1
        assert repr(s) == "OneDeviceStrategy(device='CPU:0')"
        x = np.arange(4.0)

        def fn(v):
            ctx = dv.get_replica_context()
            assert ctx is not None and ctx.strategy is s and ctx.replica_id_in_sync_group == 0
            return ctx.all_reduce("sum", v) + 1

        np.testing.assert_array_equal(s.run(fn, args=(x,)), x + 1)
        got = s.reduce("SUM", x)
        np.testing.assert_array_equal(got, x)
        assert not np.shares_memory(got, x)
        batches = list(s.experimental_distribute_dataset([np.arange(4.0)]))
        np.testing.assert_array_equal(batches[0], np.arange(4.0))
        with s.scope():
            assert dv.get_strategy() is s
    finally:
        s.close()
    with pytest.raises(TypeError, match="device string"):
        dv.OneDeviceStrategy(["CPU:0"])


def test_library_imports_no_framework():
    # In a fresh interpreter: other tests of this process may have imported them.
    code = (
        "import sys, numpy as np, distvals as dv\n"
        "s = dv.MirroredStrategy(['CPU:0', 'CPU:1'])\n"
        "out = s.run(lambda: dv.get_replica_context().all_reduce('sum', np.ones(3)))\n"
        "print(sorted(m for m in ('tensorflow', 'torch', 'cupy', 'jax', 'mpi4py') if m in sys.modules))\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_reducing_or_gathering_a_plain_array_gives_a_new_array():
    # An in-place update of the result must not change the value it came from (what
    # run returned on one device), as for the result of reducing a PerReplica.
    one = dv.OneDeviceStrategy("CPU:0")
    loss = one.run(lambda: np.array([1.0, 2.0]))
    total = one.reduce("SUM", loss, axis=None)
    total *= 10
    np.testing.assert_array_equal(loss, [1.0, 2.0])
    np.testing.assert_array_equal(total, [10.0, 20.0])
    two = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    x = np.array([1.0, 2.0])
    for got in (two.reduce("MEAN", x, axis=None), two.gather(x, 0), one.gather(loss, 0)):
        assert not np.shares_memory(got, x) and not np.shares_memory(got, loss)
        got += 100
    np.testing.assert_array_equal(x, [1.0, 2.0])
    np.testing.assert_array_equal(loss, [1.0, 2.0])
