"""Where a replica's values live: host memory or the memory of one GPU.

A CPU replica's values are numpy arrays; a GPU replica's values are
``distvals.cuda.DeviceArray`` objects on the replica's CUDA device (cupy arrays, torch
CUDA tensors and anything else offering ``__cuda_array_interface__`` or CUDA DLPack are
taken as device arrays too, without a copy). This module is the one place of the Python
layer that knows about device arrays: the strategies, collectives, variables and input
pipelines ask it to tell the kinds apart, to move values between host and device, and
for the few element-wise operations variables need.

A *place* is where a value lives: ``None`` for host memory, or a CUDA device ordinal.
Functions taking a ``device`` accept a place, a device name (``"CPU:0"``,
``"GPU:3"``; a GPU name is a logical GPU, mapped with ``distvals.config``) or ``None``.

DeviceArray offers no arithmetic. Element-wise updates of variables on a GPU (``add``,
``subtract``) run on the engine: a two-replica group on the array's own GPU all-reduces
the two operands (SUM, or PRODUCT with -1 for the negation), so no kernel beyond the
collective ones is needed.
"""

from __future__ import annotations

import atexit
import math
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import cuda as _cuda
from ._convert import as_numpy, refuse_masked
from ._core import parse_device

__all__ = [
    "Place",
    "add",
    "as_value",
    "can_place",
    "cast",
    "concat_rows",
    "copy",
    "empty",
    "empty_like",
    "freeze",
    "gpu_count",
    "is_device_array",
    "is_gpu",
    "pack",
    "place_of",
    "place_of_device",
    "reshape",
    "slice_rows",
    "subtract",
    "to_host",
    "to_replica_device",
    "unpack",
]

Place = Optional[int]
"""``None`` for host memory, else a CUDA device ordinal."""

_DL_CUDA_TYPES = (2, 13)  # kDLCUDA, kDLCUDAManaged
_HOST_TYPES = (np.ndarray, np.generic, bool, int, float, complex, str, bytes, list, tuple, dict, type(None))
_DEVICE_DTYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64", "int8", "uint8", "int32", "int64"))


# ---- devices ----------------------------------------------------------------------------


def gpu_count() -> int:
    """How many GPU replicas this process can run: the logical GPUs (physical GPUs times
    ``distvals.config.get_logical_gpus()``); 0 without the CUDA backend, a GPU or a driver."""
    try:
        return int(_cuda.logical_device_count())
    except Exception:  # noqa: BLE001 - a broken driver reads as no GPU
        return 0


def is_gpu(device: str) -> bool:
    """True for a canonical GPU device name such as ``"GPU:1"``."""
    return device.startswith("GPU:")


def place_of_device(device: Union[str, int, None]) -> Place:
    """The place of a device name (``"CPU:k"`` -> None, ``"GPU:k"`` -> its CUDA device),
    of a CUDA ordinal (itself) or of None (host)."""
    if device is None:
        return None
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        return int(device)
    if isinstance(device, str):
        name = device if device[:4] in ("CPU:", "GPU:") else parse_device(device)
        return _cuda.physical_device(name) if is_gpu(name) else None
    raise TypeError(f"a device must be a name such as 'GPU:0', a CUDA ordinal or None, got {type(device).__name__}")


def can_place(dtype: Any) -> bool:
    """True when values of ``dtype`` can live on a GPU (the engine's dtypes)."""
    dt = np.dtype(dtype)
    ok: bool = (dt in _DEVICE_DTYPES or dt.name == "bfloat16") and dt.isnative
    return ok


# ---- telling values apart -----------------------------------------------------------------


def is_device_array(x: Any) -> bool:
    """True for a DeviceArray and for any array in CUDA memory (``__cuda_array_interface__``
    or a CUDA ``__dlpack_device__``): cupy, torch CUDA tensors, numba, jax on GPU."""
    if isinstance(x, _HOST_TYPES):
        return False
    if isinstance(x, _cuda.DeviceArray):
        return True
    # Each protocol on its own: torch raises TypeError (not AttributeError) from
    # __cuda_array_interface__ for bfloat16 tensors, which are still CUDA arrays by DLPack.
    if _cuda.cuda_array_interface(x) is not None:
        return True
    try:
        dev = getattr(x, "__dlpack_device__", None)
        return callable(dev) and int(dev()[0]) in _DL_CUDA_TYPES
    except Exception:  # noqa: BLE001 - a protocol that fails is not a device array
        return False


def place_of(x: Any) -> Place:
    """Where ``x`` lives: its CUDA device, or None for anything in host memory."""
    if isinstance(x, _cuda.DeviceArray):
        return x.device
    if is_device_array(x):
        return _cuda.as_device_array(x).device
    return None


def as_value(x: Any) -> Any:
    """``x`` as an array where it lives, without a copy where possible: a DeviceArray
    (viewing cupy/torch memory) for device arrays, a numpy array otherwise."""
    if isinstance(x, (np.ndarray, _cuda.DeviceArray)):
        return x
    if is_device_array(x):
        return _cuda.as_device_array(x)
    return as_numpy(x)


# ---- moving values ---------------------------------------------------------------------------


def to_host(x: Any) -> np.ndarray:
    """``x`` as a numpy array: device arrays are copied to the host; host array-likes are
    converted without a copy where possible."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, _cuda.DeviceArray):
        return x.numpy()
    if is_device_array(x):
        return _cuda.as_device_array(x).numpy()
    return as_numpy(x)


def to_replica_device(x: Any, device: Union[str, int, None], copy: bool = False, replica: Optional[int] = None) -> Any:
    """``x`` placed on ``device`` (a name, a CUDA ordinal, or None for the host).

    To the host: a numpy array (device arrays copied down). To a GPU: a DeviceArray on
    it; host data is copied up, a device array on another GPU is copied across, one
    already there is returned as it is (as a DeviceArray view) unless ``copy`` is true.
    With ``copy`` the result never shares memory with ``x``. ``replica``, when known,
    is named in an error (several replicas can share one GPU, so the GPU alone does not
    say whose value it was).
    """
    place = place_of_device(device)
    if place is None:
        if is_device_array(x):
            return to_host(x)
        a = as_numpy(x)
        return np.array(a, copy=True) if copy else a
    if is_device_array(x):
        d = _cuda.as_device_array(x)
        if d.device == place:
            return d.copy() if copy else d
        out = _cuda.DeviceArray(d.shape, d.dtype, place)
        _copy_device(out, 0, d)
        return out
    refuse_masked(x, replica, f"a copy to GPU {place}")
    host = _contiguous(as_numpy(x))
    return _cuda.to_device(host, place)


def _contiguous(x: Any, dtype: Any = None) -> np.ndarray:
    # Unlike numpy.ascontiguousarray, keeps 0-d arrays 0-d.
    return np.asarray(x, dtype=dtype, order="C")


def _backend() -> Any:
    return _cuda._require_backend()


def _copy_device(dst: Any, offset: int, src: Any) -> None:
    """Copies device array ``src`` into ``dst`` at element ``offset`` (any two GPUs:
    unified addressing lets one copy cross devices)."""
    if src.nbytes:
        _backend().copy_device(dst.ptr + offset * dst.dtype.itemsize, src.ptr, src.nbytes, dst.device)


def _copy_up(dst: Any, offset: int, host: np.ndarray) -> None:
    """Copies the C-contiguous host array ``host`` into ``dst`` at element ``offset``."""
    if host.nbytes:
        view = _view(dst, offset, host.shape)
        _backend().copy_to_device(view.ptr, view.device, host.reshape(-1).view(np.uint8))


def _view(buf: Any, offset: int, shape: Tuple[int, ...], readonly: bool = False) -> Any:
    """A DeviceArray over ``buf``'s elements from ``offset`` on, keeping ``buf`` alive."""
    ptr = buf.ptr + offset * buf.dtype.itemsize if math.prod(shape) else 0
    return _cuda.DeviceArray._view(ptr, tuple(shape), buf.dtype, buf.device, buf, readonly)


# ---- making and shaping arrays ---------------------------------------------------------------


def empty(shape: Any, dtype: Any, device: Union[str, int, None]) -> Any:
    """An uninitialized array on ``device``."""
    place = place_of_device(device)
    if place is None:
        return np.empty(shape, dtype)
    return _cuda.DeviceArray(shape, dtype, place)


def empty_like(x: Any, shape: Any = None, dtype: Any = None) -> Any:
    """An uninitialized array where ``x`` lives (with ``x``'s shape and dtype unless given)."""
    shape = x.shape if shape is None else shape
    dtype = x.dtype if dtype is None else dtype
    return empty(shape, dtype, place_of(x))


def copy(x: Any) -> Any:
    """A copy of ``x`` where it lives (host array-likes become numpy arrays)."""
    if is_device_array(x):
        return _cuda.as_device_array(x).copy()
    return np.array(as_numpy(x), copy=True)


def freeze(x: Any) -> Any:
    """``x`` made read-only: a numpy array's flag is cleared in place; a DeviceArray comes
    back as a read-only view (collectives then refuse to write into it)."""
    if isinstance(x, np.ndarray):
        x.flags.writeable = False
        return x
    a = _cuda.as_device_array(x)
    if a.readonly:
        return a
    return _view(a, 0, a.shape, readonly=True)


def reshape(x: Any, shape: Any) -> Any:
    """A view of ``x`` with another shape of the same size."""
    shape = tuple(int(s) for s in shape)
    if isinstance(x, np.ndarray):
        return x.reshape(shape)
    a = _cuda.as_device_array(x)
    if math.prod(shape) != a.size:
        raise ValueError(f"cannot reshape an array of {a.size} elements into shape {shape}")
    return _view(a, 0, shape, a.readonly)


def slice_rows(x: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` along axis 0, as a view (a contiguous range of a C-contiguous
    device array)."""
    if isinstance(x, np.ndarray):
        return x[start:stop]
    a = _cuda.as_device_array(x)
    row = math.prod(a.shape[1:])
    return _view(a, start * row, (stop - start,) + a.shape[1:], a.readonly)


def cast(x: Any, dtype: Any) -> Any:
    """``x`` with ``dtype``, where it lives (``x`` itself when it has it already). A device
    array changes dtype through the host, since no conversion kernel exists; it stays
    there for a dtype GPUs do not hold (int16, big-endian: such variables live on the
    host)."""
    dt = np.dtype(dtype)
    if x.dtype == dt:
        return x
    if isinstance(x, np.ndarray):
        return x.astype(dt)
    a = _cuda.as_device_array(x)
    host = a.numpy().astype(dt)
    return to_replica_device(host, a.device) if can_place(dt) else host


def concat_rows(parts: Sequence[Any], device: Union[str, int, None]) -> Any:
    """The parts concatenated along axis 0, on ``device``, by copies (no engine)."""
    place = place_of_device(device)
    if place is None:
        return np.concatenate([to_host(p) for p in parts], axis=0)
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    out = _cuda.DeviceArray((rows,) + tuple(first.shape[1:]), first.dtype, place)
    offset = 0
    for p in parts:
        if is_device_array(p):
            _copy_device(out, offset, _cuda.as_device_array(p))
        else:
            _copy_up(out, offset, _contiguous(p, dtype=first.dtype))
        offset += p.size
    return out


# ---- packing leaves into one buffer ---------------------------------------------------------


def pack(values: Sequence[Any], dtype: Any, device: Union[str, int, None]) -> Any:
    """A new buffer of ``dtype`` on ``device`` holding the values one after another (flat;
    a single value keeps its shape). Host values are cast on the host and copied up;
    device values of another dtype go through the host."""
    dt = np.dtype(dtype)
    place = place_of_device(device)
    if len(values) == 1:
        shape = tuple(values[0].shape)
    else:
        shape = (sum(v.size for v in values),)
    if place is None:
        out = np.empty(shape, dt)
        flat = out.reshape(-1)
        o = 0
        for v in values:
            a = to_host(v)
            flat[o : o + a.size] = a.reshape(-1)
            o += a.size
        return out
    dev = _cuda.DeviceArray(shape, dt, place)
    o = 0
    for v in values:
        if is_device_array(v) and v.dtype == dt:
            _copy_device(dev, o, _cuda.as_device_array(v))
        else:
            _copy_up(dev, o, _contiguous(to_host(v), dtype=dt))
        o += v.size
    return dev


def unpack(buf: Any, shapes: Sequence[Tuple[int, ...]]) -> List[Any]:
    """Views of consecutive pieces of the flat ``buf`` with the given shapes."""
    out = []
    o = 0
    for s in shapes:
        size = math.prod(s)
        if isinstance(buf, np.ndarray):
            out.append(buf.reshape(-1)[o : o + size].reshape(s))
        else:
            out.append(_view(buf, o, tuple(s)))
        o += size
    return out


# ---- element-wise updates on the engine --------------------------------------------------------

_pairs: Dict[int, Any] = {}
_pairs_lock = threading.Lock()
_minus_ones: Dict[Tuple[int, str], Any] = {}


def _pair_group(gpu: int) -> Any:
    """A two-replica engine group with both replicas on CUDA device ``gpu``."""
    with _pairs_lock:
        g = _pairs.get(gpu)
        if g is None or g.closed:
            # Logical GPUs 2*gpu and 2*gpu+1, two per device, are both CUDA device `gpu`.
            g = _backend().Group([f"GPU:{2 * gpu}", f"GPU:{2 * gpu + 1}"], 2, None, 0, True)
            _pairs[gpu] = g
        return g


@atexit.register
def _close_pairs() -> None:
    # Free streams and events while the CUDA runtime is still up.
    with _pairs_lock:
        for g in _pairs.values():
            try:
                g.close()
            except Exception:  # noqa: BLE001 - shutting down
                pass
        _pairs.clear()
        _minus_ones.clear()


def _raw(a: Any) -> Tuple[int, int, int]:
    return (a.ptr, a.size, a.device)


def _pair_reduce(a: Any, b: Any, op: str) -> Any:
    """A new array ``a op b`` (element-wise) on ``a``'s GPU: a reduce to replica 0, which
    writes only ``out`` (no scratch array for the other replica's result)."""
    out = _cuda.DeviceArray(a.shape, a.dtype, a.device)
    if not a.size:
        return out
    _pair_group(a.device).run(
        "reduce", a.dtype.name, op, "direct", 0, [_raw(a), _raw(b)], [_raw(out), _raw(b)], None, -1
    )
    return out


def _operands(a: Any, b: Any, what: str) -> Tuple[Any, Any]:
    a = _cuda.as_device_array(a)
    b = to_replica_device(b, a.device)
    if b.shape != a.shape or b.dtype != a.dtype:
        raise ValueError(
            f"{what}: operands need the same shape and dtype, got {a.shape} {a.dtype.name} and {b.shape} {b.dtype.name}"
        )
    return a, b


def add(a: Any, b: Any) -> Any:
    """``a + b`` as a new array where ``a`` lives (``b`` is moved there first)."""
    if isinstance(a, np.ndarray):
        return np.asarray(a + to_host(b), dtype=a.dtype)
    a, b = _operands(a, b, "add")
    return _pair_reduce(a, b, "sum")


def _minus_one(like: Any) -> Any:
    """A read-only array of -1 (wrapped for unsigned dtypes) with ``like``'s shape, on its GPU."""
    key = (like.device, like.dtype.str)
    with _pairs_lock:
        have = _minus_ones.get(key)
    if have is None or have.size < like.size:
        host = np.full(max(like.size, 1), -1, dtype=np.int64).astype(like.dtype)
        have = freeze(_cuda.to_device(host, like.device))
        with _pairs_lock:
            _minus_ones[key] = have
    return _view(have, 0, like.shape, readonly=True)


def subtract(a: Any, b: Any) -> Any:
    """``a - b`` as a new array where ``a`` lives: ``b`` times -1 (a PRODUCT all-reduce),
    then a SUM all-reduce."""
    if isinstance(a, np.ndarray):
        return np.asarray(a - to_host(b), dtype=a.dtype)
    a, b = _operands(a, b, "subtract")
    return _pair_reduce(a, _pair_reduce(b, _minus_one(b), "prod"), "sum")
