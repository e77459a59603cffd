"""Distributed input: splitting global batches, datasets from functions, value functions."""

from __future__ import annotations

import collections
import sys

import numpy as np
import pytest

import distvals as dv
from distvals.input import split_batch_sizes

Example = collections.namedtuple("Example", ["x", "y"])


def expected_split(batch: np.ndarray, n: int):
    sizes = [len(part) for part in np.array_split(np.arange(len(batch)), n)]
    out, start = [], 0
    for s in sizes:
        out.append(batch[start : start + s])
        start += s
    return out


@pytest.mark.parametrize(
    "batch,n,sizes",
    [(6, 4, [2, 2, 1, 1]), (8, 4, [2, 2, 2, 2]), (3, 4, [1, 1, 1, 0]), (1, 2, [1, 0]), (7, 3, [3, 2, 2])],
)
def test_split_sizes(batch, n, sizes):
    assert split_batch_sizes(batch, n) == sizes


def test_global_batch_of_six_over_four(s4):
    data = np.arange(12, dtype=np.float32).reshape(6, 2)
    batch = next(iter(s4.experimental_distribute_dataset([data])))
    assert isinstance(batch, dv.PerReplica)
    for got, want in zip(batch.values, expected_split(data, 4)):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.float32
    assert [len(v) for v in batch.values] == [2, 2, 1, 1]
    # The parts are views of the batch: no copy.
    assert all(np.shares_memory(v, data) for v in batch.values)


def test_partial_last_batch_and_empty_replicas(s4):
    ds = dv.data.Dataset.from_tensor_slices(np.arange(10, dtype=np.int64).reshape(5, 2)).batch(4)
    batches = list(s4.experimental_distribute_dataset(ds))
    assert len(batches) == 2
    first, last = batches
    assert [v.shape for v in first.values] == [(1, 2)] * 4
    assert [v.shape for v in last.values] == [(1, 2), (0, 2), (0, 2), (0, 2)]
    assert all(v.dtype == np.int64 for v in last.values)
    np.testing.assert_array_equal(last.values[0], [[8, 9]])


def test_nested_elements_give_nested_per_replica(s2):
    x = np.arange(8.0).reshape(4, 2)
    y = np.arange(4, dtype=np.int32)
    ds = dv.data.Dataset.from_tensor_slices({"x": x, "y": (y, y * 2)}).batch(4)
    batch = next(iter(s2.experimental_distribute_dataset(ds)))
    assert set(batch) == {"x", "y"} and isinstance(batch["y"], tuple)
    np.testing.assert_array_equal(batch["x"].values[1], x[2:])
    np.testing.assert_array_equal(batch["y"][1].values[0], (y * 2)[:2])
    nt = next(iter(s2.experimental_distribute_dataset([Example(x, y)])))
    assert isinstance(nt, Example)
    np.testing.assert_array_equal(nt.y.values[1], y[2:])


def test_unbatched_data_is_an_error(s2):
    # Rows of from_tensor_slices or range with no batch after them (a map, a shuffle or a
    # take keeps them rows): TensorFlow would split each row's features over the replicas.
    rows = dv.data.Dataset.from_tensor_slices(np.arange(6.0).reshape(3, 2))
    for ds in (rows, rows.map(lambda x: x * 2).shuffle(2, seed=1).take(2), dv.data.Dataset.range(4)):
        with pytest.raises(ValueError, match=r"needs a batched dataset: call dataset.batch\(global_batch_size\)"):
            s2.experimental_distribute_dataset(ds)
    # Batched after all, or elements whose batching is the caller's (from_tensors,
    # from_generator): split as batches.
    for ds in (
        rows.batch(3),
        dv.data.Dataset.from_tensors(np.arange(6.0).reshape(3, 2)),
        dv.data.Dataset.from_generator(lambda: iter([np.arange(6.0).reshape(3, 2)])),
    ):
        (element,) = list(s2.experimental_distribute_dataset(ds))
        np.testing.assert_array_equal(element.values[0], [[0.0, 1.0], [2.0, 3.0]])
        np.testing.assert_array_equal(element.values[1], [[4.0, 5.0]])
    it = iter(s2.experimental_distribute_dataset(iter([1.0, 2.0])))
    with pytest.raises(ValueError, match="needs batched data, but an element has shape"):
        next(it)


def test_components_with_different_batch_sizes(s2):
    it = iter(s2.experimental_distribute_dataset([(np.zeros(4), np.zeros(3))]))
    with pytest.raises(ValueError, match="component 0 has 4, component 1 has 3"):
        next(it)


def test_not_a_dataset(s2):
    with pytest.raises(TypeError, match="expected a dataset"):
        s2.experimental_distribute_dataset(5)
    with pytest.raises(TypeError, match="options must be an InputOptions"):
        s2.experimental_distribute_dataset([np.zeros(2)], options=3)
    s2.experimental_distribute_dataset([np.zeros(2)], options=dv.InputOptions())


def test_generators_lists_and_reiteration(s2):
    batches = [np.arange(4.0) + 10 * i for i in range(3)]
    dist = s2.experimental_distribute_dataset(batches)
    for _ in range(2):  # a list can be iterated again
        got = [b.values for b in dist]
        assert len(got) == 3
        np.testing.assert_array_equal(got[2][1], batches[2][2:])
    gen = s2.experimental_distribute_dataset(b for b in batches)
    assert len(list(gen)) == 3
    assert list(gen) == []  # a generator passes once
    it = iter(dist)
    assert iter(it) is it
    np.testing.assert_array_equal(it.get_next().values[0], batches[0][:2])


def test_distributed_dataset_reduce(s2):
    dist = s2.experimental_distribute_dataset([np.arange(4.0), np.arange(4.0, 8.0)])
    total = dist.reduce(np.float64(0), lambda state, batch: state + s2.reduce("SUM", batch, axis=0))
    assert total == np.arange(8.0).sum()


class FakeTensor:
    """Stands for a tf.Tensor: has .numpy() and no buffer protocol."""

    def __init__(self, a):
        self._a = np.asarray(a)
        self.dtype = self._a.dtype

    def numpy(self):
        return self._a


class FakeDLPack:
    """Stands for a torch CPU tensor: DLPack without __array__."""

    def __init__(self, a):
        self._a = np.ascontiguousarray(a)

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_framework_like_batches_convert_without_import(s2):
    # Other tests of the run may have imported a framework already: what counts is that
    # converting these batches imports none.
    loaded = {m for m in ("tensorflow", "torch") if m in sys.modules}
    source = np.arange(8.0).reshape(4, 2)
    batches = [(FakeTensor(source), FakeDLPack(source))]
    batch = next(iter(s2.experimental_distribute_dataset(batches)))
    np.testing.assert_array_equal(batch[0].values[1], source[2:])
    np.testing.assert_array_equal(batch[1].values[0], source[:2])
    assert np.shares_memory(batch[1].values[0], batches[0][1]._a)  # DLPack: no copy
    assert {m for m in ("tensorflow", "torch") if m in sys.modules} == loaded


def test_one_replica_gives_plain_batches():
    s = dv.MirroredStrategy(["CPU:0"])
    try:
        batch = next(iter(s.experimental_distribute_dataset([np.arange(3.0)])))
        assert isinstance(batch, np.ndarray)
    finally:
        s.close()


# ---- distribute_datasets_from_function --------------------------------------------------------


def test_input_context():
    ctx = dv.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 4)
    assert ctx.get_per_replica_batch_size(64) == 16
    with pytest.raises(ValueError, match="global batch size 10 is not divisible by the 4 replicas"):
        ctx.get_per_replica_batch_size(10)
    with pytest.raises(ValueError, match="out of range"):
        dv.InputContext(2, 2, 1)
    default = dv.InputContext()
    assert (default.num_input_pipelines, default.input_pipeline_id, default.num_replicas_in_sync) == (1, 0, 1)
    assert repr(ctx) == "InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)"


def test_distribute_datasets_from_function(s2):
    seen = []

    def dataset_fn(ctx):
        seen.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(4)
        return dv.data.Dataset.from_tensor_slices(np.arange(10.0)).batch(per_replica)

    dist = s2.distribute_datasets_from_function(dataset_fn)
    assert len(seen) == 1
    assert (seen[0].num_input_pipelines, seen[0].input_pipeline_id, seen[0].num_replicas_in_sync) == (1, 0, 2)
    batches = list(dist)
    # Consecutive elements to consecutive replicas: [0,1] [2,3] | [4,5] [6,7] | [8,9] and empty.
    assert len(batches) == 3
    np.testing.assert_array_equal(batches[0].values[0], [0.0, 1.0])
    np.testing.assert_array_equal(batches[0].values[1], [2.0, 3.0])
    np.testing.assert_array_equal(batches[1].values[1], [6.0, 7.0])
    np.testing.assert_array_equal(batches[2].values[0], [8.0, 9.0])
    assert batches[2].values[1].shape == (0,) and batches[2].values[1].dtype == np.float64
    with pytest.raises(TypeError, match="dataset_fn must be callable"):
        s2.distribute_datasets_from_function(3)
    with pytest.raises(TypeError, match="expected a dataset"):
        s2.distribute_datasets_from_function(lambda ctx: 3)


@pytest.mark.parametrize("kind", ["distribute_dataset", "from_function"])
@pytest.mark.parametrize("take", ["next", "get_next", "get_next_as_optional"])
def test_next_inside_run_is_an_error_and_takes_nothing(s3, kind, take):
    # As TensorFlow: inside run each replica would take a whole global batch of the shared
    # iterator and keep only its own part, losing the others' without a word.
    if kind == "distribute_dataset":
        dist = s3.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(np.arange(12.0)).batch(3))
    else:
        dist = s3.distribute_datasets_from_function(
            lambda ctx: dv.data.Dataset.from_tensor_slices(np.arange(12.0)).batch(1)
        )
    it = iter(dist)
    calls = {
        "next": next,
        "get_next": lambda i: i.get_next(),
        "get_next_as_optional": lambda i: i.get_next_as_optional(),
    }
    with pytest.raises(ValueError, match=r"must be called outside the replica function"):
        s3.run(lambda i: calls[take](i), args=(it,))
    with pytest.raises(ValueError, match=r"must be called outside the replica function"):
        s3.run(lambda: next(iter(dist)))
    # Nothing was taken: the next batch is still the first, one element per replica.
    first = next(it)
    assert [np.asarray(v).tolist() for v in first.values] == [[0.0], [1.0], [2.0]]


def test_from_function_skips_only_a_failing_element_and_drops_no_last_elements(s3):
    # Element 4 raises in the middle of a step's three: the step fails, and the next one
    # begins with the two elements it had read; nothing else is lost or repeated.
    def m(v):
        if int(v[0]) == 4:
            raise ValueError("element 4 failed")
        return v

    dist = s3.distribute_datasets_from_function(lambda ctx: dv.data.Dataset.range(9).batch(1).map(m))
    rows, failures = [], 0
    it = iter(dist)
    while True:
        try:
            el = next(it)
        except StopIteration:
            break
        except ValueError:
            failures += 1
            continue
        rows.append([p.tolist() for p in s3.experimental_local_results(el)])
    assert failures == 1
    assert rows == [[[0], [1], [2]], [[3], [5], [6]], [[7], [8], []]]
    # Elements without a batch axis cannot give the replicas of a last partial step
    # empty batches: an error, not elements dropped without a word.
    it = iter(s3.distribute_datasets_from_function(lambda ctx: dv.data.Dataset.range(4)))
    first = next(it)
    assert [int(p) for p in s3.experimental_local_results(first)] == [0, 1, 2]
    with pytest.raises(ValueError, match="elements for 1 of 3 replicas"):
        next(it)


def test_value_context_and_values_from_function(s4):
    ctx = dv.ValueContext(2, 4)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (2, 4)
    with pytest.raises(ValueError, match="out of range"):
        dv.ValueContext(4, 4)

    def value_fn(ctx):
        return {"id": np.array([ctx.replica_id_in_sync_group]), "n": ctx.num_replicas_in_sync}

    out = s4.experimental_distribute_values_from_function(value_fn)
    assert isinstance(out["id"], dv.PerReplica)
    assert [int(v[0]) for v in out["id"].values] == [0, 1, 2, 3]
    assert out["n"].values == (4, 4, 4, 4)
    summed = s4.run(lambda v: dv.get_replica_context().all_reduce("sum", v["id"]), args=(out,))
    np.testing.assert_array_equal(summed.values[3], [6])
