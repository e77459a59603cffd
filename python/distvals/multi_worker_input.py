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
own replicas.

A dataset's ``auto_shard_policy`` (``distvals.data.AutoShardPolicy``, set with
``with_options``; a tf.data dataset's too) can change the first: with ``OFF`` each
worker reads its own copy of the dataset (the whole of it, or the part it selected
itself), and the rows of its batches are re-batched as tf.data's rebatch does (piece
sizes cycling through the split of the global batch over ``num_replicas_in_sync``
replicas, each worker starting at its first replica's, so that each step takes one
global batch's rows across the workers); the worker's replicas take consecutive pieces,
as they take elements from ``dataset_fn``'s dataset (with equal replica counts a batch
lasts as many steps as there are workers). ``FILE`` (distvals' datasets read no files
to divide) and ``HINT`` are refused; ``AUTO`` and ``DATA`` are the rule above.

The workers agree on every element
----------------------------------
A worker that takes one more or one fewer element than the others would pair its
steps with theirs one off, and every collective after that would combine different
batches: wrong numbers with no error. So each ``next`` on a multi-worker iterator ends
with one small MPI all-reduce (MAX of fourteen int64s, on a communicator of its own, so
it never pairs with a collective) of what each worker got:

- its outcome: an element, the end of its data, or an exception;
- where it stands: which of the strategy's distributed datasets it iterates (numbered
  as they are made), which pass over it (numbered at their first ``next``), and how
  many ``next`` calls the pass has had (an element that raised counts, on every
  worker), and how the dataset is divided (split global batches, OFF's pieces, or
  ``dataset_fn``'s elements).

Each quantity goes as ``x`` and ``-x``, so the maximum gives both extremes. Then:

- positions that differ: ``MismatchError`` on every worker (the workers create
  iterators, or call ``next``, out of step); so is a dataset divided one way on some
  workers and another way on others (its options differ between them);
- an exception on some worker: it raises its own there, and every other worker raises
  ``AbortedError`` naming it; every worker has consumed that element, so a loop that
  catches the error and goes on stays in step (with ``distribute_datasets_from_function``,
  where each worker reads its own data, the other workers' elements of that step are
  their next step's instead, and a failing worker's replicas that had read theirs keep
  them too: only the element that raised is skipped);
- after an exception, with ``experimental_distribute_dataset``: a pipeline that failed on
  one worker only may have dropped elements that the others kept (an element that fails
  before a batch which is not right after its map fails at once, dropping the batch's
  elements taken so far; before a shuffle it leaves the buffer one element apart), so
  their global batches would no longer be the same ones, and each worker's rows would
  come from another batch. So for the rest of the pass every worker also sends a
  fingerprint (CRC-32 and Adler-32) of the whole global batch it read, and batches that
  differ are a ``MismatchError`` on every worker, from then on (make a new iterator).
  Workers whose datasets do not give the same elements (unseeded random operations) get
  it too: their global batches were never the same ones.
- every worker at its end: ``StopIteration`` everywhere;
- some workers at their end, others not (uneven data, as in TensorFlow): the workers
  whose data has ended give their replicas empty batches (no rows, the trailing shape
  and dtype of their earlier batches) until every worker's has; when one of them cannot
  (it had no element, or its elements have no batch axis), every worker raises.

It costs one small all-reduce per element (a few microseconds), against a step. The
exchanges of one worker go one at a time, so threads may read different iterators, but
then they must take their turns in the same order on every worker (or the workers get a
``MismatchError``), as TensorFlow's collectives need.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, List, Optional

import numpy as np

from . import devices, nest
from ._core import AbortedError, MismatchError
from .data_options import AutoShardPolicy
from .fingerprint import fingerprint
from .input import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Cardinality,
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
    InputContext,
    _FromFunctionIterator,
    _iterable,
    _per_replica_spec,
    _Source,
    refuse_in_run,
    split_batch_sizes,
    to_numpy,
)
from .mpi_runtime import poll
from .values import DistributedValues, PerReplica

__all__ = ["WorkerDatasetsFromFunction", "WorkerDistributedDataset", "worker_rows", "wrap_single"]


class _LocalReplicas:
    """What the single-process iterators read from a strategy: the replica count they
    split over (this worker's), and the extended object that says where this worker's
    replicas are (their GPUs)."""

    __slots__ = ("extended", "num_replicas_in_sync")

    def __init__(self, ext: Any) -> None:
        self.num_replicas_in_sync = ext._n
        self.extended = ext


def worker_rows(batch: int, total: int, offset: int, count: int) -> slice:
    """The rows of a global batch of ``batch`` elements that belong to replicas
    ``offset`` .. ``offset + count - 1`` of ``total``."""
    sizes = split_batch_sizes(batch, total)
    start = sum(sizes[:offset])
    return slice(start, start + sum(sizes[offset : offset + count]))


class _Fingerprint:
    """Whether the global batches are to be fingerprinted (after an input error), and
    the fingerprint of the last one read (0: none)."""

    __slots__ = ("on", "since", "value")

    def __init__(self) -> None:
        self.on = False
        self.value = 0
        self.since = (0, 0)  # the worker and element of the error that turned it on


def _shard(
    iterator: Iterator[Any], total: int, offset: int, count: int, check: Optional[_Fingerprint] = None
) -> Iterator[Any]:
    """This worker's rows of every element; elements the local split rejects (unbatched,
    components of different batch sizes) pass through whole, so it reports them. (The
    builtin map: an element that fails in the dataset leaves the iterator usable.) When
    ``check.on``, the whole element's fingerprint goes to ``check.value`` first."""

    def rows_of(element: Any) -> Any:
        structured = nest.is_nested(element)
        leaves = [to_numpy(x) for x in (nest.flatten(element) if structured else [element])]
        if check is not None and check.on:
            try:
                check.value = fingerprint(leaves) or 1
            except TypeError as e:
                raise TypeError(
                    f"after an input error the workers compare each global batch by a fingerprint of its values: {e}; "
                    "make a new iterator, or give plain arrays, numbers, strings or containers of them"
                ) from None
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


# How a worker's iterator divides its dataset (compared between workers on every next).
_SPLIT, _PIECES, _FROM_FUNCTION = 1, 2, 3
_DIVISIONS = {
    _SPLIT: "each global batch split over every worker's replicas (auto_shard_policy AUTO or DATA)",
    _PIECES: "its own copy of the dataset, cut into pieces (auto_shard_policy OFF)",
    _FROM_FUNCTION: "the elements of dataset_fn's dataset (distribute_datasets_from_function)",
}


def shard_policy(dataset: Any) -> AutoShardPolicy:
    """The ``auto_shard_policy`` of ``dataset``'s options (a distvals or tf.data dataset;
    the two number the policies alike); AUTO for anything without them."""
    options = getattr(dataset, "options", None)
    if not callable(options):
        return AutoShardPolicy.AUTO
    try:
        return AutoShardPolicy(int(options().experimental_distribute.auto_shard_policy))
    except (AttributeError, TypeError, ValueError):
        return AutoShardPolicy.AUTO


class _Pieces:
    """A worker's own dataset (auto_shard_policy OFF) re-batched for its replicas, as
    tf.data's rebatch does it: the rows of its batches, in order, cut into pieces whose
    sizes cycle through the single-process split of the first batch's size B over the
    ``total`` replicas, started at this worker's first replica (``offset``), so that at
    every step the workers' replicas together take the B rows of one global batch. The
    rows left at the end are one last, shorter piece. An exception from the dataset
    passes through and leaves this usable (rows read before it stay)."""

    def __init__(self, source: Iterator[Any], total: int, offset: int) -> None:
        self._source = source
        self._total = total
        self._offset = offset
        self._sizes: Optional[List[int]] = None  # the cycle, from the first batch
        self._at = 0  # the next piece's place in it
        self._template: Any = None  # the last element read (its structure)
        self._rows: Optional[List[Any]] = None  # its leaves' rows not yet handed out

    def __iter__(self) -> _Pieces:
        return self

    def __next__(self) -> Any:
        while True:
            if self._sizes is not None and self._rows is not None:
                size = self._sizes[self._at]
                if self._rows[0].shape[0] >= size:
                    self._at = (self._at + 1) % len(self._sizes)
                    return self._take(size)
            try:
                element = next(self._source)
            except StopIteration:
                if self._rows is not None and self._rows[0].shape[0] > 0:
                    return self._take(self._rows[0].shape[0])  # the last rows, a shorter piece
                raise
            leaves = self._leaves(element)
            if self._sizes is None:
                sizes = split_batch_sizes(leaves[0].shape[0], self._total)
                k = self._offset % self._total
                self._sizes = sizes[k:] + sizes[:k]
            if self._rows is not None and self._rows[0].shape[0] > 0:
                # Batches of another size than the first: pieces go across them.
                leaves = [np.concatenate([a, b]) for a, b in zip(self._rows, leaves)]
            self._template, self._rows = element, leaves

    def _take(self, size: int) -> Any:
        rows = self._rows
        assert rows is not None
        piece = [a[:size] for a in rows]
        self._rows = [a[size:] for a in rows]
        template = self._template
        return nest.pack_sequence_as(template, piece) if nest.is_nested(template) else piece[0]

    def _leaves(self, element: Any) -> List[Any]:
        leaves = [to_numpy(x) for x in (nest.flatten(element) if nest.is_nested(element) else [element])]
        if not leaves or any(a.ndim == 0 for a in leaves):
            raise ValueError(
                "distributed input with auto_shard_policy OFF: the rows of a worker's batches are re-batched for "
                "its replicas, and this element has a component without a batch axis (batch the dataset)"
            )
        sizes = {a.shape[0] for a in leaves}
        if len(sizes) > 1:
            raise ValueError(
                "distributed input with auto_shard_policy OFF: the components of an element have different "
                f"batch sizes {sorted(sizes)}, so its rows cannot be re-batched for the replicas"
            )
        return leaves


# What a worker got from its iterator (see the module doc); the larger code wins.
_VALUE, _END, _ERROR = 0, 1, 2


def _empty_of(value: Any) -> Any:
    """``value`` (a distributed element: PerReplica leaves, or plain arrays for one
    replica) with no rows in any part; ``_NO_ROWS`` when a leaf has no batch axis."""

    def rows0(a: Any) -> Any:
        if isinstance(a, np.ndarray) or devices.is_device_array(a):
            if len(getattr(a, "shape", ())) == 0:
                raise _NoRows
            # A new empty array on the host (a view would keep the whole batch alive).
            return np.empty((0,) + a.shape[1:], a.dtype) if isinstance(a, np.ndarray) else devices.slice_rows(a, 0, 0)
        raise _NoRows

    def one(x: Any) -> Any:
        if isinstance(x, DistributedValues):
            return PerReplica(tuple(rows0(v) for v in x.values))
        return rows0(x)

    try:
        return nest.map_structure(one, value) if nest.is_nested(value) else one(value)
    except _NoRows:
        return _NO_ROWS


class _NoRows(Exception):
    pass


_NO_ROWS = object()


class _AgreedNext:
    """The ``next`` of a multi-worker iterator: this worker's element, once every worker
    has said what it got (see the module doc)."""

    _ext: Any
    _dataset: Any
    _pass: int
    _calls: int
    _wrap: bool
    _template: Any
    _agree_lock: threading.Lock
    # Whether a step's elements that another worker's failure released are this worker's
    # next step's (each worker reads its own data: nothing of it may be lost), or skipped
    # with the failed element (every worker reads the same global batches).
    _hold_released = False
    _released: Any = None
    # Every worker reads the same global batches: after an input error they are
    # fingerprinted and compared (see the module doc); the error that ended the pass.
    _check: Optional[_Fingerprint] = None
    _diverged: Optional[str] = None
    # How the dataset is divided between the workers (compared on every next).
    _division = _SPLIT

    def _setup(self, ext: Any, dataset: Any) -> None:
        self._ext = ext
        self._dataset = dataset  # its serial and its count of passes say where this iterator is
        self._pass = 0  # numbered at its first next: an iterator never advanced counts for nothing
        self._calls = 0
        self._wrap = bool(ext._wrap_results)
        self._template = None  # _NO_ROWS once known that an element has a leaf without rows
        # Threads that share the iterator: one element (and its agreement) at a time.
        self._agree_lock = threading.Lock()

    def __next__(self) -> Any:
        refuse_in_run()
        with self._agree_lock:
            return self._agreed_next()

    def _agreed_next(self) -> Any:
        ext = self._ext
        if self._diverged is not None:
            # Every worker found the batches different at once, and raises from now on.
            raise MismatchError(self._diverged)
        check = self._check
        if check is not None:
            check.value = 0
        if not self._pass:
            self._dataset._passes += 1
            self._pass = self._dataset._passes
        self._calls += 1
        error: Optional[BaseException] = None
        value: Any = None
        try:
            if self._released is not None:
                value, self._released = self._released, None
            else:
                value = super().__next__()  # type: ignore[misc]
            status = _VALUE
        except StopIteration:
            status = _END
        except Exception as e:  # noqa: BLE001 - every worker hears of it, then it is raised
            status, error = _ERROR, e
        raw = value
        if status == _VALUE:
            if self._wrap:
                value = wrap_single(value)
            if self._template is None:
                self._template = _empty_of(value)
        if ext._num_workers == 1:
            if error is not None:
                raise error
            if status == _END:
                raise StopIteration
            return value
        # Why this worker could not make empty batches, should it need to: 1, it has had
        # no element; 2, an element has a leaf without a batch axis.
        cannot_fill = 0
        if status == _END:
            cannot_fill = 1 if self._template is None else 2 if self._template is _NO_ROWS else 0
        where = (self._dataset._serial, self._pass, self._calls)
        buf = np.array(
            [status, -status, where[0], -where[0], where[1], -where[1], where[2], -where[2], -1, cannot_fill, 0, 0]
            + [self._division, -self._division],
            dtype=np.int64,
        )
        if check is not None and check.on and status == _VALUE:
            buf[10], buf[11] = check.value, -check.value
        if status == _ERROR:
            buf[8] = ext._rank
        got = self._exchange(buf)
        top, low = int(got[0]), -int(got[1])
        prefix = f"worker {ext._rank}: distributed input"
        if any(got[k] != -got[k + 1] for k in (2, 4, 6)):
            raise MismatchError(
                f"{prefix}: the workers' iterators are out of step (distributed dataset {-got[3]} to {got[2]} "
                f"of the strategy, pass {-got[5]} to {got[4]} over it, element {-got[7]} to {got[6]} of the pass; "
                f"this worker: dataset {where[0]}, pass {where[1]}, element {where[2]}); every worker must make "
                "the same distributed datasets, iterate them in the same order and call next on them the same "
                "number of times (threads that read different iterators must take their turns in the same "
                "order on every worker)"
            ) from error
        if got[12] != -got[13]:
            raise MismatchError(
                f"{prefix}: the workers divide this distributed dataset differently (this worker: "
                f"{_DIVISIONS[self._division]}; another: {_DIVISIONS[int(got[12] if got[12] != self._division else -got[13])]}"
                "); give the dataset the same options (auto_shard_policy) on every worker"
            ) from error
        if top == _ERROR:
            if check is not None and not check.on:
                check.on, check.since = True, (int(got[8]), self._calls)
            if error is not None:
                raise error
            held = self._hold_released and status == _VALUE
            if held:
                self._released = raw
            raise AbortedError(
                f"{prefix}: released from element {self._calls} because worker {int(got[8])}'s input raised an "
                "error there (see that worker's output); "
                + (
                    "this worker's elements of that step come in its next one"
                    if held
                    else "every worker skipped that element"
                )
            )
        if top == _END and low == _END:
            raise StopIteration
        if check is not None and check.on and (top != low or (top == _VALUE and got[10] != -got[11])):
            # (Or some workers' data has ended and others' has not: they read other batches.)
            worker, element = check.since
            self._diverged = (
                f"{prefix}: the workers' global batches differ at element {self._calls} of the pass, after "
                f"worker {worker}'s input raised an error at element {element}: a pipeline that failed on some "
                "workers dropped elements that the others kept (an element that fails before a batch which is "
                "not right after its map, or before a shuffle), or the dataset does not give the same elements "
                "on every worker (seed its random operations); each worker's rows would come from another "
                "batch, so this iterator raises from now on: make a new one"
            )
            raise MismatchError(self._diverged)
        if top == _END and got[9]:
            # Some worker's data has ended while others' has not, and it cannot give its
            # replicas empty batches: every worker raises (none goes on to a step alone).
            raise ValueError(
                f"{prefix}: a worker's data ended while other workers' data goes on, and it cannot give its "
                "replicas empty batches until theirs ends: "
                + (
                    "its data gave no element at all (give every worker at least one batch)"
                    if got[9] == 1
                    else "its elements have a component without a batch axis (batch the dataset)"
                )
            )
        if status == _VALUE:
            return value
        # This worker's data has ended, another's has not: empty batches, as in TensorFlow.
        return self._template

    def _exchange(self, buf: np.ndarray) -> np.ndarray:
        """MAX of ``buf`` over every worker, on the input's communicator; past the
        strategy's timeout the job ends (an MPI collective cannot be cancelled)."""
        ext = self._ext
        out = np.empty_like(buf)
        timeout = float(ext._timeout)
        # One exchange at a time per worker: threads reading different iterators would
        # otherwise post collectives on one communicator at once (which MPI forbids).
        with ext._input_lock:
            deadline = time.monotonic() + timeout
            # An interrupted exchange pairs with the others' exchange of that next(): it
            # completes before this one starts, reading and writing its own buffers,
            # which are kept until then (mpi4py keeps none for a collective).
            pending = ext._input_pending
            done = pending is None or poll(pending[0], deadline)
            if done:
                ext._input_pending = None
                req = ext._input_comm.Iallreduce(buf, out, ext._mpi.MAX)
                try:
                    done = poll(req, deadline)
                except BaseException:
                    ext._input_pending = (req, buf, out)
                    raise
        if not done:
            ext._fatal(
                f"the next element of a distributed iterator waited {timeout:g} s for the other workers, "
                "which did not all ask for theirs (every worker must iterate the same distributed datasets)"
            )
        return out


def _number(dataset: Any, ext: Any) -> None:
    """Gives a distributed dataset its serial number among the strategy's (every worker
    makes them in the same order) and a count of the passes over it."""
    ext._input_datasets += 1
    dataset._serial = ext._input_datasets
    dataset._passes = 0


class _WorkerIterator(_AgreedNext, DistributedIterator):
    pass


class _WorkerFromFunctionIterator(_AgreedNext, _FromFunctionIterator):
    _hold_released = True
    _division = _FROM_FUNCTION


class WorkerDistributedDataset(DistributedDataset):
    """What ``MultiWorkerMirroredStrategy.experimental_distribute_dataset`` returns:
    iterate it for PerReplica batches of this worker's replicas."""

    def __init__(self, strategy: Any, dataset: Any, options: Any = None) -> None:
        super().__init__(strategy, dataset, options)
        ext = strategy.extended
        self._policy = shard_policy(dataset)
        if ext._num_workers > 1 and self._policy in (AutoShardPolicy.FILE, AutoShardPolicy.HINT):
            raise ValueError(
                f"experimental_distribute_dataset: auto_shard_policy {self._policy.name} is not supported: "
                + (
                    "the dataset reads no files to divide between the workers"
                    if self._policy is AutoShardPolicy.FILE
                    else "there is no SHARD_HINT to replace"
                )
                + "; use DATA (every worker reads the same data and keeps its share of each global batch), "
                "OFF (each worker reads its own), or distribute_datasets_from_function"
            )
        _number(self, ext)
        self._total = strategy.num_replicas_in_sync
        self._offset = ext._offset
        self._count = ext._n

    def __iter__(self) -> DistributedIterator:
        ext = self._strategy.extended
        if self._policy is AutoShardPolicy.OFF:
            # Each worker's own copy, in pieces that its replicas take in turn.
            pieces = _Pieces(self._source_of().iterator(), self._total, self._offset)
            off = _WorkerFromFunctionIterator(
                _LocalReplicas(ext), pieces, self._options, element_spec=lambda: self.element_spec
            )
            off._setup(ext, self)
            off._division = _PIECES
            return off
        # From the source: an element read ahead for element_spec comes first.
        check = _Fingerprint()
        rows = _shard(self._source_of().iterator(), self._total, self._offset, self._count, check)
        it = _WorkerIterator(_LocalReplicas(ext), rows, self._options, lambda: self.element_spec)
        it._setup(ext, self)
        it._check = check
        return it

    @property
    def element_spec(self) -> Any:
        """The spec of each distributed element on this worker: the dataset's, with the
        batch dimension divided over every worker's replicas (None unless every global
        batch divides evenly), as a PerReplicaSpec per leaf of this worker's replicas."""
        spec = self._source_of().element_spec()
        return _per_replica_spec(spec, self._count, self._total, self._strategy.extended._wrap_results)

    @property
    def cardinality(self) -> Cardinality:
        """The number of steps: the dataset's global batches; with auto_shard_policy OFF
        and several workers, ``UNKNOWN_CARDINALITY`` (each worker reads its own data, and
        the steps last until every worker's has ended)."""
        if self._policy is AutoShardPolicy.OFF and self._strategy.extended._num_workers > 1:
            return Cardinality(UNKNOWN_CARDINALITY)
        return super().cardinality


class WorkerDatasetsFromFunction(DistributedDatasetsFromFunction):
    """What ``MultiWorkerMirroredStrategy.distribute_datasets_from_function`` returns."""

    def __init__(self, strategy: Any, dataset_fn: Callable[[InputContext], Any], options: Any = None) -> None:
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        from .input_options import check_options

        check_options(options, "distribute_datasets_from_function")
        ext = strategy.extended
        _number(self, ext)
        self._strategy = strategy
        self._options = options
        self._datasets = None
        self._count = ext._n
        ctx = InputContext(ext._num_workers, ext._rank, strategy.num_replicas_in_sync)
        self._dataset = _iterable(dataset_fn(ctx), "distribute_datasets_from_function (the dataset_fn result)")
        self._source = _Source(self._dataset)

    def __iter__(self) -> _FromFunctionIterator:
        ext = self._strategy.extended
        it = _WorkerFromFunctionIterator(
            _LocalReplicas(ext), self._source.iterator(), self._options, element_spec=lambda: self.element_spec
        )
        it._setup(ext, self)
        return it

    @property
    def element_spec(self) -> Any:
        """The spec of each step's elements on this worker: the dataset's, as a
        PerReplicaSpec per leaf of this worker's replicas."""
        return _per_replica_spec(self._source.element_spec(), self._count, None, self._strategy.extended._wrap_results)

    @property
    def cardinality(self) -> Cardinality:
        """The number of steps. With several workers each reads its own dataset, and the
        steps last until every worker's has ended (a worker whose data ended first gives
        its replicas empty batches): ``UNKNOWN_CARDINALITY``, the same on every worker
        without asking the others (a property may be read on one worker only), unless
        this worker's dataset is infinite (then so are the steps). With one worker, this
        worker's steps."""
        card = super().cardinality
        if self._strategy.extended._num_workers > 1 and card != INFINITE_CARDINALITY:
            return Cardinality(UNKNOWN_CARDINALITY)
        return card
