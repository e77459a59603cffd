"""Distributed input over several workers.

``experimental_distribute_dataset``: every worker iterates the same dataset (so it must
give the same batches in the same order everywhere: seed any shuffle). A global batch
of B elements is split over the global replica list by the single-process rule (the
first B mod N replicas get ceil(B/N) elements, the others floor(B/N)); each worker keeps
the rows of its own replicas and splits them among them. Since the sizes never grow
along the replica list, splitting a worker's rows by that rule again gives exactly its
replicas' shares, so the single-process iterator does the local split.

``distribute_datasets_from_function``: each worker calls ``dataset_fn`` with
``InputContext(num_input_pipelines=num_workers, input_pipeline_id=rank,
num_replicas_in_sync=total)`` and hands consecutive elements of its dataset to its
own replicas; every worker must then produce the same number of steps.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from . import nest
from .input import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
    InputContext,
    _FromFunctionIterator,
    _iterable,
    split_batch_sizes,
    to_numpy,
)
from .values import DistributedValues, PerReplica

__all__ = ["WorkerDatasetsFromFunction", "WorkerDistributedDataset", "worker_rows", "wrap_single"]


class _LocalReplicas:
    """What the single-process iterators read from a strategy: the replica count they
    split over (this worker's)."""

    __slots__ = ("num_replicas_in_sync",)

    def __init__(self, n: int) -> None:
        self.num_replicas_in_sync = n


def worker_rows(batch: int, total: int, offset: int, count: int) -> slice:
    """The rows of a global batch of ``batch`` elements that belong to replicas
    ``offset`` .. ``offset + count - 1`` of ``total``."""
    sizes = split_batch_sizes(batch, total)
    start = sum(sizes[:offset])
    return slice(start, start + sum(sizes[offset : offset + count]))


def _shard(iterator: Iterator[Any], total: int, offset: int, count: int) -> Iterator[Any]:
    """This worker's rows of every element; elements the local split rejects (unbatched,
    components of different batch sizes) pass through whole, so it reports them. (The
    builtin map: an element that fails in the dataset leaves the iterator usable.)"""

    def rows_of(element: Any) -> Any:
        structured = nest.is_nested(element)
        leaves = [to_numpy(x) for x in (nest.flatten(element) if structured else [element])]
        if not leaves or any(a.ndim == 0 for a in leaves) or any(a.shape[0] != leaves[0].shape[0] for a in leaves):
            return element
        rows = worker_rows(leaves[0].shape[0], total, offset, count)
        parts = [a[rows] for a in leaves]
        return nest.pack_sequence_as(element, parts) if structured else parts[0]

    return map(rows_of, iterator)


def wrap_single(value: Any) -> Any:
    """``value`` (one replica's) with its leaves as PerReplica values of one part: a
    worker with one replica among workers with several hands out distributed values
    like them, so that every worker treats them alike."""

    def one(x: Any) -> Any:
        return x if isinstance(x, DistributedValues) else PerReplica((x,))

    return nest.map_structure(one, value) if nest.is_nested(value) else one(value)


class _WrappingIterator(DistributedIterator):
    def __next__(self) -> Any:
        return wrap_single(super().__next__())


class _WrappingFromFunctionIterator(_FromFunctionIterator):
    def __next__(self) -> Any:
        return wrap_single(super().__next__())


class WorkerDistributedDataset(DistributedDataset):
    """What ``MultiWorkerMirroredStrategy.experimental_distribute_dataset`` returns:
    iterate it for PerReplica batches of this worker's replicas."""

    def __init__(self, strategy: Any, dataset: Any, options: Any = None) -> None:
        super().__init__(strategy, dataset, options)
        ext = strategy.extended
        self._total = strategy.num_replicas_in_sync
        self._offset = ext._offset
        self._count = ext._n

    def __iter__(self) -> DistributedIterator:
        rows = _shard(iter(self._dataset), self._total, self._offset, self._count)
        if self._strategy.extended._wrap_results:
            return _WrappingIterator(_LocalReplicas(self._count), rows)
        return DistributedIterator(_LocalReplicas(self._count), rows)


class WorkerDatasetsFromFunction(DistributedDatasetsFromFunction):
    """What ``MultiWorkerMirroredStrategy.distribute_datasets_from_function`` returns."""

    def __init__(self, strategy: Any, dataset_fn: Callable[[InputContext], Any], options: Any = None) -> None:
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        from .input_options import check_options

        check_options(options, "distribute_datasets_from_function")
        ext = strategy.extended
        self._strategy = strategy
        self._count = ext._n
        ctx = InputContext(ext._num_workers, ext._rank, strategy.num_replicas_in_sync)
        self._dataset = _iterable(dataset_fn(ctx), "distribute_datasets_from_function (the dataset_fn result)")

    def __iter__(self) -> _FromFunctionIterator:
        if self._strategy.extended._wrap_results:
            return _WrappingFromFunctionIterator(_LocalReplicas(self._count), iter(self._dataset))
        return _FromFunctionIterator(_LocalReplicas(self._count), iter(self._dataset))
