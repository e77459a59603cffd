"""TensorFlow's input API around distributed datasets: element_spec, cardinality,
get_next_as_optional, InputOptions and InputReplicationMode; and the strategy API that
ported programs reach for: RunOptions, dv.experimental, StrategyExtended."""

from __future__ import annotations

import numpy as np
import pytest

import distvals as dv
from distvals.specs import PerReplicaSpec, TensorSpec

PER_REPLICA = dv.InputReplicationMode.PER_REPLICA


def spec(shape, dtype=np.float32):
    return TensorSpec(shape, dtype)


# ---- the names --------------------------------------------------------------------------------------


def test_exported_names():
    for name in (
        "DistributedDataset",
        "DistributedIterator",
        "InputOptions",
        "InputReplicationMode",
        "RunOptions",
        "StrategyExtended",
        "TensorSpec",
        "IndexedSlices",
        "NcclAllReduce",
        "HierarchicalCopyAllReduce",
    ):
        assert name in dv.__all__ and hasattr(dv, name)
    assert dv.experimental.CommunicationOptions is dv.CommunicationOptions
    assert dv.experimental.CommunicationImplementation is dv.CommunicationImplementation
    assert dv.experimental.CollectiveCommunication is dv.CommunicationImplementation
    assert dv.experimental.ValueContext is dv.ValueContext
    assert dv.experimental.MultiWorkerMirroredStrategy is dv.MultiWorkerMirroredStrategy
    hints = dv.experimental.CollectiveHints(bytes_per_pack=1024, timeout_seconds=5)
    assert isinstance(hints, dv.CommunicationOptions) and hints.bytes_per_pack == 1024
    assert dv.data.Optional is dv.optional.Optional


def test_distributed_datasets_and_iterators_are_the_exported_classes(s2):
    ds = dv.data.Dataset.from_tensor_slices(np.arange(4.0)).batch(2)
    dd = s2.experimental_distribute_dataset(ds)
    ff = s2.distribute_datasets_from_function(lambda ctx: ds)
    assert isinstance(dd, dv.DistributedDataset) and isinstance(ff, dv.DistributedDataset)
    assert isinstance(iter(dd), dv.DistributedIterator) and isinstance(iter(ff), dv.DistributedIterator)


def test_nccl_and_hierarchical_copy_run_on_the_engine():
    for ops in (dv.NcclAllReduce(), dv.HierarchicalCopyAllReduce(num_packs=2)):
        s = dv.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
        try:
            out = s.run(
                lambda: dv.get_replica_context().all_reduce(
                    "SUM", np.full(3, dv.get_replica_context().replica_id_in_sync_group + 1.0)
                )
            )
            assert [v.tolist() for v in out.values] == [[3.0] * 3] * 2
        finally:
            s.close()
    with pytest.raises(ValueError, match="num_packs must be at least 0"):
        dv.NcclAllReduce(num_packs=-1)
    assert repr(dv.HierarchicalCopyAllReduce(num_packs=3)) == "HierarchicalCopyAllReduce(num_packs=3)"


# ---- element_spec -----------------------------------------------------------------------------------


def test_element_spec_of_a_dataset_and_its_distributed_form(s2):
    x = np.zeros((10, 3), np.float32)
    y = np.arange(10)
    ds = dv.data.Dataset.from_tensor_slices({"x": x, "y": y})
    assert ds.element_spec == {"x": spec((3,)), "y": spec((), np.int64)}
    assert ds.batch(4).element_spec == {"x": spec((None, 3)), "y": spec((None,), np.int64)}
    assert ds.batch(4, drop_remainder=True).element_spec["x"] == spec((4, 3))
    dd = s2.experimental_distribute_dataset(ds.batch(4))
    assert dd.element_spec == {
        "x": PerReplicaSpec(spec((None, 3)), spec((None, 3))),
        "y": PerReplicaSpec(spec((None,), np.int64), spec((None,), np.int64)),
    }
    assert iter(dd).element_spec == dd.element_spec
    # A batch that divides evenly gives static per-replica shapes; one that does not, None.
    assert s2.experimental_distribute_dataset(ds.batch(4, drop_remainder=True)).element_spec["x"] == PerReplicaSpec(
        spec((2, 3)), spec((2, 3))
    )
    assert s2.experimental_distribute_dataset(ds.batch(3, drop_remainder=True)).element_spec["x"] == PerReplicaSpec(
        spec((None, 3)), spec((None, 3))
    )
    assert repr(spec((None, 3))) == "TensorSpec(shape=(None, 3), dtype=float32, name=None)"


def test_element_spec_with_one_replica_is_plain():
    s = dv.MirroredStrategy(["CPU:0"])
    try:
        dd = s.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(np.zeros(5, np.int64)).batch(2))
        assert dd.element_spec == spec((None,), np.int64)
    finally:
        s.close()


def test_element_spec_of_plain_iterables(s2):
    batches = [(np.zeros((4, 2), np.float32), np.zeros(4, np.int32))] * 2
    dd = s2.experimental_distribute_dataset(batches)
    assert dd.element_spec == (
        PerReplicaSpec(spec((None, 2)), spec((None, 2))),
        PerReplicaSpec(spec((None,), np.int32), spec((None,), np.int32)),
    )
    # A one-shot iterator is peeked at without losing its first batch.
    gen = (np.full((2, 1), i, np.float32) for i in range(3))
    one_shot = s2.experimental_distribute_dataset(gen)
    assert one_shot.element_spec == PerReplicaSpec(spec((None, 1)), spec((None, 1)))
    assert [float(b.values[0][0, 0]) for b in one_shot] == [0.0, 1.0, 2.0]
    assert s2.experimental_distribute_dataset([]).element_spec is None


def test_element_spec_of_a_loader_does_not_start_an_extra_pass(s2):
    # A loader that draws a new order for each pass (as a shuffling torch DataLoader
    # does): the pass that told the spec is the first pass the replicas get.
    class Loader:
        def __init__(self):
            self.rng = np.random.default_rng(3)
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            order = self.rng.permutation(8)
            return iter([order[i : i + 4].astype(np.float32) for i in (0, 4)])

    def rows(ask):
        loader = Loader()
        dd = s2.experimental_distribute_dataset(loader)
        if ask:
            assert dd.element_spec == PerReplicaSpec(spec((None,)), spec((None,)))
        out = [[np.concatenate(s2.experimental_local_results(b)).tolist() for b in dd] for _ in range(2)]
        return out, loader.passes

    asked, plain = rows(True), rows(False)
    assert asked == plain and asked[1] == 2
    assert sorted(v for b in asked[0][0] for v in b) == list(range(8))


def test_element_spec_after_map_is_read_from_the_first_element():
    ds = dv.data.Dataset.from_tensor_slices(np.arange(6.0)).map(lambda x: (x, x * 2)).batch(2)
    assert ds.element_spec == (spec((None,), np.float64), spec((None,), np.float64))


# ---- cardinality -------------------------------------------------------------------------------------


def test_cardinality_of_datasets():
    ds = dv.data.Dataset.from_tensor_slices(np.arange(10))
    assert ds.cardinality() == 10 and ds.cardinality().dtype == np.int64
    assert ds.batch(4).cardinality() == 3 and ds.batch(4, drop_remainder=True).cardinality() == 2
    assert ds.repeat().cardinality() == dv.data.INFINITE_CARDINALITY == -1
    assert ds.repeat(3).cardinality() == 30 and ds.repeat(0).cardinality() == 0
    assert ds.take(4).cardinality() == 4 and ds.take(40).cardinality() == 10 and ds.repeat().take(7).cardinality() == 7
    assert ds.skip(3).cardinality() == 7 and ds.skip(30).cardinality() == 0
    assert ds.shuffle(4).map(lambda x: x).cardinality() == 10
    assert dv.data.Dataset.range(2, 9).cardinality() == 7 and dv.data.Dataset.from_tensors([1]).cardinality() == 1
    assert dv.data.Dataset(lambda: iter(())).cardinality() == dv.data.UNKNOWN_CARDINALITY == -2


def test_cardinality_of_distributed_datasets(s3):
    ds = dv.data.Dataset.from_tensor_slices(np.arange(10.0)).batch(4)
    card = s3.experimental_distribute_dataset(ds).cardinality
    # A property as in TensorFlow 2.21, callable as tf.data's method.
    assert card == 3 and card() == 3 and isinstance(card, int) and repr(card) == "3"
    assert s3.experimental_distribute_dataset(ds.repeat()).cardinality == -1
    assert s3.experimental_distribute_dataset([np.zeros(3)] * 5).cardinality == 5
    assert s3.experimental_distribute_dataset(iter([np.zeros(3)])).cardinality == -2
    # From a function: each step takes one element per replica.
    assert s3.distribute_datasets_from_function(lambda ctx: ds).cardinality == 1
    assert (
        s3.distribute_datasets_from_function(
            lambda ctx: dv.data.Dataset.from_tensor_slices(np.arange(14.0)).batch(2)
        ).cardinality
        == 3
    )


# ---- get_next_as_optional ---------------------------------------------------------------------------------


def test_get_next_as_optional_to_the_end(s2):
    it = iter(s2.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(np.arange(6.0)).batch(4)))
    first = it.get_next_as_optional()
    assert first.has_value() is True
    assert [v.tolist() for v in first.get_value().values] == [[0.0, 1.0], [2.0, 3.0]]
    assert first.element_spec == PerReplicaSpec(spec((2,), np.float64), spec((2,), np.float64))
    second = it.get_next_as_optional()
    assert [v.tolist() for v in second.get_value().values] == [[4.0], [5.0]]
    end = it.get_next_as_optional()
    assert end.has_value() is False and repr(end) == "Optional(empty)"
    assert end.element_spec == PerReplicaSpec(spec((None,), np.float64), spec((None,), np.float64))
    with pytest.raises(dv.errors.InvalidArgumentError, match="does not have a value"):
        end.get_value()
    with pytest.raises(StopIteration):
        it.get_next()
    with pytest.raises(StopIteration):
        next(it)


def test_get_next_as_optional_from_a_function(s2):
    it = iter(s2.distribute_datasets_from_function(lambda ctx: [np.ones(2)]))
    assert it.get_next_as_optional().has_value()
    assert not it.get_next_as_optional().has_value()


def test_optional_by_hand():
    opt = dv.data.Optional.from_value((np.zeros(2, np.float32), 3))
    assert opt.has_value() and opt.get_value()[1] == 3
    assert opt.element_spec == (spec((2,)), spec((), np.int64))
    assert not dv.data.Optional.empty(spec(())).has_value()


# ---- InputOptions -------------------------------------------------------------------------------------------


def test_input_options_defaults_and_fields():
    o = dv.InputOptions()
    assert o == (True, dv.InputReplicationMode.PER_WORKER, False, 1)
    assert o.experimental_fetch_to_device is True and o._replace(experimental_per_replica_buffer_size=0)[3] == 0
    assert [m.value for m in dv.InputReplicationMode] == ["PER_WORKER", "PER_REPLICA"]


def test_per_replica_input_pipelines(s3):
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        n = 4 if ctx.input_pipeline_id == 2 else 2  # replica 2's dataset lasts longer
        return dv.data.Dataset.from_tensor_slices(np.arange(n, dtype=np.float32) + 100 * ctx.input_pipeline_id).batch(1)

    options = dv.InputOptions(experimental_replication_mode=PER_REPLICA, experimental_fetch_to_device=False)
    dd = s3.distribute_datasets_from_function(dataset_fn, options)
    assert seen == [(3, 0, 3), (3, 1, 3), (3, 2, 3)]
    steps = list(dd)
    assert [[v.tolist() for v in step.values] for step in steps] == [
        [[0.0], [100.0], [200.0]],
        [[1.0], [101.0], [201.0]],
        [[], [], [202.0]],
        [[], [], [203.0]],
    ]
    assert dd.cardinality == 4
    assert dd.element_spec == PerReplicaSpec(*[spec((None,))] * 3)


def test_input_options_checks(s2):
    ds = dv.data.Dataset.from_tensor_slices([1.0, 2.0]).batch(2)
    with pytest.raises(
        NotImplementedError,
        match="PER_REPLICA\\) is only supported by MirroredStrategy's distribute_datasets_from_function",
    ):
        s2.experimental_distribute_dataset(ds, dv.InputOptions(experimental_replication_mode=PER_REPLICA))
    with pytest.raises(
        ValueError,
        match="experimental_place_dataset_on_device needs "
        "experimental_replication_mode=InputReplicationMode.PER_REPLICA",
    ):
        s2.distribute_datasets_from_function(lambda ctx: ds, dv.InputOptions(experimental_place_dataset_on_device=True))
    with pytest.raises(ValueError, match="cannot be True when experimental_fetch_to_device is True"):
        s2.distribute_datasets_from_function(
            lambda ctx: ds,
            dv.InputOptions(experimental_replication_mode=PER_REPLICA, experimental_place_dataset_on_device=True),
        )
    with pytest.raises(ValueError, match="must be InputReplicationMode.PER_WORKER or PER_REPLICA"):
        s2.experimental_distribute_dataset(ds, dv.InputOptions(experimental_replication_mode="sideways"))
    with pytest.raises(TypeError, match="experimental_per_replica_buffer_size must be an int"):
        s2.experimental_distribute_dataset(ds, dv.InputOptions(experimental_per_replica_buffer_size=1.5))
    with pytest.raises(TypeError, match="options must be an InputOptions"):
        s2.experimental_distribute_dataset(ds, {"experimental_fetch_to_device": False})
    # Accepted, as in TensorFlow: string modes, buffer sizes, placement with PER_REPLICA.
    for options in (
        dv.InputOptions(experimental_per_replica_buffer_size=0),
        dv.InputOptions(experimental_fetch_to_device=False),
        dv.InputOptions(experimental_replication_mode="per_worker"),
    ):
        batch = next(iter(s2.experimental_distribute_dataset(ds, options)))
        assert [v.tolist() for v in batch.values] == [[1.0], [2.0]]
    placed = dv.InputOptions(
        experimental_replication_mode=PER_REPLICA,
        experimental_fetch_to_device=False,
        experimental_place_dataset_on_device=True,
    )
    assert len(list(s2.distribute_datasets_from_function(lambda ctx: ds, placed))) == 1


def test_experimental_distribute_datasets_from_function_is_the_older_name(s2):
    ds = dv.data.Dataset.from_tensor_slices(np.arange(4.0)).batch(1)
    old = list(s2.experimental_distribute_datasets_from_function(lambda ctx: ds))
    new = list(s2.distribute_datasets_from_function(lambda ctx: ds))
    assert (
        [[v.tolist() for v in b.values] for b in old]
        == [[v.tolist() for v in b.values] for b in new]
        == [[[0.0], [1.0]], [[2.0], [3.0]]]
    )


# ---- RunOptions and StrategyExtended ------------------------------------------------------------------------


def test_run_options(s2):
    assert s2.run(lambda: 1, options=dv.RunOptions(experimental_enable_dynamic_batch_size=False)) == 1
    assert s2.run(lambda: 2, options=dv.RunOptions(experimental_bucketizing_dynamic_shape=True)) == 2
    with pytest.raises(NotImplementedError, match="experimental_xla_options has no meaning without XLA"):
        s2.run(lambda: 1, options=dv.RunOptions(experimental_xla_options=object()))
    with pytest.raises(TypeError, match="options must be a distvals.RunOptions"):
        s2.run(lambda: 1, options={"x": 1})


def test_update_non_slot_calls_fn_once_per_device_with_its_part(s3):
    # As TensorFlow: call i in the update context of copy i, with part i of distributed
    # arguments; regrouped as a Mirrored, or a tuple without group.
    e = s3.extended
    with s3.scope():
        v = dv.Variable(1.0)
    calls = []
    devices = e.non_slot_devices([v])
    out = e.update_non_slot(devices, lambda: calls.append(1) or v.assign_add(1.0, read_value=False))
    assert len(calls) == 3
    assert [float(c) for c in v.values] == [2.0, 2.0, 2.0]  # each copy once, not three times
    pr = s3.run(lambda: np.float64(dv.get_replica_context().replica_id_in_sync_group + 1))
    out = e.update_non_slot(devices, lambda a, b=0.0: a * 10 + b, args=(pr,), kwargs={"b": pr})
    assert isinstance(out, dv.Mirrored) and [float(x) for x in out.values] == [11.0, 22.0, 33.0]
    out = e.update_non_slot(devices, lambda a: a * 2, args=(np.float64(2.0),), group=False)
    assert isinstance(out, tuple) and [float(x) for x in out] == [4.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="colocate_with must name 1 to 3 devices"):
        e.update_non_slot(devices * 2, lambda: None)


@pytest.mark.parametrize("n", [1, 2])
def test_reduce_to_and_broadcast_to_take_a_numpy_scalar_as_destinations(execution, n):
    # numpy 2 gives numpy scalars a .device ("cpu"), as arrays: a host value, not a device name.
    s = dv.MirroredStrategy([f"CPU:{i}" for i in range(n)], execution=execution)
    x = np.float32(1.5)
    assert float(s.extended.reduce_to("MEAN", x, x)) == 1.5
    assert float(s.extended.broadcast_to(x, x)) == 1.5
    s.close()


def test_broadcast_to_refuses_a_structure(s2):
    with s2.scope():
        v = dv.Variable([1.0, 2.0])
    with pytest.raises(TypeError, match="broadcast_to: the value is a list of several values, not one array"):
        s2.extended.broadcast_to([np.float32(1), {"a": np.float32(2)}], v)
    with pytest.raises(TypeError, match="broadcast_to: the value is a dict"):
        s2.extended.broadcast_to({"a": np.float32(2)}, v)
    out = s2.extended.broadcast_to([1.0, 2.0], v)  # a list of numbers is one array
    assert [x.tolist() for x in out.values] == [[1.0, 2.0]] * 2


def test_strategy_extended_is_the_documented_base(s2):
    e = s2.extended
    assert isinstance(e, dv.StrategyExtended)
    for name in (
        "reduce_to",
        "batch_reduce_to",
        "broadcast_to",
        "update",
        "value_container",
        "variable_created_in_scope",
        "call_for_each_replica",
        "worker_devices_by_replica",
        "non_slot_devices",
        "update_non_slot",
        "should_checkpoint",
        "should_save_summary",
        "experimental_should_init",
        "colocate_vars_with",
        "read_var",
    ):
        assert hasattr(dv.StrategyExtended, name), name
    devices = ("/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1")
    assert e.worker_devices == devices == e.parameter_devices
    assert e.worker_devices_by_replica == tuple((d,) for d in devices)
    assert e.should_checkpoint and e.should_save_summary and e.experimental_should_init
    with s2.scope():
        v = dv.Variable(1.0)
    assert e.non_slot_devices([v]) == devices
    assert e.variable_created_in_scope(v) and not e.variable_created_in_scope(dv.Variable(1.0))
    out = e.call_for_each_replica(lambda: dv.get_replica_context().replica_id_in_sync_group * 10)
    assert out.values == (0, 10)
    assert e.update_non_slot(v, lambda: dv.in_cross_replica_context()) is True
    pr = s2.run(lambda: np.full(2, dv.get_replica_context().replica_id_in_sync_group + 1.0))
    reduced = e.reduce_to("SUM", pr, pr)
    assert isinstance(reduced, dv.Mirrored) and [x.tolist() for x in reduced.values] == [[3.0, 3.0]] * 2
    (mean,) = e.batch_reduce_to("MEAN", [(pr, "CPU:0")])
    assert mean.tolist() == [1.5, 1.5]
    copies = e.broadcast_to(np.float32(4.0), pr)
    assert isinstance(copies, dv.Mirrored) and copies.values == (4.0, 4.0)
