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

__all__ = ["framework_of", "to_numpy", "to_engine_value", "restore"]


def framework_of(x: Any) -> str:
    """"numpy" for numpy and Python values, else the array's framework: "torch", "cupy",
    "jax", or "other" (DeviceArray, numba, anything with DLPack)."""
    if isinstance(x, (np.ndarray, np.generic, int, float, complex, bool)):
        return "numpy"
    mod = type(x).__module__.split(".", 1)[0]
    if mod in ("torch", "cupy", "jax"):
        return mod
    if mod == "jaxlib":
        return "jax"
    return "other"


def _bfloat16() -> Any:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _torch_host(t: Any) -> np.ndarray:
    """A CPU torch tensor as a numpy array sharing its memory."""
    torch = sys.modules["torch"]
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16: view the bits, then as ml_dtypes' bfloat16.
        return t.contiguous().view(torch.int16).numpy().view(_bfloat16())
    return t.numpy() if t.is_contiguous() else t.contiguous().numpy()


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

    if t.requires_grad:
        t = t.detach()
    return cuda.as_device_array(t)


def to_engine_value(x: Any) -> Any:
    """``x`` as GPU replicas' collectives take it: a DeviceArray for device memory, a
    numpy array for host memory."""
    if isinstance(x, np.ndarray):
        return x
    if framework_of(x) == "torch":
        return _torch_host(x) if x.device.type == "cpu" else _torch_device(x)
    return devices.as_value(x)


def restore(result: Any, original: Any) -> Any:
    """``result`` (numpy or DeviceArray) in the kind of ``original``."""
    if isinstance(original, np.ndarray):
        if isinstance(result, np.ndarray):
            return result
        return devices.to_host(result)
    fw = framework_of(original)
    if fw == "numpy" or original is None or isinstance(original, (str, bytes)):
        if not isinstance(result, np.ndarray):
            result = devices.to_host(result)
        return result[()] if result.ndim == 0 else result
    if fw == "torch":
        return _to_torch(result, original)
    if fw == "cupy":
        cupy = sys.modules["cupy"]
        return cupy.asarray(result)
    if fw == "jax":
        jnp = sys.modules["jax.numpy"] if "jax.numpy" in sys.modules else __import__("jax.numpy").numpy
        return jnp.asarray(devices.to_host(result) if not isinstance(result, np.ndarray) else result)
    return result


def _to_torch(result: Any, original: Any) -> Any:
    torch = sys.modules["torch"]
    if isinstance(result, np.ndarray):
        if result.dtype.name == "bfloat16":
            out = torch.from_numpy(np.ascontiguousarray(result).view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(np.ascontiguousarray(result))
        if original.device.type != "cpu":
            out = out.to(original.device)
        return out
    # A DeviceArray: zero-copy through DLPack, bfloat16 through its bits.
    if result.dtype.name == "bfloat16":
        from . import cuda

        bits = cuda.DeviceArray._view(result.ptr, tuple(result.shape), np.dtype(np.int16), result.device, result,
                                      readonly=False)
        return torch.from_dlpack(bits).view(torch.bfloat16)
    return torch.from_dlpack(result)
