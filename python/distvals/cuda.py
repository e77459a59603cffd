"""GPU replicas: device arrays, copies and the CUDA backend's group.

``device_count()`` works in every build: it is 0 when distvals was built without the
CUDA backend, or when the machine has no GPU or no driver. A GPU replica's value is a
``DeviceArray`` (``shape``, ``dtype``, ``device``, ``.numpy()``,
``__cuda_array_interface__``, ``__dlpack__``); cupy arrays, torch CUDA tensors and
anything else that offers ``__cuda_array_interface__`` or CUDA DLPack are taken as
they are, without a copy (``as_device_array``).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core, config, cuda_memory
from ._convert import bfloat16
from .cuda_memory import cached_bytes, empty_cache, get_cache_limit, set_cache_limit

__all__ = [
    "CudaReplicaGroup",  # noqa: F822 - made on first use by __getattr__ (it loads the GPU group)
    "DeviceArray",
    "as_device_array",
    "cached_bytes",
    "cuda_array_interface",
    "device_count",
    "empty",
    "empty_cache",
    "get_cache_limit",
    "is_available",
    "logical_device_count",
    "physical_device",
    "set_cache_limit",
    "to_device",
    "unavailable_reason",
]

_DL_CUDA = 2
_DL_CUDA_MANAGED = 13
_SUPPORTED = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")


def _backend() -> Any:
    """``distvals._core.cuda`` (typed in its stub), or None in builds without it. Looked
    up on every call, and typed as Any: tests stand a simulated backend in for it."""
    return getattr(_core, "cuda", None)


def device_count() -> int:
    """Number of CUDA devices distvals can use; 0 without the CUDA backend, a GPU or a driver."""
    b = _backend()
    return int(b.device_count()) if b is not None else 0


def is_available() -> bool:
    """True when at least one CUDA device is usable."""
    return device_count() > 0


def unavailable_reason() -> str:
    """Why no GPU is usable, or ``""`` when one is."""
    b = _backend()
    if b is None:
        return "distvals was built without the CUDA backend (DISTVALS_ENABLE_CUDA=OFF, or no nvcc at build time)"
    if b.device_count() > 0:
        return ""
    reason = str(b.unavailable_reason())
    if "nsufficient" in reason and not _driver_present():
        # The CUDA runtime says "insufficient driver" also when there is none at all.
        return f"no NVIDIA driver is installed (libcuda.so.1 cannot be loaded); the CUDA runtime says: {reason}"
    return reason


def _driver_present() -> bool:
    """Whether the NVIDIA driver's library (libcuda) can be loaded."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


def logical_device_count() -> int:
    """Number of logical GPUs: physical GPUs times ``config.get_logical_gpus()``."""
    return device_count() * config.get_logical_gpus()


def physical_device(device: Union[int, str]) -> int:
    """The CUDA device of ``device``: an int is a CUDA ordinal already; a name such as
    ``"GPU:3"`` or ``"/device:GPU:3"`` is a logical GPU, mapped with ``config``."""
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"CUDA device must not be negative, got {device}")
        return int(device)
    if isinstance(device, str):
        name = _core.parse_device(device)
        kind, index = name.split(":")
        if kind != "GPU":
            raise ValueError(f"{device!r} is not a GPU device")
        return config.physical_gpu(int(index))
    raise TypeError(f"device must be a CUDA ordinal or a name such as 'GPU:0', got {type(device).__name__}")


def _require_backend() -> Any:
    b = _backend()
    if b is None:
        raise RuntimeError(unavailable_reason())
    return b


_CHECKED_DTYPES: Dict[Any, np.dtype] = {}  # dtype specs seen before -> their numpy dtype


def _dtype(dtype: Any) -> np.dtype:
    # Every new array asks: numpy's dtype.name is slow enough to matter per step.
    try:
        return _CHECKED_DTYPES[dtype]
    except (KeyError, TypeError):  # new, or unhashable
        pass
    dt: np.dtype = np.dtype(dtype)
    if dt.name not in _SUPPORTED or dt.byteorder == ">":
        raise TypeError(f"dtype {dt} is not supported on GPU replicas; supported: {', '.join(_SUPPORTED)}")
    try:
        _CHECKED_DTYPES[dtype] = dt
    except TypeError:
        pass
    return dt


def _shape(shape: Any) -> Tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    out = tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError(f"shape must not have negative dimensions, got {out}")
    return out


def _c_strides(shape: Tuple[int, ...], itemsize: int) -> Tuple[int, ...]:
    strides, step = [], itemsize
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def _is_c_contiguous(shape: Tuple[int, ...], strides: Optional[Sequence[int]], itemsize: int) -> bool:
    """True when ``strides`` (in bytes, or None) describe C-contiguous memory; dimensions
    of length 1 may carry any stride."""
    if strides is None or 0 in shape:
        return True
    want = _c_strides(shape, itemsize)
    return all(n <= 1 or s == w for n, s, w in zip(shape, strides, want))


class DeviceArray:
    """A C-contiguous array in the memory of one CUDA device.

    ``DeviceArray(shape, dtype, device)`` allocates (uninitialized, from the cache of
    device memory: see ``distvals.cuda_memory``); ``to_device``
    copies a host array in; ``as_device_array`` views cupy/torch/any CUDA array
    without copying. ``device`` is the CUDA ordinal (logical names such as ``"GPU:3"``
    are mapped with ``distvals.config``). ``.numpy()`` copies the data to the host.
    """

    __slots__ = ("__weakref__", "_device", "_dtype", "_owner", "_ptr", "_readonly", "_shape", "_stream")

    def __init__(self, shape: Any, dtype: Any = np.float32, device: Union[int, str] = 0):
        b = _require_backend()
        self._shape = _shape(shape)
        self._dtype = _dtype(dtype)
        self._device = physical_device(device)
        nbytes = math.prod(self._shape) * self._dtype.itemsize
        self._owner = cuda_memory.allocate(b, nbytes, self._device)
        self._ptr = self._owner.ptr
        self._readonly = False
        self._stream: Optional[Tuple[int, int]] = None

    @classmethod
    def _new_many(cls, shape: Tuple[int, ...], dtype: np.dtype, devices: Sequence[int]) -> List[DeviceArray]:
        """One new array per device of ``devices`` (CUDA ordinals), of a shape and dtype
        already checked: what a collective's outputs need, in one visit to the cache."""
        return [row[0] for row in cls._new_set(((shape, dtype),), devices)]

    @classmethod
    def _new_set(
        cls, specs: Sequence[Tuple[Tuple[int, ...], np.dtype]], devices: Sequence[int]
    ) -> List[List[DeviceArray]]:
        """For each device of ``devices`` (one per replica, CUDA ordinals, repeats
        allowed), one new array per (shape, dtype) of ``specs``, already checked: the
        outputs of a step's collectives, ``[replica][spec]``.

        One block of the cache per distinct device holds every array made on it, each
        at an offset of whole 512-byte classes of the cache (so as aligned as the block
        itself, which cudaMalloc aligns to 256 bytes). The Python work is then one block
        per GPU instead of one per array: for 8 logical replicas on one H200 that cut
        making a step's outputs from 60 to 12 µs. The block goes back to the cache when
        the last of its arrays is dropped, so one result kept alive keeps its siblings'
        memory too (at most the step's outputs on that GPU)."""
        # Step 1: each spec's offset within one replica's part of a block.
        offsets = []
        stride = 0
        for shape, dtype in specs:
            offsets.append(stride)
            stride += cuda_memory.size_class(math.prod(shape) * dtype.itemsize)
        # Step 2: how many replicas share each device, and each replica's slot there.
        slots: List[int] = []
        counts: Dict[int, int] = {}
        for d in devices:
            k = counts.get(d, 0)
            slots.append(k)
            counts[d] = k + 1
        # Step 3: one block per device, in one visit to the cache, then the views.
        gpus = list(counts)
        blocks = cuda_memory.allocate_many(_require_backend(), [stride * counts[g] for g in gpus], gpus)
        by_gpu = dict(zip(gpus, blocks))
        view = cls._view
        out = []
        for d, k in zip(devices, slots):
            b = by_gpu[d]
            base = b.ptr + k * stride
            out.append([view(base + off, shape, dtype, d, b) for off, (shape, dtype) in zip(offsets, specs)])
        return out

    @classmethod
    def _view(
        cls,
        ptr: int,
        shape: Tuple[int, ...],
        dtype: np.dtype,
        device: int,
        owner: Any,
        readonly: bool = False,
        stream: Optional[Tuple[int, int]] = None,
    ) -> DeviceArray:
        """A view of memory someone else owns; ``owner`` is kept alive with the view.
        ``stream``: (cudaStream_t, device) where the producer may still be writing it."""
        self = cls.__new__(cls)
        self._ptr = int(ptr)
        self._shape = tuple(shape)
        self._dtype = dtype
        self._device = int(device)
        self._owner = owner
        self._readonly = bool(readonly)
        self._stream = stream
        return self

    # ---- description -------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, ...]:
        """The length of each dimension, as for a numpy array (``()`` for a 0-d array)."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of the elements, one of the dtypes GPU replicas support (bfloat16
        is ml_dtypes' numpy dtype)."""
        return self._dtype

    @property
    def device(self) -> int:
        """The CUDA device ordinal holding the data."""
        return self._device

    @property
    def ndim(self) -> int:
        """The number of dimensions, ``len(shape)``."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of elements, the product of ``shape`` (1 for a 0-d array)."""
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        """The bytes of device memory the elements take, ``size * dtype.itemsize``."""
        return self.size * self._dtype.itemsize

    @property
    def ptr(self) -> int:
        """The device address of the first element (0 for an empty array)."""
        return self._ptr

    @property
    def readonly(self) -> bool:
        """True for a read-only array (a frozen view, or memory its producer's
        ``__cuda_array_interface__`` marks read-only): ``copy_from`` and collectives that
        write into it refuse it."""
        return self._readonly

    @property
    def producer_stream(self) -> Optional[Tuple[int, int]]:
        """(cudaStream_t as an int, CUDA device) on which the array's producer may still be
        writing it (a ``__cuda_array_interface__`` version 3 ``stream``), or None. The
        collectives of distvals order themselves after it on the device."""
        return self._stream

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self._shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self._shape}, dtype={self._dtype.name}, device={self._device})"

    # Conversions to Python numbers and truth values, as numpy gives them, from a host
    # copy. Without __bool__, Python would take len() for the truth value: True for any
    # non-empty array, whatever it holds.
    def __bool__(self) -> bool:
        return bool(self.numpy())

    def __float__(self) -> float:
        return float(self.numpy())

    def __int__(self) -> int:
        return int(self.numpy())

    def __complex__(self) -> complex:
        return complex(self.numpy())

    def __index__(self) -> int:
        return operator.index(self.numpy())

    # ---- data --------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A host copy of the data (waits for work queued before on the legacy default stream)."""
        out = np.empty(self._shape, dtype=self._dtype)
        if self.nbytes:
            _require_backend().copy_to_host(out.reshape(-1).view(np.uint8), self._ptr, self._device)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a DeviceArray can only become a host array by copying; use .numpy()")
        a = self.numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def copy_from(self, host: Any) -> None:
        """Overwrite the data with a host array of the same shape and dtype."""
        if self._readonly:
            raise ValueError("this DeviceArray is read-only")
        a = np.asarray(host, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
        if a.shape != self._shape or a.dtype != self._dtype:
            raise ValueError(
                f"copy_from needs shape {self._shape} and dtype {self._dtype.name}, "
                f"got shape {a.shape} and dtype {a.dtype.name}"
            )
        if self.nbytes:
            _require_backend().copy_to_device(self._ptr, self._device, a.reshape(-1).view(np.uint8))

    def copy(self) -> DeviceArray:
        """A new DeviceArray with the same data, on the same device."""
        out = DeviceArray(self._shape, self._dtype, self._device)
        if self.nbytes:
            _require_backend().copy_device(out._ptr, self._ptr, self.nbytes, self._device)
        return out

    def __deepcopy__(self, memo: Dict[int, Any]) -> DeviceArray:
        """copy(): new device memory with the same data (copying the fields would give
        two arrays over one allocation)."""
        return self.copy()

    # ---- interchange ------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        if self._dtype.name == "bfloat16":
            # The protocol has no bfloat16 type string; consumers fall back to DLPack.
            raise AttributeError("a bfloat16 DeviceArray is exchanged through __dlpack__")
        return {
            "shape": self._shape,
            "typestr": self._dtype.str,
            "data": (self._ptr, self._readonly),
            "strides": None,
            "version": 3,
            # Everything distvals does without an explicit stream has finished when it
            # returns, so consumers need not synchronize; an array still being written on
            # a stream (a collective enqueued with stream=) names it (0, the legacy
            # default stream, is 1 in this protocol).
            "stream": None if self._stream is None else (self._stream[0] or 1),
        }

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (_DL_CUDA, self._device)

    def __dlpack__(
        self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Optional[bool] = None
    ) -> Any:
        """A DLPack capsule over this memory (no copy unless ``copy=True``).

        ``stream`` needs no handling: the data is complete whenever distvals returns
        control without a stream of the caller's own.
        """
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"a DeviceArray on CUDA device {self._device} cannot be exported to {dl_device}")
        src = self.copy() if copy else self
        return _require_backend().to_dlpack(src, src._ptr, list(src._shape), src._dtype.name, src._device)


def empty(shape: Any, dtype: Any = np.float32, device: Union[int, str] = 0) -> DeviceArray:
    """An uninitialized DeviceArray."""
    return DeviceArray(shape, dtype, device)


def to_device(host: Any, device: Union[int, str] = 0) -> DeviceArray:
    """A DeviceArray holding a copy of the host array ``host``."""
    a = np.asarray(host, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
    out = DeviceArray(a.shape, a.dtype, device)
    out.copy_from(a)
    return out


_DL_DTYPES = {
    (0, 8): "int8",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
    (2, 16): "float16",
    (2, 32): "float32",
    (2, 64): "float64",
    (4, 16): "bfloat16",
}


def cuda_array_interface(obj: Any) -> Optional[Dict[str, Any]]:
    """``obj.__cuda_array_interface__``, or None when ``obj`` has none or the protocol
    fails: torch raises TypeError (not AttributeError) for bfloat16 tensors, which are
    then exchanged through DLPack."""
    try:
        cai = obj.__cuda_array_interface__
    except Exception:  # noqa: BLE001 - any failure of the protocol means "not through it"
        return None
    return cai if isinstance(cai, dict) else None


def _from_cai(obj: Any, cai: Dict[str, Any], device: Optional[int], stream: Optional[int]) -> DeviceArray:
    shape = tuple(int(s) for s in cai["shape"])
    dtype = _dtype(np.dtype(cai["typestr"]))
    if cai.get("mask") is not None:
        raise TypeError("masked CUDA arrays are not supported")
    strides: Any = cai.get("strides")  # None, or what the producer put there
    if not _is_c_contiguous(shape, strides, dtype.itemsize):
        raise ValueError(
            f"a CUDA array with strides {tuple(strides)} is not C-contiguous; make a contiguous copy first"
        )
    ptr, readonly = cai["data"]
    if device is None:
        device = _require_backend().pointer_device(int(ptr)) if ptr else 0
        if device < 0:
            raise ValueError(f"{type(obj).__name__} memory at {int(ptr):#x} is not CUDA device memory")
    producer = cai.get("stream")
    order = None
    if producer is not None and cai.get("version", 0) >= 3:
        # The producer's work must be complete before distvals reads the data. A consumer
        # that names its stream orders itself after the producer's on the device (an
        # event, no host wait); otherwise the host waits for the producer's stream.
        if stream is None:
            _require_backend().synchronize_stream(int(producer), device)
        else:
            order = (int(producer), int(device))
    return DeviceArray._view(int(ptr or 0), shape, dtype, device, obj, bool(readonly), order)


def _from_dlpack(obj: Any, device: Optional[int], stream: Optional[int]) -> DeviceArray:
    dev_type, _ = obj.__dlpack_device__()
    if int(dev_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TypeError(
            f"{type(obj).__name__} lives on DLPack device type {int(dev_type)}, not a CUDA device; "
            "copy host data with distvals.cuda.to_device"
        )
    # With the consumer's stream the producer orders that stream after its own work (the
    # DLPack protocol); without, after the legacy default stream.
    capsule = obj.__dlpack__() if stream is None else obj.__dlpack__(stream=int(stream))
    info = _require_backend().from_dlpack(capsule)
    code, bits, lanes = info["dtype"]
    name = _DL_DTYPES.get((int(code), int(bits)))
    if name is None or int(lanes) != 1:
        raise TypeError(f"DLPack dtype (code={code}, bits={bits}, lanes={lanes}) is not supported on GPU replicas")
    dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
    shape = tuple(int(s) for s in info["shape"])
    strides = info["strides"]
    byte_strides = None if strides is None else [int(s) * dtype.itemsize for s in strides]
    if not _is_c_contiguous(shape, byte_strides, dtype.itemsize):
        raise ValueError(
            f"a DLPack tensor with strides {tuple(strides)} is not C-contiguous; make a contiguous copy first"
        )
    gpu = int(info["device"][1]) if device is None else device
    return DeviceArray._view(int(info["ptr"]), shape, dtype, gpu, (obj, info["keeper"]))


def as_device_array(x: Any, device: Optional[Union[int, str]] = None, *, stream: Optional[int] = None) -> DeviceArray:
    """``x`` as a DeviceArray, without copying.

    Accepts a DeviceArray, any object with ``__cuda_array_interface__`` (cupy, torch
    CUDA tensors, numba) and any object with CUDA ``__dlpack__`` (jax, torch; also torch
    tensors whose ``__cuda_array_interface__`` raises, such as bfloat16 ones). The result
    keeps ``x`` alive. ``device`` (CUDA ordinal or logical name), when given, must be
    where the data lives; for ``__cuda_array_interface__`` objects it also saves asking
    the driver. ``stream`` (a cudaStream_t as an int): the stream that will read the
    array; the producer's pending work is then ordered before it on the device (see
    ``DeviceArray.producer_stream``) instead of waited for on the host. Host arrays
    raise TypeError: copy them with ``to_device``.
    """
    want = None if device is None else physical_device(device)
    if isinstance(x, DeviceArray):
        out = x
    else:
        cai = cuda_array_interface(x)
        dlpack = hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")
        # The array interface before version 3 says nothing of the producer's stream
        # (torch's is version 2): with a consumer stream, DLPack's stream handshake orders
        # the producer's current stream before it instead.
        if cai is not None and (cai.get("version", 0) >= 3 or stream is None or not dlpack):
            out = _from_cai(x, cai, want, stream)
        elif dlpack:
            out = _from_dlpack(x, want, stream)
        else:
            raise TypeError(
                f"expected a device array (DeviceArray, cupy, torch CUDA tensor, or anything with "
                f"__cuda_array_interface__ or CUDA __dlpack__), got {type(x).__name__}; "
                "copy host data with distvals.cuda.to_device(x, device)"
            )
    if want is not None and out.device != want:
        raise ValueError(f"the array lives on CUDA device {out.device}, expected CUDA device {want}")
    return out


def __getattr__(name: str) -> Any:
    # The group lives in its own module; import it lazily so that this module stays
    # importable (for device_count) in builds without the CUDA backend.
    if name == "CudaReplicaGroup":
        from .cuda_group import CudaReplicaGroup

        return CudaReplicaGroup
    raise AttributeError(f"module 'distvals.cuda' has no attribute {name!r}")
