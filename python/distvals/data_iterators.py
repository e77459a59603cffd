"""The iterators of ``distvals.data`` transformations. Each is an object whose state
survives an exception from the element it was computing (a generator would end), so that
after a failed element (a map function's exception) the next ``next()`` goes on with the
next element, as tf.data's iterators do."""

from __future__ import annotations

import contextvars
import threading
import typing
from typing import Any, Callable, Iterator, List

import numpy as np

from .data_elements import copy_element, flatten, is_structure, pack, stack
from .fork_locks import renewed_after_fork

# While a pass's iterators are made: whether its options keep tf.data's map-and-batch
# fusion (they are the pipeline's, set on any of its datasets, as in tf.data).
FUSE = contextvars.ContextVar("distvals_data_fuse", default=True)


class Shared:
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


class BatchIterator:
    """Batches of ``size`` elements stacked. An element that fails fails its batch, as in
    tf.data: right after a map (``whole``, tf.data's fused map-and-batch) once all the
    batch's elements are taken; otherwise at once, dropping the elements taken so far
    and starting the next batch after the failed one."""

    __slots__ = ("_combine", "_drop", "_size", "_source", "_whole")

    def __init__(
        self,
        source: Iterator[Any],
        size: int,
        drop_remainder: bool,
        whole: bool,
        combine: Callable[[List[Any]], Any] = stack,
    ) -> None:
        self._source = source
        self._size = size
        self._drop = drop_remainder
        self._whole = whole and FUSE.get()
        self._combine = combine  # how the batch's elements become one (padded_batch pads)

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
        return self._combine(chunk)


class ShuffleIterator:
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


class CountedIterator:
    """``source`` without its first ``skip`` elements, then at most ``take`` of them (-1:
    all). As in tf.data, a failed element counts as neither, and one that fails while
    the first elements are skipped starts the skipping over: the next ``next()`` skips
    ``skip`` elements after it (the ones skipped before it count as none)."""

    __slots__ = ("_count", "_skip", "_source", "_take")

    def __init__(self, source: Iterator[Any], take: int, skip: int) -> None:
        self._source = source
        self._take = take
        self._skip = self._count = skip

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while self._skip > 0:
            try:
                next(self._source)
            except StopIteration:
                raise
            except Exception:
                self._skip = self._count
                raise
            self._skip -= 1
        if self._take == 0:
            raise StopIteration
        x = next(self._source)
        if self._take > 0:
            self._take -= 1
        return x


class ShardIterator:
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


class FilterIterator:
    """The elements of ``source`` for which ``keep`` is true. An element whose predicate
    fails fails that ``next()``, and the next one goes on after it (as tf.data's).
    ``until``: the first element it rejects ends the pass (``take_while``)."""

    __slots__ = ("_done", "_keep", "_source", "_until")

    def __init__(self, source: Iterator[Any], keep: Callable[[Any], bool], until: bool = False) -> None:
        self._source = source
        self._keep = keep
        self._until = until
        self._done = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while not self._done:
            x = next(self._source)
            if self._keep(x):
                return x
            if self._until:
                self._done = True
        raise StopIteration


class ZipIterator:
    """One element of each source, packed by ``pack_one``, until a source ends (the ones
    after it are then not read). A failed element of one source fails the ``next()``;
    every other source still gives its element, which is dropped, so that the sources
    stay in step (as in tf.data)."""

    __slots__ = ("_done", "_pack", "_sources")

    def __init__(self, sources: List[Iterator[Any]], pack_one: Callable[[List[Any]], Any]) -> None:
        self._sources = sources
        self._pack = pack_one
        self._done = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        parts = []
        failed: typing.Optional[Exception] = None
        for it in self._sources:
            try:
                parts.append(next(it))
            except StopIteration:
                # This source has ended, and so has the zip: the sources after it are
                # not read (a failure among them never comes out).
                self._done = True
                break
            except Exception as e:  # noqa: BLE001 - raised once every source has moved on
                failed = failed or e
        if failed is not None:
            raise failed
        if self._done:
            raise StopIteration
        return self._pack(parts)


class ChainIterator:
    """The elements of each pass that ``passes`` makes, one pass after another
    (``concatenate``: two passes; ``flat_map``: one per element of its source;
    ``repeat``: the passes of one dataset, with ``stop_when_empty``: after a pass that
    had no element, nor a failed one, every later one would be empty too)."""

    __slots__ = ("_fuse", "_it", "_passes", "_seen", "_stop_when_empty")

    def __init__(self, passes: Iterator[Iterator[Any]], stop_when_empty: bool = False) -> None:
        self._passes = passes
        self._it: typing.Optional[Iterator[Any]] = None
        self._fuse = FUSE.get()  # later passes are made as the first
        self._stop_when_empty = stop_when_empty
        self._seen = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                token = FUSE.set(self._fuse)
                try:
                    self._it = next(self._passes)  # StopIteration: the last pass is done
                finally:
                    FUSE.reset(token)
                self._seen = False
            try:
                x = next(self._it)
            except StopIteration:
                self._it = None
                if self._stop_when_empty and not self._seen:
                    self._passes = iter(())
                continue
            except Exception:
                self._seen = True
                raise
            self._seen = True
            return x


class UnbatchIterator:
    """The rows of each element of ``source`` (every component's first axis, which must
    have one size across the components), each row a copy of its own."""

    __slots__ = ("_leaves", "_n", "_pos", "_source", "_template")

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._template: Any = None
        self._leaves: List[np.ndarray] = []
        self._pos = self._n = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while self._pos >= self._n:
            x = next(self._source)
            leaves = [np.asarray(a) for a in flatten(x)]
            for i, a in enumerate(leaves):
                if a.ndim == 0:
                    raise ValueError(f"unbatch: component {i} of an element is a scalar; every component needs an axis")
                if a.shape[0] != leaves[0].shape[0]:
                    raise ValueError(
                        f"unbatch: the components of an element must have the same batch size; component 0 "
                        f"has {leaves[0].shape[0]}, component {i} has {a.shape[0]}"
                    )
            self._template, self._leaves = x, leaves
            self._pos, self._n = 0, leaves[0].shape[0]
        i = self._pos
        self._pos += 1
        parts = [a[i, ...].copy() for a in self._leaves]
        if self._pos == self._n:
            self._leaves = []  # the element is done: do not keep it alive
        return pack(self._template, parts) if is_structure(self._template) else parts[0]


class CacheIterator:
    """A pass over ``source`` that gives its elements and keeps a copy of each; when the
    pass reaches its end, ``complete`` gets them all (a pass cut short keeps nothing)."""

    __slots__ = ("_complete", "_kept", "_source")

    def __init__(self, source: Iterator[Any], complete: Callable[[List[Any]], None]) -> None:
        self._source = source
        self._complete = complete
        self._kept: typing.Optional[List[Any]] = []

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            x = next(self._source)  # a failed element is not kept (nor given again)
        except StopIteration:
            if self._kept is not None:
                self._complete(self._kept)
                self._kept = None
            raise
        if self._kept is not None:
            self._kept.append(copy_element(x))
        return x


class WindowIterator:
    """tf.data's windows: window k holds elements ``k*shift + i*stride`` (``i`` below
    ``size``) of the source; the last windows are shorter unless ``drop_remainder``. A
    buffer holds the ``(size - 1) * stride + 1`` elements a window spans; an element that
    fails is kept in it as its error, which fails the windows that take that element
    (and no other: the windows' elements are read, and the window moved on, first)."""

    __slots__ = ("_buf", "_drop", "_make", "_shift", "_size", "_source", "_span", "_stride")

    def __init__(
        self,
        source: Iterator[Any],
        size: int,
        shift: int,
        stride: int,
        drop_remainder: bool,
        make_window: Callable[[List[Any]], Any],
    ) -> None:
        self._source: typing.Optional[Iterator[Any]] = source
        self._size, self._shift, self._stride = size, shift, stride
        self._span = (size - 1) * stride + 1
        self._drop = drop_remainder
        self._make = make_window
        self._buf: List[typing.Tuple[bool, Any]] = []  # (read, element or its error)

    def __iter__(self) -> Iterator[Any]:
        return self

    def _read(self) -> typing.Tuple[bool, Any]:
        """(True, element) or (False, its error); StopIteration at the source's end."""
        assert self._source is not None
        try:
            return True, next(self._source)
        except StopIteration:
            self._source = None
            raise
        except Exception as e:  # noqa: BLE001 - kept in its place, raised by the windows that take it
            return False, e

    def __next__(self) -> Any:
        buf = self._buf
        # 1. Fill the buffer up to one window's span (fewer at the source's end).
        while self._source is not None and len(buf) < self._span:
            try:
                buf.append(self._read())
            except StopIteration:
                break
        if not buf or (self._drop and len(buf) < self._span):
            raise StopIteration
        # 2. The window: every stride-th element of the buffer.
        members = buf[: self._span : self._stride]
        # 3. Move on by shift, reading (and dropping, errors too) the elements a shift
        #    longer than the buffer passes over.
        if self._shift >= len(buf):
            for _ in range(self._shift - len(buf)):
                if self._source is None:
                    break
                try:
                    self._read()
                except StopIteration:
                    break
            buf.clear()
        else:
            del buf[: self._shift]
        for read, x in members:
            if not read:
                raise x
        return self._make([x for _, x in members])


class ScanIterator:
    """``step(state, element)`` gives ``(new state, output)`` for each element; the state
    goes from one element to the next (a failed element leaves it as it was)."""

    __slots__ = ("_source", "_state", "_step")

    def __init__(self, source: Iterator[Any], state: Any, step: Callable[[Any, Any], typing.Tuple[Any, Any]]) -> None:
        self._source = source
        self._state = state
        self._step = step

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self._state, out = self._step(self._state, next(self._source))
        return out


class IgnoreErrorsIterator:
    """The elements of ``source`` less the ones that fail (each error goes to ``log``)."""

    __slots__ = ("_log", "_source")

    def __init__(self, source: Iterator[Any], log: typing.Optional[Callable[[Exception], None]]) -> None:
        self._source = source
        self._log = log

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                return next(self._source)
            except StopIteration:
                raise
            except Exception as e:  # noqa: BLE001 - what ignore_errors is for
                if self._log is not None:
                    self._log(e)


class UniqueIterator:
    """The elements of ``source`` that ``key`` has not seen before in this pass."""

    __slots__ = ("_key", "_seen", "_source")

    def __init__(self, source: Iterator[Any], key: Callable[[Any], Any]) -> None:
        self._source = source
        self._key = key
        self._seen: typing.Set[Any] = set()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            x = next(self._source)
            k = self._key(x)
            if k not in self._seen:
                self._seen.add(k)
                return x


def elements_text(n: int) -> str:
    """A count of elements in words, as tf.data's messages say it."""
    if n == -1:
        return "an infinite number of elements"
    return "1 element" if n == 1 else f"{n} elements"


class CardinalityCheckIterator:
    """The elements of ``source``, with an error once it proves to hold a number other
    than ``expected`` (-1: infinitely many): at its end when it held fewer, at the first
    element past ``expected`` when more (that element is not given)."""

    __slots__ = ("_count", "_expected", "_source")

    def __init__(self, source: Iterator[Any], expected: int) -> None:
        self._source = source
        self._expected = expected
        self._count = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            x = next(self._source)
        except StopIteration:
            if self._count != self._expected:
                raise CardinalityError(
                    f"Input dataset was expected to contain {elements_text(self._expected)} but contained only "
                    f"{elements_text(self._count)}."
                ) from None
            raise
        self._count += 1
        if 0 <= self._expected < self._count:
            raise CardinalityError(
                f"Input dataset was expected to contain {elements_text(self._expected)} but contained at least "
                f"{elements_text(self._count)}."
            )
        return x


class CardinalityError(RuntimeError):
    """A dataset held another number of elements than ``assert_cardinality`` said
    (tf.errors.FailedPreconditionError in tf.data)."""


class RebatchIterator:
    """The rows of ``source``'s batches regrouped into batches of the sizes ``sizes``
    gives in turn (the last batch of a pass may be shorter unless ``drop_remainder``)."""

    __slots__ = ("_drop", "_rows", "_sizes")

    def __init__(self, rows: Iterator[Any], sizes: Iterator[int], drop_remainder: bool) -> None:
        self._rows = rows  # an UnbatchIterator over the source
        self._sizes = sizes
        self._drop = drop_remainder

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        size = next(self._sizes)
        chunk: List[Any] = []
        while len(chunk) < size:
            try:
                chunk.append(next(self._rows))
            except StopIteration:
                break
        if not chunk or (self._drop and len(chunk) < size):
            raise StopIteration
        return stack(chunk)
