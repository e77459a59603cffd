"""distvals.data: interleave, window, scan, unique, ignore_errors, rebatch, counter,
choose_from_datasets, sample_from_datasets, get_single_element and
distvals.data.experimental, each against a reference written over Python lists (the
orders are tf.data's; tests/test_tf_differential.py compares them with TensorFlow)."""

from __future__ import annotations

import collections
import itertools
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distvals as dv
from distvals.data import Dataset

X = dv.data.experimental


def ints(ds):
    return [int(x) for x in ds]


def lists(ds):
    return [np.asarray(x).tolist() for x in ds]


def fails_at(bad):
    """A map function: x * 10, raising for element ``bad``."""

    def f(x):
        if int(x) == bad:
            raise ValueError(f"element {bad}")
        return x * 10

    return f


def outcomes(ds, limit=40, show=lambda x: np.asarray(x).tolist()):
    """Each next() of a pass: the element (as ``show`` gives it), "error" for a failed
    one, then "end"."""
    it, seq = iter(ds), []
    for _ in range(limit):
        try:
            x = next(it)
        except StopIteration:
            seq.append("end")
            break
        except ValueError:
            seq.append("error")
            continue
        seq.append(show(x))
    return seq


# ---- interleave ----------------------------------------------------------------------------------


def interleave_reference(inputs, make, cycle, block):
    """tf.data's interleave order over Python lists: ``cycle`` slots, each the list of one
    input; ``block`` values from a slot per turn; an exhausted slot is refilled with the
    next input when the cycle comes back to it."""
    inputs = list(inputs)
    slots = [None] * cycle
    out, i, nxt = [], 0, 0
    while nxt < len(inputs) or any(s is not None for s in slots):
        if slots[i] is None and nxt < len(inputs):
            slots[i] = list(make(inputs[nxt]))
            nxt += 1
            continue
        if slots[i] is not None:
            taken = 0
            while slots[i] and taken < block:
                v = slots[i].pop(0)
                out.append(v)
                taken += v != "error"  # a failed element takes no place in the block
            if taken < block:  # the list ran out within its turn
                slots[i] = None
                i = (i + 1) % cycle
                continue
        i = (i + 1) % cycle
    return out


def test_interleave_matches_tensorflows_documented_example():
    # tf.data's docstring: range(1, 6), each x repeated 6 times, cycle 2, block 4.
    ds = Dataset.range(1, 6).interleave(lambda x: Dataset.from_tensors(x).repeat(6), cycle_length=2, block_length=4)
    want = [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4, 5, 5, 5, 5, 5, 5]
    assert ints(ds) == want
    assert ints(ds) == interleave_reference(range(1, 6), lambda x: [x] * 6, 2, 4)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5), max_size=7),
    cycle=st.integers(1, 4),
    block=st.integers(1, 4),
)
def test_interleave_order_is_the_references(sizes, cycle, block):
    # Inner datasets of different lengths (some empty): element k of input j is 100*j+k.
    def make(j):
        return [100 * j + k for k in range(sizes[j])]

    ds = Dataset.range(len(sizes)).interleave(
        lambda j: Dataset.from_tensor_slices(np.array(make(int(j)), dtype=np.int64)), cycle, block
    )
    want = interleave_reference(range(len(sizes)), make, cycle, block)
    assert ints(ds) == want
    assert ints(ds) == want  # a second pass is the same
    assert ds.cardinality() == dv.data.UNKNOWN_CARDINALITY


def test_interleave_of_structures_keeps_them_and_reads_the_spec():
    ds = Dataset.range(1, 4).interleave(lambda x: Dataset.range(x).map(lambda y: (x, y)), cycle_length=2)
    got = [(int(a), int(b)) for a, b in ds]
    assert got == interleave_reference(range(1, 4), lambda x: [(x, y) for y in range(x)], 2, 1)
    assert ds.element_spec == (dv.TensorSpec((), np.int64), dv.TensorSpec((), np.int64))


def test_interleave_cycle_length_none_is_the_cpu_count():
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    sizes = [3] * (cpus + 2)
    ds = Dataset.range(len(sizes)).interleave(lambda j: Dataset.from_tensors(j).repeat(3))
    assert ints(ds) == interleave_reference(range(len(sizes)), lambda j: [j] * 3, cpus, 1)
    ds = Dataset.range(4).interleave(lambda j: Dataset.from_tensors(j).repeat(2), cycle_length=dv.data.AUTOTUNE)
    assert ints(ds) == interleave_reference(range(4), lambda j: [j] * 2, cpus, 1)


def test_an_exception_in_interleave_fails_one_element_and_the_pass_goes_on():
    f = fails_at(3)
    # In an inner dataset: that next() fails, the same inner dataset goes on after it.
    ds = Dataset.range(4).interleave(lambda x: Dataset.range(x, x + 2).map(f), cycle_length=2)
    ref = interleave_reference(range(4), lambda x: ["error" if v == 3 else v * 10 for v in range(x, x + 2)], 2, 1)
    assert outcomes(ds) == ref + ["end"]
    # In the input: the element whose dataset could not be made is one failed next().
    ds = Dataset.range(5).map(f).interleave(lambda x: Dataset.from_tensors(x).repeat(2), cycle_length=2)
    got = outcomes(ds)
    assert got.count("error") == 1 and got[-1] == "end"
    assert [v for v in got if v not in ("error", "end")] == interleave_reference(
        [0, 10, 20, 40], lambda x: [x, x], 2, 1
    )


def test_interleave_checks_its_arguments():
    ds = Dataset.range(3)
    with pytest.raises(TypeError, match="map_func must be callable"):
        ds.interleave(3)
    with pytest.raises(ValueError, match="cycle_length must be a positive int"):
        ds.interleave(lambda x: ds, cycle_length=0)
    with pytest.raises(ValueError, match="block_length must be a positive int"):
        ds.interleave(lambda x: ds, block_length=0)
    with pytest.raises(ValueError, match="num_parallel_calls"):
        ds.interleave(lambda x: ds, num_parallel_calls=0)
    with pytest.raises(TypeError, match="must return a distvals.data.Dataset, got list"):
        list(ds.interleave(lambda x: [x]))


def test_the_pipelines_options_reach_the_datasets_that_interleave_makes():
    # map_and_batch_fusion off: a batch right after a failing map fails at once and keeps
    # the elements after it, also in the datasets interleave makes.
    opts = dv.data.Options()
    opts.experimental_optimization.map_and_batch_fusion = False
    inner = Dataset.range(6).map(fails_at(1)).batch(3)
    unfused = Dataset.range(1).interleave(lambda _: inner, cycle_length=1).with_options(opts)
    assert outcomes(unfused) == ["error", [20, 30, 40], [50], "end"]
    assert outcomes(Dataset.range(1).interleave(lambda _: inner, cycle_length=1)) == ["error", [30, 40, 50], "end"]


# ---- window ----------------------------------------------------------------------------------------


def window_reference(n, size, shift, stride, drop):
    """Window k: elements k*shift + i*stride (i < size) that exist, while k*shift < n; with
    ``drop``, only whole windows."""
    out, k = [], 0
    while k * shift < n:
        w = [k * shift + i * stride for i in range(size) if k * shift + i * stride < n]
        if not drop or len(w) == size:
            out.append(w)
        k += 1
    if drop:
        out = [w for w in out if len(w) == size]
    return out


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 14),
    size=st.integers(1, 5),
    shift=st.integers(1, 6),
    stride=st.integers(1, 3),
    drop=st.booleans(),
)
def test_window_holds_the_references_elements(n, size, shift, stride, drop):
    ds = Dataset.range(n).window(size, shift, stride, drop)
    want = window_reference(n, size, shift, stride, drop)
    assert [ints(w) for w in ds] == want
    assert ds.cardinality() == len(want)
    # Through flat_map, as tf.data's users make arrays of windows.
    assert lists(ds.flat_map(lambda w: w.batch(size))) == want


def test_windows_of_structures_are_structures_of_datasets():
    pairs = Dataset.from_tensor_slices((np.arange(5.0, dtype=np.float32), np.arange(5)))
    ds = pairs.window(2)
    assert ds.element_spec == (
        dv.data.specs.DatasetSpec(dv.TensorSpec((), np.float32)),
        dv.data.specs.DatasetSpec(dv.TensorSpec((), np.int64)),
    )
    got = [(lists(a), lists(b)) for a, b in ds]
    assert got == [([0.0, 1.0], [0, 1]), ([2.0, 3.0], [2, 3]), ([4.0], [4])]
    named = Dataset.from_tensor_slices({"a": np.arange(4), "b": np.arange(4) * 10}).window(3, 2)
    assert [(lists(w["a"]), lists(w["b"])) for w in named] == [([0, 1, 2], [0, 10, 20]), ([2, 3], [20, 30])]
    # A window is re-iterable, and each pass hands out arrays of its own.
    w = next(iter(Dataset.range(3).window(3)))
    first = list(w)
    first[0][...] = 99
    assert ints(w) == [0, 1, 2]


def test_a_map_may_return_windows_and_the_spec_says_so():
    ds = Dataset.range(6).window(4, 2).map(lambda w: w.window(2))
    assert [[ints(x) for x in ws] for ws in ds] == [[[0, 1], [2, 3]], [[2, 3], [4, 5]], [[4, 5]]]
    spec = Dataset.range(6).map(lambda x: x).window(2).element_spec
    assert spec == dv.data.specs.DatasetSpec(dv.TensorSpec((), np.int64))


def test_an_exception_in_window_fails_the_windows_that_hold_the_element():
    f = fails_at(3)
    # Windows [0,1,2] [3,4,5] [6,7]: the second fails, the pass goes on.
    assert outcomes(Dataset.range(8).map(f).window(3), show=ints) == [[0, 10, 20], "error", [60, 70], "end"]
    # Stride 2 from 0: element 3 is in no window that starts at an even element.
    got = outcomes(Dataset.range(8).map(f).window(2, 2, 2), show=ints)
    assert got == [[0, 20], [20, 40], [40, 60], [60], "end"]
    # A shift longer than the window passes over element 3 (and its error).
    assert outcomes(Dataset.range(8).map(f).window(1, 4), show=ints) == [[0], [40], "end"]


def test_window_checks_its_arguments():
    ds = Dataset.range(5)
    for kwargs, what in (
        ({"size": 0}, "size"),
        ({"size": 2, "shift": 0}, "shift"),
        ({"size": 2, "stride": -1}, "stride"),
    ):
        with pytest.raises(ValueError, match=f"window: {what} must be a positive int"):
            ds.window(**kwargs)
    with pytest.raises(TypeError, match="drop_remainder must be a bool"):
        ds.window(2, drop_remainder="yes")


# ---- scan, unique, ignore_errors, get_single_element ---------------------------------------------------


def test_scan_gives_an_element_per_step_and_starts_each_pass_over():
    values = np.array([3.0, -1.0, 4.0, 1.5], dtype=np.float64)
    ds = Dataset.from_tensor_slices(values).scan(np.float64(0), lambda s, x: (s + x, s * 2))
    want = [2 * p for p in itertools.accumulate([0.0, *values[:-1]])]
    assert [float(x) for x in ds] == want
    assert [float(x) for x in ds] == want
    assert ds.cardinality() == 4
    # Structured states and elements; a tuple element is passed whole.
    pairs = Dataset.from_tensor_slices((np.arange(4), np.arange(4.0, dtype=np.float32)))
    got = [(int(a), float(b)) for a, b in pairs.scan(np.float32(0), lambda s, x: (s + x[1], (x[0], s)))]
    assert got == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 3.0)]


def test_scan_state_written_in_place_never_leaks_into_the_next_pass_or_the_elements():
    def step(s, x):
        s += x  # in place, which tf.data's immutable tensors would not allow
        return s, s

    ds = Dataset.range(1, 4).scan(np.zeros(2, np.int64), step)
    first = lists(ds)
    assert first == [[1, 1], [3, 3], [6, 6]]
    assert lists(ds) == first  # the initial state was not written


def test_scan_checks_the_state():
    with pytest.raises(TypeError, match="dtypes"):
        list(Dataset.range(3).scan(np.float32(0), lambda s, x: (x, x)))
    with pytest.raises(TypeError, match="structure"):
        list(Dataset.range(3).scan((np.int64(0), np.int64(0)), lambda s, x: (x, x)))
    with pytest.raises(TypeError, match="must return a pair"):
        list(Dataset.range(3).scan(np.int64(0), lambda s, x: s + x))


def test_an_exception_in_scan_leaves_the_state_as_it_was():
    ds = Dataset.range(6).map(fails_at(2)).scan(np.int64(0), lambda s, x: (s + x, s))
    assert outcomes(ds) == [0, 0, "error", 10, 40, 80, "end"]


def test_unique_keeps_first_occurrences():
    values = [3, 1, 3, 2, 1, 5, 2]
    for dtype in (np.int32, np.int64):
        assert ints(Dataset.from_tensor_slices(np.array(values, dtype)).unique()) == list(dict.fromkeys(values))
    words = Dataset.from_tensor_slices(np.array([b"a", b"bb", b"a"])).unique()
    assert [x.item() for x in words] == [b"a", b"bb"]
    assert [x.item() for x in Dataset.from_tensor_slices(["x", "y", "x"]).unique()] == ["x", "y"]
    rows = Dataset.from_tensor_slices(np.array([[1, 2], [1, 2], [2, 1]], np.int64)).unique()
    assert lists(rows) == [[1, 2], [2, 1]]
    # Each pass starts with nothing seen.
    ds = Dataset.range(6).map(lambda x: x % 3).unique()
    assert ints(ds) == [0, 1, 2] and ints(ds) == [0, 1, 2]
    with pytest.raises(TypeError, match="int32, int64 or strings, got dtype float32"):
        Dataset.from_tensor_slices(np.ones(2, np.float32)).unique()
    with pytest.raises(ValueError, match="single arrays"):
        Dataset.from_tensor_slices((np.arange(2), np.arange(2))).unique()


def test_ignore_errors_drops_the_failed_elements(caplog):
    ds = Dataset.range(6).map(fails_at(3))
    assert ints(ds.ignore_errors()) == [0, 10, 20, 40, 50]
    assert ds.ignore_errors().cardinality() == dv.data.UNKNOWN_CARDINALITY
    assert lists(ds.batch(2).ignore_errors()) == [[0, 10], [40, 50]]  # the failed batch goes whole
    with caplog.at_level(logging.WARNING, logger="distvals.data"):
        assert ints(ds.ignore_errors(log_warning=True)) == [0, 10, 20, 40, 50]
    assert "element 3" in caplog.text
    # Not an interrupt: KeyboardInterrupt still stops the pass.

    def interrupt(x):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list(Dataset.range(2).map(interrupt).ignore_errors())


def test_get_single_element():
    assert int(Dataset.range(5, 6).get_single_element()) == 5
    a, b = Dataset.from_tensors((np.int64(1), np.float32(2))).get_single_element()
    assert (int(a), float(b)) == (1, 2.0)
    with pytest.raises(ValueError, match="was empty"):
        Dataset.range(0).get_single_element()
    with pytest.raises(ValueError, match="more than one element"):
        Dataset.range(2).get_single_element()


# ---- rebatch, counter ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(0, 23),
    first=st.integers(1, 7),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    drop=st.booleans(),
)
def test_rebatch_is_unbatch_then_batches_of_the_sizes_in_turn(n, first, sizes, drop):
    rows = list(range(n))
    want, pos = [], 0
    for size in itertools.cycle(sizes):
        chunk = rows[pos : pos + size]
        pos += size
        if not chunk or (drop and len(chunk) < size):
            break
        want.append(chunk)
    arg = sizes if len(sizes) > 1 else sizes[0]
    assert lists(Dataset.range(n).batch(first).rebatch(arg, drop_remainder=drop)) == want


def test_rebatch_spec_and_structures():
    ds = Dataset.range(10).batch(4)
    assert ds.rebatch(3).element_spec == dv.TensorSpec((None,), np.int64)
    assert ds.rebatch(3, drop_remainder=True).element_spec == dv.TensorSpec((3,), np.int64)
    assert ds.rebatch([2, 3], drop_remainder=True).element_spec == dv.TensorSpec((None,), np.int64)
    pairs = Dataset.from_tensor_slices((np.arange(6), np.arange(6.0, dtype=np.float32))).batch(4).rebatch(5)
    assert [(lists([a])[0], lists([b])[0]) for a, b in pairs] == [([0, 1, 2, 3, 4], [0, 1, 2, 3, 4]), ([5], [5])]
    with pytest.raises(ValueError, match="component 0 is a scalar"):
        Dataset.range(3).rebatch(2)
    with pytest.raises(ValueError, match="every batch size must be a positive int"):
        ds.rebatch([2, 0])


def test_counter():
    assert ints(Dataset.counter(5, 2).take(4)) == [5, 7, 9, 11]
    assert ints(Dataset.counter(3, -1).take(3)) == [3, 2, 1]
    c = Dataset.counter(dtype=np.int32)
    assert c.element_spec == dv.TensorSpec((), np.int32) and next(iter(c)).dtype == np.int32
    assert c.cardinality() == dv.data.INFINITE_CARDINALITY
    with pytest.raises(TypeError, match="integer dtype"):
        Dataset.counter(dtype=np.float32)


def test_counts_may_be_elements():
    # tf.data takes a scalar tensor where it takes a count: an element of another dataset.
    ds = Dataset.range(1, 4).flat_map(lambda x: Dataset.from_tensors(x).repeat(x))
    assert ints(ds) == [1, 2, 2, 3, 3, 3]
    assert ints(Dataset.range(10).take(np.array(3))) == [0, 1, 2]
    with pytest.raises(TypeError, match="count must be an int"):
        Dataset.range(3).repeat(np.array([2]))


# ---- choose_from_datasets, sample_from_datasets ---------------------------------------------------


def choose_reference(sources, choices, stop):
    sources = [list(s) for s in sources]
    live, out = [True] * len(sources), []
    for c in choices:
        if not live[c]:
            continue
        if sources[c]:
            out.append(sources[c].pop(0))
            continue
        if stop:
            break
        live[c] = False
        if not any(live):
            break
    return out


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    picks=st.lists(st.integers(0, 3), max_size=16),
    stop=st.booleans(),
)
def test_choose_from_datasets_follows_the_choices(lengths, picks, stop):
    choices = [p % len(lengths) for p in picks]
    sources = [[100 * j + k for k in range(n)] for j, n in enumerate(lengths)]
    datasets = [Dataset.from_tensor_slices(np.array(s, dtype=np.int64)) for s in sources]
    ds = Dataset.choose_from_datasets(
        datasets, Dataset.from_tensor_slices(np.array(choices, dtype=np.int64)), stop_on_empty_dataset=stop
    )
    assert ints(ds) == choose_reference(sources, choices, stop)


def test_choose_from_datasets_checks_the_choices():
    a, b = Dataset.range(3), Dataset.range(10, 13)
    ds = Dataset.choose_from_datasets([a, b], Dataset.from_tensor_slices(np.array([0, 2, 1], np.int64)))
    assert outcomes(ds) == [0, "error", 10, "end"]
    with pytest.raises(TypeError, match="int64 scalars"):
        Dataset.choose_from_datasets([a, b], Dataset.from_tensor_slices(np.array([0, 1], np.int32)))
    with pytest.raises(TypeError, match="incompatible dataset elements"):
        Dataset.choose_from_datasets([a, Dataset.range(2).map(lambda x: (x, x))], Dataset.range(1))
    with pytest.raises(TypeError, match="list of distvals.data.Dataset"):
        Dataset.choose_from_datasets(a, Dataset.range(1))
    spec = Dataset.choose_from_datasets(
        [Dataset.from_tensors(np.zeros(2, np.float32)), Dataset.from_tensors(np.zeros(3, np.float32))],
        Dataset.range(2),
    ).element_spec
    assert spec == dv.TensorSpec((None,), np.float32)


def test_sample_from_datasets_gives_every_element_once_in_each_sources_order():
    a, b, c = Dataset.range(5), Dataset.range(100, 103), Dataset.range(200, 204)
    ds = Dataset.sample_from_datasets([a, b, c], weights=[0.5, 0.2, 0.3], seed=11)
    got = ints(ds)
    assert sorted(got) == sorted(ints(a) + ints(b) + ints(c))
    for src in (a, b, c):
        mine = set(ints(src))
        assert [x for x in got if x in mine] == ints(src)
    assert ints(ds) == got  # a seed: each pass draws the same sequence
    again = Dataset.sample_from_datasets([a, b, c], weights=[0.5, 0.2, 0.3], seed=11, rerandomize_each_iteration=True)
    passes = [ints(again) for _ in range(6)]
    assert len({tuple(p) for p in passes}) > 1  # (6 passes of 12 elements all equal: p < 1e-20)
    # A zero weight is never drawn; stop_on_empty ends with the first source that ends.
    assert ints(Dataset.sample_from_datasets([a, b], weights=[1.0, 0.0])) == ints(a)
    stopped = ints(Dataset.sample_from_datasets([a, b], seed=3, stop_on_empty_dataset=True))
    assert set(ints(a)) <= set(stopped) or set(ints(b)) <= set(stopped)


def test_sample_from_datasets_draws_in_proportion_to_the_weights():
    # 4,000 draws from two endless sources: the share of the first is 0.8 within 5 sigma.
    ds = Dataset.sample_from_datasets(
        [Dataset.counter(0).map(lambda x: x * 0), Dataset.counter(1, 0)], [0.8, 0.2], seed=5
    )
    got = np.array(ints(ds.take(4000)))
    share = np.mean(got == 0)
    assert abs(share - 0.8) < 5 * np.sqrt(0.8 * 0.2 / 4000)


def test_sample_from_datasets_checks_the_weights():
    a, b = Dataset.range(2), Dataset.range(2)
    with pytest.raises(ValueError, match="one weight per dataset"):
        Dataset.sample_from_datasets([a, b], weights=[1.0])
    with pytest.raises(ValueError, match="finite and not negative"):
        Dataset.sample_from_datasets([a, b], weights=[1.0, -1.0])
    with pytest.raises(TypeError, match="weights as a dataset"):
        Dataset.sample_from_datasets([a, b], weights=Dataset.range(2))


# ---- distvals.data.experimental -------------------------------------------------------------------------


def test_the_experimental_names_are_the_datasets_operations():
    import distvals.data.experimental as imported

    assert imported is X  # importable by its name too, as tf.data.experimental
    unknown = Dataset.range(3).filter(lambda x: x >= 0)
    assert X.cardinality(Dataset.range(4)) == 4 and X.cardinality(unknown) == X.UNKNOWN_CARDINALITY
    assert X.AUTOTUNE == dv.data.AUTOTUNE and X.AutoShardPolicy is dv.data.AutoShardPolicy
    assert ints(Dataset.from_tensor_slices(np.array([2, 2, 1], np.int64)).apply(X.unique())) == [2, 1]
    assert ints(Dataset.range(4).apply(X.scan(np.int64(0), lambda s, x: (s + x, s)))) == [0, 0, 1, 3]
    assert [(int(i), int(x)) for i, x in Dataset.range(3, 5).apply(X.enumerate_dataset(1))] == [(1, 3), (2, 4)]
    assert ints(Dataset.range(4).map(fails_at(1)).apply(X.ignore_errors())) == [0, 20, 30]
    assert int(X.get_single_element(Dataset.range(2, 3))) == 2
    assert ints(X.Counter(1, 3).take(2)) == [1, 4]
    choice = Dataset.from_tensor_slices(np.array([1, 0], np.int64))
    assert ints(X.choose_from_datasets([Dataset.range(2), Dataset.range(5, 7)], choice)) == [5, 0]
    assert sorted(ints(X.sample_from_datasets([Dataset.range(2), Dataset.range(5, 7)], seed=3))) == [0, 1, 5, 6]


def test_assert_cardinality_says_how_many_and_checks_it():
    unknown = Dataset.range(3).filter(lambda x: x >= 0)
    checked = unknown.apply(X.assert_cardinality(3))
    assert checked.cardinality() == 3 and len(checked) == 3 and ints(checked) == [0, 1, 2]
    few = iter(unknown.apply(X.assert_cardinality(5)))
    assert ints(itertools.islice(few, 3)) == [0, 1, 2]
    with pytest.raises(dv.data.CardinalityError, match="expected to contain 5 elements but contained only 3"):
        next(few)
    many = iter(unknown.apply(X.assert_cardinality(2)))
    assert ints(itertools.islice(many, 2)) == [0, 1]
    with pytest.raises(RuntimeError, match="expected to contain 2 elements but contained at least 3"):
        next(many)
    endless = unknown.repeat().apply(X.assert_cardinality(X.INFINITE_CARDINALITY))
    assert endless.cardinality() == X.INFINITE_CARDINALITY and ints(endless.take(4)) == [0, 1, 2, 0]
    with pytest.raises(RuntimeError, match="an infinite number of elements but contained only 3 elements"):
        list(unknown.apply(X.assert_cardinality(X.INFINITE_CARDINALITY)))
    with pytest.raises(ValueError, match="expected_cardinality"):
        unknown.apply(X.assert_cardinality(-2))


def test_a_distributed_dataset_reads_through_the_new_transformations():
    # 2 replicas; global batches made by rebatch of a sampled interleave: every row once.
    s = dv.MirroredStrategy(["/cpu:0", "/cpu:1"])
    try:
        rows = Dataset.range(4).interleave(lambda j: Dataset.range(10 * j, 10 * j + 3), cycle_length=2)
        ds = rows.batch(5).rebatch(4)
        seen = collections.Counter()
        for batch in s.experimental_distribute_dataset(ds):
            for part in s.experimental_local_results(batch):
                seen.update(int(v) for v in np.asarray(part))
        assert seen == collections.Counter(ints(rows))
    finally:
        s.close()
