"""Values in, values out: arrays come back in the framework they came from.

The collectives compute on numpy arrays (CPU replicas) or ``distvals.cuda`` DeviceArrays
(GPU replicas). A value handed to ``ReplicaContext.all_reduce``, ``all_gather``,
``strategy.reduce``, ``gather`` or ``extended.reduce_to`` / ``batch_reduce_to`` /
``broadcast_to`` is converted to one of those without a copy where the memory allows
(DLPack, the buffer protocol, ``__cuda_array_interface__``), and the result goes back
in the caller's framework:

- numpy arrays give numpy arrays; Python and numpy scalars give numpy scalars;
- torch tensors give torch tensors (on the tensor's device; a tensor that requires grad
  is reduced as its data, as ``torch.distributed`` does with gradients; bfloat16 works);
- cupy arrays give cupy arrays, JAX arrays give JAX arrays.

No framework is imported unless the caller passes one of its arrays: the framework is
found from the value's type (its module), and the module is already loaded then.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import devices
from ._convert import torch_host

__all__ = ["framework_of", "restore", "to_engine_value", "to_numpy"]


def framework_of(x: Any) -> str:
    """ "numpy" for numpy and Python values, else the array's framework: "torch", "cupy",
    "jax", or "other" (DeviceArray, numba, anything with DLPack)."""
    if isinstance(x, (np.ndarray, np.generic, int, float, complex, bool)):
        return "numpy"
    mod = type(x).__module__.split(".", 1)[0]
    if mod in ("torch", "cupy", "jax"):
        return mod
    if mod == "jaxlib":
        return "jax"
    return "other"


def _torch_host(t: Any) -> np.ndarray:
    """A CPU torch tensor as a C-contiguous numpy array, sharing its memory where it is
    contiguous (see ``_convert.torch_host``)."""
    host = torch_host(t)
    return host if host.flags.c_contiguous else np.ascontiguousarray(host)


def to_numpy(x: Any) -> np.ndarray:
    """``x`` as a numpy array: host memory without a copy where possible, device
    memory copied to the host."""
    if isinstance(x, np.ndarray):
        return x
    fw = framework_of(x)
    if fw == "torch":
        if x.device.type == "cpu":
            return _torch_host(x)
        return devices.to_host(_torch_device(x))
    return devices.to_host(x)


def _torch_device(t: Any) -> Any:
    """A CUDA torch tensor as a DeviceArray view (bfloat16 and grad-requiring ones too)."""
    from . import cuda

    torch = sys.modules["torch"]
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()  # the collectives read whole buffers
    if t.dtype == torch.bfloat16:
        # __cuda_array_interface__ has no bfloat16 type string (torch gives "<V2"); DLPack
        # has one, so hand the tensor over through DLPack alone.
        return cuda.as_device_array(_DLPackOnly(t))
    return cuda.as_device_array(t)


class _DLPackOnly:
    """A tensor seen through its DLPack protocol only."""

    __slots__ = ("_t",)

    def __init__(self, t: Any) -> None:
        self._t = t

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._t.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


def to_engine_value(x: Any) -> Any:
    """``x`` as GPU replicas' collectives take it: a DeviceArray for device memory, a
    numpy array for host memory."""
    if isinstance(x, np.ndarray):
        return x
    if framework_of(x) == "torch":
        return _torch_host(x) if x.device.type == "cpu" else _torch_device(x)
    return devices.as_value(x)


def restore(result: Any, original: Any) -> Any:
    """``result`` (numpy or DeviceArray) in the kind of ``original``; a result already in
    that framework is returned as it is."""
    if isinstance(original, np.ndarray):
        if isinstance(result, np.ndarray):
            return result
        return devices.to_host(result)
    fw = framework_of(original)
    if fw == "numpy" or original is None or isinstance(original, (str, bytes)):
        if isinstance(result, np.generic):
            return result
        if not isinstance(result, np.ndarray):
            result = devices.to_host(result)
        return result[()] if result.ndim == 0 else result
    if fw == "other" or framework_of(result) == fw:
        return result
    if fw == "torch":
        return _to_torch(result, original)
    if fw == "cupy":
        return _to_cupy(result, original)
    if fw == "jax":
        return _to_jax(result, original)
    return result


def _host_contiguous(a: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray turns a 0-d array into a 1-d one; keep the shape.
    return a if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(a.shape)


def _to_torch(result: Any, original: Any) -> Any:
    torch = sys.modules["torch"]
    if isinstance(result, np.generic):
        result = np.asarray(result)
    if isinstance(result, np.ndarray):
        # Zero-copy: the tensor shares the result's memory (and keeps it alive).
        a = _host_contiguous(result)
        if a.dtype.name == "bfloat16":
            out = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(a)
        if original.device.type != "cpu":
            out = out.to(original.device)
        return out
    # A DeviceArray: zero-copy through DLPack (which carries bfloat16 too).
    return torch.from_dlpack(result)


def _to_cupy(result: Any, original: Any) -> Any:
    cupy = sys.modules["cupy"]
    if isinstance(result, (np.ndarray, np.generic)):
        # A host result (CPU replicas) goes back to the GPU the input came from.
        with cupy.cuda.Device(original.device.id):
            return cupy.asarray(np.asarray(result))
    return cupy.asarray(result)  # a DeviceArray: zero-copy (__cuda_array_interface__)


def _to_jax(result: Any, original: Any) -> Any:
    jax = sys.modules["jax"] if "jax" in sys.modules else __import__("jax")
    device = _jax_device(original)
    if not isinstance(result, (np.ndarray, np.generic)):
        try:
            out = jax.dlpack.from_dlpack(result)  # a DeviceArray: zero-copy
            return out if device is None else jax.device_put(out, device)
        except Exception:  # noqa: BLE001 - through the host when DLPack cannot hand it over
            result = devices.to_host(result)
    host = np.asarray(result)
    return jax.device_put(host, device) if device is not None else jax.numpy.asarray(host)


def _jax_device(original: Any) -> Any:
    try:
        devs = original.devices()
        return next(iter(devs)) if len(devs) == 1 else None
    except Exception:  # noqa: BLE001 - a tracer or an older array type: JAX's default device
        return None
