"""Array-level collectives of the strategies, on the C++ engine.

Two styles, matching the engine's:

- cross-replica (one thread holds every replica's part): ``reduce_parts``,
  ``all_reduce_parts``, ``gather_parts``, ``broadcast_value`` use the group's
  single-call methods;
- replica context (each replica thread passes its own value): ``replica_all_reduce``
  and ``replica_all_gather`` use the per-replica ``replica_*`` methods. Nested values
  are packed: leaves of one dtype share one flat buffer (one engine call per dtype,
  or per ``bytes_per_pack`` bytes), like Horovod's tensor fusion.

Integer MEAN is computed in float64 (sum, then divide). Dtypes the engine does not
reduce (bool, int16, uint32, complex...) are gathered through the engine as raw bytes
and reduced with numpy. Results keep the kind of their input: an ndarray for an
ndarray (0-d included), a numpy scalar for a Python or numpy scalar.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import devices, nest
from ._core import AbortedError, MismatchError
from .reduce_op import ReduceOp
from .values import DistributedValues

__all__ = [
    "as_array",
    "restore_kind",
    "reduce_parts",
    "all_reduce_parts",
    "gather_parts",
    "broadcast_value",
    "replica_all_reduce",
    "replica_all_gather",
    "replica_broadcast",
    "engine_supports",
    "work_dtype",
]

_ENGINE_DTYPES = frozenset(
    np.dtype(t) for t in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
)
_F64 = np.dtype(np.float64)
_NUMPY_OPS = {
    ReduceOp.SUM: np.sum,
    ReduceOp.MEAN: np.mean,
    ReduceOp.MIN: np.min,
    ReduceOp.MAX: np.max,
    ReduceOp.PRODUCT: np.prod,
}


def engine_supports(dtype: np.dtype) -> bool:
    """True when the engine reduces this dtype natively."""
    return (dtype in _ENGINE_DTYPES or dtype.name == "bfloat16") and dtype.isnative


def work_dtype(dtype: np.dtype, op: ReduceOp) -> np.dtype:
    """The dtype the reduction runs in: float64 for integer (and bool) MEAN."""
    if op is ReduceOp.MEAN and dtype.kind in "iub":
        return _F64
    return dtype


def as_array(x: Any) -> np.ndarray:
    """``x`` (array-like, number, variable, tensor) as a numpy array, without a copy where
    possible; device arrays (cupy, torch CUDA, DeviceArray) are copied to the host."""
    if isinstance(x, np.ndarray):
        return x
    return devices.to_host(x)


def restore_kind(result: Any, original: Any) -> Any:
    """An ndarray stays an ndarray; a scalar input gives a numpy scalar back; a device
    array (a GPU replica's result) stays as it is."""
    if isinstance(original, np.ndarray) or not isinstance(result, np.ndarray) or result.ndim:
        return result
    return result[()]


def _engine_op(op: ReduceOp, dtype: np.dtype, work: np.dtype) -> str:
    # Integer MEAN runs as a float64 SUM, divided afterwards.
    if op is ReduceOp.MEAN and work is not dtype:
        return "sum"
    return op.engine_name


def _check_same(arrays: Sequence[np.ndarray], what: str, check_shape: bool = True) -> None:
    a0 = arrays[0]
    for r, a in enumerate(arrays):
        if a.dtype != a0.dtype:
            raise TypeError(
                f"{what}: replica {r} has dtype {a.dtype}, replica 0 has {a0.dtype}; "
                "every replica's value needs the same dtype"
            )
        if check_shape and a.shape != a0.shape:
            raise ValueError(
                f"{what}: replica {r} has shape {a.shape}, replica 0 has {a0.shape}; "
                "every replica's value needs the same shape"
            )


# Kinds numpy reduces element-wise: bool, integers, floats, complex, timedelta.
_REDUCIBLE_KINDS = frozenset("biufcm")


def _type_name(leaf: Any, a: np.ndarray) -> str:
    """What the user passed, for error messages: the Python type, and the dtype of arrays."""
    if a.ndim == 0:
        return type(a[()]).__name__ if a.dtype.hasobject else f"{type(a[()]).__name__} (dtype {a.dtype})"
    if isinstance(leaf, np.ndarray):
        return f"numpy array of dtype {a.dtype}"
    return f"{type(leaf).__name__} (dtype {a.dtype})"


def _check_reducible(leaves: Sequence[Any], arrays: Sequence[np.ndarray], replica: int, what: str) -> None:
    """Refuses, naming the replica, values that are not numbers (before any collective)."""
    for leaf, a in zip(leaves, arrays):
        if a.dtype.kind not in _REDUCIBLE_KINDS and not engine_supports(a.dtype):
            raise TypeError(
                f"replica {replica}: {what} cannot reduce a value of type {_type_name(leaf, a)}; "
                "pass numbers or arrays of numbers"
            )


def _check_no_objects(leaves: Sequence[Any], arrays: Sequence[np.ndarray], replica: int, what: str) -> None:
    """Refuses, naming the replica, values that are Python objects (they have no bytes to send)."""
    for leaf, a in zip(leaves, arrays):
        if a.dtype.hasobject:
            raise TypeError(
                f"replica {replica}: {what} cannot send a value of type {_type_name(leaf, a)}; "
                "pass numbers, strings or arrays of them"
            )


def _numpy_reduce_parts(arrays: Sequence[np.ndarray], parts: Sequence[Any], op: ReduceOp, dtype: np.dtype,
                        what: str) -> np.ndarray:
    """Reduces with numpy the parts the engine cannot (other dtypes; Python objects that
    support the operation, such as Decimal); anything else is a TypeError naming the type."""
    if dtype.kind not in _REDUCIBLE_KINDS and not dtype.hasobject:
        raise TypeError(
            f"{what}: cannot reduce replica 0's value of type {_type_name(parts[0], arrays[0])} with "
            f"{op.name}; pass numbers or arrays of numbers"
        )
    try:
        return _numpy_reduce(np.stack(arrays), op, dtype)
    except TypeError as e:
        if not dtype.hasobject:
            raise
        raise TypeError(
            f"{what}: cannot reduce replica 0's value of type {_type_name(parts[0], arrays[0])} with "
            f"{op.name} ({e}); pass numbers or arrays of numbers"
        ) from None


# ---- cross-replica: one thread holds every part --------------------------------------

def reduce_parts(group, parts: Sequence[Any], op: ReduceOp, what: str = "reduce",
                 via_one_device: bool = False, root: int = 0) -> np.ndarray:
    """Reduces the N parts element-wise into one new array (the engine's ``reduce`` to
    ``root``). Integer MEAN gives float64."""
    arrays = [as_array(p) for p in parts]
    _check_same(arrays, what)
    n = len(arrays)
    dtype = arrays[0].dtype
    work = work_dtype(dtype, op)
    if not engine_supports(work) or group is None:
        return _numpy_reduce_parts(arrays, parts, op, dtype, what)
    bufs = [np.asarray(a, dtype=work, order="C") for a in arrays]
    bufs[root] = np.array(arrays[root], dtype=work, order="C", copy=True)
    if n > 1:
        group.reduce(bufs, root=root, op=_engine_op(op, dtype, work))
    out = bufs[root]
    if op is ReduceOp.MEAN and work is not dtype:
        out /= n
    return out


def all_reduce_parts(group, parts: Sequence[Any], op: ReduceOp, algorithm: str = "auto",
                     via_one_device: bool = False, root: int = 0, what: str = "reduce_to") -> List[np.ndarray]:
    """All-reduces the N parts into N new arrays (one per replica, equal values)."""
    arrays = [as_array(p) for p in parts]
    _check_same(arrays, what)
    n = len(arrays)
    dtype = arrays[0].dtype
    work = work_dtype(dtype, op)
    if not engine_supports(work) or group is None:
        out = _numpy_reduce_parts(arrays, parts, op, dtype, what)
        return [out] + [out.copy() for _ in range(n - 1)]
    bufs = [np.array(a, dtype=work, order="C", copy=True) for a in arrays]
    if n > 1:
        engine_op = _engine_op(op, dtype, work)
        if via_one_device:
            group.reduce(bufs, root=root, op=engine_op)
            group.broadcast(bufs, root=root)
        else:
            group.all_reduce(bufs, op=engine_op, algorithm=algorithm)
    if op is ReduceOp.MEAN and work is not dtype:
        for b in bufs:
            b /= n
    return bufs


def _numpy_reduce(stacked: np.ndarray, op: ReduceOp, dtype: np.dtype) -> np.ndarray:
    fn = _NUMPY_OPS[op]
    if op is ReduceOp.MEAN:
        out = fn(stacked, axis=0, dtype=work_dtype(dtype, op))
    elif op in (ReduceOp.SUM, ReduceOp.PRODUCT) and dtype.kind != "b":
        out = fn(stacked, axis=0, dtype=dtype)
    else:
        out = fn(stacked, axis=0)
    return np.asarray(out)


def _normalize_axis(axis: int, ndim: int, what: str, replica: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{what}: axis must be an int, got {type(axis).__name__}")
    axis = int(axis)
    rank = max(ndim, 1)  # a 0-d value gathers like a 1-element vector
    if not -rank <= axis < rank:
        raise ValueError(f"{what}: axis {axis} is out of range for replica {replica}'s value of rank {ndim}")
    return axis % rank


def _check_gatherable(shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[np.dtype], axis: int, what: str) -> None:
    s0, d0 = shapes[0], dtypes[0]
    for r, (s, d) in enumerate(zip(shapes, dtypes)):
        if d != d0:
            raise TypeError(f"{what}: replica {r} has dtype {d}, replica 0 has {d0}; every replica needs the same dtype")
        if len(s) != len(s0) or any(a != b for i, (a, b) in enumerate(zip(s, s0)) if i != axis):
            raise ValueError(
                f"{what}: replica {r} has shape {tuple(s)}, replica 0 has shape {tuple(s0)}; "
                f"shapes may differ only along axis {axis}"
            )


def gather_parts(group, parts: Sequence[Any], axis: int, what: str = "gather") -> np.ndarray:
    """Concatenates the N parts along ``axis`` (sizes may differ along it only), through
    the engine's ``all_gather``. 0-d parts give a vector of N."""
    arrays = [as_array(p) for p in parts]
    n = len(arrays)
    ax = _normalize_axis(axis, arrays[0].ndim, what, 0)
    for r, a in enumerate(arrays):
        if a.ndim != arrays[0].ndim:
            raise ValueError(
                f"{what}: replica {r} has rank {a.ndim}, replica 0 has rank {arrays[0].ndim}; "
                f"shapes may differ only along axis {ax}"
            )
    _check_gatherable([a.shape for a in arrays], [a.dtype for a in arrays], ax, what)
    if arrays[0].ndim == 0:
        arrays = [a.reshape(1) for a in arrays]
    if not engine_supports(arrays[0].dtype) or group is None or n == 1:
        return np.concatenate(arrays, axis=ax)
    sizes = [a.shape[ax] for a in arrays]
    moved = [np.moveaxis(a, ax, 0) for a in arrays]
    biggest = max(sizes)
    if all(s == biggest for s in sizes):
        bufs = [np.asarray(m, order="C") for m in moved]
        out = group.all_gather(bufs)[0]
        return np.moveaxis(out, 0, ax) if ax else out
    # Uneven sizes: pad every part to the largest, gather, then drop the padding.
    padded = []
    for m in moved:
        p = np.zeros((biggest,) + m.shape[1:], dtype=m.dtype)
        p[: m.shape[0]] = m
        padded.append(p)
    full = group.all_gather(padded)[0]
    pieces = [full[r * biggest: r * biggest + sizes[r]] for r in range(n)]
    out = np.concatenate(pieces, axis=0)
    return np.moveaxis(out, 0, ax) if ax else out


def broadcast_value(group, value: Any, n: int) -> List[np.ndarray]:
    """N equal copies of ``value``, one per replica, through the engine's ``broadcast``."""
    a = as_array(value)
    if not engine_supports(a.dtype) or group is None or n == 1:
        return [np.array(a, copy=True) for _ in range(n)]
    bufs = [np.array(a, order="C", copy=True)] + [np.empty(a.shape, a.dtype) for _ in range(n - 1)]
    group.broadcast(bufs, root=0)
    return bufs


# ---- replica context: each replica thread passes its own value -----------------------

def _leaf_array(leaf: Any) -> np.ndarray:
    part = leaf._current() if isinstance(leaf, DistributedValues) else leaf
    return as_array(part)


def replica_all_reduce(group, replica: int, n: int, op: ReduceOp, value: Any, *, algorithm: str = "auto",
                       timeout: Optional[float] = None, bytes_per_pack: int = 0,
                       via_one_device: bool = False, root: int = 0) -> Any:
    """This replica's part of an all-reduce of ``value`` (a nested structure allowed).

    When the engine finds the replicas' calls different (or is aborted because of it),
    the exception carries this replica's leaf dtypes as ``_distvals_dtypes``, so that the
    strategy, which sees every replica's error, can name the replica whose dtype differs.
    """
    if type(value) is np.ndarray and not via_one_device:
        # The common case (one array of an engine dtype) without the packing machinery.
        dtype = value.dtype
        if dtype in _ENGINE_DTYPES and (op is not ReduceOp.MEAN or dtype.kind == "f"):
            if n == 1:
                return np.array(value, order="C")
            # Out of place: the engine reads the value and writes a new array, so the
            # result costs no copy of the input first.
            buf = np.empty(value.shape, dtype)
            try:
                group.replica_all_reduce(replica, np.asarray(value, order="C"), op.engine_name, algorithm,
                                         timeout, out=buf)
            except (MismatchError, AbortedError) as e:
                _tag_dtypes(e, [value])
                raise
            return buf
    if isinstance(value, np.ndarray):
        leaves, single = [value], True
    else:
        single = not nest.is_nested(value)
        leaves = [value] if single else nest.flatten(value)
    arrays = [_leaf_array(x) for x in leaves]
    _check_reducible(leaves, arrays, replica, "all_reduce")
    results: List[Any] = [None] * len(arrays)
    # Group the leaves by the dtype they reduce in, in order of first appearance, so
    # every replica forms the same packs in the same order.
    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(work_dtype(a.dtype, op), []).append(i)
    try:
        for work, idx in groups.items():
            for pack in _packs(idx, arrays, work, bytes_per_pack):
                _reduce_pack(group, replica, n, op, arrays, pack, work, results, algorithm, timeout,
                             via_one_device, root)
    except (MismatchError, AbortedError) as e:
        _tag_dtypes(e, arrays)
        raise
    out = [restore_kind(r, leaf) for r, leaf in zip(results, leaves)]
    return out[0] if single else nest.pack_sequence_as(value, out)


def _tag_dtypes(error: BaseException, arrays: Sequence[np.ndarray]) -> None:
    try:
        error._distvals_dtypes = tuple(str(a.dtype) for a in arrays)
    except (AttributeError, TypeError):  # an exception type without a __dict__
        pass


def _packs(idx: List[int], arrays: List[np.ndarray], work: np.dtype, bytes_per_pack: int) -> List[List[int]]:
    if bytes_per_pack <= 0 or len(idx) == 1:
        return [idx]
    packs: List[List[int]] = []
    cur: List[int] = []
    size = 0
    for i in idx:
        nbytes = arrays[i].size * work.itemsize
        if cur and size + nbytes > bytes_per_pack:
            packs.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        packs.append(cur)
    return packs


def _reduce_pack(group, replica, n, op, arrays, pack, work, results, algorithm, timeout, via_one_device, root):
    dtype = arrays[pack[0]].dtype
    if len(pack) == 1:
        buf = np.array(arrays[pack[0]], dtype=work, order="C", copy=True)
    else:
        total = sum(arrays[i].size for i in pack)
        buf = np.empty(total, dtype=work)
        o = 0
        for i in pack:
            a = arrays[i]
            buf[o: o + a.size] = a.reshape(-1)
            o += a.size
    if n > 1:
        if not engine_supports(work):
            buf = _replica_reduce_bytes(group, replica, n, op, buf, timeout)
        elif via_one_device:
            engine_op = _engine_op(op, dtype, work)
            group.replica_reduce(replica, buf, root=root, op=engine_op, timeout_seconds=timeout)
            group.replica_broadcast(replica, buf, root=root, timeout_seconds=timeout)
        else:
            group.replica_all_reduce(replica, buf, _engine_op(op, dtype, work), algorithm, timeout)
    if op is ReduceOp.MEAN and work is not dtype and n > 1:
        buf /= n
    if len(pack) == 1:
        results[pack[0]] = buf
        return
    o = 0
    for i in pack:
        a = arrays[i]
        results[i] = buf[o: o + a.size].reshape(a.shape)
        o += a.size


def _replica_reduce_bytes(group, replica, n, op, buf, timeout):
    """For dtypes the engine cannot reduce: gather the raw bytes, reduce with numpy."""
    raw = np.asarray(buf, order="C").reshape(-1).view(np.uint8)
    gathered = group.replica_all_gather(replica, raw, timeout)
    stacked = gathered.view(buf.dtype).reshape((n,) + buf.shape)
    return _numpy_reduce(stacked, op, buf.dtype).astype(buf.dtype, copy=False)


# Per-leaf header of replica_all_gather: dtype char code, ndim, then the shape.
_MAX_RANK = 32


def replica_all_gather(group, replica: int, n: int, value: Any, axis: int, *,
                       timeout: Optional[float] = None) -> Any:
    """This replica's part of an all-gather of ``value`` (nested allowed) along ``axis``."""
    single = not nest.is_nested(value)
    leaves = [value] if single else nest.flatten(value)
    arrays = [_leaf_array(x) for x in leaves]
    what = "all_gather"
    _check_no_objects(leaves, arrays, replica, what)
    axes = [_normalize_axis(axis, a.ndim, what, replica) for a in arrays]
    if n == 1:
        out = [a.reshape(1) if a.ndim == 0 else np.array(a, copy=True) for a in arrays]
        return out[0] if single else nest.pack_sequence_as(value, out)
    # Step 1: every replica learns every replica's shapes and dtypes (one engine call),
    # so uneven sizes along the axis can be padded and mismatches reported by name.
    width = 2 + _MAX_RANK
    header = np.zeros(len(arrays) * width, dtype=np.int64)
    for i, a in enumerate(arrays):
        if a.ndim > _MAX_RANK:
            raise ValueError(f"{what}: replica {replica}: rank {a.ndim} is above the supported {_MAX_RANK}")
        h = header[i * width: (i + 1) * width]
        h[0] = a.dtype.num
        h[1] = a.ndim
        h[2: 2 + a.ndim] = a.shape
    headers = group.replica_all_gather(replica, header, timeout).reshape(n, len(arrays), width)
    out = []
    for i, (a, ax) in enumerate(zip(arrays, axes)):
        shapes = [tuple(int(d) for d in headers[r, i, 2: 2 + headers[r, i, 1]]) for r in range(n)]
        nds = [int(headers[r, i, 1]) for r in range(n)]
        for r in range(n):
            if nds[r] != a.ndim:
                raise ValueError(
                    f"{what}: replica {r} has rank {nds[r]}, replica {replica} has rank {a.ndim}; "
                    f"shapes may differ only along axis {ax}"
                )
            if int(headers[r, i, 0]) != a.dtype.num:
                raise TypeError(
                    f"{what}: replicas {replica} and {r} pass different dtypes; every replica needs the same dtype"
                )
        if a.ndim == 0:
            a = a.reshape(1)
            shapes = [(1,)] * n
        _check_gatherable(shapes, [a.dtype] * n, ax, what)
        sizes = [s[ax] for s in shapes]
        biggest = max(sizes)
        moved = np.moveaxis(a, ax, 0)
        if all(s == biggest for s in sizes):
            buf = np.asarray(moved, order="C")
        else:
            buf = np.zeros((biggest,) + moved.shape[1:], dtype=a.dtype)
            buf[: moved.shape[0]] = moved
        if engine_supports(a.dtype):
            full = group.replica_all_gather(replica, buf, timeout)
        else:
            raw = group.replica_all_gather(replica, buf.reshape(-1).view(np.uint8), timeout)
            full = raw.view(a.dtype).reshape((n * biggest,) + buf.shape[1:])
        if any(s != biggest for s in sizes):
            full = np.concatenate([full[r * biggest: r * biggest + sizes[r]] for r in range(n)], axis=0)
        out.append(np.moveaxis(full, 0, ax) if ax else full)
    return out[0] if single else nest.pack_sequence_as(value, out)


def replica_broadcast(group, replica: int, n: int, value: Any, root: int = 0, *,
                      timeout: Optional[float] = None) -> np.ndarray:
    """This replica's part of a broadcast: every replica gets replica ``root``'s value
    (all replicas pass values of the same shape and dtype)."""
    buf = np.array(as_array(value), order="C", copy=True)
    _check_no_objects([value], [buf], replica, "broadcast")
    if n == 1:
        return buf
    if engine_supports(buf.dtype):
        group.replica_broadcast(replica, buf, root=root, timeout_seconds=timeout)
        return buf
    raw = group.replica_all_gather(replica, buf.reshape(-1).view(np.uint8), timeout)
    size = buf.nbytes
    return raw[root * size: (root + 1) * size].view(buf.dtype).reshape(buf.shape).copy()
