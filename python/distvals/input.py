"""Distributed input: global batches split over the replicas.

``strategy.experimental_distribute_dataset(dataset)`` splits each global batch of B
elements along axis 0: the first B mod N replicas get ceil(B/N) elements, the others
floor(B/N); a replica left with nothing gets an empty batch with the right trailing
shape and dtype. The parts are views of the batch, not copies.

The dataset may be a ``distvals.data.Dataset``, any iterable of batches (lists,
generators), a ``tf.data.Dataset`` or a torch ``DataLoader``; their leaves are turned
into numpy arrays without a copy where possible, and neither library is imported.

``DistributedDataset`` and ``DistributedIterator`` offer TensorFlow's API around that:
``element_spec`` (``distvals.specs``), ``cardinality`` (the number of global batches:
``UNKNOWN_CARDINALITY`` when it cannot be known without reading, ``INFINITE_CARDINALITY``
for a dataset that repeats forever), ``get_next_as_optional()`` and ``reduce``. Options:
``distvals.input_options``.

GPU replicas get their part of each batch in their GPU's memory: every per-replica
part is copied host-to-device onto that replica's GPU (a ``DeviceArray``). Leaves that
are already device arrays (cupy, torch CUDA tensors) are split on the GPU and only
copied when they live on another GPU than the replica's; leaves of dtypes a GPU cannot
hold (bool, strings, ...) stay on the host.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np

from . import context, devices, nest, specs
from .fork_locks import renewed_after_fork
from .input_contexts import InputContext, ValueContext
from .input_options import InputOptions, InputReplicationMode, check_options
from .optional import Optional as _Optional
from .values import PerReplica, regroup

__all__ = [
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Cardinality",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "ValueContext",
    "place_element",
    "split_batch_sizes",
]

#: ``cardinality`` of a dataset that never ends, and of one whose length is unknown
#: (tf.data's values).
INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2


class Cardinality(int):
    """The number of elements of a distributed dataset. TensorFlow 2.21 makes
    ``DistributedDataset.cardinality`` a property while ``tf.data.Dataset.cardinality``
    is a method: this int works both ways (``ds.cardinality`` and ``ds.cardinality()``)."""

    def __call__(self) -> Cardinality:
        return self

    def __repr__(self) -> str:
        return int.__repr__(self)


def split_batch_sizes(batch: int, n: int) -> List[int]:
    """Per-replica sizes of a batch of ``batch`` elements: the first batch mod n replicas
    get one more."""
    q, rem = divmod(batch, n)
    return [q + 1] * rem + [q] * (n - rem)


def to_numpy(x: Any) -> np.ndarray:
    """A leaf of an input element as a numpy array, without a copy where possible (a
    device array is copied to the host)."""
    if isinstance(x, np.ndarray):
        return x
    return devices.to_host(x)


def _leaf(x: Any, on_gpu: bool) -> Any:
    """A leaf as an array: device arrays stay on their GPU for GPU replicas."""
    if type(x) is np.ndarray:
        return x
    if on_gpu and devices.is_device_array(x):
        return devices.as_value(x)
    return to_numpy(x)


def place_element(element: Any, place: Optional[int], replica: Optional[int] = None) -> Any:
    """``element`` (nested allowed) with its array leaves on ``place`` (a CUDA device, or
    None for the host). A device leaf already there is kept as it is; leaves that are not
    arrays (Python numbers, strings) and arrays of dtypes a GPU cannot hold are kept.
    ``replica``, when known, is named in an error."""
    if place is None:
        return element

    def one(x: Any) -> Any:
        if devices.is_device_array(x):
            return x if devices.place_of(x) == place else devices.to_replica_device(x, place, replica=replica)
        if isinstance(x, (np.ndarray, np.generic)) and devices.can_place(x.dtype):
            return devices.to_replica_device(x, place, replica=replica)
        return x

    if nest.is_nested(element):
        return nest.pack_sequence_as(element, [one(x) for x in nest.flatten(element)])
    return one(element)


def _gpu_places(strategy: Any, n: int, options: Any = None) -> Optional[Tuple[int, ...]]:
    """Each replica's CUDA device when the strategy runs GPU replicas and ``options`` let
    elements go there (fetched to the device, or made on it), else None."""
    if (
        options is not None
        and getattr(options, "experimental_fetch_to_device", None) is False
        and not getattr(options, "experimental_place_dataset_on_device", False)
    ):
        return None
    ext = getattr(strategy, "extended", None)
    places = tuple(getattr(ext, "_places", ()))
    if getattr(ext, "_on_gpu", False) and len(places) == n:
        return places
    return None


def _iterable(dataset: Any, what: str) -> Any:
    if isinstance(dataset, (str, bytes, dict)) or not hasattr(dataset, "__iter__"):
        raise TypeError(
            f"{what}: expected a dataset (distvals.data.Dataset, tf.data.Dataset, a torch DataLoader or "
            f"any iterable of batches), got {type(dataset).__name__}"
        )
    return dataset


def _no_batch_dim(what: str) -> ValueError:
    return ValueError(
        f"{what} needs batched data, but an element has shape (); batch the dataset first, "
        "e.g. dataset.batch(global_batch_size)"
    )


# ---- what a dataset says about itself, without reading it --------------------------------------


class _Source:
    """A dataset with what distributing it needs to know: its element_spec and
    cardinality, read from the dataset where it says (distvals and tf.data datasets), else
    from its first element. The pass that read the first element is the next pass, which
    goes on from there: a loader that draws a new order for each pass (a shuffling torch
    DataLoader) is not moved on by the look, so one worker asking for the spec does not
    put its data out of step with the others'. A one-shot iterator says nothing once its
    one pass has begun."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        # The first element read, and the pass it came from (None: no pass begun here).
        self._peeked: Optional[List[Any]] = None
        self._pass: Optional[Iterator[Any]] = None
        self._begun = False
        self._spec: Any = _UNSET

    def iterator(self) -> Iterator[Any]:
        if self._pass is not None:
            peeked, it = self._peeked or [], self._pass
            self._peeked, self._pass = None, None
            if it is self.dataset:
                self._begun = True
            return itertools.chain(peeked, it)
        it = iter(self.dataset)
        if it is self.dataset:
            self._begun = True
        return it

    def _first(self) -> Any:
        """The first element (StopIteration for an empty dataset)."""
        if self._pass is None:
            if self._begun:
                raise _Unknown
            it = iter(self.dataset)
            self._peeked = list(itertools.islice(it, 1))
            self._pass = it
        if not self._peeked:
            raise StopIteration
        return self._peeked[0]

    def element_spec(self) -> Any:
        if self._spec is _UNSET:
            self._spec = self._read_spec()
        return self._spec

    def _read_spec(self) -> Any:
        spec = getattr(self.dataset, "element_spec", None)
        if spec is not None:
            return spec if type(self.dataset).__module__.startswith("distvals") else specs.from_tensorflow(spec)
        try:
            first = self._first()
        except (StopIteration, _Unknown):
            return None
        leaves = [to_numpy(x) for x in (nest.flatten(first) if nest.is_nested(first) else [first])]
        element = nest.pack_sequence_as(first, leaves) if nest.is_nested(first) else leaves[0]
        # Later batches may be smaller: the batch dimension is unknown.
        return specs.unbatched(specs.spec_of(element))

    def cardinality(self) -> int:
        card = getattr(self.dataset, "cardinality", None)
        if callable(card):
            try:
                return int(np.asarray(card()))
            except Exception:  # noqa: BLE001 - a cardinality that cannot be computed is unknown
                return UNKNOWN_CARDINALITY
        if hasattr(self.dataset, "__len__"):
            return len(self.dataset)
        return UNKNOWN_CARDINALITY


_UNSET = object()


def refuse_in_run() -> None:
    """ValueError when called inside ``strategy.run``, as TensorFlow's: there every
    replica would take a whole global batch of the shared iterator and keep only its own
    part, and the other parts would be lost without a word."""
    if context.current_run_context() is not None:
        raise ValueError(
            "next(iterator) (or get_next, get_next_as_optional) of a distributed iterator must be called "
            "outside the replica function, e.g. strategy.run(replica_fn, args=(next(iterator),)): inside it, "
            "each replica would take a whole global batch and keep only its own part of it"
        )


class _Unknown(Exception):
    """The first element of a one-shot iterator whose pass has begun is gone."""


def _per_replica_spec(spec: Any, n: int, split: Optional[int], wrap: bool = False) -> Any:
    """The spec of a distributed element from the spec of one element: with ``split`` (the
    global replica count) the batch dimension is divided (known only when it divides
    evenly), otherwise every replica gets a whole element. One replica gets the plain
    spec, as in TensorFlow (unless ``wrap``: elements wrapped as PerReplica of one)."""

    def one(s: specs.TensorSpec) -> Any:
        if split is not None and s.shape:
            b = s.shape[0]
            per = b // split if b is not None and b % split == 0 else None
            s = specs.TensorSpec((per,) + s.shape[1:], s.dtype, s.name)
        return s if n == 1 and not wrap else specs.PerReplicaSpec(*([s] * n))

    if spec is None:
        return None
    if isinstance(spec, specs.TensorSpec):
        return one(spec)
    return nest.map_structure(one, spec)


# ---- experimental_distribute_dataset ----------------------------------------------------------


class DistributedIterator:
    """Iterator over a distributed dataset: each ``next`` gives one global batch as
    PerReplica values (nested like the dataset's elements). The end is StopIteration,
    from ``next`` and ``get_next`` alike."""

    def __init__(
        self,
        strategy: Any,
        iterator: Iterator[Any],
        options: Any = None,
        element_spec: Optional[Callable[[], Any]] = None,
    ) -> None:
        self._strategy = strategy
        self._iterator = iterator
        self._n = strategy.num_replicas_in_sync
        self._places = _gpu_places(strategy, self._n, options)
        self._spec_fn = element_spec  # asked only when wanted: it may read the dataset
        # Threads may share one iterator: each takes whole elements, one at a time.
        self._lock = renewed_after_fork(self)

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        refuse_in_run()
        with self._lock:
            element = next(self._iterator)
        n = self._n
        if type(element) is np.ndarray and self._places is None:
            # The common case, one host array: its per-replica views straight away.
            if element.ndim == 0:
                raise _no_batch_dim("experimental_distribute_dataset")
            if n == 1:
                return element
            return PerReplica._of(_split(element, n))
        structured = nest.is_nested(element)
        on_gpu = self._places is not None
        flat = nest.flatten(element) if structured else [element]
        leaves = [_leaf(x, on_gpu) for x in flat]
        if not leaves:
            raise ValueError("experimental_distribute_dataset: an element has no components")
        for a in leaves:
            if a.ndim == 0:
                raise _no_batch_dim("experimental_distribute_dataset")
        batch = leaves[0].shape[0]
        for i, a in enumerate(leaves):
            if a.shape[0] != batch:
                raise ValueError(
                    f"experimental_distribute_dataset: the components of a batch have different batch "
                    f"sizes: component 0 has {batch}, component {i} has {a.shape[0]}"
                )
        if self._places is not None:
            per_replica = []
            start = 0
            for size in split_batch_sizes(batch, n):
                parts = [_rows(a, start, start + size) for a in leaves]
                per_replica.append(nest.pack_sequence_as(element, parts) if structured else parts[0])
                start += size
            per_replica = [place_element(e, p, r) for r, (e, p) in enumerate(zip(per_replica, self._places))]
            return regroup(per_replica, what="experimental_distribute_dataset")
        if n == 1:
            return nest.pack_sequence_as(element, leaves) if structured else leaves[0]
        columns = [PerReplica._of(_split(a, n)) for a in leaves]
        return nest.pack_sequence_as(element, columns) if structured else columns[0]

    def get_next(self) -> Any:
        """The next global batch (StopIteration at the end)."""
        return self.__next__()

    def get_next_as_optional(self) -> _Optional:
        """The next global batch as an Optional: ``has_value()`` is False at the end,
        instead of an exception."""
        try:
            value = self.__next__()
        except StopIteration:
            return _Optional.empty(self.element_spec)
        return _Optional.from_value(value)

    @property
    def element_spec(self) -> Any:
        """The spec of the distributed elements (see ``DistributedDataset.element_spec``)."""
        return _spec_of(self._spec_fn)

    def __repr__(self) -> str:
        return f"DistributedIterator(num_replicas={self._n})"


def _spec_of(spec_fn: Optional[Callable[[], Any]]) -> Any:
    if spec_fn is None:
        return None
    try:
        return spec_fn()
    except Exception:  # noqa: BLE001 - a dataset that cannot describe itself has no spec
        return None


def _split(a: Any, n: int) -> Tuple[Any, ...]:
    """The n per-replica row ranges of ``a`` (views for host arrays)."""
    q, rem = divmod(a.shape[0], n)
    out = []
    start = 0
    is_host = isinstance(a, np.ndarray)
    for r in range(n):
        stop = start + q + (r < rem)
        out.append(a[start:stop] if is_host else devices.slice_rows(a, start, stop))
        start = stop
    return tuple(out)


def _rows(a: Any, start: int, stop: int) -> Any:
    return a[start:stop] if isinstance(a, np.ndarray) else devices.slice_rows(a, start, stop)


class DistributedDataset:
    """What ``experimental_distribute_dataset`` returns: iterate it for PerReplica
    batches. Each ``iter`` starts a new pass over the dataset (a generator can be
    passed over once only)."""

    def __init__(self, strategy: Any, dataset: Any, options: Any = None) -> None:
        check_options(options, "experimental_distribute_dataset")
        self._strategy = strategy
        self._options = options
        self._dataset = _iterable(dataset, "experimental_distribute_dataset")
        self._source = _Source(dataset)
        if getattr(dataset, "_batched", True) is False:
            raise ValueError(
                "experimental_distribute_dataset needs a batched dataset: call "
                "dataset.batch(global_batch_size) before distributing it"
            )

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(
            self._strategy, self._source_of().iterator(), self._options, lambda: self.element_spec
        )

    def _source_of(self) -> _Source:
        # A subclass may have replaced _dataset after construction.
        source = getattr(self, "_source", None)
        if source is None or source.dataset is not self._dataset:
            source = self._source = _Source(self._dataset)
        return source

    @property
    def element_spec(self) -> Any:
        """The spec of each distributed element: the dataset's, with the batch dimension
        divided over the replicas (None unless every global batch divides evenly), as a
        PerReplicaSpec per leaf (a plain TensorSpec for one replica)."""
        total = self._strategy.num_replicas_in_sync
        local = getattr(self, "_count", total)
        return _per_replica_spec(self._source_of().element_spec(), local, total)

    @property
    def cardinality(self) -> Cardinality:
        """The number of global batches (``INFINITE_CARDINALITY`` = -1 when the dataset
        repeats forever, ``UNKNOWN_CARDINALITY`` = -2 when it cannot be known without
        reading it). A property as in TensorFlow 2.21; calling it also works."""
        return Cardinality(self._source_of().cardinality())

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Folds ``reduce_func(state, element)`` over every distributed element."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def __repr__(self) -> str:
        return f"DistributedDataset(num_replicas={self._strategy.num_replicas_in_sync})"


# ---- distribute_datasets_from_function -----------------------------------------------------------


class _FromFunctionIterator(DistributedIterator):
    """Replica r of each step takes the r-th of N consecutive elements of one dataset
    (PER_WORKER), or the next element of its own dataset (PER_REPLICA, ``iterators``).
    A last round that does not reach every replica gives the others empty batches."""

    def __init__(
        self,
        strategy: Any,
        iterator: Optional[Iterator[Any]],
        options: Any = None,
        iterators: Optional[List[Iterator[Any]]] = None,
        element_spec: Optional[Callable[[], Any]] = None,
    ) -> None:
        self._strategy = strategy
        # None with one iterator per replica (``iterators``); only read without them.
        self._iterator = iterator  # type: ignore[assignment]
        self._iterators = iterators
        self._n = strategy.num_replicas_in_sync
        self._places = _gpu_places(strategy, self._n, options)
        self._spec_fn = element_spec
        # Threads may share one iterator: each takes one step's elements, together.
        self._lock = renewed_after_fork(self)
        # The elements a step took before one failed: the next step's first ones (only
        # the failing element is skipped, never one that was read).
        self._held: List[Any] = []

    def __iter__(self) -> _FromFunctionIterator:
        return self

    def _take(self) -> List[Any]:
        got, self._held = self._held, []
        try:
            if self._iterators is None:
                while len(got) < self._n:
                    got.append(next(self._iterator))
            else:
                for it in self._iterators[len(got) :]:
                    got.append(next(it, _MISSING))
        except StopIteration:
            pass
        except BaseException:
            self._held = got
            raise
        if self._iterators is None:
            return got
        present = [g for g in got if g is not _MISSING]
        if not present:
            return []
        if len(present) < len(got):
            # Replicas whose dataset has ended get empty batches until every one has.
            got = [self._filler(present[0], len(present)) if g is _MISSING else g for g in got]
        return got

    def _filler(self, template: Any, present: int) -> Any:
        """An empty batch like ``template`` for a replica without an element in a last
        round; ValueError (never elements dropped without a word) when an element has
        no batch axis to make one of."""
        filler = _empty_like(template)
        if filler is None:
            raise ValueError(
                f"distribute_datasets_from_function: the last step has elements for {present} of {self._n} "
                "replicas, and they have a component without a batch axis, so the others cannot get empty "
                "batches; batch the dataset (dataset.batch(input_context.get_per_replica_batch_size(global_size))) "
                f"or give it a multiple of {self._n} elements"
            )
        return filler

    def __next__(self) -> Any:
        refuse_in_run()
        with self._lock:
            raw = self._take()
        if not raw:
            raise StopIteration
        on_gpu = self._places is not None
        values: List[Any] = []
        for element in raw:
            structured = nest.is_nested(element)
            leaves = [_leaf(x, on_gpu) for x in (nest.flatten(element) if structured else [element])]
            values.append(nest.pack_sequence_as(element, leaves) if structured else leaves[0])
        if len(values) < self._n:
            # A last partial round: the replicas without an element get empty batches.
            filler = self._filler(values[0], len(values))
            values.extend(filler for _ in range(self._n - len(values)))
        if self._places is not None:
            values = [place_element(v, p, r) for r, (v, p) in enumerate(zip(values, self._places))]
        # Every replica's element wrapped, even when one object stands for all (a
        # generator that yields one constant batch): a step gets one part per replica.
        return regroup(values, what="distribute_datasets_from_function", always_wrap=self._n > 1)


_MISSING = object()


def _empty_like(template: Any) -> Any:
    """An element like ``template`` with no rows (None when a leaf has no batch axis)."""
    leaves = nest.flatten(template) if nest.is_nested(template) else [template]
    leaves = [to_numpy(a) for a in leaves]
    if any(a.ndim == 0 for a in leaves):
        return None
    empty = [np.empty((0,) + tuple(a.shape[1:]), dtype=a.dtype) for a in leaves]
    return nest.pack_sequence_as(template, empty) if nest.is_nested(template) else empty[0]


class DistributedDatasetsFromFunction(DistributedDataset):
    """What ``distribute_datasets_from_function`` returns: replica r of each step takes
    the r-th of N consecutive elements of the dataset built by ``dataset_fn``; with
    ``InputOptions(experimental_replication_mode=PER_REPLICA)`` ``dataset_fn`` is called
    once per replica and each replica reads its own dataset."""

    def __init__(self, strategy: Any, dataset_fn: Callable[[InputContext], Any], options: Any = None) -> None:
        what = "distribute_datasets_from_function"
        mode = check_options(options, what, per_replica_allowed=True)
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        self._strategy = strategy
        self._options = options
        n = strategy.num_replicas_in_sync
        result = f"{what} (the dataset_fn result)"
        if mode is InputReplicationMode.PER_REPLICA:
            self._datasets: Optional[List[Any]] = [
                _iterable(dataset_fn(InputContext(n, r, n)), result) for r in range(n)
            ]
            self._dataset = self._datasets[0]
        else:
            self._datasets = None
            self._dataset = _iterable(dataset_fn(InputContext(1, 0, n)), result)

    def __iter__(self) -> _FromFunctionIterator:
        datasets = getattr(self, "_datasets", None)
        options = getattr(self, "_options", None)
        spec = lambda: self.element_spec  # noqa: E731
        if datasets is not None:
            return _FromFunctionIterator(self._strategy, None, options, [iter(d) for d in datasets], element_spec=spec)
        return _FromFunctionIterator(self._strategy, iter(self._dataset), options, element_spec=spec)

    @property
    def element_spec(self) -> Any:
        """The spec of each step's elements: every replica gets one whole element of its
        dataset, so the dataset's spec, as a PerReplicaSpec per leaf (a plain TensorSpec
        for one replica)."""
        n = getattr(self, "_count", self._strategy.num_replicas_in_sync)
        spec = _Source(self._dataset).element_spec() if not _one_shot(self._dataset) else None
        return _per_replica_spec(spec, n, None)

    @property
    def cardinality(self) -> Cardinality:
        """The number of steps: the dataset's elements over the replicas (rounded up)
        with one pipeline, the longest replica's dataset with PER_REPLICA; -1 / -2 for
        infinite / unknown. A property as in TensorFlow 2.21; calling it also works."""
        datasets = getattr(self, "_datasets", None)
        if datasets is not None:
            cards = [_Source(d).cardinality() for d in datasets]
            if any(c == UNKNOWN_CARDINALITY for c in cards):
                return Cardinality(UNKNOWN_CARDINALITY)
            if any(c == INFINITE_CARDINALITY for c in cards):
                return Cardinality(INFINITE_CARDINALITY)
            return Cardinality(max(cards))
        card = _Source(self._dataset).cardinality()
        n = getattr(self, "_count", self._strategy.num_replicas_in_sync)
        return Cardinality(card if card < 0 else -(-card // n))

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def __repr__(self) -> str:
        return f"DistributedDatasetsFromFunction(num_replicas={self._strategy.num_replicas_in_sync})"


def _one_shot(dataset: Any) -> bool:
    # Peeking at a one-shot iterator would lose an element of the one pass it has.
    try:
        return iter(dataset) is dataset and getattr(dataset, "element_spec", None) is None
    except TypeError:
        return True
