"""``distvals.data.Dataset``: a small input pipeline in the style of ``tf.data.Dataset``.

The sources ``from_tensor_slices``, ``from_tensors``, ``range``, ``counter``,
``from_generator``, ``zip``, ``choose_from_datasets`` and ``sample_from_datasets``; the
transformations ``batch``, ``padded_batch``, ``unbatch``, ``rebatch``, ``shuffle``,
``repeat``, ``take``, ``skip``, ``take_while``, ``shard``, ``map``, ``flat_map``,
``interleave``, ``window``, ``scan``, ``filter``, ``unique``, ``ignore_errors``,
``concatenate``, ``enumerate``, ``cache``, ``apply``, ``prefetch`` and ``with_options``
(``distvals.data.Options``, see ``distvals.data_options``); ``reduce`` and
``get_single_element``; ``element_spec``, ``cardinality()`` and ``len()`` as tf.data has
them; and ``distvals.data.experimental``, tf.data.experimental's names for them.
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

import itertools
import sys
import typing
from typing import Any, Callable, Iterator, List

import numpy as np

from . import _core, nest, specs
from .data_elements import (
    bool_scalar,
    conform,
    convert_element,
    convert_leaf,
    copy_element,
    flatten,
    flatten_up_to,
    is_structure,
    merged_spec,
    numpy_dtype,
    pack,
    pad_stack,
    padding_value,
    same_structure,
    structure_text,
)
from .data_iterators import (
    FUSE,
    BatchIterator,
    CacheIterator,
    CardinalityError,
    ChainIterator,
    CountedIterator,
    FilterIterator,
    ShardIterator,
    Shared,
    ShuffleIterator,
    UnbatchIterator,
    ZipIterator,
)
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
from .optional import Optional as Optional  # tf.data.experimental.Optional's place

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "AutotuneOptions",
    "CardinalityError",
    "Dataset",
    "DistributeOptions",
    "ExternalStatePolicy",
    "OptimizationOptions",
    "Optional",
    "Options",
    "ThreadingOptions",
    "experimental",
]

# tf.data.AUTOTUNE: "let the runtime choose" for num_parallel_calls and prefetch sizes.
AUTOTUNE = -1

#: What ``cardinality()`` says of a dataset that never ends / whose length is unknown.
INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2

# The options of a dataset that was given none.
_NO_OPTIONS = Options()._freeze()


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


class _Rows:
    """What a dataset of array slices is: ``arrays`` (the leaves of ``template``) and,
    for each pass, a stream of row selections (``range``s, or index arrays once
    shuffled); elements are those rows in order."""

    __slots__ = ("arrays", "selections", "template", "whole")

    def __init__(
        self,
        template: Any,
        arrays: List[np.ndarray],
        selections: Callable[[], Iterator[Any]],
        whole: typing.Optional[int] = None,
    ) -> None:
        self.template = template
        self.arrays = arrays
        self.selections = selections
        # The number of rows when every pass is all of them in order (from_tensor_slices
        # itself), else None: zip pairs such datasets row by row (see Dataset.zip).
        self.whole = whole

    def derive(self, selections: Callable[[], Iterator[Any]]) -> _Rows:
        return _Rows(self.template, self.arrays, selections)

    # Elements are copies, never views of the arrays the dataset was made from: a step
    # that changes its batch in place (x -= mean) must change neither the caller's array
    # nor what a later epoch reads (as with tf.data, whose tensors cannot change).
    def element(self, i: int) -> Any:
        parts = [a[i, ...].copy() for a in self.arrays]
        return pack(self.template, parts) if is_structure(self.template) else parts[0]

    def batch(self, rows: Any) -> Any:
        """The element holding ``rows`` (a range of step 1: one copy of consecutive rows;
        an index array: one gather per array)."""
        if isinstance(rows, range):
            parts = [a[rows.start : rows.stop].copy() for a in self.arrays]
        else:
            parts = [a[rows] for a in self.arrays]
        return pack(self.template, parts) if is_structure(self.template) else parts[0]


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
    """The order in which ``ShuffleIterator`` (the streaming buffer of ``Dataset.shuffle``)
    gives n elements through a buffer of ``buffer_size``, drawing the same numbers from
    ``rng``: so a seed gives one order whatever came before the shuffle (a map, say), and
    datasets shuffled apart with one seed stay paired in a zip. (numpy gives the same
    integers whether drawn one by one or in one call, with one bound or an array of
    them.) The draws are made here; ``_core.shuffle_order`` walks the buffer with them:
    while the source lasts the buffer is full, every draw is over ``size`` slots and the
    next element takes the place of the one given out; once it has ended, each draw is
    over the elements left, and the last of them takes the place of the one given out."""
    size = min(buffer_size, n)
    full = rng.integers(size, size=n - size)
    tail = rng.integers(0, np.arange(size, 0, -1)) if size else np.empty(0, dtype=np.int64)
    return _core.shuffle_order(full, tail, size)


def _card_batch(card: int, size: int, drop_remainder: bool) -> int:
    if card < 0:
        return card
    return card // size if drop_remainder else -(-card // size)


class Dataset:
    """A re-iterable sequence of elements (arrays or nested structures of arrays)."""

    _is_dataset = True  # (see data_elements.is_dataset)

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
        # Whether element_spec was read from a first element (whose sizes need not be
        # the others').
        self._spec_read = False
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
        leaves = flatten(tensors)
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
        rows = _Rows(tensors, arrays, lambda: iter((range(size),)), whole=size)
        leaf_specs = [specs.TensorSpec(a.shape[1:], a.dtype) for a in arrays]
        spec = pack(tensors, leaf_specs) if is_structure(tensors) else leaf_specs[0]
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
        leaves = [np.array(convert_leaf(x, "from_tensors"), copy=True) for x in flatten(tensors)]
        leaf_specs = [specs.TensorSpec(a.shape, a.dtype) for a in leaves]
        spec = pack(tensors, leaf_specs) if is_structure(tensors) else leaf_specs[0]

        def one() -> Iterator[Any]:
            fresh = [a.copy() for a in leaves]
            yield pack(tensors, fresh) if is_structure(tensors) else fresh[0]

        return Dataset(one, description="TensorDataset(1 element)", spec=spec, cardinality=1)

    @staticmethod
    def range(*args: int, output_type: Any = np.int64, name: typing.Optional[str] = None) -> Dataset:
        """Like Python's ``range``: elements are 0-d arrays of ``output_type`` (int64)."""
        r = range(*args)
        dtype = numpy_dtype(output_type)
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
        if spec is not None and any(type(leaf).__name__ == "TensorSpec" for leaf in flatten(spec)):
            # TensorFlow's TensorSpecs (a signature written for tf.data) as ours.
            spec = pack(
                spec,
                [leaf if isinstance(leaf, specs.TensorSpec) else specs.from_tensorflow(leaf) for leaf in flatten(spec)],
            )
        if spec is not None:
            for leaf in flatten(spec):
                if not isinstance(leaf, specs.TensorSpec):
                    raise TypeError(
                        f"from_generator: output_signature must hold TensorSpec leaves, got {type(leaf).__name__}"
                    )
        call_args = tuple(args) if args is not None else ()

        def convert(x: Any) -> Any:
            # Copies, as tf.data makes tensors of what a generator yields: a generator may
            # refill one buffer and yield it each time.
            return convert_element(x, "from_generator", copy=True) if spec is None else conform(x, spec)

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
                return BatchIterator(source._iterate(), batch_size, drop_remainder, whole)

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
            return ShuffleIterator(source._iterate(), buffer_size, generator)

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
            return ChainIterator((source._iterate() for _ in passes()), stop_when_empty=True)

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
            lambda: CountedIterator(source._iterate(), count, 0), description, finite=True, cardinality=new_card
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
        return self._derived(lambda: CountedIterator(source._iterate(), -1, count), description, cardinality=new_card)

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
            lambda: ShardIterator(source._iterate(), num_shards, index), description, cardinality=new_card
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
            return convert_element(_as_tuple(_call_with_element(fn, x, "map", "the map function")), "map")

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

    def filter(self, predicate: Callable[..., Any], name: typing.Optional[str] = None) -> Dataset:
        """The elements for which ``predicate`` (called as ``map`` calls its function) returns
        True; it must return a bool scalar. An exception in it fails that element's
        ``next()``, and the pass goes on after it, as in tf.data. Its cardinality is
        unknown, as tf.data's."""
        keep = _predicate(predicate, "filter")
        source = self
        return self._derived(
            lambda: FilterIterator(source._iterate(), keep), "FilterDataset", cardinality=UNKNOWN_CARDINALITY
        )

    def take_while(self, predicate: Callable[..., Any], name: typing.Optional[str] = None) -> Dataset:
        """The elements up to (not including) the first for which ``predicate`` (called as
        ``map`` calls its function, returning a bool scalar) returns False."""
        keep = _predicate(predicate, "take_while")
        source = self
        return self._derived(
            lambda: FilterIterator(source._iterate(), keep, until=True),
            "TakeWhileDataset",
            finite=True,
            cardinality=UNKNOWN_CARDINALITY,
        )

    @staticmethod
    def zip(*args: Any, datasets: Any = None, name: typing.Optional[str] = None) -> Dataset:
        """Elements made of one element of each dataset, nested as the datasets are given:
        ``zip(a, b)`` or ``zip((a, b))`` gives tuples, ``zip({"x": a, "y": b})`` dicts
        (structures of tuples, namedtuples and dicts nest; a list is a ``TypeError``, as in
        tf.data). It ends with the shortest dataset."""
        if args and datasets is not None:
            raise TypeError("zip: give the datasets as positional arguments or as datasets=, not both")
        if datasets is None:
            if not args:
                raise TypeError("zip: no datasets given")
            datasets = args[0] if len(args) == 1 else tuple(args)
        parts = _datasets_in(datasets, "zip")
        cards = [d._cardinality for d in parts]
        if UNKNOWN_CARDINALITY in cards:
            card = UNKNOWN_CARDINALITY
        else:
            known = [c for c in cards if c != INFINITE_CARDINALITY]
            card = min(known) if known else INFINITE_CARDINALITY
        specs_of = [d._spec for d in parts]
        spec = None if any(sp is None for sp in specs_of) else _pack_datasets(datasets, specs_of)
        batched = {d._batched for d in parts}

        sliced = [d._rows for d in parts if d._rows is not None and d._rows.whole is not None]
        rows = None
        if len(sliced) == len(parts):
            # Slices of arrays, each dataset all of its rows in order (features and labels
            # sliced apart): the zip is slices of all their arrays, row i of each, so that
            # shuffle and batch after it still cut whole arrays.
            size = min(r.whole or 0 for r in sliced)
            template = _pack_datasets(datasets, [r.template for r in sliced])
            rows = _Rows(template, [a for r in sliced for a in r.arrays], lambda: iter((range(size),)), whole=size)
            make = _rows_maker(rows)
        else:

            def pack_one(elements: List[Any]) -> Any:
                return _pack_datasets(datasets, elements)

            def make() -> Iterator[Any]:
                return ZipIterator([d._iterate() for d in parts], pack_one)

        return Dataset(
            make,
            batched=batched.pop() if len(batched) == 1 else None,
            finite=any(d._finite for d in parts),
            description=name or f"ZipDataset({len(parts)})",
            spec=spec,
            cardinality=card,
            rows=rows,
            options=_merged_options(parts),
        )

    def concatenate(self, dataset: Dataset, name: typing.Optional[str] = None) -> Dataset:
        """This dataset's elements, then ``dataset``'s. Their elements must have the same
        structure and dtypes (else ``TypeError``, as in tf.data); a dimension that differs
        between the two is None in ``element_spec``."""
        if not isinstance(dataset, Dataset):
            raise TypeError(f"concatenate: dataset must be a distvals.data.Dataset, got {type(dataset).__name__}")
        first, second = self._known_spec(), dataset._known_spec()
        spec = merged_spec(first, second, "concatenate") if first is not None and second is not None else None
        a, b = self._cardinality, dataset._cardinality
        if INFINITE_CARDINALITY in (a, b):
            card = INFINITE_CARDINALITY
        elif UNKNOWN_CARDINALITY in (a, b):
            card = UNKNOWN_CARDINALITY
        else:
            card = a + b
        source = self

        def make() -> Iterator[Any]:
            # The second pass starts when the first has ended.
            return ChainIterator(d._iterate() for d in (source, dataset))

        return Dataset(
            make,
            batched=self._batched if self._batched == dataset._batched else None,
            finite=self._finite and dataset._finite,
            description=name or "ConcatenateDataset",
            spec=spec,
            cardinality=card,
            options=_merged_options([self, dataset]),
        )

    def enumerate(self, start: int = 0, name: typing.Optional[str] = None) -> Dataset:
        """Pairs ``(i, element)``, ``i`` counting from ``start`` as an int64 0-d array."""
        start = _count(start, "enumerate", "start")
        counter = Dataset(
            lambda: (np.array(i, dtype=np.int64) for i in itertools.count(start)),
            batched=False,
            finite=False,
            spec=specs.TensorSpec((), np.int64),
            cardinality=INFINITE_CARDINALITY,
        )
        return Dataset.zip((counter, self), name=name or "EnumerateDataset")

    def unbatch(self, name: typing.Optional[str] = None) -> Dataset:
        """The rows of every element (the slices along the first axis of its components,
        which must all have that axis, of one size): the inverse of ``batch``."""
        spec = self._spec
        if spec is not None:
            for i, leaf in enumerate(flatten(spec)):
                if leaf.shape is not None and len(leaf.shape) == 0:
                    raise ValueError(f"unbatch: component {i} is a scalar; every component needs an axis to unbatch")
            spec = pack(spec, [_row_spec(leaf) for leaf in flatten(spec)]) if is_structure(spec) else _row_spec(spec)
        card = self._cardinality
        if card >= 0 and self._spec is not None:
            # Batches of a known size (batch with drop_remainder) give that many rows each.
            sizes = {leaf.shape[0] if leaf.shape else None for leaf in flatten(self._spec)}
            size = sizes.pop() if len(sizes) == 1 else None
            card = card * size if size is not None else UNKNOWN_CARDINALITY
        elif card >= 0:
            card = UNKNOWN_CARDINALITY
        source = self
        return self._derived(
            lambda: UnbatchIterator(source._iterate()),
            name or "UnbatchDataset",
            batched=False,
            spec=spec,
            cardinality=card,
        )

    def cache(self, filename: str = "", name: typing.Optional[str] = None) -> Dataset:
        """The elements of the first pass that reaches its end, given again by every later
        pass (a pass cut short keeps nothing; a failed element is not kept). distvals keeps
        the cache in memory: a ``filename`` is accepted, and nothing is written to it.
        Every element handed out is a copy of its own."""
        if not isinstance(filename, str):
            raise TypeError(f"cache: filename must be a str, got {type(filename).__name__}")
        description = name or "CacheDataset"
        kept: List[Any] = []
        done = False
        if self._rows is not None:
            # Slices of arrays: keep the first whole pass's row selections (a shuffled
            # order stays that order, as tf.data's cache keeps its elements).
            src_rows = self._rows

            def selections() -> Iterator[Any]:
                nonlocal done
                if done:
                    yield from kept
                    return
                seen = []
                for sel in src_rows.selections():
                    seen.append(sel)
                    yield sel
                if not done:
                    kept[:], done = seen, True

            rows = src_rows.derive(selections)
            return self._derived(_rows_maker(rows), description, rows=rows)

        def complete(elements: List[Any]) -> None:
            nonlocal done
            if not done:
                kept[:], done = elements, True

        source = self

        def make() -> Iterator[Any]:
            if done:
                return (copy_element(x) for x in kept)
            return CacheIterator(source._iterate(), complete)

        return self._derived(make, description)

    def flat_map(self, map_func: Callable[..., Any], name: typing.Optional[str] = None) -> Dataset:
        """The elements of the datasets that ``map_func`` (called as ``map`` calls its
        function) returns for each element, one dataset after another."""
        _transforms.dataset_passes(map_func, "flat_map")  # checks map_func now
        source = self

        def make() -> Iterator[Any]:
            return ChainIterator(map(_transforms.dataset_passes(map_func, "flat_map"), source._iterate()))

        return Dataset(make, description=name or "FlatMapDataset", options=self._options)

    def interleave(
        self,
        map_func: Callable[..., Any],
        cycle_length: typing.Optional[int] = None,
        block_length: typing.Optional[int] = None,
        num_parallel_calls: typing.Optional[int] = None,
        deterministic: typing.Optional[bool] = None,
        name: typing.Optional[str] = None,
    ) -> Dataset:
        """The elements of the datasets that ``map_func`` (called as ``map`` calls its
        function) returns for the elements, in tf.data's interleave order: the datasets of
        ``cycle_length`` elements are read in turn, ``block_length`` (default 1)
        consecutive elements from each; when one ends, the dataset of the next element
        takes its place in the cycle. ``cycle_length`` None or ``AUTOTUNE``: the number of
        CPUs this process may run on, as in tf.data. ``num_parallel_calls`` and
        ``deterministic`` are accepted; the order is always the one above."""
        return _transforms.interleave(self, map_func, cycle_length, block_length, num_parallel_calls, name)

    def window(
        self,
        size: int,
        shift: typing.Optional[int] = None,
        stride: int = 1,
        drop_remainder: bool = False,
        name: typing.Optional[str] = None,
    ) -> Dataset:
        """Windows of elements: window ``k`` holds elements ``k*shift + i*stride`` for ``i``
        below ``size`` (``shift`` defaults to ``size``); the last windows are shorter
        unless ``drop_remainder``. Each window is a dataset (a structure of datasets, one
        per component, for structured elements), as in tf.data: ``flat_map(lambda w:
        w.batch(size))`` makes arrays of them. An element that fails fails the windows
        that hold it."""
        return _transforms.window(self, size, shift, stride, drop_remainder, name)

    def scan(
        self, initial_state: Any, scan_func: Callable[[Any, Any], Any], name: typing.Optional[str] = None
    ) -> Dataset:
        """``reduce`` that gives an element at every step: ``scan_func(state, element)``
        returns ``(new_state, output_element)``. Each pass starts from ``initial_state``;
        every state must have its structure and dtypes (``TypeError`` otherwise)."""
        return _transforms.scan(self, initial_state, scan_func, name)

    def unique(self, name: typing.Optional[str] = None) -> Dataset:
        """The elements less the ones equal to an earlier element of the pass; elements
        must be single int32, int64 or string arrays (``TypeError`` otherwise)."""
        return _transforms.unique(self, name)

    def ignore_errors(self, log_warning: bool = False, name: typing.Optional[str] = None) -> Dataset:
        """The elements less the ones whose making raises (a ``map`` function's error);
        ``log_warning`` logs each error on the ``distvals.data`` logger."""
        return _transforms.ignore_errors(self, log_warning, name)

    def rebatch(self, batch_size: Any, drop_remainder: bool = False, name: typing.Optional[str] = None) -> Dataset:
        """The rows of the batches regrouped into batches of ``batch_size`` (an int, or a
        list of sizes taken in turn): ``unbatch().batch(batch_size)``, as in tf.data."""
        return _transforms.rebatch(self, batch_size, drop_remainder, name)

    def get_single_element(self, name: typing.Optional[str] = None) -> Any:
        """The one element of the dataset; ``ValueError`` when it has none or more."""
        it = self._pass()
        try:
            x = next(it)
        except StopIteration:
            raise ValueError("get_single_element: Dataset was empty.") from None
        try:
            next(it)
        except StopIteration:
            return x
        raise ValueError("get_single_element: Dataset had more than one element.")

    @staticmethod
    def counter(start: int = 0, step: int = 1, dtype: Any = np.int64, name: typing.Optional[str] = None) -> Dataset:
        """``start``, ``start + step``, ... forever, as 0-d arrays of ``dtype``."""
        return _transforms.counter(start, step, dtype, name)

    @staticmethod
    def choose_from_datasets(
        datasets: Any, choice_dataset: Dataset, stop_on_empty_dataset: bool = True, name: typing.Optional[str] = None
    ) -> Dataset:
        """Each element from the dataset that the next element of ``choice_dataset`` (int64
        scalars) names. A chosen dataset that has ended ends the iteration
        (``stop_on_empty_dataset``), or is passed over until all have ended."""
        return _transforms.choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset, name)

    @staticmethod
    def sample_from_datasets(
        datasets: Any,
        weights: Any = None,
        seed: typing.Optional[int] = None,
        stop_on_empty_dataset: bool = False,
        rerandomize_each_iteration: typing.Optional[bool] = None,
        name: typing.Optional[str] = None,
    ) -> Dataset:
        """Each element from a dataset drawn at random, with probabilities proportional to
        ``weights`` (a list of floats, one per dataset; uniform by default) among the
        datasets that have not ended. ``stop_on_empty_dataset``: the first that ends ends
        the iteration. With a ``seed`` each pass draws the same sequence unless
        ``rerandomize_each_iteration`` (numpy's generator: not tf.data's sequence)."""
        return _transforms.sample_from_datasets(
            datasets, weights, seed, stop_on_empty_dataset, rerandomize_each_iteration, name
        )

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """``transformation_func(self)``, which must return a dataset."""
        out = transformation_func(self)
        if not isinstance(out, Dataset):
            raise TypeError(f"apply: transformation_func must return a distvals.data.Dataset, got {type(out).__name__}")
        return out

    def reduce(
        self, initial_state: Any, reduce_func: Callable[[Any, Any], Any], name: typing.Optional[str] = None
    ) -> Any:
        """``reduce_func(state, element)`` over the whole dataset from ``initial_state``; the
        last state, as numpy arrays (nested like ``initial_state``). Every state must have
        the structure and dtypes of the initial one (``TypeError`` naming the difference,
        as in tf.data, where Python ints are int32 and floats float32)."""
        if not callable(reduce_func):
            raise TypeError(f"reduce: reduce_func must be callable, got {type(reduce_func).__name__}")
        state = convert_element(_as_tuple(initial_state), "reduce")
        for x in self._pass():
            new = convert_element(_as_tuple(reduce_func(state, x)), "reduce")
            state = _transforms.checked_state(new, state, "reduce", "reduce_func")
        return state

    def padded_batch(
        self,
        batch_size: int,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
        name: typing.Optional[str] = None,
    ) -> Dataset:
        """Like ``batch``, for elements whose components differ in shape: each component is
        padded with its padding value (``padding_values``, nested like the elements, or one
        value for all; by default 0, False or an empty string) up to its padded shape
        (``padded_shapes``, nested like the elements, each a shape in which None or -1
        means the largest in the batch; by default the largest in the batch in every
        dimension). An element larger than its padded shape fails its batch."""
        if _count(batch_size, "padded_batch", "batch_size") < 1:
            raise ValueError(f"padded_batch: batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(drop_remainder, (bool, np.bool_)):
            raise TypeError(f"padded_batch: drop_remainder must be a bool, got {drop_remainder!r}")
        batch_size = int(batch_size)
        spec = self._known_spec()
        leaf_specs = None if spec is None else flatten(spec)
        shapes = _padded_shapes(padded_shapes, spec)
        dtypes = None if leaf_specs is None else [leaf.dtype for leaf in leaf_specs]
        values = _padding_values(padding_values, spec, dtypes)
        source = self

        def combine(elements: List[Any]) -> Any:
            leaves = flatten(elements[0])
            n = len(leaves)
            if (shapes is not None and len(shapes) != n) or len(values) not in (1, n):
                raise ValueError(
                    f"padded_batch: elements have {n} components; padded_shapes or padding_values has another number"
                )
            vals = [
                padding_value(values[0] if len(values) == 1 else values[i], np.asarray(leaf).dtype, f"of component {i}")
                if dtypes is None
                else values[i if len(values) > 1 else 0]
                for i, leaf in enumerate(leaves)
            ]
            return pad_stack(elements, shapes if shapes is not None else [None] * n, vals)

        out_spec = None
        if spec is not None:
            batch_dim = batch_size if drop_remainder else None
            out_leaves = [
                specs.TensorSpec(
                    None
                    if leaf.shape is None
                    else (batch_dim,)
                    + tuple(
                        (leaf.shape[d] if shapes is None or shapes[i][d] is None else shapes[i][d])
                        for d in range(len(leaf.shape))
                    ),
                    leaf.dtype,
                )
                for i, leaf in enumerate(flatten(spec))
            ]
            out_spec = pack(spec, out_leaves) if is_structure(spec) else out_leaves[0]
        return Dataset(
            lambda: BatchIterator(source._iterate(), batch_size, bool(drop_remainder), False, combine),
            batched=True,
            finite=self._finite,
            description=name or f"PaddedBatchDataset({batch_size})",
            spec=out_spec,
            cardinality=_card_batch(self._cardinality, batch_size, bool(drop_remainder)),
            options=self._options,
        )

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
        # From _iterate, as every other dataset made from this one: a pass element_spec
        # began is the next pass's (its shuffle would otherwise move on one pass).
        return self._derived(self._iterate, self._description, rows=self._rows)

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
            leaf_specs = [
                specs.DatasetSpec(x.element_spec)
                if isinstance(x, Dataset)
                else specs.TensorSpec(np.shape(x), np.asarray(x).dtype)
                for x in flatten(first)
            ]
            spec = pack(first, leaf_specs) if is_structure(first) else leaf_specs[0]
            self._spec = specs.unbatched(spec) if self._batched else spec
            self._spec_read = True
        return self._spec

    def cardinality(self) -> np.int64:
        """The number of elements: ``INFINITE_CARDINALITY`` (-1) for a dataset that repeats
        forever, ``UNKNOWN_CARDINALITY`` (-2) when it cannot be known without reading it."""
        card: np.int64 = np.int64(self._cardinality)  # numpy's stubs make this Any
        return card

    def _known_spec(self) -> Any:
        """``element_spec`` when it can be had (None for an empty dataset whose spec is
        unknown, or one whose first elements all fail); where it was read from a first
        element, with every size None (the structure, ranks and dtypes hold for every
        element; the sizes may not)."""
        try:
            spec = self.element_spec
        except Exception:  # noqa: BLE001 - the data tells later; the spec stays unknown
            return None
        if spec is None or not self._spec_read:
            return spec
        leaves = [specs.TensorSpec(None if s.shape is None else (None,) * len(s.shape), s.dtype) for s in flatten(spec)]
        return pack(spec, leaves) if is_structure(spec) else leaves[0]

    def __len__(self) -> int:
        """The number of elements; ``TypeError`` when it is infinite or unknown (as in
        tf.data: see ``cardinality()``)."""
        if self._cardinality == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if self._cardinality < 0:
            raise TypeError("The dataset length is unknown.")
        return self._cardinality

    def __bool__(self) -> bool:
        return True  # a dataset is true even when empty or of unknown length, as in tf.data

    # ---- iteration --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return Shared(self._pass())

    def _pass(self) -> Iterator[Any]:
        """A pass of the whole pipeline this dataset ends: ``_iterate`` with this
        dataset's options in force while its iterators are made."""
        token = FUSE.set(fuses_map_and_batch(self._options))
        try:
            return self._iterate()
        finally:
            FUSE.reset(token)

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
    """An integer argument as an int (a 0-d integer array too, as tf.data takes a scalar
    tensor): TypeError for anything else (a bool too)."""
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iu":
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an int, got {value!r}")
    return int(value)


def _call_with_element(fn: Callable[..., Any], x: Any, what: str, name: str = "the function") -> Any:
    """``fn`` called as ``map`` calls it (a tuple element as its arguments)."""
    try:
        return fn(*x) if type(x) is tuple else fn(x)
    except StopIteration as e:
        # Not the end of the data (the iterators would take it for that): an error of
        # this element, as a generator turns it into one.
        raise RuntimeError(f"{what}: {name} raised StopIteration: {e!r}") from e


def _predicate(predicate: Any, what: str) -> Callable[[Any], bool]:
    if not callable(predicate):
        raise TypeError(f"{what}: predicate must be callable, got {type(predicate).__name__}")

    def keep(x: Any) -> bool:
        return bool_scalar(_call_with_element(predicate, x, what), what)

    return keep


def _as_tuple(x: Any) -> Any:
    # As TensorFlow: a list that a function returns is a tuple of components.
    return tuple(x) if type(x) is list else x


def _datasets_in(structure: Any, what: str) -> List[Dataset]:
    """The datasets of a structure of them (tuples, namedtuples, dicts)."""
    if isinstance(structure, list):
        raise TypeError(f"{what}: datasets must be nested in tuples or dicts; a list is not supported, use a tuple")
    leaves = flatten(structure)
    for leaf in leaves:
        if isinstance(leaf, list):
            raise TypeError(f"{what}: datasets must be nested in tuples or dicts; a list is not supported, use a tuple")
        if not isinstance(leaf, Dataset):
            raise TypeError(
                f"{what}: expected (a structure of) distvals.data.Dataset objects, got {type(leaf).__name__}"
            )
    if not leaves:
        raise ValueError(f"{what}: no datasets given")
    return leaves


def _pack_datasets(structure: Any, parts: List[Any]) -> Any:
    return pack(structure, parts) if is_structure(structure) else parts[0]


def _merged_options(datasets: List[Dataset]) -> Options:
    options = datasets[0]._options
    for d in datasets[1:]:
        if d._options is not _NO_OPTIONS:
            options = options.merge(d._options)._freeze()
    return options


def _row_spec(leaf: Any) -> Any:
    return specs.TensorSpec(None if leaf.shape is None else leaf.shape[1:], leaf.dtype)


def _padded_shapes(padded_shapes: Any, spec: Any) -> Any:
    """padded_batch's shapes, one per component (None where given none), each a tuple in
    which None is the batch's largest."""
    if padded_shapes is None:
        return None

    def one(shape: Any, i: int) -> Any:
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) and hasattr(shape, "as_list"):
            shape = shape.as_list()  # a TensorShape
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"padded_batch: padded shape of component {i} must be a shape, got {shape!r}")
        out: List[typing.Optional[int]] = []
        for d in shape:
            if d is None or (isinstance(d, (int, np.integer)) and d == -1):
                out.append(None)
            elif isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0:
                out.append(int(d))
            else:
                raise ValueError(f"padded_batch: padded shape of component {i} has a bad size {d!r}")
        return tuple(out)

    # Nested like the elements where their spec is known; otherwise a shape is a list
    # (or a tuple of sizes), and tuples of shapes and dicts are structures.
    def is_shape(x: Any) -> bool:
        return (
            isinstance(x, list)
            or hasattr(x, "as_list")
            or (isinstance(x, tuple) and all(d is None or isinstance(d, (int, np.integer)) for d in x))
        )

    def leaves_of(x: Any) -> List[Any]:
        if is_shape(x) or not isinstance(x, (tuple, dict)):
            return [x]
        if isinstance(x, tuple):
            return [leaf for v in x for leaf in leaves_of(v)]
        return [leaf for k in nest._sorted_keys(x) for leaf in leaves_of(x[k])]

    if spec is not None and is_structure(spec):
        if not same_structure(padded_shapes, spec):
            raise ValueError(
                f"padded_batch: padded_shapes must nest like the elements, {structure_text(spec)}; got {padded_shapes!r}"
            )
        given = flatten_up_to(spec, padded_shapes)
    else:
        given = [padded_shapes] if spec is not None else leaves_of(padded_shapes)
    shapes = [one(x, i) for i, x in enumerate(given)]
    if spec is not None:
        leaf_specs = flatten(spec)
        if len(shapes) != len(leaf_specs):
            raise ValueError(
                f"padded_batch: padded_shapes has {len(shapes)} shapes; the elements have {len(leaf_specs)} components"
            )
        for i, (shape, leaf) in enumerate(zip(shapes, leaf_specs)):
            if leaf.shape is not None and len(shape) != len(leaf.shape):
                raise ValueError(
                    f"padded_batch: padded shape {shape} of component {i} has rank {len(shape)}; the component's "
                    f"shape {leaf.shape} has rank {len(leaf.shape)}"
                )
    return shapes


def _padding_values(padding_values: Any, spec: Any, dtypes: Any) -> List[Any]:
    """padded_batch's padding values: per component (converted now when the dtypes are
    known), or one for every component."""
    if padding_values is None or not is_structure(padding_values):
        values = [padding_values]
    elif spec is not None and is_structure(spec):
        if not same_structure(padding_values, spec):
            raise ValueError(
                f"padded_batch: padding_values must nest like the elements, {structure_text(spec)}; "
                f"got {padding_values!r}"
            )
        values = flatten_up_to(spec, padding_values)
    else:
        values = flatten(padding_values)
    if dtypes is None:
        return values
    if len(values) == 1:
        values = values * len(dtypes)
    if len(values) != len(dtypes):
        raise ValueError(
            f"padded_batch: padding_values has {len(values)} values; the elements have {len(dtypes)} components"
        )
    return [padding_value(v, dt, f"of component {i}") for i, (v, dt) in enumerate(zip(values, dtypes))]


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
        return specs.TensorSpec(sh, numpy_dtype(t))

    return build(types, shapes, "")


def _rows_maker(rows: _Rows) -> Callable[[], Iterator[Any]]:
    def make() -> Iterator[Any]:
        for sel in rows.selections():
            for i in sel:
                yield rows.element(i)

    return make


# The transformations that live in their own modules (they import this one), and
# distvals.data.experimental, importable by that name too (as tf.data.experimental).
from . import data_experimental as experimental  # noqa: E402
from . import data_transforms as _transforms  # noqa: E402

sys.modules[__name__ + ".experimental"] = experimental
