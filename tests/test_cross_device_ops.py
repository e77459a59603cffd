"""``CrossDeviceOps.reduce``, ``batch_reduce`` and ``broadcast`` called directly, for
every cross-device ops class, on MirroredStrategy with 2 and 3 CPU replicas in both
execution modes: results against a float64 numpy reference on every destination, the
forms of destinations, which strategy runs the call, and the errors."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import distvals as dv

OPS = {
    "CollectiveAllReduce": lambda: dv.CollectiveAllReduce(),
    "CollectiveAllReduce(ring)": lambda: dv.CollectiveAllReduce("ring"),
    "ReductionToOneDevice": lambda: dv.ReductionToOneDevice(),
    "ReductionToOneDevice(CPU:1)": lambda: dv.ReductionToOneDevice(reduce_to_device="/cpu:1"),
    "NcclAllReduce": lambda: dv.NcclAllReduce(),
    "HierarchicalCopyAllReduce": lambda: dv.HierarchicalCopyAllReduce(num_packs=2),
}
OPS_NAMES = list(OPS)
REDUCE_OPS = ["SUM", "MEAN", "MAX"]


@pytest.fixture(scope="module", params=[(n, mode) for n in (2, 3) for mode in ("inline", "threads")], ids=str)
def shape(request):
    """(replicas, execution mode) of the strategies a test makes."""
    return request.param


@pytest.fixture(scope="module", params=OPS_NAMES)
def made(request, shape):
    """(strategy, ops): a MirroredStrategy made with ``ops`` as its cross_device_ops."""
    n, mode = shape
    ops = OPS[request.param]()
    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], cross_device_ops=ops, execution=mode)
    yield s, ops
    s.close()


@pytest.fixture(params=OPS_NAMES)
def free_ops(request):
    """A cross-device ops object that no strategy was made with."""
    return OPS[request.param]()


@pytest.fixture(scope="module")
def plain(shape):
    """A MirroredStrategy with the default cross-device ops."""
    n, mode = shape
    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=mode)
    yield s
    s.close()


def per_replica(n, shape=(4,), dtype=np.float32, seed=0):
    """Distinct values per replica (replica r's are offset by 10 r), exact in float32."""
    rng = np.random.default_rng(seed)
    return dv.PerReplica(tuple((rng.integers(-5, 6, size=shape) + 10 * r).astype(dtype) for r in range(n)))


def ref(parts, op):
    stack = np.stack([np.asarray(p, np.float64) for p in parts])
    return {"SUM": stack.sum(0), "MEAN": stack.mean(0), "MAX": stack.max(0), "MIN": stack.min(0)}[op]


def full(i):
    return f"/job:localhost/replica:0/task:0/device:CPU:{i}"


def destination_forms(s, value):
    """(destinations, how many copies the result has): every form TensorFlow code passes."""
    n = s.num_replicas_in_sync
    devices = [f"CPU:{i}" for i in range(n)]
    return [
        ("CPU:0", 1),
        ("/cpu:1", 1),
        (full(n - 1), 1),
        (devices, n),
        (tuple(full(i) for i in range(n)), n),
        (s.extended.worker_devices, n),
        (["CPU:1", "/cpu:0"], 2),
        (value, n),  # a distributed value: its devices
    ]


def assert_on_each(out, copies, want, what, dtype=None):
    """``out`` is the value itself for one copy, else a Mirrored of ``copies`` separate
    arrays; each equals ``want`` (float64 reference), in ``dtype`` when given."""
    parts = [out] if copies == 1 else None
    if copies == 1:
        assert not isinstance(out, dv.DistributedValues), what
    else:
        assert isinstance(out, dv.Mirrored), what
        assert len(out.values) == copies, what
        parts = list(out.values)
    for i, p in enumerate(parts):
        np.testing.assert_allclose(np.asarray(p, np.float64), want, rtol=1e-6, err_msg=f"{what}: copy {i}")
        if dtype is not None:
            assert np.asarray(p).dtype == np.dtype(dtype), f"{what}: copy {i}"
    for i in range(1, len(parts)):
        assert not np.shares_memory(np.asarray(parts[0]), np.asarray(parts[i])), f"{what}: copy {i} is copy 0"


# ---- reduce ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_per_replica_onto_every_form_of_destinations(made, op):
    s, ops = made
    value = per_replica(s.num_replicas_in_sync, seed=3)
    want = ref(value.values, op)
    for dests, copies in destination_forms(s, value):
        out = ops.reduce(op, value, dests)
        assert_on_each(out, copies, want, f"{ops!r}.reduce({op}) onto {dests!r}", np.float32)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_of_a_mirrored_reduces_its_copies(made, op):
    """As TensorFlow's CrossDeviceOps: SUM adds the N copies, MEAN and MAX give the value."""
    s, ops = made
    n = s.num_replicas_in_sync
    value = ops.broadcast(np.array([1.5, -2.0, 7.0]), s.extended.worker_devices)
    assert isinstance(value, dv.Mirrored)
    want = np.array([1.5, -2.0, 7.0]) * (n if op == "SUM" else 1)
    assert_on_each(ops.reduce(op, value, value), n, want, f"{op} of a Mirrored")
    assert_on_each(ops.reduce(op, value, "CPU:1"), 1, want, f"{op} of a Mirrored onto CPU:1")


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_of_one_replicas_value_gives_it_back(made, op):
    """A value that is not distributed, or a PerReplica of one part, is one replica's
    value (TensorFlow makes it a PerReplica of one): every op gives it back."""
    s, ops = made
    n = s.num_replicas_in_sync
    x = np.array([3, -1, 8], dtype=np.int32)
    mean_dtype = np.float64 if op == "MEAN" else np.int32  # an integer MEAN is float64
    for value in (x, dv.PerReplica((x,))):
        assert_on_each(ops.reduce(op, value, "CPU:0"), 1, x, f"{op} of {type(value).__name__}", mean_dtype)
        out = ops.reduce(op, value, s.extended.worker_devices)
        assert_on_each(out, n, x, f"{op} of {type(value).__name__} onto every device", mean_dtype)
    np.testing.assert_array_equal(x, [3, -1, 8])  # the input is left alone
    assert ops.reduce(op, 2.5, "CPU:0") == 2.5


def test_reduce_of_a_mirrored_variable_onto_the_variable(made):
    s, ops = made
    n = s.num_replicas_in_sync
    with s.scope():
        v = dv.Variable(np.array([1.0, 2.0, 4.0]))
    assert isinstance(v, dv.MirroredVariable)
    assert_on_each(ops.reduce("SUM", v, v), n, np.array([1.0, 2.0, 4.0]) * n, "SUM of a MirroredVariable")
    assert_on_each(ops.reduce("MEAN", v, "CPU:0"), 1, [1.0, 2.0, 4.0], "MEAN of a MirroredVariable")
    value = per_replica(n, shape=(3,), dtype=np.float64, seed=5)
    assert_on_each(ops.reduce("MAX", value, v), n, ref(value.values, "MAX"), "onto a variable's devices")


def test_reduce_of_a_sync_on_read_variable_reduces_every_copy(made):
    s, ops = made
    n = s.num_replicas_in_sync
    with s.scope():
        v = dv.Variable(
            np.zeros(2),
            synchronization=dv.VariableSynchronization.ON_READ,
            aggregation=dv.VariableAggregation.SUM,
        )
    s.run(lambda: v.assign(np.array([1.0, 2.0]) * (dv.get_replica_context().replica_id_in_sync_group + 1)))
    want = ref([np.array([1.0, 2.0]) * (r + 1) for r in range(n)], "SUM")
    assert_on_each(ops.reduce("SUM", v, "CPU:0"), 1, want, "SUM of a SyncOnReadVariable")


def test_reduce_inside_merge_call_is_cross_replica(made):
    s, ops = made
    n = s.num_replicas_in_sync

    def step():
        r = dv.get_replica_context().replica_id_in_sync_group
        x = np.array([r + 1.0, 10.0 * r])
        return dv.get_replica_context().merge_call(lambda st, v: ops.reduce("SUM", v, "CPU:0"), args=(x,))

    out = s.run(step)
    want = ref([np.array([r + 1.0, 10.0 * r]) for r in range(n)], "SUM")
    for part in s.experimental_local_results(out):
        np.testing.assert_allclose(part, want)


# ---- batch_reduce ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_batch_reduce_each_pair_in_order(made, op):
    s, ops = made
    n = s.num_replicas_in_sync
    a = per_replica(n, seed=1)
    b = per_replica(n, shape=(2, 3), dtype=np.float64, seed=2)
    m = ops.broadcast(np.array([4.0, 5.0]), s.extended.worker_devices)
    x = np.array([7.0, -7.0])
    out = ops.batch_reduce(op, [(a, "CPU:0"), (b, s.extended.worker_devices), (m, ["CPU:1", "CPU:0"]), (x, b), (a, a)])
    assert isinstance(out, list) and len(out) == 5
    assert_on_each(out[0], 1, ref(a.values, op), "item 0", np.float32)
    assert_on_each(out[1], n, ref(b.values, op), "item 1", np.float64)
    assert_on_each(out[2], 2, np.array([4.0, 5.0]) * (n if op == "SUM" else 1), "item 2 (a Mirrored)")
    assert_on_each(out[3], n, x, "item 3 (one replica's value)")
    assert_on_each(out[4], n, ref(a.values, op), "item 4", np.float32)
    assert ops.batch_reduce(op, []) == []


# ---- broadcast ------------------------------------------------------------------------------


def test_broadcast_onto_every_form_of_destinations(made):
    s, ops = made
    x = np.array([[1, 2], [3, 4]], dtype=np.int64)
    for dests, copies in destination_forms(s, per_replica(s.num_replicas_in_sync)):
        out = ops.broadcast(x, dests)
        assert_on_each(out, copies, x, f"broadcast onto {dests!r}", np.int64)
        if copies > 1:
            assert all(p is not x for p in out.values)
    m = ops.broadcast(x, s.extended.worker_devices)
    assert_on_each(ops.broadcast(m, ["CPU:0", "CPU:1"]), 2, x, "broadcast of a Mirrored", np.int64)
    with pytest.raises(ValueError, match=rf"^{type(ops).__name__}\.broadcast: the value is a PerReplica"):
        ops.broadcast(per_replica(s.num_replicas_in_sync), "CPU:0")


# ---- which strategy, and the ops' own choice ---------------------------------------------------


def test_an_ops_object_of_no_strategy_runs_on_the_strategy_in_scope(plain, free_ops):
    n = plain.num_replicas_in_sync
    value = per_replica(n, seed=8)
    with plain.scope():
        out = free_ops.reduce("SUM", value, plain.extended.worker_devices)
        (pair,) = free_ops.batch_reduce("MEAN", [(value, "CPU:1")])
    assert_on_each(out, n, ref(value.values, "SUM"), "reduce in scope")
    assert_on_each(pair, 1, ref(value.values, "MEAN"), "batch_reduce in scope")


def test_outside_any_scope_an_ops_object_of_no_strategy_uses_the_default_strategy(free_ops):
    x = np.array([1.0, 2.0])
    assert_on_each(free_ops.reduce("SUM", x, ["CPU:0", "CPU:1"]), 2, x, "plain value, default strategy")
    assert_on_each(free_ops.broadcast(x, "CPU:0"), 1, x, "broadcast, default strategy")
    with pytest.raises(ValueError, match=r"PerReplica with 2 values, but DefaultStrategy\(\) has 1 replica;"):
        free_ops.reduce("SUM", per_replica(2), "CPU:0")


def test_collective_all_reduce_algorithm_is_used_unless_options_name_one(plain, monkeypatch):
    n = plain.num_replicas_in_sync
    ext = plain.extended
    seen = []
    original = ext._all_reduce_leaves

    def spy(op, leaves, algorithm, *args, **kwargs):
        seen.append(algorithm)
        return original(op, leaves, algorithm, *args, **kwargs)

    monkeypatch.setattr(ext, "_all_reduce_leaves", spy)
    value = per_replica(n, seed=9)
    want = ref(value.values, "SUM")
    with plain.scope():
        assert_on_each(dv.CollectiveAllReduce("tree").reduce("SUM", value, value), n, want, "tree")
        assert_on_each(dv.CollectiveAllReduce("ring").batch_reduce("SUM", [(value, value)])[0], n, want, "ring")
        opts = dv.CommunicationOptions(implementation="direct")
        assert_on_each(dv.CollectiveAllReduce("ring").reduce("SUM", value, value, opts), n, want, "options")
        assert_on_each(dv.NcclAllReduce().reduce("SUM", value, value), n, want, "the strategy's")
    assert seen == ["tree", "ring", "direct", ext._algorithm]


def test_a_strategy_made_with_reduction_to_one_device_reduces_through_it(shape, monkeypatch):
    n, mode = shape
    ops = dv.ReductionToOneDevice(reduce_to_device="CPU:1")
    with dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], cross_device_ops=ops, execution=mode) as s:
        roots = []
        original = s.extended._all_reduce_via_root
        monkeypatch.setattr(
            s.extended,
            "_all_reduce_via_root",
            lambda op, leaves: roots.append(s.extended._via_root) or original(op, leaves),
        )
        value = per_replica(n, seed=10)
        assert_on_each(ops.reduce("MAX", value, value), n, ref(value.values, "MAX"), "via CPU:1")
        assert roots == [1]


def test_the_strategy_of_a_variable_runs_the_call(shape):
    n, mode = shape
    ops = dv.NcclAllReduce()
    with dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=mode) as s:
        with s.scope():
            v = dv.Variable(np.array([2.0, 3.0]))
        # ops belongs to no strategy and no scope is entered: the variable names s.
        assert_on_each(ops.reduce("SUM", v, v), n, np.array([2.0, 3.0]) * n, "the variable's strategy")
        assert_on_each(ops.broadcast(np.ones(2), v), n, np.ones(2), "broadcast onto a variable")


def test_copies_of_an_ops_object_belong_to_no_strategy(shape):
    n, mode = shape
    ops = dv.NcclAllReduce(num_packs=3)
    value = per_replica(n, seed=12)
    with dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], cross_device_ops=ops, execution=mode) as s:
        assert_on_each(ops.reduce("SUM", value, "CPU:0"), 1, ref(value.values, "SUM"), "made with it")
        for other in (copy.deepcopy(ops), pickle.loads(pickle.dumps(ops))):
            assert other.num_packs == 3
            with pytest.raises(ValueError, match=r"but DefaultStrategy\(\) has 1 replica"):
                other.reduce("SUM", value, "CPU:0")
        twin = copy.deepcopy(s)
        try:
            mine = twin.extended._cross_device_ops
            assert mine is not ops
            assert_on_each(mine.reduce("MEAN", value, "CPU:0"), 1, ref(value.values, "MEAN"), "the copy's strategy")
        finally:
            twin.close()
    # Closed, the strategy no longer runs the ops' calls.
    with pytest.raises(ValueError, match=r"but DefaultStrategy\(\) has 1 replica"):
        ops.reduce("SUM", value, "CPU:0")


def test_an_ops_object_of_several_open_strategies_needs_a_scope(shape):
    n, mode = shape
    ops = dv.CollectiveAllReduce()
    devices = [f"CPU:{i}" for i in range(n)]
    with (
        dv.MirroredStrategy(devices, cross_device_ops=ops, execution=mode) as a,
        dv.MirroredStrategy(devices, cross_device_ops=ops, execution=mode),
    ):
        value = per_replica(n, seed=13)
        with pytest.raises(ValueError, match=r"^CollectiveAllReduce\.reduce: .*several open strategies"):
            ops.reduce("SUM", value, "CPU:0")
        with a.scope():
            assert_on_each(ops.reduce("SUM", value, "CPU:0"), 1, ref(value.values, "SUM"), "in a's scope")


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dests", "error", "message"),
    [
        (5, TypeError, "destinations must be a device string, a list of them, or a distributed value, got int"),
        (None, ValueError, "destinations must be a device string, a list of them, or a distributed value, got None"),
        ([], ValueError, "destinations must not be empty"),
        (["CPU:0", 1], TypeError, "destination devices must be strings, got int"),
        ({"CPU:0"}, TypeError, "got set"),
        ("TPU:0", ValueError, "TPU:0"),
    ],
)
def test_wrong_destinations_are_named_before_anything_moves(made, dests, error, message, monkeypatch):
    s, ops = made
    name = type(ops).__name__
    value = per_replica(s.num_replicas_in_sync)
    calls = []
    monkeypatch.setattr(s.extended, "_all_reduce_leaves", lambda *a, **k: calls.append(a))
    with pytest.raises(error, match=rf"^{name}\.reduce: .*{message}"):
        ops.reduce("SUM", value, dests)
    with pytest.raises(error, match=rf"^{name}\.broadcast: .*{message}"):
        ops.broadcast(np.ones(2), dests)
    # A good item first: nothing is reduced when a later item is wrong.
    with pytest.raises(error, match=rf"^{name}\.batch_reduce \(item 1\): .*{message}"):
        ops.batch_reduce("SUM", [(value, "CPU:0"), (value, dests)])
    assert calls == []


def test_calls_inside_run_are_refused(made):
    s, ops = made
    name = type(ops).__name__
    x = np.ones(2)
    calls = {
        "reduce": lambda: ops.reduce("SUM", x, "CPU:0"),
        "batch_reduce": lambda: ops.batch_reduce("SUM", [(x, "CPU:0")]),
        "broadcast": lambda: ops.broadcast(x, "CPU:0"),
    }
    for method, call in calls.items():
        with pytest.raises(
            RuntimeError, match=rf"{name}\.{method} must be called in cross-replica context, not inside strategy\.run"
        ):
            s.run(call)


def test_values_of_another_strategy_are_refused(shape):
    n, mode = shape
    ops = dv.NcclAllReduce()
    with (
        dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], cross_device_ops=ops, execution=mode) as s,
        dv.MirroredStrategy([f"CPU:{i}" for i in range(n + 1)], execution=mode) as other,
    ):
        bigger = per_replica(n + 1)
        with pytest.raises(ValueError, match=rf"PerReplica with {n + 1} values, but .* has {n} replicas"):
            ops.reduce("SUM", bigger, "CPU:0")
        with pytest.raises(ValueError, match=rf"item 1\): the value is a PerReplica with {n + 1} values"):
            ops.batch_reduce("SUM", [(per_replica(n), "CPU:0"), (bigger, "CPU:0")])
        with pytest.raises(ValueError, match=rf"destinations is a PerReplica with {n + 1} values"):
            ops.reduce("SUM", per_replica(n), bigger)
        with other.scope():
            theirs = dv.Variable(np.ones(2))
        with s.scope():
            mine = dv.Variable(np.ones(2))
            with pytest.raises(ValueError, match=r"the value is a variable of MirroredStrategy.*but the scope of"):
                ops.reduce("SUM", theirs, "CPU:0")
        with pytest.raises(ValueError, match="variables of different strategies"):
            ops.batch_reduce("SUM", [(mine, "CPU:0"), (theirs, "CPU:0")])
        with pytest.raises(ValueError, match="variables of different strategies"):
            ops.reduce("SUM", mine, theirs)


def test_other_wrong_arguments(made):
    s, ops = made
    name = type(ops).__name__
    n = s.num_replicas_in_sync
    value = per_replica(n)
    with pytest.raises(TypeError, match=rf"^{name}\.reduce: expected one PerReplica, Mirrored or array, got a tuple"):
        ops.reduce("SUM", (value, value), "CPU:0")
    with pytest.raises(TypeError, match=rf"^{name}\.reduce: options must be a CommunicationOptions"):
        ops.reduce("SUM", value, "CPU:0", options="ring")
    with pytest.raises(ValueError, match="unknown reduce op 'AVERAGED'"):
        ops.reduce("AVERAGED", value, "CPU:0")
    with pytest.raises(TypeError, match=rf"^{name}\.batch_reduce: value_destination_pairs must be a list"):
        ops.batch_reduce("SUM", value)
    with pytest.raises(TypeError, match=rf"^{name}\.batch_reduce: item 0 is not a \(value, destinations\) pair"):
        ops.batch_reduce("SUM", [value])
    shapes = dv.PerReplica(tuple(np.ones(3 if r == n - 1 else 2) for r in range(n)))
    with pytest.raises(ValueError, match=rf"replica {n - 1} has shape \(3,\)"):
        ops.reduce("SUM", shapes, s.extended.worker_devices)
