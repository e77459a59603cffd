"""``CudaCollectives``: GPU replicas, the CUDA engine on device memory.

Values of replica ``r`` live on its CUDA device ``places[r]`` as ``distvals.cuda``
DeviceArrays (cupy arrays and torch CUDA tensors are viewed as such without a copy).
Host values reaching a collective (a Python float loss, say) are moved to the replica's
GPU first; dtypes a GPU cannot hold (int16, bool, complex...) stay on the host and are
reduced with numpy, as on CPU replicas.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import devices
from .engine_collectives import EngineCollectives

__all__ = ["CudaCollectives"]


class CudaCollectives(EngineCollectives):
    """Single-call collectives of GPU replicas; ``places[r]`` is replica r's CUDA device."""

    def _can_place(self, dtype: np.dtype) -> bool:
        return devices.can_place(dtype)

    def _where(self, r: int, dtype: np.dtype) -> Optional[int]:
        # Dtypes a GPU cannot hold stay on the host.
        return self.places[r] if devices.can_place(dtype) else None

    def _empty(self, shape: Tuple[int, ...], dtype: np.dtype, r: int) -> Any:
        return devices.empty(shape, dtype, self._where(r, dtype))

    def _copy(self, x: Any, r: int, dtype: Optional[np.dtype] = None) -> Any:
        if dtype is not None and x.dtype != dtype:
            x = devices.cast(x, dtype)
            if devices.is_device_array(x) or self._where(r, x.dtype) is None:
                return devices.to_replica_device(x, self._where(r, x.dtype))
        return devices.to_replica_device(x, self._where(r, x.dtype), copy=True)

    def _engine_input(self, x: Any, r: int) -> Any:
        return devices.to_replica_device(x, self._where(r, x.dtype))

    def _pack(self, xs: Sequence[Any], dtype: np.dtype, r: int) -> Any:
        return devices.pack(xs, dtype, self._where(r, dtype))

    def _unpack(self, buf: Any, shapes: Sequence[Tuple[int, ...]]) -> List[Any]:
        return devices.unpack(buf, shapes)

    def _host(self, x: Any) -> np.ndarray:
        return devices.to_host(x)

    def _divide(self, buf: Any, count: int, r: int) -> Any:
        # Integer MEAN on a GPU: the float64 sum is divided on the host (there is no
        # element-wise kernel for it), then moved back.
        host = np.array(devices.to_host(buf), copy=True)
        host /= count
        return devices.to_replica_device(host, self._where(r, host.dtype))

    def _concat(self, xs: Sequence[Any], axis: int, r: int) -> Any:
        place = self._where(r, xs[0].dtype)
        if axis == 0 and place is not None:
            return devices.concat_rows(xs, place)
        host = np.concatenate([devices.to_host(x) for x in xs], axis=axis)
        return devices.to_replica_device(host, place)

    def _reshape(self, x: Any, shape: Tuple[int, ...]) -> Any:
        return devices.reshape(x, shape)
