"""The ``distvals.data.Dataset`` transformations that regroup or mix elements:
``interleave``, ``window``, ``scan``, ``unique``, ``ignore_errors``, ``rebatch``, the
sources ``counter``, ``choose_from_datasets`` and ``sample_from_datasets``, and
``distvals.data.experimental.assert_cardinality``, with tf.data's semantics (the methods
of ``Dataset`` document each and call these)."""

from __future__ import annotations

import itertools
import logging
import os
import typing
from typing import Any, Callable, Iterator, List

import numpy as np

from . import specs
from .data import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    _as_tuple,
    _call_with_element,
    _check_parallel,
    _count,
    _merged_options,
)
from .data_elements import (
    convert_element,
    copy_element,
    flatten,
    is_structure,
    merged_spec,
    pack,
    same_dtype,
    same_structure,
)
from .data_elements import structure_text as _structure_text
from .data_interleave import ChooseIterator, InterleaveIterator, SampleIterator
from .data_iterators import (
    FUSE,
    CardinalityCheckIterator,
    IgnoreErrorsIterator,
    RebatchIterator,
    ScanIterator,
    UnbatchIterator,
    UniqueIterator,
    WindowIterator,
)

_log = logging.getLogger("distvals.data")


def _positive(value: Any, what: str, name: str) -> int:
    n = _count(value, what, name)
    if n < 1:
        raise ValueError(f"{what}: {name} must be a positive int, got {value!r}")
    return n


def _bool(value: Any, what: str, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: {name} must be a bool, got {value!r}")
    return bool(value)


def dataset_passes(map_func: Callable[..., Any], what: str) -> Callable[[Any], Iterator[Any]]:
    """A function from an element to a pass of the dataset ``map_func`` makes of it (called
    as ``map`` calls its function), under the options in force when it was made."""
    if not callable(map_func):
        raise TypeError(f"{what}: map_func must be callable, got {type(map_func).__name__}")
    fuse = FUSE.get()

    def open_pass(x: Any) -> Iterator[Any]:
        d = _call_with_element(map_func, x, what)
        if not isinstance(d, Dataset):
            raise TypeError(f"{what}: map_func must return a distvals.data.Dataset, got {type(d).__name__}")
        token = FUSE.set(fuse)
        try:
            return d._iterate()
        finally:
            FUSE.reset(token)

    return open_pass


def interleave(
    ds: Dataset,
    map_func: Callable[..., Any],
    cycle_length: Any,
    block_length: Any,
    num_parallel_calls: Any,
    name: typing.Optional[str],
) -> Dataset:
    _check_parallel(num_parallel_calls, "interleave")
    dataset_passes(map_func, "interleave")  # checks map_func now
    if cycle_length is None or (not isinstance(cycle_length, bool) and cycle_length == AUTOTUNE):
        # tf.data's AUTOTUNE cycle: one input per CPU this process may run on.
        cycle = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    else:
        cycle = _positive(cycle_length, "interleave", "cycle_length")
    block = 1 if block_length is None else _positive(block_length, "interleave", "block_length")

    def make() -> Iterator[Any]:
        return InterleaveIterator(ds._iterate(), dataset_passes(map_func, "interleave"), cycle, block)

    return Dataset(make, description=name or "InterleaveDataset", options=ds._options)


def _list_dataset(values: List[Any], spec: Any) -> Dataset:
    """A dataset of ``values`` (each pass hands out copies of its own)."""
    return Dataset(
        lambda: (copy_element(v) for v in values),
        batched=False,
        description="WindowDataset",
        spec=spec,
        cardinality=len(values),
    )


def window(ds: Dataset, size: Any, shift: Any, stride: Any, drop_remainder: Any, name: typing.Optional[str]) -> Dataset:
    size = _positive(size, "window", "size")
    shift = size if shift is None else _positive(shift, "window", "shift")
    stride = _positive(stride, "window", "stride")
    drop = _bool(drop_remainder, "window", "drop_remainder")
    source_spec = ds._spec
    leaf_specs = None if source_spec is None else flatten(source_spec)

    def make_window(members: List[Any]) -> Any:
        # One dataset per component: the window's values of that component.
        first = members[0]
        if not is_structure(first):
            return _list_dataset(members, source_spec)
        columns = [list(c) for c in zip(*(flatten(m) for m in members))]
        parts = [_list_dataset(c, None if leaf_specs is None else leaf_specs[i]) for i, c in enumerate(columns)]
        return pack(first, parts)

    spec = None
    if source_spec is not None:
        window_specs = [specs.DatasetSpec(leaf) for leaf in flatten(source_spec)]
        spec = pack(source_spec, window_specs) if is_structure(source_spec) else window_specs[0]
    n = ds._cardinality
    if n < 0:
        card = n
    elif drop:
        # The windows that fit whole: one at the start, then one per shift in the rest.
        rest = n - ((size - 1) * stride + 1)
        card = 0 if rest < 0 else rest // shift + 1
    else:
        card = -(-n // shift)
    return ds._derived(
        lambda: WindowIterator(ds._iterate(), size, shift, stride, drop, make_window),
        name or f"WindowDataset({size})",
        batched=False,
        spec=spec,
        cardinality=card,
    )


def checked_state(new: Any, state: Any, what: str, fn_name: str) -> Any:
    """``new`` (a state ``fn_name`` returned, as numpy arrays) when it has the structure and
    dtypes of ``state``; TypeError naming the difference otherwise (as tf.data)."""
    if not same_structure(new, state) or not same_structure(state, new):
        raise TypeError(
            f"{what}: {fn_name} returned a state of structure {_structure_text(new)}; the initial state's is "
            f"{_structure_text(state)}"
        )
    got = [a.dtype for a in flatten(new)]
    kinds = [a.dtype for a in flatten(state)]
    if not all(same_dtype(g, k) for g, k in zip(got, kinds)):
        raise TypeError(
            f"{what}: {fn_name} returned a state of dtypes {[str(d) for d in got]}; the initial state's are "
            f"{[str(d) for d in kinds]}"
        )
    return new


def scan(ds: Dataset, initial_state: Any, scan_func: Callable[..., Any], name: typing.Optional[str]) -> Dataset:
    if not callable(scan_func):
        raise TypeError(f"scan: scan_func must be callable, got {type(scan_func).__name__}")
    state0 = convert_element(_as_tuple(initial_state), "scan")

    def step(state: Any, x: Any) -> typing.Tuple[Any, Any]:
        out = _call_with_element(scan_func, (state, x), "scan", "scan_func")
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"scan: scan_func must return a pair (new_state, output_element), got {out!r}")
        new = checked_state(convert_element(_as_tuple(out[0]), "scan"), state0, "scan", "scan_func")
        element = convert_element(_as_tuple(out[1]), "scan")
        # The element is the caller's: an array it shares with the state is copied, so
        # that writing to it cannot change the next step's state.
        held = {id(a) for a in flatten(new)}
        if any(id(a) in held for a in flatten(element)):
            element = copy_element(element)
        return new, element

    def make() -> Iterator[Any]:
        # Every pass starts from its own copy of the initial state.
        return ScanIterator(ds._iterate(), copy_element(state0), step)

    return Dataset(
        make,
        batched=ds._batched,
        finite=ds._finite,
        description=name or "ScanDataset",
        cardinality=ds._cardinality,
        options=ds._options,
    )


_UNIQUE_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _unique_key(x: Any) -> Any:
    if is_structure(x):
        raise ValueError(f"unique: elements must be single arrays, got an element of structure {_structure_text(x)}")
    a = np.asarray(x)
    if a.dtype in _UNIQUE_DTYPES:
        return (a.shape, a.tobytes())
    if a.dtype.kind in "US" or (a.dtype.kind == "O" and all(isinstance(v, (str, bytes)) for v in a.flat)):
        return (a.shape, tuple(a.ravel().tolist()))
    raise TypeError(f"unique: elements must be int32, int64 or strings, got dtype {a.dtype}")


def unique(ds: Dataset, name: typing.Optional[str]) -> Dataset:
    spec = ds._spec
    if spec is not None:
        if is_structure(spec):
            raise ValueError(
                f"unique: elements must be single arrays, got elements of structure {_structure_text(spec)}"
            )
        if spec.dtype not in _UNIQUE_DTYPES and spec.dtype.kind not in "USO":
            raise TypeError(f"unique: elements must be int32, int64 or strings, got dtype {spec.dtype}")
    return ds._derived(
        lambda: UniqueIterator(ds._iterate(), _unique_key), name or "UniqueDataset", cardinality=UNKNOWN_CARDINALITY
    )


def ignore_errors(ds: Dataset, log_warning: Any, name: typing.Optional[str]) -> Dataset:
    def log(e: Exception) -> None:
        _log.warning("ignore_errors: ignoring an element that failed: %r", e)

    logs = log if _bool(log_warning, "ignore_errors", "log_warning") else None
    return ds._derived(
        lambda: IgnoreErrorsIterator(ds._iterate(), logs),
        name or "IgnoreErrorsDataset",
        cardinality=UNKNOWN_CARDINALITY,
    )


def rebatch(ds: Dataset, batch_size: Any, drop_remainder: Any, name: typing.Optional[str]) -> Dataset:
    if isinstance(batch_size, (list, tuple, np.ndarray)):
        sizes = [_positive(b, "rebatch", "every batch size") for b in np.asarray(batch_size).ravel().tolist()]
        if not sizes:
            raise ValueError("rebatch: batch_size is an empty list")
    else:
        sizes = [_positive(batch_size, "rebatch", "batch_size")]
    drop = _bool(drop_remainder, "rebatch", "drop_remainder")
    spec = ds._spec
    if spec is not None:
        leaves = flatten(spec)
        for i, leaf in enumerate(leaves):
            if leaf.shape is not None and len(leaf.shape) == 0:
                raise ValueError(f"rebatch: component {i} is a scalar; every component needs a batch axis")
        # A fixed batch dimension only when every batch has the one size.
        size = sizes[0] if drop and len(set(sizes)) == 1 else None
        out = [specs.TensorSpec(None if s.shape is None else (size,) + s.shape[1:], s.dtype) for s in leaves]
        spec = pack(spec, out) if is_structure(spec) else out[0]
    return ds._derived(
        lambda: RebatchIterator(UnbatchIterator(ds._iterate()), itertools.cycle(sizes), drop),
        name or "RebatchDataset",
        batched=True,
        spec=spec,
        cardinality=UNKNOWN_CARDINALITY,  # as tf.data's (even of an infinite dataset)
    )


def assert_cardinality(ds: Dataset, expected: Any, name: typing.Optional[str]) -> Dataset:
    n = _count(expected, "assert_cardinality", "expected_cardinality")
    if n < INFINITE_CARDINALITY:
        raise ValueError(
            f"assert_cardinality: expected_cardinality must be a count or INFINITE_CARDINALITY (-1), got {n}"
        )
    return ds._derived(
        lambda: CardinalityCheckIterator(ds._iterate(), n),
        name or "AssertCardinalityDataset",
        finite=n != INFINITE_CARDINALITY,
        cardinality=n,
    )


def counter(start: Any, step: Any, dtype: Any, name: typing.Optional[str]) -> Dataset:
    start = _count(start, "counter", "start")
    step = _count(step, "counter", "step")
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise TypeError(f"counter: dtype must be an integer dtype, got {dt}")
    return Dataset(
        lambda: (np.array(i, dtype=dt) for i in itertools.count(start, step)),
        batched=False,
        finite=False,
        description=name or "CounterDataset",
        spec=specs.TensorSpec((), dt),
        cardinality=INFINITE_CARDINALITY,
    )


def _datasets_list(datasets: Any, what: str) -> List[Dataset]:
    if isinstance(datasets, Dataset) or not isinstance(datasets, (list, tuple)):
        raise TypeError(
            f"{what}: datasets must be a list of distvals.data.Dataset objects, got {type(datasets).__name__}"
        )
    if not datasets:
        raise ValueError(f"{what}: datasets is empty")
    for i, d in enumerate(datasets):
        if not isinstance(d, Dataset):
            raise TypeError(f"{what}: datasets[{i}] is a {type(d).__name__}, not a distvals.data.Dataset")
    return list(datasets)


def _mixed_spec(datasets: List[Dataset], what: str) -> Any:
    """The spec that every dataset's elements fit (TypeError when structures or dtypes
    differ); None when one is unknown."""
    known = [d._known_spec() for d in datasets]
    if any(s is None for s in known):
        return None
    spec = known[0]
    for other in known[1:]:
        spec = merged_spec(spec, other, what)
    return spec


def _mixed(datasets: List[Dataset], make: Callable[[], Iterator[Any]], description: str, what: str) -> Dataset:
    batched = {d._batched for d in datasets}
    return Dataset(
        make,
        batched=batched.pop() if len(batched) == 1 else None,
        finite=all(d._finite for d in datasets),
        description=description,
        spec=_mixed_spec(datasets, what),
        cardinality=UNKNOWN_CARDINALITY,
        options=_merged_options(datasets),
    )


def _choice(x: Any) -> int:
    a = np.asarray(x)
    if a.shape != () or a.dtype != np.int64:
        raise TypeError(
            f"choose_from_datasets: every element of choice_dataset must be an int64 scalar, got "
            f"{a.dtype} of shape {a.shape}"
        )
    return int(a)


def choose_from_datasets(
    datasets: Any, choice_dataset: Any, stop_on_empty_dataset: Any, name: typing.Optional[str]
) -> Dataset:
    parts = _datasets_list(datasets, "choose_from_datasets")
    if not isinstance(choice_dataset, Dataset):
        raise TypeError(
            f"choose_from_datasets: choice_dataset must be a distvals.data.Dataset, got {type(choice_dataset).__name__}"
        )
    choice_spec = choice_dataset._spec
    if choice_spec is not None and (
        is_structure(choice_spec) or choice_spec.shape != () or choice_spec.dtype != np.int64
    ):
        raise TypeError(
            f"choose_from_datasets: choice_dataset must be a dataset of int64 scalars, got elements {choice_spec}"
        )
    stop = _bool(stop_on_empty_dataset, "choose_from_datasets", "stop_on_empty_dataset")

    def make() -> Iterator[Any]:
        choices = map(_choice, choice_dataset._iterate())
        return ChooseIterator([d._iterate() for d in parts], choices, stop)

    return _mixed(parts, make, name or "DirectedInterleaveDataset", "choose_from_datasets")


def sample_from_datasets(
    datasets: Any,
    weights: Any,
    seed: Any,
    stop_on_empty_dataset: Any,
    rerandomize_each_iteration: Any,
    name: typing.Optional[str],
) -> Dataset:
    parts = _datasets_list(datasets, "sample_from_datasets")
    if isinstance(weights, Dataset):
        raise TypeError("sample_from_datasets: weights as a dataset is not supported; pass a list of floats")
    if weights is None:
        w = np.ones(len(parts))
    else:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (len(parts),):
            raise ValueError(
                f"sample_from_datasets: weights must hold one weight per dataset ({len(parts)}), got shape {w.shape}"
            )
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError(f"sample_from_datasets: weights must be finite and not negative, got {w.tolist()}")
    stop = _bool(stop_on_empty_dataset, "sample_from_datasets", "stop_on_empty_dataset")
    if seed is not None:
        _count(seed, "sample_from_datasets", "seed")
    rerandomize = rerandomize_each_iteration is not None and _bool(
        rerandomize_each_iteration, "sample_from_datasets", "rerandomize_each_iteration"
    )
    epoch = itertools.count()
    base = np.random.SeedSequence(seed) if seed is not None else None

    def generator() -> np.random.Generator:
        # With a seed, each pass draws the same (or, rerandomized, its own) sequence.
        e = next(epoch) if rerandomize else 0
        if base is None:
            return np.random.default_rng()
        return np.random.default_rng(np.random.SeedSequence(base.entropy, spawn_key=(e,)))

    def make() -> Iterator[Any]:
        return SampleIterator([d._iterate() for d in parts], w, generator, stop)

    return _mixed(parts, make, name or "SampleFromDatasets", "sample_from_datasets")
