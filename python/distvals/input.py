"""Distributed input: global batches split over the replicas.

``strategy.experimental_distribute_dataset(dataset)`` splits each global batch of B
elements along axis 0: the first B mod N replicas get ceil(B/N) elements, the others
floor(B/N); a replica left with nothing gets an empty batch with the right trailing
shape and dtype. The parts are views of the batch, not copies.

The dataset may be a ``distvals.data.Dataset``, any iterable of batches (lists,
generators), a ``tf.data.Dataset`` or a torch ``DataLoader``; their leaves are turned
into numpy arrays without a copy where possible, and neither library is imported.

GPU replicas get their part of each batch in their GPU's memory: every per-replica
part is copied host-to-device onto that replica's GPU (a ``DeviceArray``). Leaves that
are already device arrays (cupy, torch CUDA tensors) are split on the GPU and only
copied when they live on another GPU than the replica's; leaves of dtypes a GPU cannot
hold (bool, strings, ...) stay on the host.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional

import numpy as np

from . import devices, nest
from .values import regroup

__all__ = [
    "InputContext",
    "ValueContext",
    "InputOptions",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "split_batch_sizes",
    "place_element",
]


def _check_count(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


class InputContext:
    """What ``dataset_fn`` of ``distribute_datasets_from_function`` is told: how many
    input pipelines there are, which one this is, and how many replicas consume them."""

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1) -> None:
        self._num_input_pipelines = _check_count(num_input_pipelines, "num_input_pipelines", 1)
        self._input_pipeline_id = _check_count(input_pipeline_id, "input_pipeline_id", 0)
        self._num_replicas_in_sync = _check_count(num_replicas_in_sync, "num_replicas_in_sync", 1)
        if self._input_pipeline_id >= self._num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id {input_pipeline_id} is out of range for {num_input_pipelines} input pipelines"
            )

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size`` // ``num_replicas_in_sync``; ValueError when it does not divide."""
        global_batch_size = _check_count(global_batch_size, "global_batch_size", 0)
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(
                f"the global batch size {global_batch_size} is not divisible by the "
                f"{self._num_replicas_in_sync} replicas in sync"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
                f"input_pipeline_id={self._input_pipeline_id}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")


class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` is told."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self._replica_id = _check_count(replica_id_in_sync_group, "replica_id_in_sync_group", 0)
        self._num_replicas = _check_count(num_replicas_in_sync, "num_replicas_in_sync", 1)
        if self._replica_id >= self._num_replicas:
            raise ValueError(
                f"replica_id_in_sync_group {replica_id_in_sync_group} is out of range for "
                f"{num_replicas_in_sync} replicas"
            )

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self._num_replicas})")


class InputOptions:
    """Options of distributed datasets, as ``tf.distribute.InputOptions``.

    ``experimental_fetch_to_device``: None or True (the default) copies GPU replicas'
    batches to their GPUs; False keeps them in host memory. The other options are
    accepted for compatibility and change nothing."""

    def __init__(self, experimental_fetch_to_device: Optional[bool] = None,
                 experimental_replication_mode: Any = None, experimental_place_dataset_on_device: bool = False,
                 experimental_per_replica_buffer_size: int = 1) -> None:
        self.experimental_fetch_to_device = experimental_fetch_to_device
        self.experimental_replication_mode = experimental_replication_mode
        self.experimental_place_dataset_on_device = experimental_place_dataset_on_device
        self.experimental_per_replica_buffer_size = experimental_per_replica_buffer_size

    def __repr__(self) -> str:
        return "InputOptions()"


def _check_options(options: Any) -> None:
    if options is not None and not isinstance(options, InputOptions) and type(options).__name__ != "InputOptions":
        raise TypeError(f"options must be an InputOptions, got {type(options).__name__}")


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
    if devices.is_device_array(x):
        return devices.to_host(x)
    if hasattr(x, "__dlpack__") and not isinstance(x, np.generic):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError):
            pass
    numpy_fn = getattr(x, "numpy", None)
    if callable(numpy_fn):
        try:
            return np.asarray(numpy_fn())
        except Exception:  # noqa: BLE001 - e.g. a torch tensor that requires grad
            detach = getattr(x, "detach", None)
            if callable(detach):
                return np.asarray(detach().cpu().numpy())
            raise
    return np.asarray(x)


def _leaf(x: Any, on_gpu: bool) -> Any:
    """A leaf as an array: device arrays stay on their GPU for GPU replicas."""
    if on_gpu and devices.is_device_array(x):
        return devices.as_value(x)
    return to_numpy(x)


def _rows(a: Any, start: int, stop: int) -> Any:
    return a[start:stop] if isinstance(a, np.ndarray) else devices.slice_rows(a, start, stop)


def place_element(element: Any, place: Optional[int]) -> Any:
    """``element`` (nested allowed) with its array leaves on ``place`` (a CUDA device, or
    None for the host). A device leaf already there is kept as it is; leaves that are not
    arrays (Python numbers, strings) and arrays of dtypes a GPU cannot hold are kept."""
    if place is None:
        return element

    def one(x: Any) -> Any:
        if devices.is_device_array(x):
            return x if devices.place_of(x) == place else devices.to_replica_device(x, place)
        if isinstance(x, (np.ndarray, np.generic)) and devices.can_place(x.dtype):
            return devices.to_replica_device(x, place)
        return x

    if nest.is_nested(element):
        return nest.pack_sequence_as(element, [one(x) for x in nest.flatten(element)])
    return one(element)


def _gpu_places(strategy: Any, n: int, options: Any = None) -> Optional[tuple]:
    """Each replica's CUDA device when the strategy runs GPU replicas (and ``options`` do
    not say ``experimental_fetch_to_device=False``), else None."""
    if options is not None and getattr(options, "experimental_fetch_to_device", None) is False:
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


class DistributedIterator:
    """Iterator over a distributed dataset: each ``next`` gives one global batch as
    PerReplica values (nested like the dataset's elements)."""

    def __init__(self, strategy: Any, iterator: Iterator[Any], options: Any = None) -> None:
        self._strategy = strategy
        self._iterator = iterator
        self._n = strategy.num_replicas_in_sync
        self._places = _gpu_places(strategy, self._n, options)

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        element = next(self._iterator)
        n = self._n
        structured = nest.is_nested(element)
        on_gpu = self._places is not None
        leaves = [_leaf(x, on_gpu) for x in (nest.flatten(element) if structured else [element])]
        if not leaves:
            raise ValueError("experimental_distribute_dataset: an element has no components")
        for a in leaves:
            if a.ndim == 0:
                raise ValueError(
                    "experimental_distribute_dataset needs batched data, but an element has shape (); "
                    "batch the dataset first, e.g. dataset.batch(global_batch_size)"
                )
        batch = leaves[0].shape[0]
        for i, a in enumerate(leaves):
            if a.shape[0] != batch:
                raise ValueError(
                    f"experimental_distribute_dataset: the components of a batch have different batch "
                    f"sizes: component 0 has {batch}, component {i} has {a.shape[0]}"
                )
        sizes = split_batch_sizes(batch, n)
        per_replica = []
        start = 0
        for size in sizes:
            parts = [_rows(a, start, start + size) for a in leaves]
            per_replica.append(nest.pack_sequence_as(element, parts) if structured else parts[0])
            start += size
        if on_gpu:
            per_replica = [place_element(e, p) for e, p in zip(per_replica, self._places)]
        return regroup(per_replica, what="experimental_distribute_dataset")

    def get_next(self) -> Any:
        """The next global batch (StopIteration at the end)."""
        return self.__next__()

    def __repr__(self) -> str:
        return f"DistributedIterator(num_replicas={self._n})"


class DistributedDataset:
    """What ``experimental_distribute_dataset`` returns: iterate it for PerReplica
    batches. Each ``iter`` starts a new pass over the dataset (a generator can be
    passed over once only)."""

    def __init__(self, strategy: Any, dataset: Any, options: Any = None) -> None:
        _check_options(options)
        self._strategy = strategy
        self._options = options
        self._dataset = _iterable(dataset, "experimental_distribute_dataset")
        if getattr(dataset, "_batched", True) is False:
            raise ValueError(
                "experimental_distribute_dataset needs a batched dataset: call "
                "dataset.batch(global_batch_size) before distributing it"
            )

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._strategy, iter(self._dataset), self._options)

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Folds ``reduce_func(state, element)`` over every distributed element."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def __repr__(self) -> str:
        return f"DistributedDataset(num_replicas={self._strategy.num_replicas_in_sync})"


class _FromFunctionIterator:
    def __init__(self, strategy: Any, iterator: Iterator[Any], options: Any = None) -> None:
        self._iterator = iterator
        self._n = strategy.num_replicas_in_sync
        self._places = _gpu_places(strategy, self._n, options)

    def __iter__(self) -> "_FromFunctionIterator":
        return self

    def __next__(self) -> Any:
        values: List[Any] = []
        for _ in range(self._n):
            try:
                element = next(self._iterator)
            except StopIteration:
                break
            structured = nest.is_nested(element)
            on_gpu = self._places is not None
            leaves = [_leaf(x, on_gpu) for x in (nest.flatten(element) if structured else [element])]
            values.append(nest.pack_sequence_as(element, leaves) if structured else leaves[0])
        if not values:
            raise StopIteration
        if len(values) < self._n:
            # A last partial round: the replicas without an element get empty batches.
            template = values[0]
            leaves = nest.flatten(template) if nest.is_nested(template) else [template]
            if any(a.ndim == 0 for a in leaves):
                raise StopIteration
            empty = [np.empty((0,) + tuple(a.shape[1:]), dtype=a.dtype) for a in leaves]
            filler = nest.pack_sequence_as(template, empty) if nest.is_nested(template) else empty[0]
            values.extend(filler for _ in range(self._n - len(values)))
        if self._places is not None:
            values = [place_element(v, p) for v, p in zip(values, self._places)]
        return regroup(values, what="distribute_datasets_from_function")

    def get_next(self) -> Any:
        return self.__next__()


class DistributedDatasetsFromFunction:
    """What ``distribute_datasets_from_function`` returns: replica r of each step takes
    the r-th of N consecutive elements of the dataset built by ``dataset_fn``."""

    def __init__(self, strategy: Any, dataset_fn: Callable[[InputContext], Any], options: Any = None) -> None:
        _check_options(options)
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        self._strategy = strategy
        self._options = options
        ctx = InputContext(1, 0, strategy.num_replicas_in_sync)
        self._dataset = _iterable(dataset_fn(ctx), "distribute_datasets_from_function (the dataset_fn result)")

    def __iter__(self) -> _FromFunctionIterator:
        return _FromFunctionIterator(self._strategy, iter(self._dataset), self._options)

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def __repr__(self) -> str:
        return f"DistributedDatasetsFromFunction(num_replicas={self._strategy.num_replicas_in_sync})"
