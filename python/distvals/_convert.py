"""Host arrays of other libraries (torch, TensorFlow, jax, buffers) as numpy arrays
sharing their memory: the one place that knows each library's pitfalls.

- torch: a tensor that requires grad is read as its data; bfloat16 (which numpy lacks)
  as ml_dtypes' bfloat16 over the same bits; a tensor whose negative or conjugate bit is
  set (``z.conj().imag``, ``z.conj()``) holds other values than its memory, so it is
  resolved into a copy to be read, and refused where the engine would write into it.
- TensorFlow: never exported through DLPack (exporting a string tensor ends the process
  in a failed check instead of raising): ``numpy()`` to read, and only numeric tensors
  where the engine works in place.
- others: DLPack, then ``numpy()``; for the engine, DLPack or the buffer protocol.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 (numpy's dtype for bfloat16 data of other libraries)."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 data needs the ml_dtypes package for its numpy dtype") from None
    dt: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return dt


def _library(x: Any) -> str:
    module = type(x).__module__
    return module.split(".", 1)[0]


def torch_host(t: Any, writable: bool = False) -> np.ndarray:
    """A CPU torch tensor as a numpy array sharing its memory (strides kept). A tensor
    with its negative or conjugate bit set is resolved into a copy, or, for the engine
    (``writable``: it may write the memory it reads), refused: a copy would drop an
    in-place result, and the raw memory holds the other values."""
    torch = sys.modules["torch"]
    if t.is_neg() or t.is_conj():
        bit = "negative" if t.is_neg() else "conjugate"
        if writable:
            raise TypeError(
                f"a torch tensor with its {bit} bit set (a lazy view such as z.conj() or z.conj().imag) holds "
                "other values than its memory, which the engine reads and writes; call resolve_neg() or "
                "resolve_conj() first"
            )
        t = t.resolve_neg().resolve_conj()
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: the same bits as int16, seen as ml_dtypes' bfloat16.
        bits: np.ndarray = t.view(torch.int16).numpy().view(bfloat16())
        return bits
    host: np.ndarray = t.numpy()
    return host


def host_array(x: Any) -> Optional[np.ndarray]:
    """``x``, a host tensor of another library, as a numpy array (sharing its memory
    where the library allows); None when ``x`` is none of those (a list, a number, an
    object with only ``__array__``)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, np.generic):
        return None
    library = _library(x)
    if library == "torch" and hasattr(x, "is_neg"):
        return torch_host(x) if x.device.type == "cpu" else None
    if library != "tensorflow" and hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError):
            pass
    numpy_fn = getattr(x, "numpy", None)  # TensorFlow's tensors and variables, and the like
    return np.asarray(numpy_fn()) if callable(numpy_fn) else None


def refuse_masked(x: Any, replica: Optional[int], what: str) -> None:
    """Raises TypeError for a numpy masked array: its mask says which values to leave
    out, and the collectives, which read the data whole, would drop it and count the
    masked-out values (a wrong result with no error). A plain ndarray is passed at
    once; ``numpy.ma`` is looked up only when loaded: without it there is no masked
    array."""
    if type(x) is np.ndarray:
        return
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(x, ma.MaskedArray):
        who = "" if replica is None else f"replica {replica}: "
        raise TypeError(
            f"{who}{what}: a numpy masked array, whose mask would be dropped (its masked-out values "
            "used as any other); pass x.filled(value), or x.data to use every value"
        )


def as_numpy(x: Any) -> np.ndarray:
    """``x`` as a numpy array: a host tensor of another library as ``host_array`` gives
    it, anything else through ``np.asarray``."""
    host = host_array(x)
    return np.asarray(x) if host is None else host


def as_host_array(obj: Any, replica: int) -> np.ndarray:
    """``obj`` as a numpy array sharing its memory, for the engine (which reads and may
    write it).

    Accepts numpy arrays, host tensors with ``__dlpack__`` (torch CPU tensors, numeric
    TensorFlow eager tensors, jax arrays) and buffer-protocol objects (``memoryview``,
    ``bytearray``, ``array.array``). Raises TypeError naming the replica for anything
    else, such as Python lists, which would need a copy: the engine works in place and
    a copy would silently drop the result.
    """
    if isinstance(obj, np.ndarray):
        refuse_masked(obj, replica, "the collective")
        return obj
    library = _library(obj)
    if library == "torch" and hasattr(obj, "is_neg"):
        if obj.device.type != "cpu":
            where = "needs a GPU group" if obj.device.type == "cuda" else "is not in host memory"
            raise TypeError(f"replica {replica}: a torch tensor on {obj.device} {where}")
        try:
            return torch_host(obj, writable=True)
        except TypeError as e:
            raise TypeError(f"replica {replica}: {e}") from None
    if library == "tensorflow" and getattr(getattr(obj, "dtype", None), "name", "") == "string":
        raise TypeError(f"replica {replica}: a TensorFlow string tensor is not an array of numbers")
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            raise TypeError(
                f"replica {replica}: cannot view {type(obj).__name__} through DLPack "
                f"without a copy ({e}); device arrays need a GPU group"
            ) from None
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"replica {replica}: expected an array (numpy, DLPack or buffer protocol), "
            f"got {type(obj).__name__}; convert it with numpy.asarray first"
        ) from None
    try:
        return np.asarray(view)
    except (TypeError, ValueError) as e:
        raise TypeError(f"replica {replica}: unsupported buffer ({e})") from None
