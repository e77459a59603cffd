"""One collectives interface for every strategy, and the helpers its implementations share.

A strategy chooses, in its constructor, one implementation of ``Collectives``:

- ``distvals.host_collectives.HostCollectives``: CPU replicas, the C++ engine on host
  memory;
- ``distvals.cuda_collectives.CudaCollectives``: GPU replicas, the CUDA engine on device
  memory;
- ``distvals.mpi_collectives.HierarchicalCollectives``: the replicas of several MPI
  processes, one of the two above inside each process and MPI between them.

Every method is single-call: one thread passes every local replica's value at once (the
strategy's meeting has gathered them), and the collective runs once. ``leaves[r][i]`` is
leaf ``i`` of replica ``r``'s (flattened) value; every replica has the same number of
leaves and, leaf by leaf, the same dtype and shape (the caller checked: see
``distvals.meeting``). ``value``, where given, is replica 0's value as passed (the
structure the leaves came from): implementations that must agree with other processes
describe the call with it. Results are new arrays, one per replica and leaf, where the
replica's values live.

The strategy never asks "am I on a GPU?" again: what differs between backends is the
implementation, not the strategy's code.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .reduce_op import ReduceOp

__all__ = [
    "ENGINE_DTYPES",
    "REDUCIBLE_KINDS",
    "Collectives",
    "accumulator_dtype",
    "engine_supports",
    "normalize_axis",
    "numpy_reduce",
    "type_name",
    "work_dtype",
]

ENGINE_DTYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64"))
_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)
# Kinds numpy reduces element-wise: bool, integers, floats, complex, timedelta.
REDUCIBLE_KINDS = frozenset("biufcm")
_NUMPY_OPS: Dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.sum,
    ReduceOp.MEAN: np.mean,
    ReduceOp.MIN: np.min,
    ReduceOp.MAX: np.max,
    ReduceOp.PRODUCT: np.prod,
}


def engine_supports(dtype: np.dtype) -> bool:
    """True when the engine reduces this dtype natively (native byte order only)."""
    return (dtype in ENGINE_DTYPES or dtype.name == "bfloat16") and dtype.isnative


_I64 = np.dtype(np.int64)


def work_dtype(dtype: np.dtype, op: ReduceOp) -> np.dtype:
    """The dtype a reduction runs in: for integer MEAN the dtype of TensorFlow's true
    division, float32 for 8- and 16-bit integers and float64 for wider ones (and bool);
    the native byte order of a big-endian dtype; int64 for the SUM or PRODUCT of bools
    (numpy's, so that one replica's result has the dtype several replicas' have)."""
    if op is ReduceOp.MEAN and dtype.kind in "iub":
        return _F32 if dtype.kind != "b" and dtype.itemsize <= 2 else _F64
    if dtype.kind == "b" and (op is ReduceOp.SUM or op is ReduceOp.PRODUCT):
        return _I64
    if not dtype.isnative and dtype.kind in "biufcm":
        native: np.dtype = dtype.newbyteorder("=")
        return native
    return dtype


def accumulator_dtype(dtype: np.dtype) -> Optional[np.dtype]:
    """float32 for the 16-bit floats (float16, bfloat16), whose sums (means, products)
    run in float32 on every path and are rounded once: in their own dtype a partial sum
    loses every bit past the 11th (8th) or overflows. None for every other dtype."""
    if dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16"):
        return _F32
    return None


def normalize_axis(axis: Any, ndim: int, what: str, replica: int) -> int:
    """``axis`` in 0..max(ndim, 1)-1 (a 0-d value gathers like a 1-element vector)."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{what}: axis must be an int, got {type(axis).__name__}")
    index = int(axis)
    rank = max(ndim, 1)
    if not -rank <= index < rank:
        raise ValueError(f"{what}: axis {index} is out of range for replica {replica}'s value of rank {ndim}")
    return index % rank


def numpy_reduce(stacked: np.ndarray, op: ReduceOp, dtype: np.dtype) -> np.ndarray:
    """Reduces axis 0 of ``stacked`` (one row per replica) with numpy, in ``dtype``
    (float for integer MEAN, see work_dtype); what the engine does not reduce (int16, bool, complex,
    timedelta64, big-endian) goes this way."""
    fn = _NUMPY_OPS[op]
    acc = accumulator_dtype(stacked.dtype)
    if acc is not None and op in (ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.PRODUCT):
        # 16-bit floats in float32, rounded once (in their own dtype a partial sum or
        # product rounds, or overflows: 300 * 300 * 0 would be NaN in float16).
        with np.errstate(over="ignore"):  # past the dtype's range: inf, as the engine gives
            return np.asarray(fn(stacked, axis=0, dtype=acc).astype(dtype))
    if op is ReduceOp.MEAN:
        out = fn(stacked, axis=0, dtype=work_dtype(dtype, op) if dtype.kind in "iub" else None)
    elif op in (ReduceOp.SUM, ReduceOp.PRODUCT) and dtype.kind in "iuf":
        out = fn(stacked, axis=0, dtype=work_dtype(dtype, op))
    else:
        out = fn(stacked, axis=0)
    return np.asarray(out)


def type_name(leaf: Any, a: Any) -> str:
    """What the user passed, for error messages: the Python type and the array dtype."""
    if getattr(a, "ndim", 1) == 0 and isinstance(a, np.ndarray):
        return type(a[()]).__name__ if a.dtype.hasobject else f"{type(a[()]).__name__} (dtype {a.dtype})"
    if isinstance(leaf, np.ndarray):
        return f"numpy array of dtype {a.dtype}"
    return f"{type(leaf).__name__} (dtype {a.dtype})"


class Collectives:
    """The single-call collectives a strategy runs over its local replicas' values.

    ``num_local``: the replicas of this process; ``num_replicas``: all replicas of the
    strategy (more than ``num_local`` only across processes); ``places[r]``: where replica
    ``r``'s values live (None: host memory; k: CUDA device k).
    """

    num_local: int = 1
    num_replicas: int = 1
    places: Tuple[Optional[int], ...] = (None,)

    # ---- replica context: one value per replica, one result per replica ----------------
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
        """Every replica gets, leaf by leaf, ``op`` over every replica's leaf. Small leaves
        of one dtype travel packed in one buffer (at most ``bytes_per_pack`` bytes each when
        positive). Integer MEAN gives float64 (float32 for 8- and 16-bit integers).

        ``label`` (here and in ``broadcast``, ``reduce`` and ``gather``): what the call is
        for, where that is part of what it is (a variable's read or update, which names
        the variable). Between processes, calls of different labels never pair, whatever
        their data; in one process there is nothing to pair, and it is not used."""
        raise NotImplementedError

    def all_gather(
        self,
        leaves: Sequence[Sequence[Any]],
        axes: Sequence[int],
        *,
        timeout: Optional[float] = None,
        value: Any = None,
    ) -> List[List[Any]]:
        """Every replica gets, leaf by leaf, the replicas' leaves concatenated along
        ``axes[i]`` (sizes may differ along it; 0-d leaves count as 1-element vectors)."""
        raise NotImplementedError

    def broadcast(
        self,
        leaves: Sequence[Sequence[Any]],
        root: int,
        *,
        timeout: Optional[float] = None,
        value: Any = None,
        label: str = "",
    ) -> List[List[Any]]:
        """Every replica gets a copy of replica ``root``'s leaves (``root`` counts all
        replicas of the strategy)."""
        raise NotImplementedError

    # ---- cross-replica context: one thread combines the parts --------------------------------
    def reduce(self, op: ReduceOp, parts: Sequence[Any], *, timeout: Optional[float] = None, label: str = "") -> Any:
        """``op`` over the parts (and over every other process's), one new array where
        replica 0's values live."""
        raise NotImplementedError

    def gather(self, parts: Sequence[Any], axis: int, *, timeout: Optional[float] = None, label: str = "") -> Any:
        """The parts (of every process, in replica order) concatenated along ``axis``."""
        raise NotImplementedError

    def total(self, count: int, *, timeout: Optional[float] = None) -> int:
        """``count`` summed over every process (itself in one process)."""
        return count

    def close(self) -> None:
        """Releases the engine group (and anything else held)."""
