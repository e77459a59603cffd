"""IndexedSlices through the collectives: ``ReplicaContext.all_reduce``, ``strategy.reduce``,
``extended.reduce_to`` and ``batch_reduce_to``.

As in TensorFlow, SUM gathers every replica's rows (indices and values concatenated in
replica order, dense_shape kept) and MEAN also divides the values by the number of
replicas; replicas may pass different numbers of rows. Every replica's result is
compared with a float64 numpy reference, both as rows and made dense; each replica
passes its own values and indices.
"""

from __future__ import annotations

import numpy as np
import pytest
from simulated_cuda import SimulatedCuda, install

import distvals as dv
from distvals import config, devices

WIDTH = 3
DENSE_ROWS = 10


def slices_for(r: int, rows: int, dtype="float32", indices_dtype="int64") -> dv.IndexedSlices:
    """Replica r's IndexedSlices: ``rows`` rows of its own values, at its own indices
    (repeated ones too: rows that land on one index add up)."""
    values = (np.arange(rows * WIDTH, dtype=np.float64).reshape(rows, WIDTH) + 10 * r + 1) * (-1) ** r
    indices = (np.arange(rows) * (r + 2) + r) % DENSE_ROWS
    if rows > 1:
        indices[-1] = indices[0]
    return dv.IndexedSlices(values.astype(dtype), indices.astype(indices_dtype), (DENSE_ROWS, WIDTH))


def dense(values, indices, shape=(DENSE_ROWS, WIDTH)) -> np.ndarray:
    out = np.zeros(shape, np.float64)
    np.add.at(out, np.asarray(indices), np.asarray(values, np.float64))
    return out


def expected(parts, op: str):
    """The float64 reference: (values, indices, dense) of the reduction of ``parts``."""
    n = len(parts)
    values = np.concatenate([np.asarray(p.values, np.float64) for p in parts], axis=0)
    indices = np.concatenate([np.asarray(p.indices) for p in parts])
    total = sum(dense(p.values, p.indices) for p in parts)
    if op == "MEAN":
        return values / n, indices, total / n
    return values, indices, total


def check_slices(got, parts, op: str, what: str, values_dtype=None, tol=1e-6) -> None:
    want_values, want_indices, want_dense = expected(parts, op)
    assert isinstance(got, dv.IndexedSlices), f"{what}: a {type(got).__name__}"
    got_values = devices.to_host(got.values)
    got_indices = devices.to_host(got.indices)
    assert got_values.dtype == np.dtype(values_dtype or parts[0].values.dtype), f"{what}: {got_values.dtype}"
    assert got_indices.dtype == np.asarray(parts[0].indices).dtype, f"{what}: {got_indices.dtype}"
    np.testing.assert_array_equal(got_indices, want_indices, err_msg=f"{what}: indices")
    np.testing.assert_allclose(got_values.astype(np.float64), want_values, rtol=tol, atol=tol, err_msg=what)
    np.testing.assert_allclose(dense(got_values, got_indices), want_dense, rtol=tol, atol=tol, err_msg=what)
    assert tuple(got.dense_shape) == (DENSE_ROWS, WIDTH), f"{what}: dense_shape {got.dense_shape}"


def strategy(n: int, execution: str, **kwargs) -> dv.MirroredStrategy:
    return dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=execution, **kwargs)


def rid() -> int:
    return dv.get_replica_context().replica_id_in_sync_group


def all_reduce_step(op, make):
    def step():
        ctx = dv.get_replica_context()
        return ctx.all_reduce(op, make(ctx.replica_id_in_sync_group))

    return step


# ---- inside strategy.run ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_all_reduce_gathers_every_replicas_rows_in_replica_order(execution, n, op):
    parts = [slices_for(r, r + 2) for r in range(n)]
    kept = [(p.values.copy(), p.indices.copy()) for p in parts]
    with strategy(n, execution) as s:
        out = s.run(all_reduce_step(op, lambda r: parts[r]))
    for r in range(n):
        check_slices(out.values[r], parts, op, f"replica {r}")
        # Each replica's own arrays: no replica sees another's change.
        for k in range(r):
            assert not np.shares_memory(out.values[r].values, out.values[k].values)
        np.testing.assert_array_equal(parts[r].values, kept[r][0], err_msg=f"replica {r}'s input changed")
        np.testing.assert_array_equal(parts[r].indices, kept[r][1], err_msg=f"replica {r}'s input changed")


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_replicas_may_pass_different_numbers_of_rows_and_none(execution, op):
    rows = [0, 3, 1]  # replica 0 touches no row at all
    parts = [slices_for(r, rows[r]) for r in range(3)]
    with strategy(3, execution) as s:
        out = s.run(all_reduce_step(op, lambda r: parts[r]))
    for r in range(3):
        check_slices(out.values[r], parts, op, f"replica {r}")
        assert len(out.values[r].indices) == 4


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_a_structure_mixes_indexed_slices_and_dense_arrays(execution, n, op):
    def value(r):
        return {
            "bias": np.arange(4, dtype=np.float32) * (r + 1) - r,
            "embedding": slices_for(r, r + 1),
            "pair": (np.full((2, 2), 3 * r + 1, np.int32), slices_for(r, 2, "float64")),
        }

    inputs = [value(r) for r in range(n)]
    with strategy(n, execution) as s:
        out = s.run(all_reduce_step(op, lambda r: inputs[r]))
    bias = np.stack([np.asarray(v["bias"], np.float64) for v in inputs])
    counts = np.stack([np.asarray(v["pair"][0], np.float64) for v in inputs])
    for r in range(n):
        got = out["bias"].values[r]
        assert isinstance(out["pair"], tuple)  # the structure kept (run regroups it)
        want_bias = bias.sum(0) if op == "SUM" else bias.mean(0)
        np.testing.assert_allclose(got, want_bias, rtol=1e-6, err_msg=f"replica {r}")
        assert got.dtype == np.float32
        got_counts = out["pair"][0].values[r]
        # Integer MEAN is float64, as for any dense value.
        assert got_counts.dtype == (np.int32 if op == "SUM" else np.float64)
        np.testing.assert_allclose(got_counts, counts.sum(0) if op == "SUM" else counts.mean(0), err_msg=f"{r}")
        check_slices(out["embedding"].values[r], [v["embedding"] for v in inputs], op, f"replica {r} embedding")
        check_slices(out["pair"][1].values[r], [v["pair"][1] for v in inputs], op, f"replica {r} pair", tol=1e-12)


class Key:
    """A dict key that prints like every other (as two unnamed variables' refs do)."""

    def __repr__(self) -> str:
        return "<Key>"


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_leaves_under_keys_that_print_alike_keep_their_own_rows(execution, op):
    a, b, nan_a, nan_b = Key(), Key(), float("nan"), float("nan")

    def value(r):
        return {
            a: slices_for(r, 2),
            b: slices_for(r + 5, 3),
            nan_a: slices_for(r + 10, 1),
            nan_b: slices_for(r + 20, 2),
            "dense": np.full(3, r + 1.0),
        }

    inputs = [value(r) for r in range(3)]
    with strategy(3, execution) as s:
        out = s.run(all_reduce_step(op, lambda r: inputs[r]))
    for r in range(3):
        for key in (a, b, nan_a, nan_b):
            check_slices(out[key].values[r], [v[key] for v in inputs], op, f"replica {r}, key {key!r} #{id(key)}")


@pytest.mark.parametrize(
    "dtype,op,result",
    [
        ("int32", "SUM", "int32"),
        ("int32", "MEAN", "float64"),
        ("int8", "MEAN", "float32"),
        ("float16", "MEAN", "float16"),
        ("float16", "SUM", "float16"),
    ],
)
def test_values_keep_their_dtype_and_integer_mean_is_float(execution, dtype, op, result):
    parts = [slices_for(r, 2, dtype, "int32") for r in range(3)]
    with strategy(3, execution) as s:
        out = s.run(all_reduce_step(op, lambda r: parts[r]))
    tol = 1e-3 if dtype == "float16" or result == "float16" else 1e-6
    for r in range(3):
        check_slices(out.values[r], parts, op, f"replica {r}", values_dtype=result, tol=tol)


def test_with_one_replica_and_in_the_default_context(execution):
    part = slices_for(1, 3)
    with strategy(1, execution) as s:
        out = s.run(all_reduce_step("MEAN", lambda r: part))
    check_slices(out, [part], "MEAN", "one replica")
    check_slices(dv.get_replica_context().all_reduce("SUM", part), [part], "SUM", "default context")


def test_reduction_to_one_device_and_options_give_the_same_rows(execution):
    parts = [slices_for(r, 2 + r) for r in range(3)]
    with strategy(3, execution, cross_device_ops=dv.ReductionToOneDevice()) as s:
        out = s.run(all_reduce_step("SUM", lambda r: {"e": parts[r], "d": np.float64(r + 0.5)}))
        opts = dv.CommunicationOptions(timeout_seconds=30)
        again = s.run(lambda: dv.get_replica_context().all_reduce("MEAN", parts[rid()], options=opts))
    for r in range(3):
        check_slices(out["e"].values[r], parts, "SUM", f"replica {r}")
        assert out["d"].values[r] == pytest.approx(0.5 + 1.5 + 2.5)
        check_slices(again.values[r], parts, "MEAN", f"replica {r}")


# ---- errors: named, raised before anything is reduced ---------------------------------------------


@pytest.mark.parametrize("op", ["MIN", "MAX", "PRODUCT"])
def test_ops_other_than_sum_and_mean_are_refused(execution, op):
    # Each replica refuses its own (on threads, whichever refuses first is reported).
    with strategy(2, execution) as s:
        with pytest.raises(
            ValueError, match=rf"replica [01]: all_reduce cannot reduce an IndexedSlices at \['e'\] with {op}"
        ):
            s.run(all_reduce_step(op, lambda r: {"e": slices_for(r, 2), "d": np.ones(2)}))
        # A dense value alone is still reduced with that op.
        out = s.run(all_reduce_step(op, lambda r: np.array([r + 2.0])))
    want = {"MIN": 2.0, "MAX": 3.0, "PRODUCT": 6.0}[op]
    assert [float(v[0]) for v in out.values] == [want, want]


MISMATCHES = {
    "values dtype": (
        lambda r: slices_for(r, 2, "float32" if r < 2 else "float64"),
        r"replica 0 passed IndexedSlices values of dtype float32, replica 2 of dtype float64",
    ),
    "row shape": (
        lambda r: dv.IndexedSlices(np.ones((2, 3 if r < 2 else 4), np.float32), np.array([0, r])),
        r"replica 0 passed IndexedSlices values of shape \(2, 3\), replica 2 of shape \(2, 4\)",
    ),
    "indices dtype": (
        lambda r: slices_for(r, 2, indices_dtype="int64" if r < 2 else "int32"),
        r"replica 0 passed IndexedSlices indices of dtype int64, replica 2 of dtype int32",
    ),
    "dense_shape": (
        lambda r: dv.IndexedSlices(np.ones((1, 3), np.float32), np.array([r]), (10 + r // 2, 3)),
        r"replica 0 passed an IndexedSlices of dense_shape \(10, 3\), replica 2 of dense_shape \(11, 3\)",
    ),
    "dense on one replica": (
        lambda r: slices_for(r, 2) if r < 2 else np.ones((2, 3), np.float32),
        r"replica 0 passed an IndexedSlices at \[1\], replica 2 a dense value of dtype float32 and shape \(2, 3\)",
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_replicas_that_disagree_get_a_mismatch_error_naming_them(execution, case):
    make, message = MISMATCHES[case]
    before = [None] * 3

    def step():
        r = rid()
        value = make(r)
        before[r] = np.array(value.values if isinstance(value, dv.IndexedSlices) else value, copy=True)
        return dv.get_replica_context().all_reduce("SUM", [np.full(2, r, np.float32), value])

    with strategy(3, execution) as s:
        with pytest.raises(dv.MismatchError, match=message):
            s.run(step)
        # The strategy still works afterwards: nothing was left half done.
        ok = s.run(all_reduce_step("SUM", lambda r: slices_for(r, 1)))
    for r in range(3):
        check_slices(ok.values[r], [slices_for(k, 1) for k in range(3)], "SUM", f"replica {r}")


@pytest.mark.parametrize("dense_first", [True, False])
def test_one_array_against_one_indexed_slices_is_a_mismatch(execution, dense_first):
    # A lone numpy array takes the quick path of all_reduce; the meeting still names it.
    dense_replica = 0 if dense_first else 1

    def value(r):
        return np.ones((2, 3), np.float32) if r == dense_replica else slices_for(r, 2)

    with (
        strategy(2, execution) as s,
        pytest.raises(
            dv.MismatchError,
            match=rf"replica {1 - dense_replica} passed an IndexedSlices, replica {dense_replica} a dense value of "
            r"dtype float32 and shape \(2, 3\)",
        ),
    ):
        s.run(all_reduce_step("SUM", value))


BAD_SLICES = {
    "float indices": (
        lambda: dv.IndexedSlices(np.ones((1, 3), np.float32), np.array([1.0])),
        TypeError,
        r"replica 1: all_reduce: the indices of the IndexedSlices must be integers, got dtype float64",
    ),
    "matrix of indices": (
        lambda: dv.IndexedSlices(np.ones((1, 3), np.float32), np.array([[1]])),
        ValueError,
        r"replica 1: all_reduce: the indices of the IndexedSlices must be a vector, got shape \(1, 1\)",
    ),
    "a row per index": (
        lambda: dv.IndexedSlices(np.ones((3, 3), np.float32), np.array([0, 1])),
        ValueError,
        r"replica 1: all_reduce: the IndexedSlices has 2 indices and values of shape \(3, 3\)",
    ),
    "dense_shape": (
        lambda: dv.IndexedSlices(np.ones((1, 3), np.float32), np.array([0]), (10, 4)),
        ValueError,
        r"replica 1: all_reduce: the IndexedSlices has dense_shape \(10, 4\) and values of shape \(1, 3\)",
    ),
    "object values": (
        lambda: dv.IndexedSlices(np.array([[object()]]), np.array([0])),
        TypeError,
        r"replica 1: all_reduce cannot reduce the values of the IndexedSlices, of type",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SLICES))
def test_a_bad_indexed_slices_is_named_in_its_replica(execution, case):
    make, error, message = BAD_SLICES[case]
    with strategy(2, execution) as s, pytest.raises(error, match=message):
        s.run(all_reduce_step("SUM", lambda r: slices_for(r, 1) if r == 0 else make()))


# ---- cross-replica context ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_strategy_reduce_and_reduce_to_gather_the_rows(execution, n, op):
    parts = [slices_for(r, n - r) for r in range(n)]
    with strategy(n, execution) as s:
        per = s.run(lambda: parts[rid()])
        assert isinstance(per, dv.PerReplica)
        check_slices(s.reduce(op, per, axis=None), parts, op, "strategy.reduce")
        nested = s.reduce(op, {"e": per, "d": s.run(lambda: np.full(2, rid() + 1.0))}, axis=None)
        check_slices(nested["e"], parts, op, "strategy.reduce of a structure")
        d = np.arange(1, n + 1, dtype=np.float64)
        np.testing.assert_allclose(nested["d"], np.full(2, d.sum() if op == "SUM" else d.mean()))
        mirrored = s.extended.reduce_to(op, per, s.extended.worker_devices)
        assert isinstance(mirrored, dv.Mirrored)
        for r in range(n):
            check_slices(mirrored.values[r], parts, op, f"reduce_to copy {r}")
        for r in range(1, n):
            assert not np.shares_memory(mirrored.values[r].values, mirrored.values[0].values)
        check_slices(s.extended.reduce_to(op, per, "CPU:0"), parts, op, "reduce_to one device")


def test_batch_reduce_to_takes_indexed_slices_beside_dense_values(execution):
    parts = [slices_for(r, 2 * r + 1) for r in range(3)]
    with strategy(3, execution) as s:
        sparse = s.run(lambda: parts[rid()])
        dense_value = s.run(lambda: np.full(3, 2.0 * rid() + 1, np.float32))
        devs = s.extended.worker_devices
        out = s.extended.batch_reduce_to("MEAN", [(dense_value, devs), (sparse, devs), (sparse, "CPU:1")])
    for r in range(3):
        np.testing.assert_allclose(out[0].values[r], np.full(3, 3.0))
        check_slices(out[1].values[r], parts, "MEAN", f"batch_reduce_to copy {r}")
    check_slices(out[2], parts, "MEAN", "batch_reduce_to onto one device")


def test_a_plain_indexed_slices_stands_for_every_replicas(execution):
    part = slices_for(2, 3)
    with strategy(2, execution) as s:
        assert s.reduce("MEAN", part, axis=None) is part
        with pytest.raises(ValueError, match=r"strategy.reduce: a non-distributed value cannot be reduced with SUM"):
            s.reduce("SUM", part, axis=None)
        with pytest.raises(ValueError, match=r"strategy.reduce cannot reduce an IndexedSlices with MAX"):
            s.reduce("MAX", part, axis=None)
    with strategy(1, execution) as s:
        assert s.reduce("SUM", part, axis=None) is part
        with pytest.raises(ValueError, match=r"strategy.reduce: IndexedSlices are reduced across replicas only"):
            s.reduce("MEAN", part, axis=0)


def test_cross_replica_errors_name_the_call_and_the_replica(execution):
    with strategy(2, execution) as s:
        per = s.run(lambda: slices_for(rid(), 2))
        with pytest.raises(ValueError, match=r"strategy.reduce cannot reduce an IndexedSlices with MAX"):
            s.reduce("MAX", per, axis=None)
        with pytest.raises(ValueError, match=r"strategy.reduce: IndexedSlices are reduced across replicas only"):
            s.reduce("SUM", per, axis=0)
        mixed = dv.PerReplica((slices_for(0, 1), np.ones((1, 3), np.float32)))
        with pytest.raises(dv.MismatchError, match=r"replica 0's value is an IndexedSlices, replica 1's a ndarray"):
            s.reduce("SUM", mixed, axis=None)
        other = dv.PerReplica((slices_for(0, 1), slices_for(1, 1, "float64")))
        with pytest.raises(
            dv.MismatchError, match=r"reduce_to: replica 0 passed IndexedSlices values of dtype float32"
        ):
            s.extended.reduce_to("SUM", other, s.extended.worker_devices)


# ---- GPU replicas (the simulated backend) -----------------------------------------------------------


@pytest.fixture
def gpus(monkeypatch):
    before = config.get_logical_gpus()
    install(SimulatedCuda(2), monkeypatch.setattr)
    try:
        yield
    finally:
        config.set_logical_gpus(before)


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_gpu_replicas_gather_rows_on_their_devices(gpus, op):
    parts = [slices_for(r, 3 - r) for r in range(2)]

    def on_device(r):
        p = parts[r]
        return dv.IndexedSlices(
            devices.to_replica_device(p.values, r), devices.to_replica_device(p.indices, r), p.dense_shape
        )

    with dv.MirroredStrategy(["GPU:0", "GPU:1"]) as s:
        out = s.run(all_reduce_step(op, lambda r: {"e": on_device(r), "d": np.full(2, r + 1.0, np.float32)}))
        host = s.run(all_reduce_step(op, lambda r: parts[r]))
        per = s.run(lambda: on_device(rid()))
        reduced = s.reduce(op, per, axis=None)
    for r in range(2):
        got = out["e"].values[r]
        assert devices.place_of(got.values) == r, f"replica {r}'s values on GPU {devices.place_of(got.values)}"
        check_slices(got, parts, op, f"replica {r}")
        np.testing.assert_allclose(devices.to_host(out["d"].values[r]), np.full(2, 3.0 if op == "SUM" else 1.5))
        assert isinstance(host.values[r].values, np.ndarray)  # numpy in, numpy out
        check_slices(host.values[r], parts, op, f"replica {r} from host arrays")
    check_slices(reduced, parts, op, "strategy.reduce")
