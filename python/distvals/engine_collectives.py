"""Collectives of the replicas of one process, on the C++ engine (host or CUDA memory).

``EngineCollectives`` holds everything the host and CUDA implementations share: which
leaves go to the engine and which to numpy, packing small leaves together (tensor
fusion), integer MEAN in float, uneven all-gathers. A backend only says where values
live and how memory is made and copied there (the ``_empty``, ``_copy``, ``_pack``, ...
hooks): ``distvals.host_collectives`` and ``distvals.cuda_collectives``.

Every collective runs once for all replicas, in the engine's single-call style: the
engine spreads the native work over its own threads (or streams).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _core
from .collectives import Collectives, accumulator_dtype, engine_supports, numpy_reduce, work_dtype
from .reduce_op import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from .group import ReplicaGroup

# leaves[r][i]: leaf i of replica r; out[r][i]: its result.
_Leaves = Sequence[Sequence[Any]]
_Out = List[List[Any]]

__all__ = ["FUSE_LEAF_BYTES", "HOST_PACK_BYTES", "EngineCollectives", "exact_algorithm", "host_pack_bytes"]

# Leaves up to this size are packed with the other small leaves of their dtype, one
# engine call per pack: below it an engine call costs more than copying the leaf.
FUSE_LEAF_BYTES = 32 << 10
# On host memory a pack holds at most this many bytes unless the caller chose a size.
# A pack is written by the calling thread just before the engine reads it; past this
# size the engine shares the work out to its threads on other cores, which must pull
# every freshly written line across, and one large pack cost more than its leaves did
# one call each (measured, 2 replicas, 64 leaves of 2 KiB: 85 µs in one pack, 69 in 64
# calls, 59 in packs of 32 KiB; 2 leaves of 32 KiB: 42 µs packed, 14 apart).
HOST_PACK_BYTES = 32 << 10


def host_pack_bytes(bytes_per_pack: int) -> int:
    """The pack size host collectives use: the caller's ``bytes_per_pack``, or by default
    ``HOST_PACK_BYTES``."""
    return bytes_per_pack if bytes_per_pack > 0 else HOST_PACK_BYTES


def exact_algorithm(algorithm: str, work: np.dtype, engine_op: str) -> str:
    """The engine algorithm of a strategy's all-reduce of engine dtype ``work``:
    ``algorithm``, except that sums, means and products of float16 and bfloat16 go direct,
    which accumulates in float32 and rounds once (ring and tree round each partial result
    to the dtype; a strategy promises float32 accumulation whatever implementation its
    options name). The one rule, in C++, that the engine's one-call paths apply too."""
    if accumulator_dtype(work) is None:
        return algorithm
    chosen: str = _core.strategy_algorithm(algorithm, work, engine_op)
    return chosen


def _engine_op(op: ReduceOp, dtype: np.dtype, work: np.dtype) -> str:
    # Integer MEAN runs as a float64 SUM, divided afterwards.
    if op is ReduceOp.MEAN and work is not dtype and dtype.kind in "iub":
        return "sum"
    return op.engine_name


class EngineCollectives(Collectives):
    """Single-call collectives of ``group`` (a ``ReplicaGroup``; None for one replica).

    Subclasses provide the memory hooks below.
    """

    def __init__(self, group: Optional[ReplicaGroup], num_local: int, places: Sequence[Optional[int]]) -> None:
        self.group = group
        self.num_local = num_local
        self.num_replicas = num_local
        self.places = tuple(places)

    # ---- memory hooks (per backend) ----------------------------------------------------
    def _empty(self, shape: Tuple[int, ...], dtype: np.dtype, r: int) -> Any:
        """A new uninitialized array where replica ``r``'s values live."""
        raise NotImplementedError

    def _copy(self, x: Any, r: int, dtype: Optional[np.dtype] = None) -> Any:
        """An independent copy of ``x`` (cast to ``dtype``) where replica ``r``'s values live."""
        raise NotImplementedError

    def _engine_input(self, x: Any, r: int) -> Any:
        """``x`` as the engine can read it for replica ``r`` (contiguous, in place)."""
        raise NotImplementedError

    def _pack(self, xs: Sequence[Any], dtype: np.dtype, r: int) -> Any:
        """A new flat buffer of ``dtype`` for replica ``r`` holding ``xs`` one after another."""
        raise NotImplementedError

    def _unpack(self, buf: Any, shapes: Sequence[Tuple[int, ...]]) -> List[Any]:
        """Views of consecutive pieces of the flat ``buf``."""
        raise NotImplementedError

    def _host(self, x: Any) -> np.ndarray:
        """``x`` as a numpy array (copied from the device when it lives there)."""
        raise NotImplementedError

    def _divide(self, buf: Any, count: int, r: int) -> Any:
        """``buf / count`` (float64), where replica ``r``'s values live."""
        raise NotImplementedError

    def _concat(self, xs: Sequence[Any], axis: int, r: int) -> Any:
        """The arrays concatenated along ``axis``, where replica ``r``'s values live."""
        raise NotImplementedError

    # ---- all-reduce ----------------------------------------------------------------------
    def all_reduce(
        self,
        op: ReduceOp,
        leaves: Sequence[Sequence[Any]],
        *,
        algorithm: str = "auto",
        bytes_per_pack: int = 0,
        timeout: Optional[float] = None,
        value: Any = None,
        label: str = "",
    ) -> List[List[Any]]:
        n = self.num_local
        if n > 1 and self.group is not None:
            done = self._all_reduce_in_one_call(op, leaves, algorithm, bytes_per_pack)
            if done is not None:
                return done
        count = len(leaves[0])
        out: List[List[Any]] = [[None] * count for _ in range(n)]
        fused: Dict[np.dtype, List[int]] = {}
        for i in range(count):
            a0 = leaves[0][i]
            dtype = a0.dtype
            work = work_dtype(dtype, op)
            if n == 1 or self.group is None:
                self._reduce_alone(op, leaves, i, dtype, work, out)
            elif not engine_supports(work) or not self._can_place(work):
                self._reduce_numpy(op, leaves, i, dtype, out)
            elif count > 1 and a0.size * work.itemsize <= FUSE_LEAF_BYTES:
                fused.setdefault(work, []).append(i)
            else:
                self._reduce_leaf(op, leaves, i, dtype, work, algorithm, out)
        # Packs of small leaves, by dtype in order of first appearance: one engine call
        # each (or one per bytes_per_pack bytes).
        for work, idx in fused.items():
            for pack in _packs(idx, leaves[0], work, bytes_per_pack):
                self._reduce_pack(op, leaves, pack, work, algorithm, out)
        return out

    def _all_reduce_in_one_call(
        self, op: ReduceOp, leaves: Sequence[Sequence[Any]], algorithm: str, bytes_per_pack: int
    ) -> Optional[List[List[Any]]]:
        """Every leaf through one call into the engine (packing and all), when the
        backend has one and every leaf suits it; None otherwise (then leaf by leaf here)."""
        return None

    def _can_place(self, dtype: np.dtype) -> bool:
        return True

    def _reduce_alone(self, op: ReduceOp, leaves: _Leaves, i: int, dtype: np.dtype, work: np.dtype, out: _Out) -> None:
        # One replica: the result is a copy of its value (a float for integer MEAN).
        for r in range(len(leaves)):
            out[r][i] = self._copy(leaves[r][i], r, work)

    def _reduce_numpy(self, op: ReduceOp, leaves: _Leaves, i: int, dtype: np.dtype, out: _Out) -> None:
        """Dtypes the engine does not reduce: numpy over the stacked values, a copy each."""
        stacked = np.stack([self._host(leaves[r][i]) for r in range(len(leaves))])
        host = numpy_reduce(stacked, op, dtype)
        for r in range(len(leaves)):
            out[r][i] = self._copy(host, r) if r else self._place_host(host, 0)

    def _place_host(self, host: np.ndarray, r: int) -> Any:
        """A host result where replica ``r``'s values live (no copy on the host)."""
        return self._copy(host, r)

    def _reduce_leaf(
        self, op: ReduceOp, leaves: _Leaves, i: int, dtype: np.dtype, work: np.dtype, algorithm: str, out: _Out
    ) -> None:
        """One large leaf: straight from the replicas' arrays into new outputs."""
        n = len(leaves)
        engine_op = _engine_op(op, dtype, work)
        algorithm = exact_algorithm(algorithm, work, engine_op)
        if work is dtype or work == dtype:
            ins = [self._engine_input(leaves[r][i], r) for r in range(n)]
            outs = [self._empty(ins[r].shape, work, r) for r in range(n)]
            self.group.all_reduce(ins, engine_op, algorithm, out=outs)  # type: ignore[union-attr]
        else:
            # A cast is a copy anyway: reduce in place in it.
            outs = [self._copy(leaves[r][i], r, work) for r in range(n)]
            self.group.all_reduce(outs, engine_op, algorithm)  # type: ignore[union-attr]
        if engine_op != op.engine_name:
            outs = [self._divide(o, self.num_replicas, r) for r, o in enumerate(outs)]
        for r in range(n):
            out[r][i] = outs[r]

    def _reduce_pack(
        self, op: ReduceOp, leaves: _Leaves, pack: List[int], work: np.dtype, algorithm: str, out: _Out
    ) -> None:
        n = len(leaves)
        dtype = leaves[0][pack[0]].dtype
        engine_op = _engine_op(op, dtype, work)
        algorithm = exact_algorithm(algorithm, work, engine_op)
        bufs = [self._pack([leaves[r][i] for i in pack], work, r) for r in range(n)]
        self.group.all_reduce(bufs, engine_op, algorithm)  # type: ignore[union-attr]
        if engine_op != op.engine_name:
            bufs = [self._divide(b, self.num_replicas, r) for r, b in enumerate(bufs)]
        shapes = [tuple(leaves[0][i].shape) for i in pack]
        for r in range(n):
            for i, piece in zip(pack, self._unpack(bufs[r], shapes)):
                out[r][i] = piece

    # ---- all-gather --------------------------------------------------------------------------
    def all_gather(
        self,
        leaves: Sequence[Sequence[Any]],
        axes: Sequence[int],
        *,
        timeout: Optional[float] = None,
        value: Any = None,
    ) -> List[List[Any]]:
        n = self.num_local
        count = len(leaves[0])
        out: List[List[Any]] = [[None] * count for _ in range(n)]
        for i in range(count):
            parts = [leaves[r][i] for r in range(n)]
            if parts[0].ndim == 0:
                parts = [self._reshape(p, (1,)) for p in parts]
            ax = axes[i]
            dtype = parts[0].dtype
            even = all(p.shape[ax] == parts[0].shape[ax] for p in parts)
            if (
                n > 1
                and self.group is not None
                and ax == 0
                and even
                and engine_supports(dtype)
                and self._can_place(dtype)
            ):
                ins = [self._engine_input(p, r) for r, p in enumerate(parts)]
                gathered = self.group.all_gather(ins)
            else:
                first = self._concat(parts, ax, 0)
                gathered = [first] + [self._copy(first, r) for r in range(1, n)]
            for r in range(n):
                out[r][i] = gathered[r]
        return out

    def _reshape(self, x: Any, shape: Tuple[int, ...]) -> Any:
        return x.reshape(shape)

    # ---- broadcast ------------------------------------------------------------------------------
    def broadcast(
        self,
        leaves: Sequence[Sequence[Any]],
        root: int,
        *,
        timeout: Optional[float] = None,
        value: Any = None,
        label: str = "",
    ) -> List[List[Any]]:
        n = self.num_local
        count = len(leaves[0])
        out: List[List[Any]] = [[None] * count for _ in range(n)]
        for i in range(count):
            src = leaves[root][i]
            dtype = src.dtype
            if n > 1 and self.group is not None and engine_supports(dtype) and self._can_place(dtype):
                bufs = [self._copy(src, r) if r == root else self._empty(tuple(src.shape), dtype, r) for r in range(n)]
                self.group.broadcast(bufs, root=root)
            else:
                bufs = [self._copy(src, r) for r in range(n)]
            for r in range(n):
                out[r][i] = bufs[r]
        return out

    # ---- cross-replica ---------------------------------------------------------------------------
    def reduce(self, op: ReduceOp, parts: Sequence[Any], *, timeout: Optional[float] = None, label: str = "") -> Any:
        n = len(parts)
        dtype = parts[0].dtype
        work = work_dtype(dtype, op)
        if n == 1 or self.group is None or not engine_supports(work) or not self._can_place(work):
            host = numpy_reduce(np.stack([self._host(p) for p in parts]), op, dtype)
            return self._place_host(host, 0)
        engine_op = _engine_op(op, dtype, work)
        if all(p.dtype == work for p in parts):
            # Straight from the parts into a new result: each part read once.
            ins = [self._engine_input(p, r) for r, p in enumerate(parts)]
            root = self._empty(tuple(ins[0].shape), work, 0)
            self.group.reduce(ins, root=0, op=engine_op, out=root)
        else:
            # A cast is a copy anyway: the engine reduces in place into replica 0's.
            root = self._copy(parts[0], 0, work)
            bufs = [root] + [
                self._engine_input(p, r) if p.dtype == work else self._copy(p, r, work)
                for r, p in enumerate(parts)
                if r
            ]
            self.group.reduce(bufs, root=0, op=engine_op)
        if engine_op != op.engine_name:
            root = self._divide(root, self.num_replicas, 0)
        return root

    def gather(self, parts: Sequence[Any], axis: int, *, timeout: Optional[float] = None, label: str = "") -> Any:
        if parts[0].ndim == 0:
            parts = [self._reshape(p, (1,)) for p in parts]
        return self._concat(parts, axis, 0)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def _packs(idx: List[int], first: Sequence[Any], work: np.dtype, bytes_per_pack: int) -> List[List[int]]:
    """Splits leaf indices into packs of at most ``bytes_per_pack`` bytes (one pack when 0)."""
    if bytes_per_pack <= 0 or len(idx) == 1:
        return [idx]
    packs: List[List[int]] = []
    cur: List[int] = []
    size = 0
    for i in idx:
        nbytes = first[i].size * work.itemsize
        if cur and size + nbytes > bytes_per_pack:
            packs.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        packs.append(cur)
    return packs
