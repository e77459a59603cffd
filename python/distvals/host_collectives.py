"""``HostCollectives``: CPU replicas, the C++ engine on host memory.

Results come from the host pool (``distvals._core.pooled_empty``): memory freed by
Python when the last array using it goes is handed out again for the next result of the
same size, already mapped, so a training loop's collectives cost no page faults after
the first step. Small results (below a page) come from numpy, whose allocator is
faster for them.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import _core
from .engine_collectives import FUSE_LEAF_BYTES, EngineCollectives, host_pack_bytes
from .reduce_op import ReduceOp

__all__ = ["HostCollectives", "new_array"]

# Below this many bytes numpy's own allocator is faster than the pool, and its memory
# is reused without page faults anyway.
_POOL_MIN_BYTES = 4096
_pooled_empty = _core.pooled_empty
_all_reduce_leaves = _core.all_reduce_leaves


def new_array(shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array, from the host pool when it is large."""
    size = dtype.itemsize
    for d in shape:
        size *= d
    if size < _POOL_MIN_BYTES:
        return np.empty(shape, dtype)
    return _pooled_empty(shape, dtype)


class HostCollectives(EngineCollectives):
    """Single-call collectives of CPU replicas (every place is the host)."""

    def __init__(self, group: Any, num_local: int) -> None:
        super().__init__(group, num_local, (None,) * num_local)

    def _empty(self, shape: Tuple[int, ...], dtype: np.dtype, r: int) -> np.ndarray:
        return new_array(shape, dtype)

    def _copy(self, x: Any, r: int, dtype: Optional[np.dtype] = None) -> np.ndarray:
        a = np.asarray(x)
        out = new_array(a.shape, a.dtype if dtype is None else dtype)
        np.copyto(out, a, casting="unsafe")
        return out

    def _place_host(self, host: np.ndarray, r: int) -> np.ndarray:
        return host

    def _all_reduce_in_one_call(
        self, op: ReduceOp, leaves: Sequence[Sequence[Any]], algorithm: str, bytes_per_pack: int
    ) -> Optional[List[List[Any]]]:
        # The engine's own batch (distvals._core.all_reduce_leaves): it checks the leaves,
        # packs the small ones, reduces into pooled outputs with the GIL released once and
        # its threads kept awake between the calls. None for leaves it does not reduce as
        # they are (integer MEAN, dtypes numpy reduces).
        core: _core.Group = self.group._group  # type: ignore[union-attr,assignment]  # CPU replicas' engine group
        return _all_reduce_leaves(
            core, leaves, op.engine_name, algorithm, FUSE_LEAF_BYTES, host_pack_bytes(bytes_per_pack)
        )

    def _engine_input(self, x: Any, r: int) -> np.ndarray:
        a = np.asarray(x)
        flags = a.flags
        # The engine reads whole, aligned elements: anything else is copied first.
        return a if flags.c_contiguous and flags.aligned else np.require(a, requirements=("C", "A"))

    def _pack(self, xs: Sequence[Any], dtype: np.dtype, r: int) -> np.ndarray:
        total = 0
        for x in xs:
            total += x.size
        if total * dtype.itemsize < _POOL_MIN_BYTES:
            # Small packs (most fused gradients of small layers): one call into numpy.
            return np.concatenate([x.ravel() for x in xs], dtype=dtype, casting="unsafe")
        buf = new_array((total,), dtype)
        o = 0
        for x in xs:
            s = x.size
            # ravel() is a view for contiguous arrays; copyto casts where needed.
            np.copyto(buf[o : o + s], np.ravel(x), casting="unsafe")
            o += s
        return buf

    def _unpack(self, buf: np.ndarray, shapes: Sequence[Tuple[int, ...]]) -> List[np.ndarray]:
        out = []
        o = 0
        for s in shapes:
            size = 1
            for d in s:
                size *= d
            out.append(buf[o : o + size].reshape(s))
            o += size
        return out

    def _host(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def _divide(self, buf: np.ndarray, count: int, r: int) -> np.ndarray:
        buf /= count
        return buf

    def _concat(self, xs: Sequence[Any], axis: int, r: int) -> np.ndarray:
        first = xs[0]
        shape = list(first.shape)
        shape[axis] = sum(x.shape[axis] for x in xs)
        out = new_array(tuple(shape), first.dtype)
        return np.concatenate(xs, axis=axis, out=out)


def host_group(devices: Sequence[str], timeout: Optional[float]) -> Any:
    """The engine group of CPU replicas (None for one replica)."""
    from .group import ReplicaGroup

    if len(devices) == 1:
        return None
    return ReplicaGroup(list(devices), timeout_seconds=timeout, spin_us=0)


_ = _core  # the pool lives in the extension module
