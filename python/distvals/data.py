"""``distvals.data.Dataset``: a small input pipeline in the style of ``tf.data.Dataset``.

Enough for examples and tests: ``from_tensor_slices``, ``from_tensors``, ``range``,
``batch``, ``shuffle``, ``repeat``, ``take``, ``skip``, ``map``, ``prefetch``.
Iteration yields numpy arrays (0-d arrays for scalar elements) or nested structures
(tuples, namedtuples, dicts) of them; as in tf.data, a list is one component. Python floats become float32 and Python ints int32, as in TensorFlow; numpy
arrays keep their dtype.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Optional

import numpy as np

from . import nest

__all__ = ["Dataset"]

_INT32 = np.iinfo(np.int32)


# As in tf.data, tuples (namedtuples too) and dicts are structures; a list is one
# component, converted to an array.
def _is_structure(x: Any) -> bool:
    return isinstance(x, (tuple, dict))


def _flatten(x: Any) -> list:
    if isinstance(x, tuple):
        return [leaf for item in x for leaf in _flatten(item)]
    if isinstance(x, dict):
        return [leaf for k in nest._sorted_keys(x) for leaf in _flatten(x[k])]
    return [x]


def _pack(template: Any, leaves: list) -> Any:
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


def _convert_leaf(x: Any, what: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "dtype"):
        # numpy scalars and tensors of other libraries keep their dtype.
        if hasattr(x, "__dlpack__") and not isinstance(x, np.generic):
            try:
                return np.from_dlpack(x)
            except (BufferError, RuntimeError, TypeError, ValueError):
                pass
        if hasattr(x, "numpy") and callable(x.numpy):
            try:
                return np.asarray(x.numpy())
            except Exception:  # noqa: BLE001 - e.g. a torch tensor that requires grad
                pass
        return np.asarray(x)
    a = np.asarray(x)
    if a.dtype == np.float64:
        return a.astype(np.float32)
    if a.dtype.kind == "i" and a.dtype.itemsize > 4:
        if a.size == 0 or (a.min() >= _INT32.min and a.max() <= _INT32.max):
            return a.astype(np.int32)
    if a.dtype == object:
        raise TypeError(f"{what}: cannot make an array of {x!r}; nested lists must be rectangular")
    return a


class Dataset:
    """A re-iterable sequence of elements (arrays or nested structures of arrays)."""

    def __init__(self, make_iterator: Callable[[], Iterator[Any]], *, batched: bool = False,
                 finite: bool = True, description: str = "Dataset") -> None:
        self._make_iterator = make_iterator
        self._batched = batched
        self._finite = finite
        self._description = description

    # ---- sources ------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any) -> "Dataset":
        """One element per index along the first axis of every component of ``tensors``
        (an array-like or a nested structure of them, all with the same first size)."""
        leaves = _flatten(tensors)
        if not leaves:
            raise ValueError("from_tensor_slices: no components given")
        arrays = [_convert_leaf(x, "from_tensor_slices") for x in leaves]
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
        structured = _is_structure(tensors)

        def make() -> Iterator[Any]:
            for i in range(size):
                parts = [a[i, ...] for a in arrays]
                yield _pack(tensors, parts) if structured else parts[0]

        return Dataset(make, description=f"TensorSliceDataset({size} elements)")

    @staticmethod
    def from_tensors(tensors: Any) -> "Dataset":
        """A dataset of one element, ``tensors``."""
        leaves = [_convert_leaf(x, "from_tensors") for x in _flatten(tensors)]
        element = _pack(tensors, leaves) if _is_structure(tensors) else leaves[0]
        return Dataset(lambda: iter((element,)), description="TensorDataset(1 element)")

    @staticmethod
    def range(*args: int) -> "Dataset":
        """Like Python's ``range``: elements are 0-d int64 arrays."""
        r = range(*args)
        return Dataset(lambda: (np.array(i, dtype=np.int64) for i in r), description=f"RangeDataset({r})")

    # ---- transformations ----------------------------------------------------------------------
    def batch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
        """Stacks ``batch_size`` consecutive elements into one (a new first axis); the last
        batch may be smaller unless ``drop_remainder``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch: batch_size must be a positive int, got {batch_size!r}")
        batch_size = int(batch_size)
        source = self

        def make() -> Iterator[Any]:
            it = iter(source)
            while True:
                chunk = list(itertools.islice(it, batch_size))
                if not chunk or (drop_remainder and len(chunk) < batch_size):
                    return
                yield _stack(chunk)

        return Dataset(make, batched=True, finite=self._finite, description=f"BatchDataset({batch_size})")

    def shuffle(self, buffer_size: int, seed: Optional[int] = None, reshuffle_each_iteration: bool = True) -> "Dataset":
        """Shuffles with a buffer of ``buffer_size`` elements (uniform when it holds the
        whole dataset). A seed makes the order reproducible; with
        ``reshuffle_each_iteration`` each pass still gets a different order."""
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) or buffer_size < 1:
            raise ValueError(f"shuffle: buffer_size must be a positive int, got {buffer_size!r}")
        buffer_size = int(buffer_size)
        source = self
        epoch = itertools.count()
        base = np.random.SeedSequence(seed) if seed is not None else None

        def make() -> Iterator[Any]:
            e = next(epoch) if reshuffle_each_iteration else 0
            if base is None:
                rng = np.random.default_rng()
            else:
                rng = np.random.default_rng(np.random.SeedSequence(base.entropy, spawn_key=(e,)))
            buf: list = []
            for x in source:
                if len(buf) < buffer_size:
                    buf.append(x)
                    continue
                j = int(rng.integers(len(buf)))
                yield buf[j]
                buf[j] = x
            while buf:
                j = int(rng.integers(len(buf)))
                buf[j], buf[-1] = buf[-1], buf[j]
                yield buf.pop()

        return Dataset(make, batched=self._batched, finite=self._finite, description=f"ShuffleDataset({buffer_size})")

    def repeat(self, count: Optional[int] = None) -> "Dataset":
        """The dataset ``count`` times over (forever for None or -1)."""
        if count is not None and (isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < -1):
            raise ValueError(f"repeat: count must be None, -1 or a non-negative int, got {count!r}")
        forever = count is None or count == -1
        source = self

        def make() -> Iterator[Any]:
            passes = itertools.count() if forever else range(int(count))
            for _ in passes:
                yielded = False
                for x in source:
                    yielded = True
                    yield x
                if not yielded:
                    return

        return Dataset(make, batched=self._batched, finite=self._finite and not forever,
                       description=f"RepeatDataset({count})")

    def take(self, count: int) -> "Dataset":
        """The first ``count`` elements (all of them for -1)."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < -1:
            raise ValueError(f"take: count must be -1 or a non-negative int, got {count!r}")
        source = self
        if count == -1:
            return Dataset(lambda: iter(source), batched=self._batched, finite=self._finite, description="TakeDataset(-1)")
        return Dataset(lambda: itertools.islice(iter(source), int(count)), batched=self._batched,
                       finite=True, description=f"TakeDataset({count})")

    def skip(self, count: int) -> "Dataset":
        """All but the first ``count`` elements."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"skip: count must be a non-negative int, got {count!r}")
        source = self
        return Dataset(lambda: itertools.islice(iter(source), int(count), None), batched=self._batched,
                       finite=self._finite, description=f"SkipDataset({count})")

    def map(self, fn: Callable) -> "Dataset":
        """Applies ``fn`` to every element (a tuple element is passed as arguments)."""
        if not callable(fn):
            raise TypeError(f"map: fn must be callable, got {type(fn).__name__}")
        source = self

        def make() -> Iterator[Any]:
            for x in source:
                y = fn(*x) if type(x) is tuple else fn(x)
                leaves = [_convert_leaf(v, "map") for v in _flatten(y)]
                yield _pack(y, leaves) if _is_structure(y) else leaves[0]

        return Dataset(make, batched=self._batched, finite=self._finite, description="MapDataset")

    def prefetch(self, buffer_size: Any = None) -> "Dataset":
        """Accepted for compatibility; elements are produced on demand."""
        return self

    # ---- iteration --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return iter(self._make_iterator())

    def as_numpy_iterator(self) -> Iterator[Any]:
        """An iterator over the elements (already numpy arrays)."""
        return iter(self)

    def __repr__(self) -> str:
        return f"<Dataset {self._description}{' batched' if self._batched else ''}>"


def _stack(elements: list) -> Any:
    first = elements[0]
    if not _is_structure(first):
        return np.stack([np.asarray(e) for e in elements])
    columns = zip(*(_flatten(e) for e in elements))
    return _pack(first, [np.stack([np.asarray(v) for v in col]) for col in columns])
