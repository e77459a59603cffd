"""Sparse updates and reads of variables: ``IndexedSlices`` and the scatter/gather kernels.

``Variable.scatter_add(IndexedSlices(values, indices))`` and the rest of the ``scatter_*``
family change the rows ``indices`` of a variable (its first axis); ``scatter_nd_*`` take
``(indices, updates)`` where the last axis of ``indices`` addresses leading axes, as in
TensorFlow. The kernels work on host arrays with numpy's unbuffered ``ufunc.at``, so a
repeated index counts once per occurrence (two updates of row 3 both land), as
TensorFlow's scatter ops do.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from . import kinds
from .errors import InvalidArgumentError

__all__ = [
    "SCATTER_KINDS",
    "IndexedSlices",
    "SparseDelta",
    "apply_sparse",
    "concat_deltas",
    "gather_nd",
    "nd_delta",
    "sparse_delta",
    "take_rows",
]

#: Update kinds that carry a SparseDelta (the rest carry a dense value).
SCATTER_KINDS = frozenset(
    [f"scatter_{op}" for op in ("update", "add", "sub", "mul", "div", "min", "max")]
    + [f"scatter_nd_{op}" for op in ("update", "add", "sub", "min", "max")]
)

_UFUNCS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "min": np.minimum, "max": np.maximum}


class IndexedSlices:
    """Rows of a dense value: ``values[i]`` is row ``indices[i]`` (TensorFlow's
    ``tf.IndexedSlices(values, indices, dense_shape)``). What the ``scatter_*`` methods of
    a variable take; a ``tf.IndexedSlices`` (or any object with ``indices`` and
    ``values``) works as well. ``ReplicaContext.all_reduce``, ``strategy.reduce`` and
    ``extended.reduce_to`` take it too (SUM or MEAN): the replicas' rows are gathered,
    not added, as in TensorFlow."""

    __slots__ = ("dense_shape", "indices", "values")

    def __init__(self, values: Any, indices: Any, dense_shape: Any = None) -> None:
        self.values = values
        self.indices = indices
        self.dense_shape = dense_shape

    def __repr__(self) -> str:
        return f"IndexedSlices(indices={self.indices!r}, values={self.values!r}" + (
            f", dense_shape={self.dense_shape!r})" if self.dense_shape is not None else ")"
        )


class SparseDelta:
    """A checked sparse update of one variable: integer ``indices`` and ``values`` of the
    variable's dtype; ``nd`` for the ``scatter_nd_*`` addressing. A plain object (not a
    tuple) so that nested-structure code treats it as one value."""

    __slots__ = ("indices", "nd", "values")

    def __init__(self, indices: np.ndarray, values: Any, nd: bool) -> None:
        self.indices = indices
        self.values = values
        self.nd = nd


def _indices(x: Any, what: str) -> np.ndarray:
    a = kinds.to_numpy(x) if not isinstance(x, (list, tuple, int)) else np.asarray(x)
    a = np.asarray(a)
    if a.dtype.kind not in "iu" or a.dtype == np.uint64:
        if a.size == 0 and a.dtype.kind == "f":
            return a.astype(np.int64)
        raise TypeError(f"{what}: indices must be integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_bounds(indices: np.ndarray, sizes: Tuple[int, ...], what: str) -> None:
    """InvalidArgumentError naming the first index outside ``[0, size)`` (TensorFlow
    refuses negative indices too)."""
    if indices.size == 0:
        return
    flat = indices.reshape(-1, len(sizes))
    bad = (flat < 0) | (flat >= np.asarray(sizes, np.int64))
    if bad.any():
        row = int(np.argmax(bad.any(axis=1)))
        idx = flat[row].tolist()
        shown = idx[0] if len(sizes) == 1 else idx
        raise InvalidArgumentError(f"{what}: index {shown} is out of range for shape {tuple(sizes)}")


def sparse_delta(sparse: Any, shape: Tuple[int, ...], coerce: Any, what: str) -> SparseDelta:
    """The (indices, values) of an IndexedSlices-like ``sparse`` for a variable of
    ``shape``; ``coerce(values, what)`` converts the values to the variable's dtype."""
    if isinstance(sparse, (tuple, list, dict, np.ndarray)) or not (
        hasattr(sparse, "indices") and hasattr(sparse, "values")
    ):
        raise TypeError(f"{what}: sparse_delta must be an IndexedSlices(values, indices), got {type(sparse).__name__}")
    if not shape:
        raise ValueError(f"{what}: a scalar variable has no rows to scatter into")
    idx = _indices(sparse.indices, what)
    if idx.ndim != 1:
        raise ValueError(f"{what}: IndexedSlices indices must be a vector, got shape {idx.shape}")
    values = coerce(sparse.values, what)
    want = idx.shape + tuple(shape[1:])
    if tuple(values.shape) != want:
        raise ValueError(
            f"{what}: values have shape {tuple(values.shape)}, {len(idx)} rows of the variable need {want}"
        )
    _check_bounds(idx[:, None], shape[:1], what)
    return SparseDelta(idx, values, nd=False)


def nd_delta(indices: Any, updates: Any, shape: Tuple[int, ...], coerce: Any, what: str) -> SparseDelta:
    """The checked ``(indices, updates)`` of a ``scatter_nd_*`` call on a variable of
    ``shape``: ``indices[..., :K]`` addresses the first K axes."""
    idx = _indices(indices, what)
    if idx.ndim == 0 or not 1 <= idx.shape[-1] <= len(shape):
        raise ValueError(
            f"{what}: indices of shape {idx.shape} cannot address a variable of shape {tuple(shape)}; "
            "the last axis of indices must be between 1 and the variable's rank"
        )
    k = idx.shape[-1]
    values = coerce(updates, what)
    want = idx.shape[:-1] + tuple(shape[k:])
    if tuple(values.shape) != want:
        raise ValueError(
            f"{what}: updates have shape {tuple(values.shape)}, indices of shape {idx.shape} into a "
            f"variable of shape {tuple(shape)} need {want}"
        )
    _check_bounds(idx, tuple(shape[:k]), what)
    return SparseDelta(idx, values, nd=True)


def rows(delta: SparseDelta) -> SparseDelta:
    """``delta`` with one update per row: ``scatter_nd`` indices of any leading shape
    become a (rows, K) matrix and their updates (rows, ...), so that the updates of
    several replicas join along the first axis whatever their leading shapes."""
    if not delta.nd or delta.indices.ndim == 2:
        return delta
    k = delta.indices.shape[-1]
    values = np.asarray(kinds.to_numpy(delta.values))
    lead = delta.indices.ndim - 1
    return SparseDelta(delta.indices.reshape(-1, k), values.reshape((-1,) + values.shape[lead:]), True)


def concat_deltas(deltas: Any, scale: Any = None) -> SparseDelta:
    """The replicas' sparse updates as one: their (indices, values) concatenated, as
    TensorFlow sums IndexedSlices across replicas; ``scale`` multiplies the values (1/N
    for MEAN)."""
    deltas = [rows(d) for d in deltas]
    first = deltas[0]
    idx = np.concatenate([d.indices for d in deltas], axis=0)
    vals = np.concatenate([np.asarray(kinds.to_numpy(d.values)) for d in deltas], axis=0)
    if scale is not None:
        vals = (vals * scale).astype(vals.dtype, copy=False)
    return SparseDelta(idx, vals, first.nd)


def _key(delta: SparseDelta) -> Any:
    if delta.nd:
        return tuple(np.moveaxis(delta.indices, -1, 0))
    return delta.indices


def apply_sparse(kind: str, current: np.ndarray, delta: SparseDelta) -> np.ndarray:
    """The new value of a variable holding ``current`` after the update ``kind``."""
    op = kind.rsplit("_", 1)[1]
    new = np.array(current, copy=True)
    key = _key(delta)
    values = np.asarray(kinds.to_numpy(delta.values))
    if op == "update":
        new[key] = values
    elif op == "div":
        _divide_at(new, key, values)
    else:
        _UFUNCS[op].at(new, key, values)
    return new


def _divide_at(new: np.ndarray, key: Any, values: np.ndarray) -> None:
    if new.dtype.kind not in "iu":
        np.divide.at(new, key, values)
        return
    # Integers divide truncating toward zero (C's division, as TensorFlow's kernel),
    # one update after another so that repeated indices compose.
    if values.size and not values.all():
        raise InvalidArgumentError("scatter_div: integer division by zero")
    nd = isinstance(key, tuple)
    if nd:
        batch = key[0].ndim
        key = tuple(k.reshape(-1) for k in key)
        values = values.reshape((-1,) + values.shape[batch:])
    values = values.astype(new.dtype, copy=False)
    signed = new.dtype.kind == "i"
    for i in range(len(values)):
        where = tuple(k[i] for k in key) if nd else key[i]
        # In the variable's own dtype (through int64, uint64 values from 2**63 on turned
        # negative, and the absolute value of int64's minimum overflowed): numpy floors,
        # so a quotient with a remainder and operands of opposite signs goes up by one.
        a, b = new[where], values[i]
        with np.errstate(over="ignore"):  # the minimum over -1 wraps, as in C
            q = a // b
            if signed:
                q = q + (((a - q * b) != 0) & ((a < 0) != (b < 0))).astype(new.dtype)
        new[where] = q


def take_rows(value: np.ndarray, indices: Any, what: str) -> np.ndarray:
    """``value``'s rows ``indices`` (``sparse_read``)."""
    idx = _indices(indices, what)
    if value.ndim == 0:
        raise ValueError(f"{what}: a scalar variable has no rows")
    _check_bounds(idx.reshape(-1, 1), value.shape[:1], what)
    return np.take(value, idx, axis=0)


def gather_nd(value: np.ndarray, indices: Any, what: str) -> np.ndarray:
    """``value`` gathered at ``indices`` whose last axis addresses leading axes."""
    idx = _indices(indices, what)
    if idx.ndim == 0 or not 1 <= idx.shape[-1] <= value.ndim:
        raise ValueError(f"{what}: indices of shape {idx.shape} cannot address a value of shape {value.shape}")
    _check_bounds(idx, value.shape[: idx.shape[-1]], what)
    return np.asarray(value[tuple(np.moveaxis(idx, -1, 0))])
