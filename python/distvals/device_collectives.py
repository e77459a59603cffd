"""Array-level collectives of the strategies for GPU replicas, on the CUDA engine.

The counterpart of ``cross_device`` for strategies whose replicas are GPUs: the same
functions, with ``places`` (each replica's CUDA device, from its engine group) added.
Values may be device arrays (DeviceArray, cupy, torch CUDA tensors) or host values;
which kind a result is follows these rules:

- cross-replica ``reduce_parts`` and ``gather_parts``: when any part is a device array,
  the parts are combined on the GPUs and the result is a DeviceArray on the first
  replica's (or the root's) GPU; parts that are all host values are combined on the
  host, as numpy;
- ``all_reduce_parts`` and ``broadcast_value`` (one copy per replica) give a DeviceArray
  on every replica's GPU;
- replica context (``replica_all_reduce``, ``replica_all_gather``,
  ``replica_broadcast``): each leaf comes back as the kind it went in: a device leaf as
  a DeviceArray on the replica's GPU, a host leaf (a Python float loss, a numpy array)
  as numpy, reduced through the replica's GPU all the same.

What the engine cannot do on a GPU (integer MEAN, dtypes it does not reduce, gathers
along an axis other than 0, reductions along an axis) goes through host memory, and
the result is placed back where the rules above say.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from . import cross_device, devices, nest
from .reduce_op import ReduceOp
from .values import DistributedValues

__all__ = [
    "as_values",
    "reduce_parts",
    "all_reduce_parts",
    "gather_parts",
    "broadcast_value",
    "replica_all_reduce",
    "replica_all_gather",
    "replica_broadcast",
]

Places = Sequence[Optional[int]]


def _unwrap(x: Any) -> Any:
    # A variable (a MirroredVariable's copy, say) stands for its current value.
    from .variables import Variable

    return x._read() if isinstance(x, Variable) else x


def as_values(parts: Sequence[Any]) -> List[Any]:
    """Each part as an array where it lives (DeviceArray or numpy); variables stand for
    their current value."""
    return [devices.as_value(_unwrap(p)) for p in parts]


def _any_device(values: Sequence[Any]) -> bool:
    return any(not isinstance(v, np.ndarray) for v in values)


def _on_engine(dtype: np.dtype, work: np.dtype) -> bool:
    return work is dtype and cross_device.engine_supports(dtype)


# ---- cross-replica: one thread holds every part --------------------------------------

def reduce_parts(group, places: Places, parts: Sequence[Any], op: ReduceOp, what: str = "reduce",
                 root: int = 0) -> Any:
    """The N parts reduced element-wise into one new array (the engine's ``reduce`` to
    ``root``): a DeviceArray on the root's GPU when any part is a device array."""
    vals = as_values(parts)
    if not _any_device(vals):
        return cross_device.reduce_parts(None, vals, op, what)
    cross_device._check_same(vals, what)
    n = len(vals)
    dtype = vals[0].dtype
    work = cross_device.work_dtype(dtype, op)
    if group is None or n == 1 or not _on_engine(dtype, work):
        host = cross_device.reduce_parts(None, [devices.to_host(v) for v in vals], op, what)
        return devices.to_replica_device(host, places[root])
    bufs = [devices.to_replica_device(v, places[r]) for r, v in enumerate(vals)]
    bufs[root] = devices.to_replica_device(vals[root], places[root], copy=True)
    group.reduce(bufs, root=root, op=op.engine_name)
    return bufs[root]


def all_reduce_parts(group, places: Places, parts: Sequence[Any], op: ReduceOp, algorithm: str = "auto",
                     via_one_device: bool = False, root: int = 0, what: str = "reduce_to") -> List[Any]:
    """The N parts all-reduced into N new DeviceArrays, one on each replica's GPU."""
    vals = as_values(parts)
    cross_device._check_same(vals, what)
    n = len(vals)
    dtype = vals[0].dtype
    work = cross_device.work_dtype(dtype, op)
    if group is None or n == 1 or not _on_engine(dtype, work):
        host = cross_device.reduce_parts(None, [devices.to_host(v) for v in vals], op, what)
        return [_place(host, places[r]) for r in range(n)]
    bufs = [devices.to_replica_device(v, places[r], copy=True) for r, v in enumerate(vals)]
    if via_one_device:
        group.reduce(bufs, root=root, op=op.engine_name)
        group.broadcast(bufs, root=root)
    else:
        group.all_reduce(bufs, op=op.engine_name, algorithm=algorithm)
    return bufs


def _place(host: np.ndarray, place: Optional[int]) -> Any:
    """A copy of ``host`` at ``place``; dtypes a GPU cannot hold stay on the host."""
    if place is None or not devices.can_place(host.dtype):
        return np.array(host, copy=True)
    return devices.to_replica_device(host, place)


def gather_parts(group, places: Places, parts: Sequence[Any], axis: int, what: str = "gather") -> Any:
    """The N parts concatenated along ``axis`` (sizes may differ along it only): a
    DeviceArray on the first replica's GPU when any part is a device array. Equal parts
    along axis 0 go through the engine's ``all_gather``, uneven ones are copied into
    place; other axes go through the host."""
    vals = as_values(parts)
    if not _any_device(vals):
        return cross_device.gather_parts(None, vals, axis, what)
    n = len(vals)
    ax = cross_device._normalize_axis(axis, vals[0].ndim, what, 0)
    for r, v in enumerate(vals):
        if v.ndim != vals[0].ndim:
            raise ValueError(
                f"{what}: replica {r} has rank {v.ndim}, replica 0 has rank {vals[0].ndim}; "
                f"shapes may differ only along axis {ax}"
            )
    cross_device._check_gatherable([tuple(v.shape) for v in vals], [v.dtype for v in vals], ax, what)
    if vals[0].ndim == 0:
        vals = [devices.reshape(v, (1,)) for v in vals]
    if ax != 0 or not cross_device.engine_supports(vals[0].dtype):
        host = cross_device.gather_parts(None, [devices.to_host(v) for v in vals], ax, what)
        return devices.to_replica_device(host, places[0])
    sizes = [v.shape[0] for v in vals]
    if group is None or n == 1 or any(s != sizes[0] for s in sizes):
        return devices.concat_rows(vals, places[0])
    bufs = [devices.to_replica_device(v, places[r]) for r, v in enumerate(vals)]
    return group.all_gather(bufs)[0]


def broadcast_value(group, places: Places, value: Any, n: int) -> List[Any]:
    """N equal copies of ``value``, a DeviceArray on each replica's GPU, through the
    engine's ``broadcast``."""
    v = devices.as_value(value)
    if not devices.can_place(v.dtype):
        host = devices.to_host(v)
        return [np.array(host, copy=True) for _ in range(n)]
    first = devices.to_replica_device(v, places[0], copy=True)
    if group is None or n == 1:
        return [first] + [devices.to_replica_device(first, places[r], copy=True) for r in range(1, n)]
    bufs = [first] + [devices.empty(first.shape, first.dtype, places[r]) for r in range(1, n)]
    group.broadcast(bufs, root=0)
    return bufs


# ---- replica context: each replica thread passes its own value -----------------------

def _leaf_value(leaf: Any) -> Any:
    part = leaf._current() if isinstance(leaf, DistributedValues) else leaf
    return devices.as_value(_unwrap(part))


def _restore(result: Any, leaf_value: Any, leaf: Any) -> Any:
    """The result in the kind of the leaf: numpy (or a numpy scalar) for host leaves."""
    if isinstance(leaf_value, np.ndarray) and not isinstance(result, np.ndarray):
        result = devices.to_host(result)
    return cross_device.restore_kind(result, leaf)


def replica_all_reduce(group, places: Places, replica: int, n: int, op: ReduceOp, value: Any, *,
                       algorithm: str = "auto", timeout: Optional[float] = None, bytes_per_pack: int = 0,
                       via_one_device: bool = False, root: int = 0) -> Any:
    """This replica's part of an all-reduce of ``value`` (a nested structure allowed);
    leaves of one dtype share one device buffer (one engine call per pack)."""
    place = places[replica]
    if devices.is_device_array(value) and not via_one_device:
        # The common case (one device array of an engine dtype) without the packing.
        a = devices.as_value(value)
        if _on_engine(a.dtype, cross_device.work_dtype(a.dtype, op)):
            buf = devices.to_replica_device(a, place, copy=True)
            if n > 1:
                group.replica_all_reduce(replica, buf, op.engine_name, algorithm, timeout)
            return buf
    single = not nest.is_nested(value)
    leaves = [value] if single else nest.flatten(value)
    vals = [_leaf_value(x) for x in leaves]
    results: List[Any] = [None] * len(vals)
    # Same grouping and order as on CPU replicas, so every replica forms the same packs.
    groups: dict = {}
    for i, v in enumerate(vals):
        groups.setdefault(cross_device.work_dtype(v.dtype, op), []).append(i)
    for work, idx in groups.items():
        for pack in cross_device._packs(idx, vals, work, bytes_per_pack):
            _reduce_pack(group, place, replica, n, op, vals, pack, work, results, algorithm, timeout,
                         via_one_device, root)
    out = [_restore(r, v, leaf) for r, v, leaf in zip(results, vals, leaves)]
    return out[0] if single else nest.pack_sequence_as(value, out)


def _reduce_pack(group, place, replica, n, op, vals, pack, work, results, algorithm, timeout,
                 via_one_device, root) -> None:
    dtype = vals[pack[0]].dtype
    members = [vals[i] for i in pack]
    if cross_device.engine_supports(work):
        buf = devices.pack(members, work, place)
        if n > 1:
            engine_op = cross_device._engine_op(op, dtype, work)
            if via_one_device:
                group.replica_reduce(replica, buf, root=root, op=engine_op, timeout_seconds=timeout)
                group.replica_broadcast(replica, buf, root=root, timeout_seconds=timeout)
            else:
                group.replica_all_reduce(replica, buf, engine_op, algorithm, timeout)
        if op is ReduceOp.MEAN and work is not dtype and n > 1:
            # Integer MEAN: a float64 sum, divided on the host (no kernel for it here).
            host = devices.to_host(buf)
            host /= n
            buf = devices.to_replica_device(host, place)
    else:
        # Only host values have dtypes the engine does not reduce: gather their bytes
        # through the GPU, reduce with numpy.
        host = devices.pack(members, work, None)
        if n > 1:
            raw = devices.to_replica_device(host.reshape(-1).view(np.uint8), place)
            gathered = devices.to_host(group.replica_all_gather(replica, raw, timeout))
            stacked = gathered.view(work).reshape((n,) + host.shape)
            host = cross_device._numpy_reduce(stacked, op, work).astype(work, copy=False)
        buf = host
    if len(pack) == 1:
        results[pack[0]] = buf
        return
    for i, piece in zip(pack, devices.unpack(buf, [tuple(v.shape) for v in members])):
        results[i] = piece


# Per-leaf header of replica_all_gather: dtype char code, ndim, then the shape.
_MAX_RANK = cross_device._MAX_RANK


def replica_all_gather(group, places: Places, replica: int, n: int, value: Any, axis: int, *,
                       timeout: Optional[float] = None) -> Any:
    """This replica's part of an all-gather of ``value`` (nested allowed) along ``axis``."""
    place = places[replica]
    single = not nest.is_nested(value)
    leaves = [value] if single else nest.flatten(value)
    vals = [_leaf_value(x) for x in leaves]
    what = "all_gather"
    axes = [cross_device._normalize_axis(axis, v.ndim, what, replica) for v in vals]
    if n == 1:
        out = [devices.copy(devices.reshape(v, (1,)) if v.ndim == 0 else v) for v in vals]
        out = [_restore(o, v, leaf) for o, v, leaf in zip(out, vals, leaves)]
        return out[0] if single else nest.pack_sequence_as(value, out)
    # Step 1: every replica learns every replica's shapes and dtypes (one engine call
    # through the GPU), so uneven sizes can be padded and mismatches named.
    width = 2 + _MAX_RANK
    header = np.zeros(len(vals) * width, dtype=np.int64)
    for i, v in enumerate(vals):
        if v.ndim > _MAX_RANK:
            raise ValueError(f"{what}: replica {replica}: rank {v.ndim} is above the supported {_MAX_RANK}")
        h = header[i * width: (i + 1) * width]
        h[0] = np.dtype(v.dtype).num
        h[1] = v.ndim
        h[2: 2 + v.ndim] = v.shape
    headers = devices.to_host(group.replica_all_gather(replica, devices.to_replica_device(header, place),
                                                       timeout)).reshape(n, len(vals), width)
    out = []
    for i, (v, ax, leaf) in enumerate(zip(vals, axes, leaves)):
        nds = [int(headers[r, i, 1]) for r in range(n)]
        shapes = [tuple(int(d) for d in headers[r, i, 2: 2 + nds[r]]) for r in range(n)]
        for r in range(n):
            if nds[r] != v.ndim:
                raise ValueError(
                    f"{what}: replica {r} has rank {nds[r]}, replica {replica} has rank {v.ndim}; "
                    f"shapes may differ only along axis {ax}"
                )
            if int(headers[r, i, 0]) != np.dtype(v.dtype).num:
                raise TypeError(
                    f"{what}: replicas {replica} and {r} pass different dtypes; every replica needs the same dtype"
                )
        if v.ndim == 0:
            v = devices.reshape(v, (1,))
            shapes = [(1,)] * n
        cross_device._check_gatherable(shapes, [v.dtype] * n, ax, what)
        sizes = [s[ax] for s in shapes]
        full = _gather_leaf(group, place, replica, n, v, ax, sizes, timeout)
        out.append(_restore(full, vals[i], leaf))
    return out[0] if single else nest.pack_sequence_as(value, out)


def _gather_leaf(group, place, replica, n, v, ax, sizes, timeout) -> Any:
    biggest = max(sizes)
    even = all(s == biggest for s in sizes)
    if ax == 0 and cross_device.engine_supports(v.dtype):
        # Along axis 0 everything stays on the GPU: pad to the largest part, gather,
        # then copy the real rows together.
        if even:
            buf = devices.to_replica_device(v, place)
        else:
            buf = devices.concat_rows(
                [v, np.zeros((biggest - v.shape[0],) + tuple(v.shape[1:]), dtype=v.dtype)], place)
        full = group.replica_all_gather(replica, buf, timeout)
        if even:
            return full
        return devices.concat_rows([devices.slice_rows(full, r * biggest, r * biggest + sizes[r])
                                    for r in range(n)], place)
    # Another axis (or a dtype the engine does not move as such): on the host, the way
    # CPU replicas do it, with the bytes carried through the GPU.
    host = devices.to_host(v)
    moved = np.moveaxis(host, ax, 0)
    buf = np.zeros((biggest,) + moved.shape[1:], dtype=host.dtype)
    buf[: moved.shape[0]] = moved
    raw = devices.to_replica_device(buf.reshape(-1).view(np.uint8), place)
    full = devices.to_host(group.replica_all_gather(replica, raw, timeout))
    full = full.view(host.dtype).reshape((n * biggest,) + buf.shape[1:])
    if any(s != biggest for s in sizes):
        full = np.concatenate([full[r * biggest: r * biggest + sizes[r]] for r in range(n)], axis=0)
    result = np.moveaxis(full, 0, ax) if ax else full
    if devices.is_device_array(v):
        return devices.to_replica_device(result, place)
    return result


def replica_broadcast(group, places: Places, replica: int, n: int, value: Any, root: int = 0, *,
                      timeout: Optional[float] = None) -> Any:
    """This replica's part of a broadcast: every replica gets replica ``root``'s value, in
    the kind it passed (all replicas pass values of the same shape and dtype)."""
    v = devices.as_value(value)
    place = places[replica]
    if not devices.can_place(v.dtype):
        host = np.array(devices.to_host(v), order="C", copy=True)
        if n == 1:
            return host
        raw = devices.to_replica_device(host.reshape(-1).view(np.uint8), place)
        got = devices.to_host(group.replica_all_gather(replica, raw, timeout))
        size = host.nbytes
        return got[root * size: (root + 1) * size].view(host.dtype).reshape(host.shape).copy()
    buf = devices.to_replica_device(v, place, copy=True)
    if n > 1:
        group.replica_broadcast(replica, buf, root=root, timeout_seconds=timeout)
    return devices.to_host(buf) if isinstance(v, np.ndarray) else buf
