"""Reducing ``IndexedSlices`` across replicas: their rows gathered, as TensorFlow does.

TensorFlow adds no sparse values element by element across replicas. The SUM of
IndexedSlices is every replica's indices and values concatenated in replica order (a row
that several replicas touch appears once per replica, and the copies add up when the
result is applied or made dense), with the dense_shape kept; MEAN also divides the
values by the number of replicas (``cross_device_utils.aggregate_tensors_or_indexed_slices``
and ``divide_by_n_tensors_or_indexed_slices``; ``CollectiveAllReduce`` all-gathers the
values and the indices). Other ops are refused, as there. So the collective under a
sparse leaf is an all-gather of its values and of its indices along the first axis, and
replicas may pass different numbers of rows; the dense leaves of the same call are
all-reduced as usual, and every replica gets the same result.

Each replica's IndexedSlices is checked where it is passed (``sparse_parts``: integer
index vector, one row of values per index, a dense_shape that fits them), then the
replicas' against each other before anything moves (``check_sparse_leaves``: the same
leaves sparse, the same dtypes, row shape and dense_shape; only the number of rows may
differ).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import devices, kinds, nest
from ._convert import refuse_masked
from ._core import MismatchError
from .collectives import REDUCIBLE_KINDS, accumulator_dtype, engine_supports, type_name, work_dtype
from .meeting import check_leaves
from .reduce_op import ReduceOp
from .sparse import IndexedSlices
from .values import DistributedValues

__all__ = [
    "SparseExtra",
    "SparseParts",
    "all_reduce_rows",
    "check_sparse_leaves",
    "holds_sparse",
    "is_sparse",
    "reduce_sparse",
    "refuse_op",
    "sparse_parts",
]

# The ops whose result on sparse values TensorFlow defines (its ReduceOp has no others).
_SPARSE_OPS = (ReduceOp.SUM, ReduceOp.MEAN)


def is_sparse(x: Any) -> bool:
    """True for an ``IndexedSlices`` (distvals' or TensorFlow's, or one of the same name
    with ``indices`` and ``values``)."""
    if isinstance(x, IndexedSlices):
        return True
    return type(x).__name__ == "IndexedSlices" and hasattr(x, "indices") and hasattr(x, "values")


def holds_sparse(value: Any) -> bool:
    """True for a distributed value with an IndexedSlices among its parts."""
    return isinstance(value, DistributedValues) and any(is_sparse(p) for p in value.values)


class SparseParts:
    """One replica's IndexedSlices as the collectives take it: ``values`` and ``indices``
    converted (numpy arrays, or device arrays on GPU replicas), ``shape`` the dense_shape
    as a tuple (None when it has none), and ``original`` the object passed, whose
    frameworks the result takes."""

    __slots__ = ("indices", "original", "shape", "values")

    def __init__(self, values: Any, indices: Any, shape: Optional[Tuple[int, ...]], original: Any) -> None:
        self.values = values
        self.indices = indices
        self.shape = shape
        self.original = original

    def result(self, gathered: Tuple[Any, Any]) -> IndexedSlices:
        """The (values, indices) that the collective gave this replica, as an
        IndexedSlices in the kinds of the one it passed."""
        values, indices = gathered
        o = self.original
        return IndexedSlices(kinds.restore(values, o.values), kinds.restore(indices, o.indices), o.dense_shape)


class SparseExtra(tuple):  # type: ignore[type-arg]
    """The ``extra`` (leaves, options) of an all-reduce request with IndexedSlices among
    its leaves (as SparseParts): the resolver gathers those instead of reducing them."""

    __slots__ = ()


def refuse_op(op: ReduceOp, who: str, where: str = "") -> None:
    """ValueError unless ``op`` is one that IndexedSlices are reduced with."""
    if op not in _SPARSE_OPS:
        raise ValueError(
            f"{who} cannot reduce an IndexedSlices{where} with {op.name}: its rows are gathered across "
            "replicas, which SUM and MEAN only define (TensorFlow refuses the other ops too); make it a "
            f"dense array first to reduce it with {op.name}"
        )


def sparse_parts(x: Any, op: ReduceOp, convert: Callable[[Any], Any], who: str, where: str = "") -> SparseParts:
    """The checked parts of one replica's IndexedSlices ``x``: ``convert`` makes an
    array of its values and of its indices; errors start with ``who`` (the replica and
    the call) and name the leaf by ``where``."""
    refuse_op(op, who, where)
    refuse_masked(x.values, None, f"{who}: the values of the IndexedSlices{where}")
    values = convert(x.values)
    indices = convert(x.indices)
    if indices.dtype.kind not in "iu":
        if indices.size == 0 and indices.dtype.kind == "f":
            indices = np.zeros(0, np.int64)  # an empty list of indices
        else:
            raise TypeError(
                f"{who}: the indices of the IndexedSlices{where} must be integers, got dtype {indices.dtype}"
            )
    if indices.ndim != 1:
        raise ValueError(
            f"{who}: the indices of the IndexedSlices{where} must be a vector, got shape {tuple(indices.shape)}"
        )
    if values.ndim == 0 or values.shape[0] != indices.shape[0]:
        raise ValueError(
            f"{who}: the IndexedSlices{where} has {indices.shape[0]} indices and values of shape "
            f"{tuple(values.shape)}; its values need one row per index"
        )
    dt = values.dtype
    if dt.hasobject or (dt.kind not in REDUCIBLE_KINDS and not engine_supports(dt)):
        raise TypeError(
            f"{who} cannot reduce the values of the IndexedSlices{where}, of type "
            f"{type_name(x.values, values)}; pass numbers or arrays of numbers"
        )
    shape = _dense_shape(x, who, where)
    if shape is not None and (len(shape) != values.ndim or shape[1:] != tuple(values.shape[1:])):
        raise ValueError(
            f"{who}: the IndexedSlices{where} has dense_shape {shape} and values of shape {tuple(values.shape)}; "
            f"its rows must have the dense shape's trailing dimensions {shape[1:]}"
        )
    return SparseParts(values, indices, shape, x)


def _dense_shape(x: Any, who: str, where: str) -> Optional[Tuple[int, ...]]:
    ds = getattr(x, "dense_shape", None)
    if ds is None:
        return None
    a = np.asarray(ds if isinstance(ds, (list, tuple)) else kinds.to_numpy(ds))
    if a.size == 0 and a.ndim == 1:
        a = a.astype(np.int64)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise TypeError(f"{who}: the dense_shape of the IndexedSlices{where} must be a vector of integers, got {ds!r}")
    return tuple(int(d) for d in a)


class _StandIn:
    """What the dense leaves' check sees in place of an IndexedSlices (checked on its
    own): the same dtype and shape on every replica."""

    dtype = np.dtype(np.int8)
    shape: Tuple[int, ...] = ()


_STAND_IN = _StandIn()


def check_sparse_leaves(value0: Any, rows: Sequence[Sequence[Any]], what: str) -> None:
    """MismatchError naming the replicas and the leaf where the replicas' leaves
    ``rows[r][i]`` (SparseParts or arrays) differ: an IndexedSlices on one replica and a
    dense value on another, or IndexedSlices of different dtypes, row shapes or
    dense_shapes (their numbers of rows may differ); then the dense leaves as always."""
    paths = nest.paths(value0) if nest.is_nested(value0) else None
    first = rows[0]
    for i, p0 in enumerate(first):
        where = f" at {paths[i]}" if paths and i < len(paths) and paths[i] else ""
        sparse0 = type(p0) is SparseParts
        for r in range(1, len(rows)):
            p = rows[r][i]
            if (type(p) is SparseParts) != sparse0:
                has, hasnt, dense = (0, r, p) if sparse0 else (r, 0, p0)
                raise MismatchError(
                    f"{what}: replica {has} passed an IndexedSlices{where}, replica {hasnt} a dense value of dtype "
                    f"{dense.dtype} and shape {tuple(dense.shape)}; every replica must pass an IndexedSlices there, "
                    "or none"
                )
            if sparse0:
                _compare(p0, p, r, what, where)
    if any(type(p) is not SparseParts for p in first):
        check_leaves(value0, [[_STAND_IN if type(a) is SparseParts else a for a in row] for row in rows], what)


def _compare(p0: SparseParts, p: SparseParts, r: int, what: str, where: str) -> None:
    v0, v = p0.values, p.values
    if v.dtype != v0.dtype:
        raise MismatchError(
            f"{what}: replica 0 passed IndexedSlices values of dtype {v0.dtype}, replica {r} of dtype {v.dtype}"
            f"{where}; every replica's values need the same dtype"
        )
    if tuple(v.shape[1:]) != tuple(v0.shape[1:]):
        raise MismatchError(
            f"{what}: replica 0 passed IndexedSlices values of shape {tuple(v0.shape)}, replica {r} of shape "
            f"{tuple(v.shape)}{where}; the replicas' values may differ in their number of rows only"
        )
    if p.indices.dtype != p0.indices.dtype:
        raise MismatchError(
            f"{what}: replica 0 passed IndexedSlices indices of dtype {p0.indices.dtype}, replica {r} of dtype "
            f"{p.indices.dtype}{where}; every replica's indices need the same dtype"
        )
    if p.shape != p0.shape:
        raise MismatchError(
            f"{what}: replica 0 passed an IndexedSlices of dense_shape {p0.shape}, replica {r} of dense_shape "
            f"{p.shape}{where}; every replica's dense_shape must be the same"
        )


def _divided(values: Any, count: int) -> np.ndarray:
    """MEAN's share of one replica's values: each divided by ``count``, in the dtype of
    a MEAN (floats keep theirs, integers become float64, float32 for 8- and 16-bit ones;
    16-bit floats divided in float32 and rounded once). Dividing before the gather gives
    the same numbers as TensorFlow's division of the gathered values."""
    host = devices.to_host(values)
    dt = host.dtype
    work = work_dtype(dt, ReduceOp.MEAN)
    acc = accumulator_dtype(dt)
    if acc is not None:
        return np.asarray((host.astype(acc) / acc.type(count)).astype(dt))
    return np.asarray(host.astype(work) / count)


def _shape_row(shape: Optional[Tuple[int, ...]]) -> np.ndarray:
    """A dense_shape as one row to gather between workers (no dense_shape: a row of
    none, which workers that have one disagree with by the row's length)."""
    return np.array([shape if shape is not None else ()], dtype=np.int64).reshape(1, -1)


def _same_shapes(gathered: Any, what: str, where: str) -> None:
    """MismatchError naming the first replica (of every worker, in global order) whose
    dense_shape differs from replica 0's: each worker checked its own replicas' before
    anything moved, and every worker sees the same gathered rows, so all raise alike."""
    rows = devices.to_host(gathered)
    for g in range(1, len(rows)):
        if not np.array_equal(rows[g], rows[0]):
            raise MismatchError(
                f"{what}: replica 0 passed an IndexedSlices of dense_shape {tuple(rows[0].tolist())}, replica {g} "
                f"of dense_shape {tuple(rows[g].tolist())}{where}; every replica's dense_shape must be the same"
            )


def all_reduce_rows(
    op: ReduceOp,
    rows: Sequence[Sequence[Any]],
    value0: Any,
    total: int,
    all_reduce: Callable[[List[List[Any]], Any], List[List[Any]]],
    all_gather: Callable[[List[List[Any]], List[int], Any], List[List[Any]]],
    what: str = "all_reduce",
) -> List[List[Any]]:
    """Every replica's result leaves for the checked leaves ``rows[r][i]`` (SparseParts
    or arrays) of replica 0's value ``value0``: ``all_reduce(leaves, value)`` reduces the
    dense leaves (one call), ``all_gather(leaves, axes, value)`` gathers the sparse ones'
    values and indices (one call); ``total`` replicas in all divide a MEAN. A sparse
    leaf's result is the pair (values, indices). With replicas in other processes
    (``total`` above the local count), the dense_shapes are gathered too and compared:
    the calls between workers compare dtypes and row shapes, not dense_shapes."""
    n = len(rows)
    first = rows[0]
    sparse_at = [i for i, p in enumerate(first) if type(p) is SparseParts]
    dense_at = [i for i, p in enumerate(first) if type(p) is not SparseParts]
    out: List[List[Any]] = [[None] * len(first) for _ in range(n)]
    if dense_at:
        reduced = all_reduce([[row[i] for i in dense_at] for row in rows], tuple(first[i] for i in dense_at))
        for r in range(n):
            for k, i in enumerate(dense_at):
                out[r][i] = reduced[r][k]
    # Each sparse leaf's values and indices, keyed by the leaf's path: the calls between
    # workers name them by it. Keys that print alike (two objects with one repr, NaNs)
    # give two leaves one path: a path held by more than one leaf also carries the leaf's
    # number, so that no leaf's rows take another's place.
    paths = nest.paths(value0) if nest.is_nested(value0) else ["value"]
    held = collections.Counter(paths[i] for i in sparse_at)
    keys = {i: paths[i] if held[paths[i]] == 1 else f"{paths[i]} (leaf {i})" for i in sparse_at}
    mean = op is ReduceOp.MEAN

    between_workers = total > n

    def pieces(row: Sequence[Any]) -> Any:
        by_path = {}
        for i in sparse_at:
            p = row[i]
            piece = {"indices": p.indices, "values": _divided(p.values, total) if mean else p.values}
            if between_workers:
                piece["dense_shape"] = _shape_row(p.shape)
            by_path[keys[i]] = piece
        return by_path

    structures = [pieces(row) for row in rows]
    flat = [nest.flatten(s) for s in structures]
    gathered = all_gather(flat, [0] * len(flat[0]), structures[0])
    for r in range(n):
        back = nest.pack_sequence_as(structures[0], gathered[r])
        for i in sparse_at:
            d = back[keys[i]]
            if between_workers and r == 0:
                _same_shapes(d["dense_shape"], what, f" at {paths[i]}" if nest.is_nested(value0) else "")
            out[r][i] = (d["values"], d["indices"])
    return out


def reduce_sparse(
    op: ReduceOp,
    parts: Sequence[Any],
    total: int,
    convert: Callable[[Any], Any],
    gather: Callable[[List[Any]], Any],
    what: str,
) -> IndexedSlices:
    """The reduction of the replicas' IndexedSlices ``parts`` outside ``strategy.run``
    (``strategy.reduce``, ``extended.reduce_to``): ``gather(arrays)`` concatenates the
    replicas' arrays (of every worker) along the first axis."""
    refuse_op(op, what)
    for r, p in enumerate(parts):
        if not is_sparse(p):
            s = next(k for k, q in enumerate(parts) if is_sparse(q))
            raise MismatchError(
                f"{what}: replica {s}'s value is an IndexedSlices, replica {r}'s a {type(p).__name__}; every "
                "replica's value must be an IndexedSlices, or none"
            )
    checked = [sparse_parts(p, op, convert, f"{what} (replica {r})") for r, p in enumerate(parts)]
    check_sparse_leaves(None, [[c] for c in checked], what)
    if total > len(parts):
        # Replicas in other processes: their dense_shapes compared too (see all_reduce_rows).
        _same_shapes(gather([_shape_row(c.shape) for c in checked]), what, "")
    values = [_divided(c.values, total) if op is ReduceOp.MEAN else c.values for c in checked]
    gathered_values = gather(values)
    gathered_indices = gather([c.indices for c in checked])
    return checked[0].result((gathered_values, gathered_indices))
