"""``distvals.data.Dataset``: a small input pipeline in the style of ``tf.data.Dataset``.

Enough for examples and tests: ``from_tensor_slices``, ``from_tensors``, ``range``,
``from_generator``, ``batch``, ``shuffle``, ``repeat``, ``take``, ``skip``, ``shard``,
``map``, ``prefetch``, ``with_options`` (``distvals.data.Options``, see
``distvals.data_options``), and ``element_spec`` / ``cardinality()`` as tf.data has them.
``num_parallel_calls`` (``AUTOTUNE`` or a count) and ``deterministic`` are accepted
where tf.data takes them; elements are still made one at a time, in order, on the
thread that asks for them. Iteration yields numpy arrays
(0-d arrays for scalar elements) or nested structures (tuples, namedtuples, dicts) of
them; as in tf.data, a list is one component. Python floats become float32 and Python
ints int32, as in TensorFlow; numpy arrays keep their dtype.

A dataset of slices of arrays (``from_tensor_slices``, then any of ``shuffle``,
``repeat``, ``take``, ``skip``) knows which rows of its arrays each element is, so
``batch`` cuts whole arrays instead of stacking rows one by one: a batch of consecutive
rows is one copy of a slice of each array, a shuffled batch one vectorized gather. Every
element is the caller's own (writing to it changes neither the arrays the dataset was
made from nor a later epoch); the dataset reads those arrays when it iterates, without
a copy of its own.

An exception in a ``map`` function reaches the caller's ``next()`` and the pass goes on
with the next element, as in tf.data: the iterators of ``map``, ``batch``, ``shuffle``,
``repeat``, ``take`` and ``skip`` are objects whose state survives an exception from
the element they were computing (generators would end). A batch right after a map
that holds a failed element fails whole, after taking all its elements (tf.data's fused
map-and-batch); any other batch fails at once, and the next starts after the failed
element.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import typing
from typing import Any, Callable, Iterator, List

import numpy as np

from . import nest, specs
from ._convert import as_numpy
from .data_options import (
    AutoShardPolicy,
    AutotuneOptions,
    DistributeOptions,
    ExternalStatePolicy,
    OptimizationOptions,
    Options,
    ThreadingOptions,
    fuses_map_and_batch,
)
from .fork_locks import renewed_after_fork
from .optional import Optional as Optional  # tf.data.experimental.Optional's place

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "AutotuneOptions",
    "Dataset",
    "DistributeOptions",
    "ExternalStatePolicy",
    "OptimizationOptions",
    "Optional",
    "Options",
    "ThreadingOptions",
]

# tf.data.AUTOTUNE: "let the runtime choose" for num_parallel_calls and prefetch sizes.
AUTOTUNE = -1

#: What ``cardinality()`` says of a dataset that never ends / whose length is unknown.
INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2

_INT32 = np.iinfo(np.int32)
# The options of a dataset that was given none.
_NO_OPTIONS = Options()._freeze()
# While a pass's iterators are made: whether its options keep tf.data's map-and-batch
# fusion (they are the pipeline's, set on any of its datasets, as in tf.data).
_FUSE = contextvars.ContextVar("distvals_data_fuse", default=True)


def _first_good(it: Iterator[Any], failures: List[Exception]) -> Any:
    """The first element of ``it`` that does not fail (a map function's exception for the
    first ones: tf.data knows the spec without running it), with the failures before it
    appended to ``failures``; StopIteration when there is none; the first failure when
    64 fail in a row."""
    for _ in range(64):
        try:
            return next(it)
        except StopIteration:
            if failures:
                raise failures[0] from None
            raise
        except Exception as e:  # noqa: BLE001 - the next element may tell the spec
            failures.append(e)
    raise failures[0]


class _Resumed:
    """A pass that element_spec began: what it read (each failure raised again, then the
    first element), then the rest of the pass."""

    def __init__(self, failures: List[Exception], firsts: List[Any], rest: Iterator[Any]) -> None:
        self._failures = failures
        self._firsts = firsts
        self._rest = rest

    def __iter__(self) -> _Resumed:
        return self

    def __next__(self) -> Any:
        if self._failures:
            raise self._failures.pop(0)
        if self._firsts:
            return self._firsts.pop()
        return next(self._rest)


# As in tf.data, tuples (namedtuples too) and dicts are structures; a list is one
# component, converted to an array.


def _is_structure(x: Any) -> bool:
    return isinstance(x, (tuple, dict))


def _flatten(x: Any) -> List[Any]:
    if isinstance(x, tuple):
        return [leaf for item in x for leaf in _flatten(item)]
    if isinstance(x, dict):
        return [leaf for k in nest._sorted_keys(x) for leaf in _flatten(x[k])]
    return [x]


def _pack(template: Any, leaves: List[Any]) -> Any:
    it = iter(leaves)

    def build(t: Any) -> Any:
        if isinstance(t, tuple):
            items = [build(v) for v in t]
            return type(t)(*items) if hasattr(type(t), "_fields") else type(t)(items)
        if isinstance(t, dict):
            values = {k: build(t[k]) for k in nest._sorted_keys(t)}
            return type(t)((k, values[k]) for k in t)
        return next(it)

    return build(template)


def _python_numbers(x: Any) -> bool:
    """True for Python numbers and (nested) lists and tuples of only them."""
    if isinstance(x, (list, tuple)):
        return all(_python_numbers(v) for v in x)
    return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


def convert_leaf(x: Any, what: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "dtype"):
        # numpy scalars and tensors of other libraries keep their dtype. (A torch
        # tensor's numpy view also stops resize_ from moving its memory under it.)
        return as_numpy(x)
    a = np.asarray(x)
    if a.dtype == np.float64 and _python_numbers(x):
        # Python floats become float32, as in TensorFlow; numpy float64 values in a list
        # keep their dtype there too.
        return a.astype(np.float32)
    if (
        a.dtype.kind == "i"
        and a.dtype.itemsize > 4
        and (a.size == 0 or (a.min() >= _INT32.min and a.max() <= _INT32.max))
        and _python_numbers(x)
    ):
        # Python ints become int32 where they fit, as in TensorFlow; numpy int64 values
        # in a list keep their dtype.
        return a.astype(np.int32)
    if a.dtype == object:
        raise TypeError(f"{what}: cannot make an array of {x!r}; nested lists must be rectangular")
    return a


def _convert_element(x: Any, what: str, copy: bool = False) -> Any:
    """An element (a leaf or a nested structure) with every leaf converted to an array
    (with ``copy``, arrays of its own, never the caller's)."""
    leaves = [convert_leaf(v, what) for v in _flatten(x)]
    if copy:
        leaves = [np.array(a, copy=True) if _shares(a, v) else a for a, v in zip(leaves, _flatten(x))]
    return _pack(x, leaves) if _is_structure(x) else leaves[0]


class _Rows:
    """What a dataset of array slices is: ``arrays`` (the leaves of ``template``) and,
    for each pass, a stream of row selections (``range``s, or index arrays once
    shuffled); elements are those rows in order."""

    __slots__ = ("arrays", "selections", "template")

    def __init__(self, template: Any, arrays: List[np.ndarray], selections: Callable[[], Iterator[Any]]) -> None:
        self.template = template
        self.arrays = arrays
        self.selections = selections

    def derive(self, selections: Callable[[], Iterator[Any]]) -> _Rows:
        return _Rows(self.template, self.arrays, selections)

    # Elements are copies, never views of the arrays the dataset was made from: a step
    # that changes its batch in place (x -= mean) must change neither the caller's array
    # nor what a later epoch reads (as with tf.data, whose tensors cannot change).
    def element(self, i: int) -> Any:
        parts = [a[i, ...].copy() for a in self.arrays]
        return _pack(self.template, parts) if _is_structure(self.template) else parts[0]

    def batch(self, rows: Any) -> Any:
        """The element holding ``rows`` (a range of step 1: one copy of consecutive rows;
        an index array: one gather per array)."""
        if isinstance(rows, range):
            parts = [a[rows.start : rows.stop].copy() for a in self.arrays]
        else:
            parts = [a[rows] for a in self.arrays]
        return _pack(self.template, parts) if _is_structure(self.template) else parts[0]


def _cut(selections: Iterator[Any], start: int, stop: typing.Optional[int]) -> Iterator[Any]:
    """Rows ``start`` .. ``stop`` (None: to the end) of a stream of row selections."""
    seen = 0
    for sel in selections:
        n = len(sel)
        lo, hi = max(start - seen, 0), n if stop is None else min(stop - seen, n)
        if lo < hi:
            yield sel[lo:hi]
        seen += n
        if stop is not None and seen >= stop:
            return


def _batches(selections: Iterator[Any], size: int, drop_remainder: bool) -> Iterator[Any]:
    """Row selections of ``size`` rows each, cut from a stream of selections; a batch
    that spans two selections becomes one index array."""
    pending: List[Any] = []
    have = 0
    for sel in selections:
        pos, n = 0, len(sel)
        while pos < n:
            take = min(size - have, n - pos)
            piece = sel[pos : pos + take]
            pos += take
            if not pending and take == size:
                yield piece
                continue
            pending.append(piece)
            have += take
            if have == size:
                yield _joined(pending)
                pending, have = [], 0
    if pending and not drop_remainder:
        yield _joined(pending)


def _joined(pieces: List[Any]) -> Any:
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate([np.arange(p.start, p.stop) if isinstance(p, range) else p for p in pieces])


def _shuffled_order(n: int, buffer_size: int, rng: np.random.Generator) -> np.ndarray:
    """The order in which a buffer of ``buffer_size`` shuffles n elements: uniform when
    the buffer holds them all, else the streaming buffer of ``Dataset.shuffle``."""
    if buffer_size >= n:
        return rng.permutation(n)
    out = np.empty(n, dtype=np.int64)
    buf = list(range(buffer_size))
    # While the source lasts the buffer is full: every draw is over buffer_size slots.
    draws = rng.integers(buffer_size, size=n - buffer_size)
    for k, j in enumerate(draws.tolist()):
        out[k] = buf[j]
        buf[j] = buffer_size + k
    tail = n - buffer_size
    for k in range(buffer_size):
        j = int(rng.integers(len(buf)))
        buf[j], buf[-1] = buf[-1], buf[j]
        out[tail + k] = buf.pop()
    return out


def _card_batch(card: int, size: int, drop_remainder: bool) -> int:
    if card < 0:
        return card
    return card // size if drop_remainder else -(-card // size)


class Dataset:
    """A re-iterable sequence of elements (arrays or nested structures of arrays)."""

    def __init__(
        self,
        make_iterator: Callable[[], Iterator[Any]],
        *,
        batched: typing.Optional[bool] = None,
        finite: bool = True,
        description: str = "Dataset",
        spec: Any = None,
        cardinality: int = UNKNOWN_CARDINALITY,
        rows: typing.Optional[_Rows] = None,
        options: typing.Optional[Options] = None,
    ) -> None:
        self._make_iterator = make_iterator
        # What with_options set (frozen), carried by every dataset made from this one.
        self._options = _NO_OPTIONS if options is None else options
        # True: made by batch; False: rows (from_tensor_slices, range) with no batch
        # after them; None: not known (from_tensors, from_generator may give batches).
        self._batched = batched
        self._finite = finite
        self._description = description
        self._spec = spec
        self._cardinality = cardinality
        self._rows = rows
        # Made by map: a batch right after it fails whole (tf.data fuses the two).
        self._mapped = False
        # The pass element_spec read its first element from, for the next pass to go on
        # with (see element_spec).
        self._saved: typing.Optional[_Resumed] = None

    def _derived(
        self,
        make: Callable[[], Iterator[Any]],
        description: str,
        *,
        batched: typing.Optional[bool] = None,
        finite: typing.Optional[bool] = None,
        spec: Any = None,
        cardinality: typing.Optional[int] = None,
        rows: typing.Optional[_Rows] = None,
    ) -> Dataset:
        return Dataset(
            make,
            batched=self._batched if batched is None else batched,
            finite=self._finite if finite is None else finite,
            description=description,
            spec=self._spec if spec is None else spec,
            cardinality=self._cardinality if cardinality is None else cardinality,
            rows=rows,
            options=self._options,
        )

    # ---- sources ------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """One element per index along the first axis of every component of ``tensors``
        (an array-like or a nested structure of them, all with the same first size)."""
        leaves = _flatten(tensors)
        if not leaves:
            raise ValueError("from_tensor_slices: no components given")
        arrays = [convert_leaf(x, "from_tensor_slices") for x in leaves]
        for a in arrays:
            if a.ndim == 0:
                raise ValueError(
                    "from_tensor_slices: a component has shape () and cannot be sliced; "
                    "every component needs at least one axis (use from_tensors for one element)"
                )
        size = arrays[0].shape[0]
        for i, a in enumerate(arrays):
            if a.shape[0] != size:
                raise ValueError(
                    f"from_tensor_slices: components need the same first dimension; component 0 "
                    f"has {size}, component {i} has {a.shape[0]}"
                )
        rows = _Rows(tensors, arrays, lambda: iter((range(size),)))
        leaf_specs = [specs.TensorSpec(a.shape[1:], a.dtype) for a in arrays]
        spec = _pack(tensors, leaf_specs) if _is_structure(tensors) else leaf_specs[0]
        return Dataset(
            _rows_maker(rows),
            batched=False,
            description=f"TensorSliceDataset({size} elements)",
            spec=spec,
            cardinality=size,
            rows=rows,
        )

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        """A dataset of one element, ``tensors``."""
        # A copy of the caller's arrays, and each pass hands out a copy of its own: a step
        # that edits its element changes neither the caller's arrays nor the next pass.
        leaves = [np.array(convert_leaf(x, "from_tensors"), copy=True) for x in _flatten(tensors)]
        leaf_specs = [specs.TensorSpec(a.shape, a.dtype) for a in leaves]
        spec = _pack(tensors, leaf_specs) if _is_structure(tensors) else leaf_specs[0]

        def one() -> Iterator[Any]:
            fresh = [a.copy() for a in leaves]
            yield _pack(tensors, fresh) if _is_structure(tensors) else fresh[0]

        return Dataset(one, description="TensorDataset(1 element)", spec=spec, cardinality=1)

    @staticmethod
    def range(*args: int, output_type: Any = np.int64, name: typing.Optional[str] = None) -> Dataset:
        """Like Python's ``range``: elements are 0-d arrays of ``output_type`` (int64)."""
        r = range(*args)
        dtype = _numpy_dtype(output_type)
        return Dataset(
            lambda: (np.array(i, dtype=dtype) for i in r),
            batched=False,
            description=name or f"RangeDataset({r})",
            spec=specs.TensorSpec((), dtype),
            cardinality=len(r),
        )

    @staticmethod
    def from_generator(
        generator: Callable[..., Any],
        output_types: Any = None,
        output_shapes: Any = None,
        args: Any = None,
        output_signature: Any = None,
        name: typing.Optional[str] = None,
    ) -> Dataset:
        """The elements that ``generator(*args)`` yields; each pass calls it again.

        ``output_signature`` (a ``TensorSpec`` or a nested structure of them), or the
        older ``output_types`` (and ``output_shapes``), says what each element is: every
        element must have that structure, its leaves are converted to the dtypes (as
        tf.data does) and must fit the shapes (None: any size), else the element raises
        a ``TypeError`` or ``ValueError`` naming what differs. Without either, leaves are
        converted as ``from_tensor_slices`` converts its components."""
        if not callable(generator):
            raise TypeError(f"from_generator: generator must be callable, got {type(generator).__name__}")
        if output_signature is not None and (output_types is not None or output_shapes is not None):
            raise TypeError("from_generator: give output_signature, or output_types (and output_shapes), not both")
        spec = output_signature
        if spec is None and output_types is not None:
            spec = _signature_of(output_types, output_shapes)
        elif spec is None and output_shapes is not None:
            raise TypeError("from_generator: output_shapes needs output_types")
        if spec is not None and any(type(leaf).__name__ == "TensorSpec" for leaf in _flatten(spec)):
            # TensorFlow's TensorSpecs (a signature written for tf.data) as ours.
            spec = _pack(
                spec,
                [
                    leaf if isinstance(leaf, specs.TensorSpec) else specs.from_tensorflow(leaf)
                    for leaf in _flatten(spec)
                ],
            )
        if spec is not None:
            for leaf in _flatten(spec):
                if not isinstance(leaf, specs.TensorSpec):
                    raise TypeError(
                        f"from_generator: output_signature must hold TensorSpec leaves, got {type(leaf).__name__}"
                    )
        call_args = tuple(args) if args is not None else ()

        def convert(x: Any) -> Any:
            # Copies, as tf.data makes tensors of what a generator yields: a generator may
            # refill one buffer and yield it each time.
            return _convert_element(x, "from_generator", copy=True) if spec is None else _conform(x, spec)

        def make() -> Iterator[Any]:
            return map(convert, iter(generator(*call_args)))

        return Dataset(make, description=name or "GeneratorDataset", spec=spec)

    # ---- transformations ----------------------------------------------------------------------
    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_calls: typing.Optional[int] = None,
        deterministic: typing.Optional[bool] = None,
        name: typing.Optional[str] = None,
    ) -> Dataset:
        """Stacks ``batch_size`` consecutive elements into one (a new first axis); the last
        batch may be smaller unless ``drop_remainder``. (``num_parallel_calls``,
        ``deterministic`` and ``name``: accepted as in tf.data.)"""
        _check_parallel(num_parallel_calls, "batch")
        if _count(batch_size, "batch", "batch_size") < 1:
            raise ValueError(f"batch: batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(drop_remainder, (bool, np.bool_)):
            raise TypeError(f"batch: drop_remainder must be a bool, got {drop_remainder!r}")
        batch_size = int(batch_size)
        source = self
        rows = self._rows
        if rows is not None:

            def make() -> Iterator[Any]:
                for sel in _batches(rows.selections(), batch_size, drop_remainder):
                    yield rows.batch(sel)
        else:
            whole = self._mapped

            def make() -> Iterator[Any]:
                return _BatchIterator(source._iterate(), batch_size, drop_remainder, whole)

        spec = None if self._spec is None else specs.with_batch(self._spec, batch_size if drop_remainder else None)
        return Dataset(
            make,
            batched=True,
            finite=self._finite,
            description=f"BatchDataset({batch_size})",
            spec=spec,
            cardinality=_card_batch(self._cardinality, batch_size, drop_remainder),
            options=self._options,
        )

    def shuffle(
        self, buffer_size: int, seed: typing.Optional[int] = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """Shuffles with a buffer of ``buffer_size`` elements (uniform when it holds the
        whole dataset). A seed makes the order reproducible; with
        ``reshuffle_each_iteration`` each pass still gets a different order."""
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) or buffer_size < 1:
            raise ValueError(f"shuffle: buffer_size must be a positive int, got {buffer_size!r}")
        buffer_size = int(buffer_size)
        source = self
        epoch = itertools.count()
        # Without a seed, an order kept over passes still needs one seed, drawn now.
        base = np.random.SeedSequence(seed) if seed is not None or not reshuffle_each_iteration else None

        def generator() -> np.random.Generator:
            # Pass e's order (a pass element_spec began is the next pass, see there).
            e = next(epoch) if reshuffle_each_iteration else 0
            if base is None:
                return np.random.default_rng()
            return np.random.default_rng(np.random.SeedSequence(base.entropy, spawn_key=(e,)))

        description = f"ShuffleDataset({buffer_size})"
        if self._rows is not None and self._finite:
            # Shuffle the row numbers of one pass, then read the rows in that order.
            src_rows = self._rows

            def selections() -> Iterator[Any]:
                order = np.concatenate(
                    [np.arange(s.start, s.stop) if isinstance(s, range) else s for s in src_rows.selections()]
                    or [np.empty(0, np.int64)]
                )
                yield order[_shuffled_order(len(order), buffer_size, generator())]

            rows = src_rows.derive(selections)
            return self._derived(_rows_maker(rows), description, rows=rows)

        def make() -> Iterator[Any]:
            return _ShuffleIterator(source._iterate(), buffer_size, generator)

        return self._derived(make, description)

    def repeat(self, count: typing.Optional[int] = None) -> Dataset:
        """The dataset ``count`` times over (forever for None or -1)."""
        times = -1 if count is None else max(_count(count, "repeat", "count"), -1)  # any negative: forever
        forever = times == -1
        source = self
        card = self._cardinality
        if card == 0 or times == 0:
            new_card = 0
        elif forever:
            # As tf.data: forever is infinite unless the data is known to be empty (a
            # pass that yields nothing still ends it).
            new_card = INFINITE_CARDINALITY
        else:
            new_card = card * times if card >= 0 else card

        def passes() -> Iterator[int]:
            return itertools.count() if forever else iter(range(times))

        description = f"RepeatDataset({count})"
        finite = self._finite and not forever
        if self._rows is not None:
            src_rows = self._rows

            def selections() -> Iterator[Any]:
                for _ in passes():
                    yielded = False
                    for sel in src_rows.selections():
                        yielded = yielded or len(sel) > 0
                        yield sel
                    if not yielded:
                        return

            rows = src_rows.derive(selections)
            return self._derived(_rows_maker(rows), description, finite=finite, cardinality=new_card, rows=rows)

        def make() -> Iterator[Any]:
            return _RepeatIterator(source, passes())

        return self._derived(make, description, finite=finite, cardinality=new_card)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all of them for -1, or any negative count)."""
        count = _count(count, "take", "count")
        source = self
        if count < 0:
            return self._derived(source._iterate, "TakeDataset(-1)", rows=self._rows)
        count = int(count)
        card = self._cardinality
        new_card = (
            count if card == INFINITE_CARDINALITY else (card if card == UNKNOWN_CARDINALITY else min(card, count))
        )
        description = f"TakeDataset({count})"
        if self._rows is not None:
            src_rows = self._rows
            rows = src_rows.derive(lambda: _cut(src_rows.selections(), 0, count))
            return self._derived(_rows_maker(rows), description, finite=True, cardinality=new_card, rows=rows)
        return self._derived(
            lambda: _CountedIterator(source._iterate(), count, 0), description, finite=True, cardinality=new_card
        )

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (none for -1, or any negative count: the
        data is not read)."""
        count = _count(count, "skip", "count")
        if count < 0:
            return self._derived(lambda: iter(()), f"SkipDataset({count})", finite=True, cardinality=0)
        source = self
        card = self._cardinality
        new_card = card if card < 0 else max(card - count, 0)
        description = f"SkipDataset({count})"
        if self._rows is not None:
            src_rows = self._rows
            rows = src_rows.derive(lambda: _cut(src_rows.selections(), count, None))
            return self._derived(_rows_maker(rows), description, cardinality=new_card, rows=rows)
        return self._derived(lambda: _CountedIterator(source._iterate(), -1, count), description, cardinality=new_card)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element, from element ``index`` on: this input
        pipeline's share when ``num_shards`` pipelines read the same data (as in
        ``distribute_datasets_from_function``:
        ``ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)``). As in tf.data, a
        failed element counts as no element: its position goes to the next one."""
        num_shards = _count(num_shards, "shard", "num_shards")
        index = _count(index, "shard", "index")
        if num_shards < 1:
            raise ValueError(f"shard: num_shards must be at least 1, got {num_shards}")
        if not 0 <= index < num_shards:
            raise ValueError(f"shard: index must be in [0, {num_shards}) for num_shards={num_shards}, got {index}")
        card = self._cardinality
        new_card = card if card < 0 else max(0, -(-(card - index) // num_shards))
        description = f"ShardDataset({num_shards}, {index})"
        if num_shards == 1:
            return self._derived(self._iterate, description, rows=self._rows)
        source = self
        if self._rows is not None:
            src_rows = self._rows

            def selections() -> Iterator[Any]:
                # Keep the rows whose position in the pass is index modulo num_shards.
                seen = 0
                for sel in src_rows.selections():
                    first = (index - seen) % num_shards
                    seen += len(sel)
                    if first < len(sel):
                        picked = sel[first::num_shards]
                        # A range of step num_shards becomes an index array: batch
                        # gathers those rows (ranges stand for consecutive rows).
                        yield np.arange(picked.start, picked.stop, picked.step) if isinstance(picked, range) else picked

            rows = src_rows.derive(selections)
            return self._derived(_rows_maker(rows), description, cardinality=new_card, rows=rows)
        return self._derived(
            lambda: _ShardIterator(source._iterate(), num_shards, index), description, cardinality=new_card
        )

    def map(
        self,
        fn: Callable[..., Any],
        num_parallel_calls: typing.Optional[int] = None,
        deterministic: typing.Optional[bool] = None,
        name: typing.Optional[str] = None,
    ) -> Dataset:
        """Applies ``fn`` to every element (a tuple element is passed as arguments).
        ``num_parallel_calls`` (``AUTOTUNE`` or a positive count), ``deterministic`` and
        ``name`` are accepted as in tf.data; the elements are made one at a time, in
        order."""
        _check_parallel(num_parallel_calls, "map")
        if not callable(fn):
            raise TypeError(f"map: fn must be callable, got {type(fn).__name__}")
        source = self

        def apply(x: Any) -> Any:
            try:
                y = fn(*x) if type(x) is tuple else fn(x)
            except StopIteration as e:
                # Not the end of the data (the iterators would take it for that): an
                # error of this element, as a generator turns it into one.
                raise RuntimeError(f"map: the map function raised StopIteration: {e!r}") from e
            if type(y) is list:
                y = tuple(y)  # as TensorFlow: a list that fn returns is a tuple of components
            return _convert_element(y, "map")

        def make() -> Iterator[Any]:
            # The builtin map: an exception in fn reaches next() and leaves it usable.
            return map(apply, source._iterate())

        # What fn makes is known once it has run (see element_spec).
        out = Dataset(
            make,
            batched=self._batched,
            finite=self._finite,
            description="MapDataset",
            cardinality=self._cardinality,
            options=self._options,
        )
        out._mapped = True
        return out

    def prefetch(self, buffer_size: Any = AUTOTUNE, name: typing.Optional[str] = None) -> Dataset:
        """Accepted for compatibility (``buffer_size``: ``AUTOTUNE`` or a count of at
        least 0); elements are produced on demand. (A batch after it is not fused with a
        map before it, as in tf.data.)"""
        if buffer_size is not None and (
            isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) or buffer_size < AUTOTUNE
        ):
            raise ValueError(f"prefetch: buffer_size must be AUTOTUNE or a count of at least 0, got {buffer_size!r}")
        if not self._mapped:
            return self
        return self._derived(self._make_iterator, self._description, rows=self._rows)

    def with_options(self, options: Options) -> Dataset:
        """This dataset with ``options`` (a ``distvals.data.Options``) merged into the
        ones it has: an option ``options`` sets replaces the one set before, an unset one
        changes nothing. Every dataset made from the result carries them. Of the
        options, ``experimental_distribute.auto_shard_policy`` (see ``AutoShardPolicy``)
        and the two that turn off the fused map-and-batch failure change what distvals
        does (see ``distvals.data_options``)."""
        if not isinstance(options, Options):
            raise TypeError(
                f"with_options: options must be distvals.data.Options, got {type(options).__name__} "
                "(set the options on distvals.data.Options(), then pass it)"
            )
        out = self._derived(self._iterate, self._description, rows=self._rows)
        # (A batch after it is not fused with a map before it, as in tf.data: _derived
        # leaves the result unmapped.)
        out._options = self._options.merge(options)._freeze()
        return out

    def options(self) -> Options:
        """The options set on this dataset and those it was made from (read-only: set
        new ones with ``with_options``)."""
        return self._options

    # ---- what it holds --------------------------------------------------------------------------
    @property
    def element_spec(self) -> Any:
        """The spec of every element: a ``TensorSpec(shape, dtype)`` per component, nested
        like the elements; the batch dimension is None when the last batch may be
        smaller. After ``map`` it is read from the first element: the pass that read it is
        the next pass's, which goes on from there, so asking costs the source no extra
        pass (a generator with state of its own, such as a random order, yields the
        same elements whether or not something asked first; across workers, one worker
        asking does not put its data out of step with the others')."""
        if self._spec is None:
            it = self._pass()
            failures: List[Exception] = []
            try:
                first = _first_good(it, failures)
            except StopIteration:
                self._saved = _Resumed(failures, [], it)
                return None
            except Exception:
                self._saved = _Resumed(failures, [], it)
                raise
            self._saved = _Resumed(failures, [first], it)
            leaves = [np.asarray(x) for x in _flatten(first)]
            leaf_specs = [specs.TensorSpec(a.shape, a.dtype) for a in leaves]
            spec = _pack(first, leaf_specs) if _is_structure(first) else leaf_specs[0]
            self._spec = specs.unbatched(spec) if self._batched else spec
        return self._spec

    def cardinality(self) -> np.int64:
        """The number of elements: ``INFINITE_CARDINALITY`` (-1) for a dataset that repeats
        forever, ``UNKNOWN_CARDINALITY`` (-2) when it cannot be known without reading it."""
        card: np.int64 = np.int64(self._cardinality)  # numpy's stubs make this Any
        return card

    # ---- iteration --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return _Shared(self._pass())

    def _pass(self) -> Iterator[Any]:
        """A pass of the whole pipeline this dataset ends: ``_iterate`` with this
        dataset's options in force while its iterators are made."""
        token = _FUSE.set(fuses_map_and_batch(self._options))
        try:
            return self._iterate()
        finally:
            _FUSE.reset(token)

    def _iterate(self) -> Iterator[Any]:
        """A pass's iterator without the lock of ``__iter__``'s: what the combinators
        read from (only the outermost iterator can be shared by threads). The pass
        element_spec began, when it has not been taken yet."""
        saved = self._saved
        if saved is not None:
            self._saved = None
            return saved
        return iter(self._make_iterator())

    def as_numpy_iterator(self) -> Iterator[Any]:
        """An iterator over the elements (already numpy arrays)."""
        return iter(self)

    def __repr__(self) -> str:
        return f"<Dataset {self._description}{' batched' if self._batched else ''}>"


def _count(value: Any, what: str, name: str) -> int:
    """An integer argument as an int: TypeError for anything else (a bool too)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an int, got {value!r}")
    return int(value)


def _check_parallel(num_parallel_calls: Any, what: str) -> None:
    if num_parallel_calls is None:
        return
    if (
        isinstance(num_parallel_calls, bool)
        or not isinstance(num_parallel_calls, (int, np.integer))
        or not (num_parallel_calls == AUTOTUNE or num_parallel_calls >= 1)
    ):
        raise ValueError(
            f"{what}: num_parallel_calls must be AUTOTUNE (-1) or a positive count, got {num_parallel_calls!r}"
        )


def _signature_of(types: Any, shapes: Any) -> Any:
    """A signature of TensorSpecs from from_generator's output_types and output_shapes
    (shapes nested like the types, each leaf a shape; None: unknown rank)."""

    def build(t: Any, sh: Any, path: str) -> Any:
        if isinstance(t, tuple):
            if sh is not None and (not isinstance(sh, (tuple, list)) or len(sh) != len(t)):
                raise ValueError(f"from_generator: output_shapes{path} does not match output_types{path}: {sh!r}")
            items = [build(v, None if sh is None else sh[i], f"{path}[{i}]") for i, v in enumerate(t)]
            return type(t)(*items) if hasattr(type(t), "_fields") else type(t)(items)
        if isinstance(t, dict):
            if sh is not None and (not isinstance(sh, dict) or set(sh) != set(t)):
                raise ValueError(f"from_generator: output_shapes{path} does not match output_types{path}: {sh!r}")
            return type(t)((k, build(v, None if sh is None else sh[k], f"{path}[{k!r}]")) for k, v in t.items())
        return specs.TensorSpec(sh, _numpy_dtype(t))

    return build(types, shapes, "")


def _numpy_dtype(t: Any) -> np.dtype:
    # tf.DType objects say their numpy dtype; anything numpy understands is taken as is.
    dtype: np.dtype = np.dtype(getattr(t, "as_numpy_dtype", t))
    return dtype


def _shares(a: np.ndarray, source: Any) -> bool:
    """Whether array ``a``, converted from ``source``, may use ``source``'s memory (it is
    ``source``, or a view of someone's buffer: a DLPack or buffer-protocol export)."""
    return a is source or not a.flags.owndata


def _conform(x: Any, spec: Any) -> Any:
    """Generator element ``x`` in the structure, dtypes and shapes of ``spec``."""
    if type(x) is list and type(spec) is tuple:
        x = tuple(x)
    leaf_specs = _flatten(spec)
    if not _same_structure(x, spec):
        raise TypeError(
            f"from_generator: the generator yielded an element of structure {_structure_text(x)} where the "
            f"output signature is {_structure_text(spec)}"
        )
    leaves = _flatten_up_to(spec, x)
    out = []
    for i, (v, sp) in enumerate(zip(leaves, leaf_specs)):
        try:
            # A copy: the generator may yield one buffer again and again.
            a = np.array(v, dtype=sp.dtype, copy=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(
                f"from_generator: component {i} of an element cannot be converted to {sp.dtype}: {e}"
            ) from None
        if sp.shape is not None and (
            a.ndim != len(sp.shape) or any(d is not None and d != n for d, n in zip(sp.shape, a.shape))
        ):
            raise ValueError(
                f"from_generator: component {i} of an element has shape {a.shape}, which does not fit the "
                f"output signature's {sp.shape}"
            )
        out.append(a)
    return _pack(spec, out) if _is_structure(spec) else out[0]


def _same_structure(x: Any, spec: Any) -> bool:
    """Whether ``x`` nests like ``spec`` (tuples of the same length, dicts of the same
    keys; a list is one component, as everywhere in this module). A leaf of ``spec``
    takes any value, converted to an array (a tuple of numbers too, as tf.data does)."""
    if isinstance(spec, tuple):
        return isinstance(x, tuple) and len(x) == len(spec) and all(map(_same_structure, x, spec))
    if isinstance(spec, dict):
        return isinstance(x, dict) and set(x) == set(spec) and all(_same_structure(x[k], spec[k]) for k in spec)
    return True


def _flatten_up_to(spec: Any, x: Any) -> List[Any]:
    """The leaves of ``x`` at the places of ``spec``'s leaves (``x`` nests like it)."""
    if isinstance(spec, tuple):
        return [leaf for s, v in zip(spec, x) for leaf in _flatten_up_to(s, v)]
    if isinstance(spec, dict):
        return [leaf for k in nest._sorted_keys(spec) for leaf in _flatten_up_to(spec[k], x[k])]
    return [x]


def _structure_text(x: Any) -> str:
    if isinstance(x, tuple):
        return "(" + ", ".join(_structure_text(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_structure_text(x[k])}" for k in x) + "}"
    return "*"


# ---- iterators that outlive an exception ------------------------------------------------------


class _Shared:
    """A dataset's iterator, which threads may share: each next() takes one whole
    element (a whole batch, a whole shuffle draw), one thread at a time, as tf.data's
    iterators do. (Reentrant: a map function may iterate its own dataset.)"""

    __slots__ = ("__weakref__", "_it", "_lock")

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._lock = renewed_after_fork(self, threading.RLock)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return next(self._it)


# A generator ends for good when an exception leaves it; these keep their place, so that
# after a failed element (a map function's exception) the next() call goes on with the
# next element, as tf.data's iterators do.


class _BatchIterator:
    """Batches of ``size`` elements stacked. An element that fails fails its batch, as in
    tf.data: right after a map (``whole``, tf.data's fused map-and-batch) once all the
    batch's elements are taken; otherwise at once, dropping the elements taken so far
    and starting the next batch after the failed one."""

    __slots__ = ("_drop", "_size", "_source", "_whole")

    def __init__(self, source: Iterator[Any], size: int, drop_remainder: bool, whole: bool) -> None:
        self._source = source
        self._size = size
        self._drop = drop_remainder
        self._whole = whole and _FUSE.get()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        chunk: List[Any] = []
        failed: typing.Optional[Exception] = None
        taken = 0
        while taken < self._size:
            try:
                x = next(self._source)
            except StopIteration:
                break
            except Exception as e:  # the batch fails whole (or at once), below
                if not self._whole:
                    raise
                failed = failed or e
                taken += 1
                continue
            chunk.append(x)
            taken += 1
        if failed is not None:
            raise failed
        if not chunk or (self._drop and taken < self._size):
            raise StopIteration
        return _stack(chunk)


class _ShuffleIterator:
    """The elements of ``source`` through a shuffle buffer of ``size``: each element is
    drawn from the buffer once it is filled (the place the last one left is filled first,
    so the order for a seed is the one ``Dataset.shuffle`` always gave, and an element
    that fails comes out where tf.data gives its error)."""

    __slots__ = ("_buf", "_ended", "_generator", "_hole", "_rng", "_size", "_source")

    def __init__(self, source: Iterator[Any], size: int, generator: Callable[[], np.random.Generator]) -> None:
        self._source = source
        self._size = size
        self._generator = generator
        self._rng: typing.Optional[np.random.Generator] = None
        self._buf: List[Any] = []
        self._hole: typing.Optional[int] = None  # the place of the element given out last
        self._ended = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._rng is None:
            self._rng = self._generator()  # at the pass's first element, as a generator would
        buf = self._buf
        # 1. Fill the buffer, the place the last element left first.
        while not self._ended and (self._hole is not None or len(buf) < self._size):
            try:
                x = next(self._source)
            except StopIteration:
                self._ended = True
                break
            if self._hole is not None:
                buf[self._hole] = x
                self._hole = None
            else:
                buf.append(x)
        if self._hole is not None:
            # 2. The source has ended: the last element takes the empty place.
            last = buf.pop()
            if self._hole < len(buf):
                buf[self._hole] = last
            self._hole = None
        if not buf:
            raise StopIteration
        # 3. One element drawn from the full buffer.
        j = int(self._rng.integers(len(buf)))
        self._hole = j
        return buf[j]


class _RepeatIterator:
    """The passes of ``dataset``, one after another, while ``passes`` lasts; stops for
    good after a pass that had no element (nor a failed one)."""

    __slots__ = ("_dataset", "_fuse", "_it", "_passes", "_seen")

    def __init__(self, dataset: Any, passes: Iterator[int]) -> None:
        self._dataset = dataset
        self._passes = passes
        self._it: typing.Optional[Iterator[Any]] = None
        self._seen = False
        self._fuse = _FUSE.get()  # later passes are made as the first

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                next(self._passes)  # StopIteration: the last pass is done
                token = _FUSE.set(self._fuse)
                try:
                    self._it = self._dataset._iterate()
                finally:
                    _FUSE.reset(token)
                self._seen = False
            try:
                x = next(self._it)
            except StopIteration:
                self._it = None
                if not self._seen:
                    self._passes = iter(())  # an empty pass: every later one would be too
                continue
            except Exception:
                self._seen = True
                raise
            self._seen = True
            return x


class _CountedIterator:
    """``source`` without its first ``skip`` elements, then at most ``take`` of them (-1:
    all). As in tf.data, a failed element counts as neither."""

    __slots__ = ("_skip", "_source", "_take")

    def __init__(self, source: Iterator[Any], take: int, skip: int) -> None:
        self._source = source
        self._take = take
        self._skip = skip

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while self._skip > 0:
            next(self._source)
            self._skip -= 1
        if self._take == 0:
            raise StopIteration
        x = next(self._source)
        if self._take > 0:
            self._take -= 1
        return x


class _ShardIterator:
    """Elements ``index``, ``index + num_shards``, ... of ``source``. A failed element
    counts as none (as in tf.data): the next element takes its position."""

    __slots__ = ("_index", "_num_shards", "_pos", "_source")

    def __init__(self, source: Iterator[Any], num_shards: int, index: int) -> None:
        self._source = source
        self._num_shards = num_shards
        self._index = index
        self._pos = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        # Pass over the other shards' elements, then take this one's. An element that
        # fails while they are passed over leaves the position where this call found
        # it, as tf.data's shard does (so the elements passed over before it count as
        # none either).
        skip = (self._index - self._pos) % self._num_shards
        for _ in range(skip):
            next(self._source)
        self._pos += skip
        x = next(self._source)
        self._pos += 1
        return x


def _rows_maker(rows: _Rows) -> Callable[[], Iterator[Any]]:
    def make() -> Iterator[Any]:
        for sel in rows.selections():
            for i in sel:
                yield rows.element(i)

    return make


def _stack(elements: List[Any]) -> Any:
    first = elements[0]
    if not _is_structure(first):
        return np.stack([np.asarray(e) for e in elements])
    columns = zip(*(_flatten(e) for e in elements))
    return _pack(first, [np.stack([np.asarray(v) for v in col]) for col in columns])
