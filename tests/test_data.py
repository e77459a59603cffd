"""distvals.data.Dataset: slices, batches, shuffling, repetition."""

from __future__ import annotations

import collections
import re
import threading

import numpy as np
import pytest

import distvals as dv
import distvals.data
from distvals.data import Dataset

Point = collections.namedtuple("Point", ["x", "y"])


def test_import_path():
    assert distvals.data.Dataset is Dataset


def test_from_tensor_slices_python_floats_become_float32():
    elements = list(Dataset.from_tensor_slices([5.0, 6.0, 7.0]))
    assert len(elements) == 3
    assert all(isinstance(e, np.ndarray) and e.shape == () and e.dtype == np.float32 for e in elements)
    assert [float(e) for e in elements] == [5.0, 6.0, 7.0]


def test_from_tensor_slices_dtypes():
    assert next(iter(Dataset.from_tensor_slices([1, 2]))).dtype == np.int32
    assert next(iter(Dataset.from_tensor_slices([2**40, 1]))).dtype == np.int64
    assert next(iter(Dataset.from_tensor_slices([True, False]))).dtype == np.bool_
    assert next(iter(Dataset.from_tensor_slices(np.arange(3.0)))).dtype == np.float64  # numpy keeps its dtype


def test_from_tensor_slices_structures():
    x = np.arange(6.0).reshape(3, 2)
    y = np.array([0, 1, 0])
    pairs = list(Dataset.from_tensor_slices((x, y)))
    assert isinstance(pairs[1], tuple)
    np.testing.assert_array_equal(pairs[1][0], x[1])
    assert int(pairs[2][1]) == 0
    dicts = list(Dataset.from_tensor_slices({"b": y, "a": x}))
    assert list(dicts[0]) == ["b", "a"]
    np.testing.assert_array_equal(dicts[2]["a"], x[2])
    points = list(Dataset.from_tensor_slices(Point(x, y)))
    assert isinstance(points[0], Point)


def test_from_tensor_slices_errors():
    with pytest.raises(ValueError, match="component 0 has 3, component 1 has 2"):
        Dataset.from_tensor_slices((np.zeros(3), np.zeros(2)))
    with pytest.raises(ValueError, match="shape \\(\\) and cannot be sliced"):
        Dataset.from_tensor_slices(1.0)


def test_batch():
    ds = Dataset.from_tensor_slices(np.arange(10)).batch(4)
    batches = list(ds)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    dropped = list(Dataset.from_tensor_slices(np.arange(10)).batch(4, drop_remainder=True))
    assert [len(b) for b in dropped] == [4, 4]
    nested = next(iter(Dataset.from_tensor_slices((np.arange(6.0).reshape(3, 2), np.arange(3))).batch(2)))
    assert nested[0].shape == (2, 2) and nested[1].tolist() == [0, 1]
    with pytest.raises(ValueError, match="positive int"):
        Dataset.from_tensor_slices(np.arange(3)).batch(0)


def test_shuffle_is_a_permutation_and_seeded():
    ds = Dataset.from_tensor_slices(np.arange(50)).shuffle(50, seed=3)
    first = [int(e) for e in ds]
    second = [int(e) for e in ds]
    assert sorted(first) == list(range(50)) and sorted(second) == list(range(50))
    assert first != list(range(50))
    assert first != second  # reshuffled each pass
    again = [int(e) for e in Dataset.from_tensor_slices(np.arange(50)).shuffle(50, seed=3)]
    assert again == first  # the same seed gives the same sequence of orders
    fixed = Dataset.from_tensor_slices(np.arange(50)).shuffle(50, seed=3, reshuffle_each_iteration=False)
    assert [int(e) for e in fixed] == [int(e) for e in fixed]


def test_shuffle_buffer_bounds_displacement():
    # With a buffer of k, element i cannot come out before position i - k + 1.
    k = 4
    out = [int(e) for e in Dataset.from_tensor_slices(np.arange(100)).shuffle(k, seed=1)]
    assert sorted(out) == list(range(100))
    for pos, value in enumerate(out):
        assert value <= pos + k - 1


def test_repeat_take_skip():
    ds = Dataset.from_tensor_slices(np.arange(3))
    assert [int(e) for e in ds.repeat(2)] == [0, 1, 2, 0, 1, 2]
    assert [int(e) for e in ds.repeat().take(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [int(e) for e in ds.take(2)] == [0, 1]
    assert [int(e) for e in ds.take(-1)] == [0, 1, 2]
    assert [int(e) for e in ds.skip(1)] == [1, 2]
    assert list(ds.repeat(0)) == []
    # Negative counts as tf.data: take all, skip all (without reading), repeat forever.
    assert [int(e) for e in ds.take(-5)] == [0, 1, 2] and int(ds.take(-5).cardinality()) == 3
    endless = ds.repeat()
    assert list(endless.skip(-1)) == [] and int(endless.skip(-1).cardinality()) == 0
    assert [int(e) for e in ds.repeat(-2).take(4)] == [0, 1, 2, 0]
    for bad in (2.0, "2", True, None):
        with pytest.raises(TypeError, match="count must be an int"):
            ds.take(bad)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        ds.batch(2.0)
    with pytest.raises(TypeError, match="drop_remainder must be a bool"):
        ds.batch(2, drop_remainder=None)


@pytest.mark.parametrize(
    "build",
    [
        lambda x: Dataset.from_tensor_slices(x),
        lambda x: Dataset.from_tensor_slices({"x": x, "y": -x}).map(lambda e: e["x"]),
        lambda x: Dataset.from_tensor_slices(x).repeat(3),
        lambda x: Dataset.from_tensor_slices(x).skip(2).take(9),
        lambda x: Dataset.from_generator(lambda: iter(x.tolist())).repeat(2),
    ],
    ids=["slices", "map", "repeat", "skip-take", "generator"],
)
@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 40])
def test_shard_takes_every_nth_element_and_the_shards_partition_the_data(build, num_shards):
    x = np.arange(100, 121, dtype=np.int64)
    whole = np.asarray([int(e) for e in build(x)])
    for index in range(min(num_shards, 4)) if num_shards < 40 else (0, 39):
        ds = build(x).shard(num_shards, index)
        want = whole[index::num_shards]
        assert [int(e) for e in ds] == want.tolist()
        card = int(ds.cardinality())
        assert card == (len(want) if int(build(x).cardinality()) >= 0 else dv.data.UNKNOWN_CARDINALITY)
        # Batched: the same rows, cut into batches (a gather of every nth row).
        batches = [np.asarray(b) for b in ds.batch(4)]
        assert [b.tolist() for b in batches] == [want[i : i + 4].tolist() for i in range(0, len(want), 4)]
    # Every shard together: each element exactly once.
    joined = sorted(int(e) for i in range(num_shards) for e in build(x).shard(num_shards, i))
    assert joined == sorted(whole.tolist())


def test_shards_of_one_shuffled_order_partition_it_and_a_batch_before_shard_is_one_element():
    x = np.arange(50, dtype=np.float32)
    shards = [[float(e) for e in Dataset.from_tensor_slices(x).shuffle(50, seed=5).shard(3, i)] for i in range(3)]
    assert sorted(v for shard in shards for v in shard) == x.tolist()
    order = [float(e) for e in Dataset.from_tensor_slices(x).shuffle(50, seed=5)]
    assert order != x.tolist() and all(shards[i] == order[i::3] for i in range(3))
    batches = [b.tolist() for b in Dataset.from_tensor_slices(x).batch(4).shard(2, 1)]
    assert batches == [x[i : i + 4].tolist() for i in range(4, 50, 8)]


def test_shard_a_failed_element_counts_as_none_and_bad_arguments_are_refused():
    f = _fails_at({4})

    # The failed element 4 gives its position to element 5 (as tf.data, whose results
    # these are; one passed over while skipping also takes back the skipped ones).
    assert _drain(iter(Dataset.range(9).map(f).shard(3, 1))) == [10, "error", 50, 80]
    assert _drain(iter(Dataset.range(9).map(f).shard(3, 2))) == [20, "error", 70]
    ds = Dataset.range(5)
    for args, err, text in [
        ((0, 0), ValueError, "num_shards must be at least 1"),
        ((2, 2), ValueError, r"index must be in \[0, 2\)"),
        ((2, -1), ValueError, r"index must be in \[0, 2\)"),
        ((2.0, 0), TypeError, "num_shards must be an int"),
        ((2, True), TypeError, "index must be an int"),
    ]:
        with pytest.raises(err, match=text):
            ds.shard(*args)


def test_distribute_datasets_from_function_with_shard_gives_each_batch_once(s2):
    x = np.arange(23, dtype=np.float32)
    pipelines = []

    def dataset_fn(ctx):
        pipelines.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        # One pipeline that reads every second row: its rows go to the replicas once each.
        return Dataset.from_tensor_slices(x).shard(2, 0).batch(ctx.get_per_replica_batch_size(6))

    seen = []
    for batch in s2.distribute_datasets_from_function(dataset_fn):
        seen += [v for part in s2.experimental_local_results(batch) for v in np.asarray(part).tolist()]
    assert pipelines == [(1, 0)] and sorted(seen) == x[0::2].tolist()


def test_repeat_forever_of_unknown_size_is_infinite_as_in_tf_data():
    gen = Dataset.from_generator(lambda: iter(range(3)))
    assert int(gen.cardinality()) == dv.data.UNKNOWN_CARDINALITY
    assert int(gen.repeat().cardinality()) == dv.data.INFINITE_CARDINALITY
    assert int(gen.repeat().take(5).cardinality()) == 5
    assert int(gen.repeat().batch(2).cardinality()) == dv.data.INFINITE_CARDINALITY
    assert [int(e) for e in gen.repeat().take(5)] == [0, 1, 2, 0, 1]
    # (A pass that yields nothing still ends it.)
    assert list(Dataset.from_generator(lambda: iter(())).repeat()) == []


def test_lists_of_numpy_int64_arrays_keep_int64_and_range_takes_an_output_type():
    big = [np.array([1, 2], np.int64), np.array([3, 4], np.int64)]
    assert next(iter(Dataset.from_tensor_slices(big))).dtype == np.int64
    assert next(iter(Dataset.from_tensors(big))).dtype == np.int64
    assert next(iter(Dataset.from_tensor_slices([1, 2]))).dtype == np.int32  # Python ints, as TensorFlow
    r = Dataset.range(2, 5, output_type=np.int32)
    assert r.element_spec == dv.TensorSpec((), np.int32) and [e.dtype for e in r] == [np.int32] * 3


def test_map_and_prefetch():
    ds = Dataset.from_tensor_slices((np.arange(4.0), np.arange(4))).map(lambda x, y: (x * 2, y + 1)).prefetch(2)
    out = list(ds)
    assert [float(x) for x, _ in out] == [0.0, 2.0, 4.0, 6.0]
    assert [int(y) for _, y in out] == [1, 2, 3, 4]


def test_batched_flag_follows_the_pipeline():
    ds = Dataset.from_tensor_slices(np.arange(8))
    assert not ds._batched
    assert ds.batch(2).shuffle(4).repeat(2).take(3)._batched


def test_range_and_from_tensors():
    assert [int(e) for e in Dataset.range(2, 5)] == [2, 3, 4]
    (only,) = list(Dataset.from_tensors([1.0, 2.0]))
    assert only.dtype == np.float32 and only.tolist() == [1.0, 2.0]


# ---- batches cut from whole arrays ------------------------------------------------------------


def _generic(ds: Dataset) -> Dataset:
    """The same elements through the row-by-row path (a map loses the array slices)."""
    return ds.map(lambda *x: x if len(x) > 1 else x[0])


def test_batches_of_slices_are_copies_of_the_rows():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10)
    batches = list(Dataset.from_tensor_slices((x, y)).batch(4))
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    assert not any(np.shares_memory(b[0], x) or np.shares_memory(b[1], y) for b in batches)
    assert all(b[0].flags.writeable and b[0].flags.c_contiguous for b in batches)
    np.testing.assert_array_equal(batches[2][0], x[8:])
    assert batches[1][1].dtype == y.dtype and isinstance(batches[0], tuple)


@pytest.mark.parametrize(
    "build",
    [
        lambda ds: ds.batch(3),
        lambda ds: ds.batch(3, drop_remainder=True),
        lambda ds: ds.repeat(3).batch(4),
        lambda ds: ds.skip(2).take(5).batch(2),
        lambda ds: ds.take(7).repeat(2).batch(5, drop_remainder=True),
        lambda ds: ds.repeat().take(23).batch(6),
        lambda ds: ds.skip(1).repeat(2).skip(3).batch(4),
    ],
)
def test_sliced_batches_equal_stacked_rows(build):
    data = {"a": np.arange(30.0).reshape(10, 3), "b": np.arange(10, dtype=np.int32)}
    fast = list(build(Dataset.from_tensor_slices(data)))
    slow = list(build(_generic(Dataset.from_tensor_slices(data))))
    assert len(fast) == len(slow) > 0
    for f, s in zip(fast, slow):
        assert list(f) == ["a", "b"]
        np.testing.assert_array_equal(f["a"], s["a"])
        np.testing.assert_array_equal(f["b"], s["b"])
        assert f["b"].dtype == np.int32


def test_shuffled_sliced_batches_are_permutations_per_pass():
    ds = Dataset.from_tensor_slices(np.arange(100)).shuffle(100, seed=5).batch(32)
    first = np.concatenate(list(ds))
    second = np.concatenate(list(ds))
    assert sorted(first.tolist()) == list(range(100)) == sorted(second.tolist())
    assert first.tolist() != second.tolist() and first.tolist() != list(range(100))
    again = np.concatenate(list(Dataset.from_tensor_slices(np.arange(100)).shuffle(100, seed=5).batch(32)))
    assert again.tolist() == first.tolist()
    # A small buffer still bounds how far an element moves forward.
    k = 4
    order = np.concatenate(list(Dataset.from_tensor_slices(np.arange(200)).shuffle(k, seed=2).batch(7)))
    assert sorted(order.tolist()) == list(range(200))
    assert all(value <= pos + k - 1 for pos, value in enumerate(order.tolist()))
    # shuffle then repeat: every pass a new order.
    epochs = np.concatenate(list(Dataset.from_tensor_slices(np.arange(10)).shuffle(10, seed=1).repeat(3).batch(10)))
    passes = epochs.reshape(3, 10)
    assert all(sorted(p.tolist()) == list(range(10)) for p in passes)
    assert len({tuple(p) for p in passes.tolist()}) > 1


def test_unbatched_slices_are_rows():
    x = np.arange(6).reshape(3, 2)
    rows = list(Dataset.from_tensor_slices(x).shuffle(3, seed=0).repeat(2).skip(1))
    assert len(rows) == 5 and all(r.shape == (2,) for r in rows)


@pytest.mark.parametrize("shuffled", [False, True])
def test_elements_are_the_callers_own_and_leave_the_source_and_later_epochs_alone(shuffled):
    # A step that normalises its batch in place must change neither the arrays the
    # dataset was made from nor what the next epoch reads.
    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    y = np.arange(12, dtype=np.int64) * 10
    source = (x.copy(), y.copy())
    ds = dv.data.Dataset.from_tensor_slices((x, y))
    if shuffled:
        ds = ds.shuffle(12, seed=3, reshuffle_each_iteration=False)
    batched = ds.batch(4)
    epochs = []
    for _ in range(2):
        seen = []
        for bx, by in batched:
            seen.append((bx.copy(), by.copy()))
            bx += 1000
            by -= 7
        epochs.append(seen)
    np.testing.assert_array_equal(x, source[0])
    np.testing.assert_array_equal(y, source[1])
    for (ax, ay), (bx, by) in zip(*epochs):
        np.testing.assert_array_equal(ax, bx)
        np.testing.assert_array_equal(ay, by)
    # The rows of the first epoch are the source's, each once.
    rows = np.concatenate([bx for bx, _ in epochs[0]])
    np.testing.assert_array_equal(np.sort(rows[:, 0]), x[:, 0])
    # Unbatched elements too.
    for ex, ey in ds:
        ex += 1
        ey += 1
    np.testing.assert_array_equal(x, source[0])
    np.testing.assert_array_equal(y, source[1])


def test_distributed_batches_changed_in_a_step_leave_the_source_and_later_epochs_alone(s2):
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    keep = x.copy()
    dist = s2.experimental_distribute_dataset(dv.data.Dataset.from_tensor_slices(x).batch(4))

    def step(b):
        before = b.copy()
        b += 100
        return before

    for _ in range(2):
        got = [s2.experimental_local_results(s2.run(step, args=(b,))) for b in dist]
        # Every epoch's replicas see the source's rows, in order, split evenly.
        np.testing.assert_array_equal(np.concatenate([p for parts in got for p in parts]), keep)
    np.testing.assert_array_equal(x, keep)


# ---- values as TensorFlow gives them, and no state shared by accident ---------------------------


def test_numpy_float64_values_in_lists_keep_their_dtype():
    # Python floats become float32 (TensorFlow's rule); numpy float64 values do not.
    got = list(Dataset.from_tensor_slices([np.float64(0.1), np.float64(1 + 2**-40)]))
    assert [x.dtype for x in got] == [np.float64, np.float64]
    assert [float(x) for x in got] == [0.1, 1 + 2**-40]
    rows = list(Dataset.from_tensor_slices([np.arange(3.0), np.arange(3.0) + 0.1]))
    assert rows[1].dtype == np.float64 and rows[1].tolist() == [0.1, 1.1, 2.1]
    assert next(iter(Dataset.from_tensors([np.float64(0.1)]))).dtype == np.float64
    assert [x.dtype for x in Dataset.from_tensor_slices([0.5, 1.5])] == [np.float32, np.float32]


def test_map_returning_a_list_gives_a_tuple_of_components():
    got = list(Dataset.from_tensor_slices(np.arange(3.0)).map(lambda x: [x, x * 2]))
    assert all(type(e) is tuple and len(e) == 2 for e in got)
    assert [(float(a), float(b)) for a, b in got] == [(0.0, 0.0), (1.0, 2.0), (2.0, 4.0)]
    assert all(a.dtype == np.float64 for e in got for a in e)


def test_from_tensors_hands_out_copies():
    x = np.arange(4.0)
    ds = Dataset.from_tensors(x).repeat(2)
    seen = []
    for e in ds:
        seen.append(e.tolist())
        e -= 100  # a step that edits its element in place
    assert seen == [[0.0, 1.0, 2.0, 3.0]] * 2 and x.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_shuffle_without_reshuffle_keeps_one_order_without_a_seed():
    ds = Dataset.range(30).shuffle(30, reshuffle_each_iteration=False)
    first = [int(x) for x in ds]
    assert sorted(first) == list(range(30)) and first != list(range(30))
    assert [int(x) for x in ds] == first
    twice = [int(x) for x in ds.repeat(2)]
    assert twice == first + first


@pytest.mark.parametrize("then", ["batch", "prefetch", "prefetch-batch"])
def test_element_spec_does_not_move_the_shuffle_order(then):
    def orders(peek):
        ds = Dataset.range(8).shuffle(8, seed=1).map(lambda x: x * 1)
        if peek:
            assert ds.element_spec is not None
        for step in then.split("-"):
            ds = ds.batch(4) if step == "batch" else ds.prefetch(1)
        return [np.asarray(b).tolist() for _ in range(2) for b in ds]

    assert orders(True) == orders(False)


@pytest.mark.parametrize("buffer_size", [1, 3, 5, 6, 7, 100])
def test_a_seed_gives_one_shuffle_order_whatever_comes_before_the_shuffle(buffer_size):
    # As tf.data: the order depends on the seed, the buffer and the element count only,
    # so features and labels shuffled apart with one seed stay paired. (Rows of arrays
    # used to be permuted at once when the buffer held them all, other sources drawn
    # from the buffer one by one: zip paired 0 with 4.)
    x = np.arange(6)
    sources = [
        Dataset.from_tensor_slices(x),
        Dataset.from_tensor_slices(x).map(lambda v: v),
        Dataset.range(6),
        Dataset.from_generator(lambda: iter(range(6)), output_signature=dv.specs.TensorSpec((), np.int64)),
    ]
    orders = [[int(v) for v in ds.shuffle(buffer_size, seed=7)] for ds in sources]
    assert all(o == orders[0] for o in orders), orders
    assert sorted(orders[0]) == list(range(6))
    pairs = Dataset.zip(sources[0].shuffle(buffer_size, seed=7), sources[1].shuffle(buffer_size, seed=7))
    assert all(int(a) == int(b) for a, b in pairs)


@pytest.mark.parametrize("n", [0, 1, 2, 9, 257])
def test_shuffled_rows_of_arrays_come_in_the_order_of_the_streaming_buffer(n):
    # Rows of arrays are shuffled by one native walk of the buffer's draws; a source of
    # elements one by one goes through the streaming buffer itself. Both draw the same
    # numbers, so every buffer size (filled, draining, larger than the data) and every
    # pass must give one order.
    for buffer_size in sorted({1, 2, 3, max(1, n // 2), max(1, n - 1), max(1, n), n + 5}):
        rows = Dataset.from_tensor_slices(np.arange(n, dtype=np.int64)).shuffle(buffer_size, seed=11)
        streamed = Dataset.range(n).shuffle(buffer_size, seed=11)
        for _ in range(2):
            got = [int(v) for v in rows]
            assert got == [int(v) for v in streamed], (n, buffer_size)
            assert sorted(got) == list(range(n))


def test_the_native_shuffle_walk_refuses_draws_outside_its_buffer():
    from distvals import _core

    assert _core.shuffle_order(np.array([0, 1], np.int64), np.array([1, 0], np.int64), 2).tolist() == [0, 1, 3, 2]
    with pytest.raises(ValueError, match="draw 0 is 5, not a slot of a buffer of 1"):
        _core.shuffle_order(np.array([5], np.int64), np.array([0], np.int64), 1)
    with pytest.raises(ValueError, match="draw 2 is 1, not a slot of a buffer of 1"):
        _core.shuffle_order(np.array([0], np.int64), np.array([0, 1], np.int64), 2)
    with pytest.raises(ValueError, match="1 tail draws for a buffer of 2 slots"):
        _core.shuffle_order(np.array([0], np.int64), np.array([0], np.int64), 2)


@pytest.mark.parametrize("fails_first", [False, True])
def test_element_spec_reads_from_the_next_pass_not_an_extra_one(fails_first):
    # A generator with state of its own (one random order per call, from one seeded
    # source): asking for the spec must not call it once more, or the passes that follow
    # yield other orders than without the question (across workers: rows duplicated and
    # lost when only one worker asks). A first element that fails fails in that pass too.
    def make(ask):
        rng = np.random.default_rng(0)
        calls = []

        def gen():
            calls.append(1)
            yield from rng.permutation(8)

        def f(x):
            if fails_first and x == first_of_each[0]:
                raise ValueError("element failed")
            return x * 10

        first_of_each = [np.random.default_rng(0).permutation(8)[0]]
        ds = Dataset.from_generator(gen).map(f).batch(4)
        if ask:
            assert ds.element_spec == dv.TensorSpec((None,), np.int64)
        passes = []
        for _ in range(2):
            got, failed = [], 0
            it = iter(ds)
            while True:
                try:
                    got.append([int(v) for v in next(it)])
                except StopIteration:
                    break
                except ValueError:
                    failed += 1
            passes.append((got, failed))
        return passes, len(calls)

    asked, asked_calls = make(True)
    plain, plain_calls = make(False)
    assert asked == plain and asked_calls == plain_calls == 2
    if fails_first:
        # The batch with the failing element fails whole (map and batch are fused), in
        # the pass element_spec began as in any other.
        assert [failed for _, failed in asked] == [1, 1] and all(len(got) == 1 for got, _ in asked)
    else:
        assert sorted(v // 10 for b in asked[0][0] for v in b) == list(range(8))


def test_a_distributed_iterator_shared_by_threads_hands_out_each_batch_once():
    import threading
    import time

    s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    try:

        def slow(x):
            time.sleep(0.0001)  # a source that lets other threads in while it works
            return x

        ds = Dataset.from_tensor_slices(np.arange(4000)).map(slow).batch(4)
        it = iter(s.experimental_distribute_dataset(ds))
        seen, errors = [], []

        def take():
            try:
                for b in it:
                    seen.append(np.concatenate(s.experimental_local_results(b)).tolist())
            except BaseException as e:
                errors.append(e)

        ts = [threading.Thread(target=take) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert errors == []
        assert sorted(seen) == [[4 * i + k for k in range(4)] for i in range(1000)]
    finally:
        s.close()


# ---- an exception in a map function fails one element, and the pass goes on --------------------


def _fails_at(bad):
    def f(x):
        if int(x) in bad:
            raise ValueError(f"element {int(x)}")
        return x * 10

    return f


def _drain(it, limit=40):
    """What next() gives, one call at a time: values, 'error' for a raised exception."""
    seen = []
    for _ in range(limit):
        try:
            x = next(it)
        except StopIteration:
            return seen
        except ValueError as e:
            assert str(e).startswith("element "), e
            seen.append("error")
            continue
        seen.append(np.asarray(x).tolist())
    raise AssertionError(f"no end after {limit} elements: {seen}")


@pytest.mark.parametrize(
    "build,want",
    [
        (lambda f: Dataset.range(6).map(f), [0, 10, "error", 30, "error", 50]),
        (lambda f: Dataset.range(6).map(f).map(lambda y: y + 1), [1, 11, "error", 31, "error", 51]),
        # A batch with a failed element fails whole, after taking all of its elements.
        (lambda f: Dataset.range(7).map(f).batch(2), [[0, 10], "error", "error", [60]]),
        (lambda f: Dataset.range(7).map(f).batch(2, drop_remainder=True), [[0, 10], "error", "error"]),
        (lambda f: Dataset.range(3).map(f).repeat(2), [0, 10, "error", 0, 10, "error"]),
        # A failed element counts as neither taken nor skipped.
        (lambda f: Dataset.range(6).map(f).take(4), [0, 10, "error", 30, "error", 50]),
        (lambda f: Dataset.range(6).map(f).skip(1), [10, "error", 30, "error", 50]),
        (lambda f: Dataset.range(6).map(f).shuffle(1), [0, 10, "error", 30, "error", 50]),
    ],
    ids=["map", "map-map", "batch", "batch-drop", "repeat", "take", "skip", "shuffle-1"],
)
def test_an_exception_in_map_fails_its_element_and_the_pass_goes_on(build, want):
    assert _drain(iter(build(_fails_at({2, 4})))) == want


def test_a_shuffle_buffer_keeps_its_elements_across_a_failed_one():
    ds = Dataset.range(20).map(_fails_at({3, 11})).shuffle(5, seed=1)
    got = _drain(iter(ds))
    assert got.count("error") == 2
    assert sorted(x for x in got if x != "error") == [10 * i for i in range(20) if i not in (3, 11)]


@pytest.mark.parametrize("execution", ["inline", "threads"])
def test_a_distributed_iterator_goes_on_after_a_failed_batch(execution):
    s = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution=execution)
    try:
        dist = s.experimental_distribute_dataset(Dataset.range(8).map(_fails_at({2})).batch(2))
        it = iter(dist)
        seen = []
        for _ in range(6):
            try:
                b = next(it)
            except StopIteration:
                break
            except ValueError:
                seen.append("error")
                continue
            seen.append([np.asarray(p).tolist() for p in s.experimental_local_results(b)])
        assert seen == [[[0], [10]], "error", [[40], [50]], [[60], [70]]]
    finally:
        s.close()


@pytest.mark.parametrize(
    "build,want",
    [
        # Not right after a map, a batch fails at once: the elements it took before the
        # failed one are dropped, and the next batch starts after it (tf.data's unfused batch).
        (lambda f: Dataset.range(9).map(f).take(9).batch(3), ["error", "error", [50, 60, 70], [80]]),
        (lambda f: Dataset.range(9).map(f).prefetch(1).batch(3), ["error", "error", [50, 60, 70], [80]]),
        (lambda f: Dataset.range(5).map(f).repeat(2).batch(4), ["error"] * 4),
    ],
    ids=["take-batch", "prefetch-batch", "repeat-batch"],
)
def test_a_batch_not_right_after_map_fails_at_once(build, want):
    assert _drain(iter(build(_fails_at({2, 4})))) == want


def test_stop_iteration_in_a_map_function_is_an_error_not_the_end():
    def f(x):
        if int(x) == 4:
            raise StopIteration("not the end")
        return x

    it = iter(Dataset.range(8).map(f).batch(3))
    assert np.asarray(next(it)).tolist() == [0, 1, 2]
    with pytest.raises(RuntimeError, match="map function raised StopIteration"):
        next(it)
    assert [np.asarray(b).tolist() for b in it] == [[6, 7]]
    # Skipped elements that fail raise too, and start the skip over, as in tf.data:
    # after element 4 fails, 5 more are skipped.
    it = iter(Dataset.range(8).map(f).skip(5))
    with pytest.raises(RuntimeError, match="map function raised StopIteration"):
        next(it)
    assert [int(x) for x in it] == []
    it = iter(Dataset.range(12).map(f).skip(2))
    assert [int(next(it)) for _ in range(2)] == [2, 3]
    with pytest.raises(RuntimeError, match="map function raised StopIteration"):
        next(it)  # not while skipping: the next element follows it
    assert int(next(it)) == 5


def test_element_spec_skips_elements_that_fail():
    ds = Dataset.range(6).map(_fails_at({0, 1}))
    assert ds.element_spec == dv.TensorSpec((), np.int64)
    assert ds.batch(2).element_spec == dv.TensorSpec((None,), np.int64)
    with pytest.raises(ValueError, match="element 0"):
        Dataset.range(3).map(_fails_at({0, 1, 2})).element_spec  # noqa: B018 - the property raises


@pytest.mark.parametrize("how", ["dataset", "from_function", "distributed"])
def test_threads_sharing_one_iterator_each_take_whole_elements(how):
    # Every element exactly once, every batch consecutive rows, however the threads
    # interleave (tf.data's iterators are thread-safe).
    s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        base = Dataset.range(4000)
        if how == "dataset":
            it = iter(base.skip(5).take(3000).batch(4))
        elif how == "from_function":
            it = iter(s.distribute_datasets_from_function(lambda ctx: base.batch(2)))
        else:
            it = iter(s.experimental_distribute_dataset(base.batch(4)))
        got: list = []
        lock = threading.Lock()

        def pull():
            while True:
                try:
                    x = next(it)
                except StopIteration:
                    return
                rows = np.concatenate([np.asarray(p) for p in s.experimental_local_results(x)])
                with lock:
                    got.append(rows.tolist())

        threads = [threading.Thread(target=pull) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for rows in got:
            assert rows == list(range(rows[0], rows[0] + len(rows))), rows
        flat = sorted(v for rows in got for v in rows)
        assert flat == (list(range(5, 3005)) if how == "dataset" else list(range(4000)))
    finally:
        s.close()


# ---- from_generator, AUTOTUNE and the arguments tf.data takes for parallelism -------------------


def test_from_generator_calls_the_generator_for_each_pass_and_conforms_to_the_signature():
    calls = []

    def gen(n, scale):
        calls.append((n, scale))
        for i in range(n):
            yield (np.arange(i + 1) * scale, float(i))  # float64 data, int in the signature

    sig = (dv.TensorSpec(shape=(None,), dtype=np.float32), dv.TensorSpec(shape=(), dtype=np.int64))
    ds = Dataset.from_generator(gen, args=(3, 2.0), output_signature=sig)
    assert ds.element_spec == sig
    assert int(ds.cardinality()) == dv.data.UNKNOWN_CARDINALITY
    for _ in range(2):  # two passes, the generator called for each
        got = list(ds)
        assert [(a.dtype, b.dtype) for a, b in got] == [(np.float32, np.int64)] * 3
        for i, (a, b) in enumerate(got):
            np.testing.assert_array_equal(a, np.arange(i + 1, dtype=np.float64) * 2.0)
            assert int(b) == i
    assert calls == [(3, 2.0), (3, 2.0)]
    # The older output_types / output_shapes give the same signature.
    old = Dataset.from_generator(gen, output_types=(np.float32, np.int64), output_shapes=((None,), ()), args=(3, 2.0))
    assert old.element_spec == sig
    # Without a signature, leaves are converted as from_tensor_slices converts (float32 floats).
    plain = Dataset.from_generator(lambda: iter([1.5, 2.5])).batch(2)
    (batch,) = list(plain)
    assert batch.dtype == np.float32 and batch.tolist() == [1.5, 2.5]


def test_from_generator_elements_that_do_not_fit_fail_alone_and_the_pass_goes_on():
    def gen():
        yield np.zeros(2)
        yield np.zeros(3)  # wrong shape
        yield (np.zeros(2), np.zeros(2))  # wrong structure
        yield "text"  # not a number
        yield np.ones(2)

    it = iter(Dataset.from_generator(gen, output_signature=dv.TensorSpec((2,), np.float64)))
    np.testing.assert_array_equal(next(it), np.zeros(2))
    with pytest.raises(ValueError, match=r"component 0 of an element has shape \(3,\).*\(2,\)"):
        next(it)
    # A tuple where the signature has one tensor is converted, as tf.data does: here to
    # shape (2, 2).
    with pytest.raises(ValueError, match=r"has shape \(2, 2\)"):
        next(it)
    with pytest.raises(TypeError, match="cannot be converted to float64"):
        next(it)
    np.testing.assert_array_equal(next(it), np.ones(2))
    with pytest.raises(StopIteration):
        next(it)


def test_from_generator_signatures_from_nested_and_dict_types_and_shapes():
    # Shapes follow the types' structure (a dict's keys in any order, nested tuples).
    def gen():
        yield {"y": np.int32(1), "x": np.array([1.0, 2.0]), "z": ((1, 2), 3)}

    ds = Dataset.from_generator(
        gen,
        output_types={"y": np.int32, "x": np.float32, "z": ((np.int32, np.int64), np.float32)},
        output_shapes={"y": (), "x": (None,), "z": (((), ()), ())},
    )
    spec = ds.element_spec
    assert spec["y"] == dv.TensorSpec((), np.int32) and spec["x"] == dv.TensorSpec((None,), np.float32)
    assert spec["z"] == ((dv.TensorSpec((), np.int32), dv.TensorSpec((), np.int64)), dv.TensorSpec((), np.float32))
    (e,) = list(ds)
    assert e["x"].dtype == np.float32 and e["x"].tolist() == [1.0, 2.0]
    assert (e["z"][0][0].dtype, e["z"][0][1].dtype, e["z"][1].dtype) == (np.int32, np.int64, np.float32)
    with pytest.raises(ValueError, match="output_shapes does not match output_types"):
        Dataset.from_generator(gen, output_types=(np.int32, np.int32), output_shapes=((),))
    # A tuple of numbers where the signature has one tensor: converted, as tf.data does.
    (pair,) = list(Dataset.from_generator(lambda: iter([(1, 2)]), output_signature=dv.TensorSpec((2,), np.int32)))
    assert pair.dtype == np.int32 and pair.tolist() == [1, 2]


def test_from_generator_takes_specs_shaped_like_tensorflows():
    # What from_generator reads of a tf.TensorSpec: shape.as_list(), rank, dtype.as_numpy_dtype, name.
    class Shape:
        def __init__(self, dims):
            self.dims, self.rank = dims, len(dims)

        def as_list(self):
            return list(self.dims)

    class DType:
        as_numpy_dtype = np.float16

    class TensorSpec:  # the class name is what tells it apart
        def __init__(self, dims, name=None):
            self.shape, self.dtype, self.name = Shape(dims), DType(), name

    sig = (TensorSpec([None, 2], "a"), dv.TensorSpec((), np.int32))
    ds = Dataset.from_generator(lambda: iter([(np.ones((3, 2)), 5)]), output_signature=sig)
    ((x, y),) = list(ds)
    assert x.dtype == np.float16 and x.shape == (3, 2) and y.dtype == np.int32 and int(y) == 5
    assert ds.element_spec == (dv.TensorSpec((None, 2), np.float16, "a"), dv.TensorSpec((), np.int32))
    with pytest.raises(ValueError):
        list(Dataset.from_generator(lambda: iter([np.ones((3, 3))]), output_signature=TensorSpec([None, 2])))


def test_from_generator_refuses_bad_arguments():
    with pytest.raises(TypeError, match="generator must be callable"):
        Dataset.from_generator(iter([1, 2]))
    with pytest.raises(TypeError, match="not both"):
        Dataset.from_generator(lambda: iter([]), output_types=np.float32, output_signature=dv.TensorSpec(()))
    with pytest.raises(TypeError, match="TensorSpec leaves"):
        Dataset.from_generator(lambda: iter([]), output_signature=(np.float32,))
    with pytest.raises(TypeError, match="output_shapes needs output_types"):
        Dataset.from_generator(lambda: iter([]), output_shapes=(2,))


def test_autotune_and_parallel_arguments_are_accepted_and_change_nothing():
    assert dv.data.AUTOTUNE == -1
    x = np.arange(10.0)
    want = [list(b) for b in Dataset.from_tensor_slices(x).map(lambda v: v * 3).batch(4)]
    ds = (
        Dataset.from_tensor_slices(x)
        .map(lambda v: v * 3, num_parallel_calls=dv.data.AUTOTUNE, deterministic=True)
        .batch(4, num_parallel_calls=2, deterministic=False)
        .prefetch(dv.data.AUTOTUNE)
    )
    assert [list(b) for b in ds] == want == [[0.0, 3.0, 6.0, 9.0], [12.0, 15.0, 18.0, 21.0], [24.0, 27.0]]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_parallel_calls must be AUTOTUNE"):
            Dataset.range(3).map(lambda v: v, num_parallel_calls=bad)
        with pytest.raises(ValueError, match="num_parallel_calls must be AUTOTUNE"):
            Dataset.range(3).batch(2, num_parallel_calls=bad)
    with pytest.raises(ValueError, match="prefetch: buffer_size"):
        Dataset.range(3).prefetch(-5)


# ---- options ------------------------------------------------------------------------------------


def _off(**more):
    o = distvals.data.Options()
    o.experimental_distribute.auto_shard_policy = distvals.data.AutoShardPolicy.OFF
    for name, value in more.items():
        setattr(o, name, value)
    return o


def test_options_start_unset_and_take_values_of_their_types():
    o = distvals.data.Options()
    assert o.experimental_distribute.auto_shard_policy is distvals.data.AutoShardPolicy.AUTO
    assert o.deterministic is None and o.threading.private_threadpool_size is None
    o.deterministic = False
    o.threading.private_threadpool_size = 4
    o.experimental_optimization.map_parallelization = True
    assert (o.deterministic, o.experimental_deterministic) == (False, False)  # the old spelling reads the same
    assert o.experimental_threading.private_threadpool_size == 4
    assert o.experimental_optimization.map_parallelization is True
    assert [int(p) for p in distvals.data.AutoShardPolicy] == [-1, 0, 1, 2, 3]  # tf.data's values
    with pytest.raises(AttributeError, match="no_such_option"):
        o.no_such_option = 1
    with pytest.raises(TypeError, match="auto_shard_policy.*AutoShardPolicy.*got: 2"):
        o.experimental_distribute.auto_shard_policy = 2  # an int is not a policy
    with pytest.raises(TypeError, match="deterministic.*bool"):
        o.deterministic = 1
    with pytest.raises(TypeError, match="private_threadpool_size.*int"):
        o.threading.private_threadpool_size = "4"
    assert o.deterministic is False and o.threading.private_threadpool_size == 4  # a refused value changes nothing


def test_with_options_merges_later_over_earlier_and_unset_changes_nothing():
    A = distvals.data.AutoShardPolicy
    base = Dataset.from_tensor_slices(np.arange(7))
    data = distvals.data.Options()
    data.experimental_distribute.auto_shard_policy = A.DATA
    data.threading.private_threadpool_size = 3
    a = base.with_options(data)
    b = a.with_options(_off(deterministic=False))

    def state(ds):
        o = ds.options()
        return (o.experimental_distribute.auto_shard_policy, o.deterministic, o.threading.private_threadpool_size)

    assert state(base) == (A.AUTO, None, None)
    assert state(a) == (A.DATA, None, 3)
    assert state(b) == (A.OFF, False, 3)
    assert state(b.with_options(distvals.data.Options())) == (A.OFF, False, 3)
    auto = distvals.data.Options()
    auto.experimental_distribute.auto_shard_policy = A.AUTO  # the default: as unset, in tf.data too
    assert state(b.with_options(auto)) == (A.OFF, False, 3)
    assert data.merge(_off()).experimental_distribute.auto_shard_policy is A.OFF
    assert data.experimental_distribute.auto_shard_policy is A.DATA  # merge makes new options
    # Changing the options given afterwards changes nothing; those returned cannot change.
    data.experimental_distribute.auto_shard_policy = A.FILE
    assert state(a) == (A.DATA, None, 3)
    with pytest.raises(ValueError, match="with_options"):
        a.options().deterministic = True
    with pytest.raises(TypeError, match="distvals.data.Options.*int"):
        base.with_options(3)
    assert a.options() == a.options() and a.options() != b.options()


def test_every_dataset_made_from_one_with_options_carries_them_and_its_elements_stay():
    x = np.arange(11, dtype=np.int64)
    ds = Dataset.from_tensor_slices(x)
    opt = ds.with_options(_off())
    # Every transformation carries the options.
    chain = opt.shuffle(4, seed=1).repeat(2).skip(1).take(9).shard(2, 0).map(lambda v: v * 2).batch(2).prefetch(1)
    assert chain.options().experimental_distribute.auto_shard_policy is distvals.data.AutoShardPolicy.OFF
    # The elements, cardinality and spec are the dataset's own, on the row-gathering path too.
    assert [int(v) for v in opt] == x.tolist()
    assert int(opt.cardinality()) == 11 and opt.element_spec == ds.element_spec
    np.testing.assert_array_equal(np.concatenate(list(opt.batch(4))), x)
    shuffled = [v.tolist() for v in ds.shuffle(11, seed=5).batch(3)]
    assert [v.tolist() for v in ds.shuffle(11, seed=5).with_options(_off()).batch(3)] == shuffled


def test_with_options_between_a_map_and_a_batch_unfuses_them_as_in_tf_data():
    f = _fails_at({2})

    def outcomes(ds):
        return _drain(iter(ds))

    mapped = Dataset.range(8).map(f)
    # Right after its map a batch fails whole; after with_options, the failed element alone.
    fused, unfused = [[0, 10], "error", [40, 50], [60, 70]], [[0, 10], "error", [30, 40], [50, 60], [70]]
    assert outcomes(mapped.batch(2)) == fused
    assert outcomes(mapped.with_options(_off()).batch(2)) == unfused
    # Options that turn the fusion off, set anywhere in the pipeline (every pass of a repeat).
    nofuse, nodefault, keep = distvals.data.Options(), distvals.data.Options(), distvals.data.Options()
    nofuse.experimental_optimization.map_and_batch_fusion = False
    nodefault.experimental_optimization.apply_default_optimizations = False
    keep.experimental_optimization.apply_default_optimizations = False
    keep.experimental_optimization.map_and_batch_fusion = True
    assert outcomes(mapped.batch(2).with_options(nofuse)) == unfused
    assert outcomes(Dataset.range(8).with_options(nofuse).map(f).batch(2)) == unfused
    assert outcomes(mapped.batch(2).repeat(2).with_options(nodefault)) == unfused + unfused
    assert outcomes(mapped.batch(2).with_options(keep)) == fused
    # The options belong to the pipeline they end: the same batch dataset without them fuses.
    assert outcomes(mapped.batch(2)) == fused


@pytest.mark.parametrize("policy", ["OFF", "FILE", "HINT", "DATA"])
def test_one_process_strategies_divide_nothing_whatever_the_policy(policy):
    # One worker: every policy gives the batches the dataset gives without options.
    o = distvals.data.Options()
    o.experimental_distribute.auto_shard_policy = getattr(distvals.data.AutoShardPolicy, policy)
    s = dv.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        ds = Dataset.from_tensor_slices(np.arange(10.0)).batch(4)
        plain = [[p.tolist() for p in s.experimental_local_results(b)] for b in s.experimental_distribute_dataset(ds)]
        got = [
            [p.tolist() for p in s.experimental_local_results(b)]
            for b in s.experimental_distribute_dataset(ds.with_options(o))
        ]
        assert got == plain == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]], [[8.0], [9.0]]]
    finally:
        s.close()


# ---- filter, zip, concatenate, enumerate, unbatch, cache, flat_map, reduce, padded_batch ----


def test_filter_and_take_while_need_a_bool_scalar_and_name_what_they_got():
    ds = Dataset.range(4)
    assert [int(x) for x in ds.filter(lambda x: x % 2 == 1)] == [1, 3]
    assert [int(x) for x in ds.filter(lambda x: True)] == [0, 1, 2, 3]
    for bad, text in ((lambda x: x, "int64 of shape ()"), (lambda x: np.array([True, False]), "bool of shape (2,)")):
        with pytest.raises(ValueError, match=r"filter: the predicate must return a bool scalar.*" + re.escape(text)):
            next(iter(ds.filter(bad)))
    with pytest.raises(ValueError, match="take_while: the predicate"):
        next(iter(ds.take_while(lambda x: 1)))
    with pytest.raises(TypeError, match="predicate must be callable"):
        ds.filter(3)


def test_a_filter_whose_predicate_raises_stop_iteration_fails_that_element_only():
    def keep(x):
        if int(x) == 1:
            raise StopIteration
        return True

    it = iter(Dataset.range(3).filter(keep))
    assert int(next(it)) == 0
    with pytest.raises(RuntimeError, match="filter: the function raised StopIteration"):
        next(it)
    assert int(next(it)) == 2


def test_zip_packs_each_datasets_element_as_the_datasets_are_nested():
    a = Dataset.range(3)
    b = Dataset.from_tensor_slices(np.arange(10.0, 15.0))
    out = list(Dataset.zip(Point(a, {"b": b, "c": (a,)})))
    assert len(out) == 3
    for i, e in enumerate(out):
        assert isinstance(e, Point) and set(e.y) == {"b", "c"} and isinstance(e.y["c"], tuple)
        assert int(e.x) == i and float(e.y["b"]) == 10.0 + i and int(e.y["c"][0]) == i
    with pytest.raises(TypeError, match="give the datasets as positional arguments or as datasets="):
        Dataset.zip(a, datasets=(a, b))
    with pytest.raises(ValueError, match="zip: no datasets given"):
        Dataset.zip(())


def test_enumerate_counts_from_start_as_int64():
    out = list(Dataset.from_tensor_slices(np.array([7, 8], np.int16)).enumerate(start=-2))
    assert [(int(i), int(x)) for i, x in out] == [(-2, 7), (-1, 8)]
    assert out[0][0].dtype == np.int64 and out[0][1].dtype == np.int16


def test_concatenate_refuses_what_is_not_a_dataset_and_elements_that_differ():
    a = Dataset.range(2)
    with pytest.raises(TypeError, match="concatenate: dataset must be a distvals.data.Dataset, got list"):
        a.concatenate([1, 2])
    with pytest.raises(TypeError, match="incompatible dataset elements"):
        a.concatenate(Dataset.range(2).map(lambda x: x.astype(np.int32)))
    both = a.concatenate(Dataset.range(5, 7))
    assert [int(x) for x in both] == [0, 1, 5, 6] and len(both) == 4


def test_unbatch_gives_rows_of_their_own_and_names_components_of_different_sizes():
    batches = [np.arange(6.0).reshape(3, 2)]
    rows = list(Dataset.from_generator(lambda: iter(batches)).unbatch())
    assert [r.tolist() for r in rows] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    rows[0][:] = -1
    assert rows[1].tolist() == [2.0, 3.0] and batches[0][0].tolist() == [0.0, 1.0]
    assert all(r.base is None for r in rows)  # not views that keep the whole batch alive

    def uneven():
        yield np.arange(2), np.arange(3)
        yield np.arange(1), np.arange(1)

    it = iter(Dataset.from_generator(uneven).unbatch())
    with pytest.raises(ValueError, match="component 0 has 2, component 1 has 3"):
        next(it)
    a, b = next(it)  # the pass goes on with the next element
    assert int(a) == 0 and int(b) == 0


def test_cache_gives_copies_and_keeps_the_first_whole_pass():
    calls = []

    def gen():
        calls.append(1)
        for i in range(3):
            yield np.full(2, float(i))

    ds = Dataset.from_generator(gen).cache()
    first = list(ds)
    first[0][:] = 99.0  # the caller's own: the cache is not changed
    again = list(ds)
    assert [x.tolist() for x in again] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    again[1][:] = 99.0
    assert [x.tolist() for x in ds][1] == [1.0, 1.0]
    assert len(calls) == 1


def test_cache_of_array_slices_keeps_the_first_passs_order_and_batches_by_slicing():
    x = np.arange(20.0).reshape(10, 2)
    ds = Dataset.from_tensor_slices(x).shuffle(10, seed=3).cache()
    assert ds._rows is not None  # batch still cuts whole arrays
    first = np.concatenate(list(ds.batch(4)))
    second = np.concatenate(list(ds.batch(4)))
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(np.sort(first[:, 0]), x[:, 0])  # every row once
    assert not np.array_equal(first, x)  # shuffled (seed 3 does not give the identity)


def test_cache_takes_only_a_str_filename():
    with pytest.raises(TypeError, match="cache: filename must be a str"):
        Dataset.range(2).cache(3)


def test_flat_map_needs_a_dataset_from_its_function():
    it = iter(Dataset.range(3).flat_map(lambda x: Dataset.range(x) if int(x) != 1 else [1]))
    with pytest.raises(TypeError, match="flat_map: map_func must return a distvals.data.Dataset, got list"):
        next(it)
    assert [int(v) for v in it] == [0, 1]


def test_reduce_keeps_the_initial_states_structure_and_dtypes():
    ds = Dataset.range(4)
    total, count = ds.reduce((np.int64(0), np.int64(0)), lambda s, x: (s[0] + x, s[1] + 1))
    assert (int(total), int(count)) == (6, 4) and total.dtype == np.int64
    with pytest.raises(TypeError, match=r"reduce: reduce_func returned a state of structure \(\*, \*\); the initial"):
        ds.reduce(np.int64(0), lambda s, x: (s, x))
    with pytest.raises(TypeError, match=r"dtypes \['float64'\]; the initial state's are \['int64'\]"):
        ds.reduce(np.int64(0), lambda s, x: s + x * 0.5)


def test_padded_batch_checks_its_shapes_and_values():
    words = Dataset.from_generator(
        lambda: (np.arange(n, dtype=np.int8) for n in (2, 1)), output_signature=dv.TensorSpec((None,), np.int8)
    )
    out = list(words.padded_batch(2, padded_shapes=(3,), padding_values=-1))
    assert out[0].dtype == np.int8 and out[0].tolist() == [[0, 1, -1], [0, -1, -1]]
    with pytest.raises(
        TypeError, match=r"padding value 300 of component 0 cannot be a int8: Python integer 300 out of bounds"
    ):
        words.padded_batch(2, padding_values=300)
    with pytest.raises(TypeError, match=r"padding value 1.5 of component 0 is not exactly a int8"):
        words.padded_batch(2, padding_values=1.5)
    with pytest.raises(TypeError, match="padding value of component 0 has dtype int64; the component's is int8"):
        words.padded_batch(2, padding_values=np.int64(1))
    with pytest.raises(ValueError, match=r"padded shape \(2, 2\) of component 0 has rank 2"):
        words.padded_batch(2, padded_shapes=[2, 2])
    pairs = Dataset.zip((words, Dataset.range(2)))
    with pytest.raises(ValueError, match="padded_shapes must nest like the elements"):
        pairs.padded_batch(2, padded_shapes=[3])
    # Without a spec (a generator with none) the checks come with the batch.
    loose = Dataset.from_generator(lambda: iter([np.zeros(2), np.zeros((1, 1))]))
    with pytest.raises(ValueError, match=r"component 0 has elements of different ranks \[1, 2\]"):
        next(iter(loose.padded_batch(2)))


@pytest.mark.parametrize("kind", [str, bytes])
def test_strings_of_any_width_are_one_dtype_and_padding_keeps_its_own(kind):
    """numpy strings of different widths are tf.data's one string dtype: padding values,
    concatenation, padded batches of generated strings and a scan state that grows all
    keep every character (a padding "PAD" was cut to the component's width, "PA")."""

    def a(*xs):
        return np.array([kind(x, "ascii") if kind is bytes else x for x in xs])

    pad = kind("PAD", "ascii") if kind is bytes else "PAD"
    out = list(
        Dataset.from_tensor_slices(a("ab", "cd").reshape(2, 1)).padded_batch(2, padded_shapes=[3], padding_values=pad)
    )
    assert out[0].tolist() == [[x, pad, pad] for x in a("ab", "cd").tolist()]
    both = Dataset.from_tensor_slices(a("a")).concatenate(Dataset.from_tensor_slices(a("bb")))
    assert [x.item() for x in both] == a("a", "bb").tolist()
    assert both.element_spec.dtype.kind == a("a").dtype.kind
    rows = [a("a"), a("bbb", "c")]
    gen = Dataset.from_generator(lambda: iter(rows), output_signature=dv.TensorSpec((None,), a("a").dtype))
    assert next(iter(gen.padded_batch(2))).tolist() == [a("a", "").tolist(), a("bbb", "c").tolist()]
    grow = Dataset.range(3).scan(a("a")[0], lambda s, i: (np.char.add(s, a("b")[0]), s))
    assert [x.item() for x in grow] == a("a", "ab", "abb").tolist()


def test_batch_of_elements_of_different_shapes_or_dtypes_names_the_component():
    """As tf.data: a batch's elements share each component's shape and dtype; the error
    names the component and both shapes or dtypes (numpy widened mixed dtypes, so that a
    batch's dtype differed from element_spec's, with no error)."""
    ragged = Dataset.range(1, 3).map(lambda i: (i, np.arange(i))).batch(2)
    with pytest.raises(ValueError, match=r"different shapes in component 1: the first element has shape \(1,\), "):
        list(ragged)
    mixed = Dataset.range(3).map(lambda i: i if i < 2 else np.float32(i))
    assert mixed.element_spec.dtype == np.int64
    with pytest.raises(
        TypeError, match="different dtypes in component 0: the first element has dtype int64, element 2"
    ):
        list(mixed.batch(3))


def test_zipped_features_and_labels_split_over_replicas_in_both_modes():
    x = np.arange(24.0, dtype=np.float32).reshape(8, 3)
    y = np.arange(8, dtype=np.int64) * 10
    ds = Dataset.zip((Dataset.from_tensor_slices(x), Dataset.from_tensor_slices(y))).batch(4)
    for execution in ("inline", "threads"):
        s = dv.MirroredStrategy(["CPU:0", "CPU:1"], execution=execution)
        try:
            steps = list(s.experimental_distribute_dataset(ds))
            assert len(steps) == 2
            for k, (xs, ys) in enumerate(steps):
                for r in range(2):
                    rows = slice(4 * k + 2 * r, 4 * k + 2 * r + 2)
                    np.testing.assert_array_equal(xs.values[r], x[rows])
                    np.testing.assert_array_equal(ys.values[r], y[rows])
        finally:
            s.close()


def test_zip_of_array_slices_stays_slices_so_that_batches_cut_whole_arrays():
    x = np.arange(30.0).reshape(10, 3)
    y = {"label": np.arange(12, dtype=np.int64) * 7, "w": [0.5] * 12}  # longer: the zip has 10 rows
    ds = Dataset.zip(Dataset.from_tensor_slices(x), Dataset.from_tensor_slices(y))
    assert ds._rows is not None and len(ds) == 10
    batches = list(ds.batch(4))
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    for k, (xs, ys) in enumerate(batches):
        rows = slice(4 * k, min(4 * k + 4, 10))
        np.testing.assert_array_equal(xs, x[rows])
        np.testing.assert_array_equal(ys["label"], y["label"][rows])
        assert ys["w"].dtype == np.float32 and ys["w"].tolist() == [0.5] * len(ys["label"])
    xs[:] = -1  # the caller's own copy
    assert x[8, 0] == 24.0
    # Shuffled after the zip, every row keeps its label.
    shuffled = Dataset.zip((Dataset.from_tensor_slices(x), Dataset.from_tensor_slices(y))).shuffle(10, seed=4)
    seen = []
    for xs, ys in shuffled.batch(3):
        np.testing.assert_array_equal(ys["label"], (xs[:, 0] // 3).astype(np.int64) * 7)
        seen.extend(xs[:, 0].tolist())
    assert sorted(seen) == x[:, 0].tolist() and seen != x[:, 0].tolist()
    # Not from the first row of each (a skip): zipped element by element, same pairs.
    late = Dataset.zip((Dataset.from_tensor_slices(x).skip(2), Dataset.from_tensor_slices(y)))
    assert late._rows is None
    assert [(float(a[0]), int(b["label"])) for a, b in late][:2] == [(6.0, 0), (9.0, 7)]


def test_the_pipelines_options_reach_the_datasets_that_flat_map_makes():
    # map_and_batch_fusion off: a batch right after a failing map fails at once and keeps
    # the elements after the failed one, also in the datasets flat_map makes as it goes.
    def f(x):
        if int(x) == 1:
            raise ValueError("element 1")
        return x

    opts = dv.data.Options()
    opts.experimental_optimization.map_and_batch_fusion = False
    inner = Dataset.range(6).map(f).batch(3)
    for ds, want in (
        (Dataset.range(1).flat_map(lambda _: inner).with_options(opts), [[2, 3, 4], [5]]),
        (Dataset.range(1).flat_map(lambda _: inner), [[3, 4, 5]]),  # fused, the default
    ):
        it = iter(ds)
        with pytest.raises(ValueError, match="element 1"):
            next(it)
        assert [np.asarray(b).tolist() for b in it] == want
